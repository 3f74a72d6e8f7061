"""The per-node agent: ships rank spools into the store (and, as it grows, tails logs, reads
NVML and exposes Prometheus metrics)."""

from __future__ import annotations

from ranklens._guard import require_installed_name
from ranklens.collector.shipper import Shipper, ShipResult

require_installed_name(__name__, "ranklens.collector")  # not `import collector` from the repository root

__all__ = ["ShipResult", "Shipper"]
