"""Who runs where: the job's ranks and their nodes, from the ``ranks`` table."""

from __future__ import annotations

from ranklens.store.api import Store
from ranklens.store.api import sql_escape as _esc

__all__ = ["rank_hosts"]


def rank_hosts(store: Store, job_id: str, attempt: int | None = None) -> dict[int, str]:
    """rank -> node of a job (every attempt when ``attempt`` is None); ranks without a node are left out."""
    where = f"job_id = '{_esc(job_id)}'" + (f" AND attempt = {int(attempt)}" if attempt is not None else "")
    rows = store.query(f"SELECT rank, any(host) AS rank_host FROM ranks WHERE {where} GROUP BY rank").rows()
    return {int(r): str(h) for r, h in rows if h}
