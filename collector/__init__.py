"""The per-node agent: ships rank spools into the store (and, as it grows, tails logs, reads
NVML and exposes Prometheus metrics)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ranklens._guard import require_installed_name

require_installed_name(__name__, "ranklens.collector")  # not `import collector` from the repository root

if TYPE_CHECKING:
    from ranklens.collector.shipper import Shipper, ShipResult

__all__ = ["ShipResult", "Shipper"]


def __getattr__(name: str) -> Any:
    # the shipper (and the store code under it) is imported when first named, not by every
    # `ranklens.collector.<module>` import: one-shot `ranklens logs classify` saves ~50 ms (issue 18)
    if name in __all__:
        from ranklens.collector import shipper

        return getattr(shipper, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
