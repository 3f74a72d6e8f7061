"""What every dashboard query shares: limits, WHERE clauses and running SQL into a DataFrame.

Every query aggregates in the store (chDB or a ClickHouse server, the same SQL on both, 18.16
included: no window functions, no ``WITH`` subqueries, aliases never shadow a column used inside an
aggregate), and every result has a ``LIMIT``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from ranklens.store.api import Store
from ranklens.store.api import sql_escape as esc

__all__ = [
    "LIVE_S",
    "MAX_CELLS",
    "MAX_SERIES",
    "RANK_DETAIL_MAX",
    "ROW_LIMIT",
    "TTL_S",
    "esc",
    "frame",
    "ints",
    "job_where",
    "steps_where",
]

TTL_S = 10.0  # the job may be running: results older than this are recomputed
ROW_LIMIT = 50_000  # no query feeding a chart or a table returns more rows than this
MAX_CELLS = 80_000  # heat-map cells sent to the browser
RANK_DETAIL_MAX = 512  # above this many ranks, heat maps aggregate rows (node or rank bucket)
MAX_SERIES = 16  # GPU series drawn one by one; more are summarised (fleet quantiles + worst k)
LIVE_S = 120.0  # a job whose newest step is older than this is no longer running


def job_where(job_id: str, attempt: int) -> str:
    return f"job_id = '{esc(job_id)}' AND attempt = {int(attempt)}"


def steps_where(job_id: str, attempt: int, step_from: int, step_to: int) -> str:
    return f"{job_where(job_id, attempt)} AND step >= {int(step_from)} AND step <= {int(step_to)}"


def ints(values: Sequence[int]) -> str:
    return ", ".join(str(int(v)) for v in values) or "-1"


def frame(store: Store, sql: str) -> pd.DataFrame:
    return store.query(sql).arrow.to_pandas()
