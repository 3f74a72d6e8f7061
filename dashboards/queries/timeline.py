"""Timeline: the ranks that made the others wait (blame, :mod:`ranklens.analyzers.blame`), and the
phases and collectives of chosen ranks in a step window."""

from __future__ import annotations

import pandas as pd

from ranklens.dashboards.queries._cache import job_blame_cells
from ranklens.dashboards.queries._sql import ROW_LIMIT, frame, ints, steps_where
from ranklens.store.api import Store

__all__ = ["timeline_collectives", "timeline_phases", "worst_ranks"]


def worst_ranks(
    store: Store, job_id: str, attempt: int, step_from: int, step_to: int, k: int = 16, t0_ns: int = 0
) -> pd.DataFrame:
    """The ``k`` ranks that made the others wait longest in a step window (culprits, not victims):
    the blame analyzer's cells (:func:`~ranklens.analyzers.blame.blame_cells`: p2p left out, clocks
    aligned, overlapping waits counted once) summed per last arriver.

    Returns:
        ``culprit``, ``caused_s`` (seconds the others waited, mean per collective, summed) and
        ``times_last`` (collectives it arrived last at), worst first.
    """
    cells = job_blame_cells(store, job_id, attempt, step_from, step_to, t0_ns or None)
    per_rank = pd.DataFrame({"culprit": cells.ranks, "caused_s": cells.delay_s, "times_last": cells.collectives})
    out = per_rank.groupby("culprit", as_index=False).sum()
    out = out.sort_values(["caused_s", "culprit"], ascending=[False, True], kind="stable").head(int(k))
    return out.reset_index(drop=True)


def timeline_phases(
    store: Store, job_id: str, attempt: int, step_from: int, step_to: int, ranks: tuple[int, ...]
) -> pd.DataFrame:
    """Phases of the given ranks in a step window (one row per rank x step x phase)."""
    return frame(
        store,
        f"""
SELECT rank, step, phase, start_ns, end_ns
FROM phases
WHERE {steps_where(job_id, attempt, step_from, step_to)} AND rank IN ({ints(ranks)})
ORDER BY rank, start_ns
LIMIT {ROW_LIMIT}
""",
    )


def timeline_collectives(
    store: Store, job_id: str, attempt: int, step_from: int, step_to: int, ranks: tuple[int, ...]
) -> pd.DataFrame:
    """Collectives of the given ranks in a step window, each with its group's last arrival.

    ``last_enter_ns`` and ``last_rank`` are over *all* members of the ``(pg, seq)``, so the wait
    of a shown rank (its arrival up to the last arrival) is right even when the culprit is not shown.
    """
    w = steps_where(job_id, attempt, step_from, step_to)
    return frame(
        store,
        f"""
SELECT rank, pg, seq, op, nbytes, step, enter_ns, end_ns, last_enter_ns, last_rank, members
FROM
(
    SELECT rank, pg, seq, op, nbytes, step, enter_ns, end_ns
    FROM collectives WHERE {w} AND rank IN ({ints(ranks)})
) AS lhs
ALL INNER JOIN
(
    SELECT pg, seq, max(enter_ns) AS last_enter_ns, argMax(rank, enter_ns) AS last_rank, count() AS members
    FROM collectives WHERE {w}
    GROUP BY pg, seq
) AS rhs
USING (pg, seq)
ORDER BY rank, enter_ns
LIMIT {ROW_LIMIT}
""",
    )
