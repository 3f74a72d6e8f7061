"""Dashboards: a Streamlit app over the store (``ranklens dashboard``).

Pages (``page_*.py``) read aggregated query results (:mod:`ranklens.dashboards.queries`) and draw
Plotly figures (:mod:`ranklens.dashboards.charts`); :func:`run_dashboard` starts the server.
Importing this package imports neither Streamlit nor Plotly.
"""

from __future__ import annotations

from typing import Any

from ranklens._guard import require_installed_name

require_installed_name(__name__, "ranklens.dashboards")  # not `import dashboards` from the repository root

__all__ = ["run_dashboard"]


def run_dashboard(*args: Any, **kwargs: Any) -> int:
    """Start the dashboard server (see :func:`ranklens.dashboards.launch.run_dashboard`)."""
    from ranklens.dashboards.launch import run_dashboard as run

    return run(*args, **kwargs)
