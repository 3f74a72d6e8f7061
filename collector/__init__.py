"""The per-node agent: ships rank spools into the store (and, as it grows, tails logs, reads
NVML and exposes Prometheus metrics)."""

from __future__ import annotations

from ranklens.collector.shipper import Shipper, ShipResult

__all__ = ["ShipResult", "Shipper"]
