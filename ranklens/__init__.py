"""ranklens: per-rank observability and diagnostics for distributed PyTorch training.

Subpackages: :mod:`ranklens.tracing` (in-process capture, light: stdlib + numpy + torch),
:mod:`ranklens.collector` (per-node agent), :mod:`ranklens.analyzers` (findings),
:mod:`ranklens.store` (embedded chDB or ClickHouse server), :mod:`ranklens.dashboards`.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
