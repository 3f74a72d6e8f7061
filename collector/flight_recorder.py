"""PyTorch flight-recorder (FR) dumps in the collector: find the dump files, map them to the arrival
ledger's rows, ingest them. The dump model, the safe unpickler and the parser are the ground floor's
(:mod:`ranklens.formats.flight_recorder`, whose docstring has the format's quirks).

Mapping to the ``collectives`` table (:func:`to_collective_rows`), one row per non-p2p entry:

==========  ===================================================================================
pg          the FR process-group *name* (``"0"`` is the default group), the same on every member
            and the same name ranklens' tracer uses; p2p entries go to ``"<name>/p2p"``
seq         ``collective_seq_id`` (p2p: ``p2p_seq_id``, a per-rank counter, not per pair)
op          ``profiling_name`` without its ``gloo:``/``nccl:`` prefix (gloo records
            ``reduce_scatter_tensor`` as ``all_reduce`` and ``all_gather_into_tensor`` as
            ``all_gather``: the recorded op is kept)
nbytes      sum over input tensors of numel x element size (0 when the dtype is unknown)
dtype       the first input dtype in torch's spelling (``Float`` -> ``float32``)
step        -1 (FR does not know training steps; the blame analyzer ignores such rows)
enter_ns    ``time_created_ns`` (CPU time the collective was enqueued)
start_ns    ``time_discovered_started_ns`` when recorded (NCCL), else 0
end_ns      ``time_discovered_completed_ns`` when recorded; a retired entry without a time (gloo)
            gets -1, "ended at an unknown time, possibly failed"; 0 means still in flight
clock       ``cpu``
==========  ===================================================================================
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ranklens.errors import IngestError
from ranklens.formats.digest import feed_file
from ranklens.formats.flight_recorder import (
    DUMP_NAME,
    FRDump,
    FREntry,
    UnreadableDump,
    infer_process_groups,
    load_dump,
    rank_from_name,
)
from ranklens.store.api import Store
from ranklens.store.once import write_once

__all__ = [
    "infer_job_id",
    "ingest_flight_recorder",
    "job_from_path",
    "load_dumps",
    "read_dumps",
    "to_collective_rows",
    "to_process_group_rows",
]

# Element sizes of c10 ScalarType names as FR records them, with torch's Python spelling.
_DTYPES: dict[str, tuple[str, int]] = {
    "Byte": ("uint8", 1),
    "Char": ("int8", 1),
    "Short": ("int16", 2),
    "Int": ("int32", 4),
    "Long": ("int64", 8),
    "Half": ("float16", 2),
    "Float": ("float32", 4),
    "Double": ("float64", 8),
    "ComplexHalf": ("complex32", 4),
    "ComplexFloat": ("complex64", 8),
    "ComplexDouble": ("complex128", 16),
    "Bool": ("bool", 1),
    "BFloat16": ("bfloat16", 2),
    "UInt16": ("uint16", 2),
    "UInt32": ("uint32", 4),
    "UInt64": ("uint64", 8),
    "Float8_e5m2": ("float8_e5m2", 1),
    "Float8_e4m3fn": ("float8_e4m3fn", 1),
    "Float8_e5m2fnuz": ("float8_e5m2fnuz", 1),
    "Float8_e4m3fnuz": ("float8_e4m3fnuz", 1),
}


# ---------------------------------------------------------------------------------------- discovery


def _dump_files(directory: Path) -> list[Path]:
    return sorted(
        q
        for q in directory.rglob("*")
        if q.is_file() and not any(part.startswith(".") for part in q.relative_to(directory).parts)
        if DUMP_NAME.match(q.name)
    )


def load_dumps(paths: str | Path | Sequence[str | Path]) -> list[FRDump]:
    """Read dumps from files and directories; every file is validated before any is returned.

    A directory contributes, recursively, the files named like dumps: ``<anything><rank>`` with
    no extension, ``.json``, ``.pkl`` or ``.pickle`` (so ``logs/rank0.log`` or
    ``ground_truth.json`` next to them are skipped). A file named explicitly is always read.

    Args:
        paths: one path or several.

    Returns:
        The dumps, sorted by rank.

    Raises:
        IngestError: a missing path, no dump found, a malformed dump, or two dumps of one rank
            (the pickle and the JSON copy of one dump, as torch writes them side by side, are read
            once: the pickle, which has the stack frames).
    """
    return _read_dumps(paths, strict=True)[0]


def read_dumps(paths: str | Path | Sequence[str | Path]) -> tuple[list[FRDump], list[UnreadableDump]]:
    """Like :func:`load_dumps`, but a dump that cannot be read (truncated, corrupt, hostile) does
    not stop the others: it is returned, with its rank when its name tells it, and the error.

    Returns:
        ``(readable dumps sorted by rank, unreadable dumps)``.

    Raises:
        IngestError: a missing path, no dump found, or two dumps of one rank.
    """
    return _read_dumps(paths, strict=False)


def _read_dumps(paths: str | Path | Sequence[str | Path], *, strict: bool) -> tuple[list[FRDump], list[UnreadableDump]]:
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    files: list[Path] = []
    for item in map(Path, items):
        if item.is_dir():
            found = _dump_files(item)
            if not found:
                raise IngestError(str(item), "", "no flight-recorder dumps found (files named <prefix><rank>[.json])")
            files.extend(found)
        elif item.exists():
            files.append(item)
        else:
            raise IngestError(str(item), "", "no such file or directory")
    if not files:
        raise IngestError("<none>", "", "no flight-recorder dump paths given")
    by_rank: dict[int, FRDump] = {}
    bad: list[UnreadableDump] = []
    for f in files:
        try:
            d = load_dump(f)
        except IngestError as e:
            if strict:
                raise
            bad.append(UnreadableDump(str(f), rank_from_name(f), str(e)))
            continue
        if d.rank in by_rank:
            kept = by_rank[d.rank]
            if _same_dump(kept, d):
                # one dump in two formats (torch writes both when asked: fr_pickle/ and fr_json/):
                # read once, the copy with the stack frames (JSON dumps carry none)
                if _frames(d) > _frames(kept):
                    by_rank[d.rank] = d
                continue
            raise IngestError(
                str(f),
                "",
                f"rank {d.rank} already read from {kept.source_path}, a different dump; give one dump per "
                "rank (dumps of two runs or two moments of one run: point at one of them)",
            )
        by_rank[d.rank] = d
    return [by_rank[r] for r in sorted(by_rank)], bad


def _frames(d: FRDump) -> int:
    return sum(len(e.frames) for e in d.entries)


def _same_dump(a: FRDump, b: FRDump) -> bool:
    """Whether ``a`` and ``b`` are one dump (the pickle and the JSON torch writes of it): every
    field equal but the path, the format and the entries' stack frames (which JSON leaves out)."""

    def rest(d: FRDump) -> FRDump:
        return dataclasses.replace(d, entries=(), source_path="", format="")

    if rest(a) != rest(b):
        return False
    return len(a.entries) == len(b.entries) and all(
        dataclasses.replace(x, frames=()) == dataclasses.replace(y, frames=()) for x, y in zip(a.entries, b.entries)
    )


# ---------------------------------------------------------------------------------------- parsing


def _dtype(fr_name: str) -> tuple[str, int]:
    return _DTYPES.get(fr_name, (fr_name.lower(), 0))


def _nbytes(e: FREntry) -> int:
    total = 0
    for i, shape in enumerate(e.input_sizes):
        dt = e.input_dtypes[i] if i < len(e.input_dtypes) else (e.input_dtypes[-1] if e.input_dtypes else "")
        total += math.prod(shape) * _dtype(dt)[1]
    return total


def to_collective_rows(dumps: Iterable[FRDump], job_id: str, attempt: int = 0) -> list[dict[str, Any]]:
    """Rows of the ``collectives`` table, one per entry (mapping in the module docstring).

    Args:
        dumps: the dumps.
        job_id: the job the rows belong to.
        attempt: the restart attempt.

    Returns:
        Dicts keyed by the table's column names.
    """
    rows = []
    for d in dumps:
        for e in d.entries:
            if e.time_completed_ns:
                end = e.time_completed_ns
            else:
                end = -1 if e.retired else 0
            rows.append(
                {
                    "job_id": job_id,
                    "attempt": attempt,
                    "rank": d.rank,
                    "pg": f"{e.pg_name}/p2p" if e.is_p2p else e.pg_name,
                    "seq": e.p2p_seq_id if e.is_p2p else e.collective_seq_id,
                    "op": e.op,
                    "nbytes": _nbytes(e),
                    "dtype": _dtype(e.input_dtypes[0])[0] if e.input_dtypes else "",
                    "peer": -1,
                    "step": -1,
                    "enter_ns": e.time_created_ns,
                    "start_ns": e.time_started_ns,
                    "end_ns": end,
                    "clock": "cpu",
                    "async_op": 0,
                }
            )
    return rows


def to_process_group_rows(
    dumps: Sequence[FRDump], job_id: str, attempt: int = 0, world_size: int | None = None
) -> list[dict[str, Any]]:
    """Rows of the ``process_groups`` table (members as :func:`infer_process_groups` finds them).

    Args:
        dumps: the dumps.
        job_id: the job the rows belong to.
        attempt: the restart attempt.
        world_size: the number of ranks when known.

    Returns:
        Dicts keyed by the table's column names.
    """
    groups, _ = infer_process_groups(dumps, world_size)
    backend = next((d.backend for d in dumps if d.backend), "")
    return [
        {
            "job_id": job_id,
            "attempt": attempt,
            "pg": g.name,
            "name": g.desc,
            "backend": backend,
            "ranks": list(g.members),
            "created_ns": 0,
        }
        for g in groups.values()
    ]


def infer_job_id(dumps: Sequence[FRDump]) -> str:
    """A stable job id for dumps that came without one: ``fr-<UTC time of the first entry>-<hash>``.

    The same dumps always give the same id, so ingesting them twice lands in one job.

    Args:
        dumps: the dumps.

    Returns:
        The id.
    """
    h = hashlib.sha1()
    first = 0
    for d in sorted(dumps, key=lambda d: d.rank):
        h.update(f"{d.rank}:{len(d.entries)}".encode())
        for e in d.entries[:1] + d.entries[-1:]:
            h.update(f":{e.record_id}:{e.time_created_ns}".encode())
            first = e.time_created_ns if not first else min(first, e.time_created_ns)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(first / 1e9)) if first else "unknown"
    return f"fr-{stamp}-{h.hexdigest()[:6]}"


def job_from_path(paths: Iterable[str | Path]) -> tuple[str, int] | None:
    """The job and attempt of dumps written by ranklens' tracer, from where they lie:
    ``<spool>/<job>/<attempt>/fr/fr_trace_rank_<r>.json``. None when the dumps are elsewhere or
    the paths disagree.

    Args:
        paths: the dump files (``FRDump.source_path`` values).

    Returns:
        ``(job id, attempt)`` or None.
    """
    found = set()
    for p in map(Path, paths):
        fr, attempt = p.parent, p.parent.parent
        if fr.name != "fr" or not attempt.name.isdigit() or not attempt.parent.name:
            return None
        found.add((attempt.parent.name, int(attempt.name)))
    return found.pop() if len(found) == 1 else None


def ingest_flight_recorder(
    store: Store,
    paths: str | Path | Sequence[str | Path],
    job_id: str | None = None,
    *,
    attempt: int = 0,
    world_size: int | None = None,
) -> dict[str, int]:
    """Read and validate every dump, then write ``collectives`` and ``process_groups`` at once.

    Args:
        store: where to write.
        paths: dump files and/or directories (see :func:`load_dumps`).
        job_id: the job; default: the ``<job>`` of ``<spool>/<job>/<attempt>/fr/`` where the dumps
            lie there (see :func:`job_from_path`), else :func:`infer_job_id` of the dumps.
        attempt: the restart attempt.
        world_size: the number of ranks, when known (membership of the default group).

    Returns:
        Rows written per table.

    Raises:
        IngestError: a malformed dump; nothing was written.
    """
    import pyarrow as pa

    from ranklens.records import to_arrow

    dumps = load_dumps(paths)
    from_path = job_from_path([d.source_path for d in dumps])  # dumps the tracer wrote into its spool
    job = job_id or (from_path[0] if from_path else infer_job_id(dumps))
    parts = []
    for d in dumps:
        try:
            parts.append(to_arrow("collectives", to_collective_rows([d], job, attempt)))
        except ValueError as e:  # e.g. a value beyond Int64 in a corrupt dump
            raise IngestError(d.source_path, "collectives", str(e)) from None
    groups = to_arrow("process_groups", to_process_group_rows(dumps, job, attempt, world_size))
    # the same dumps ingested again (same content, job and attempt) are not written twice
    key = [b"flight-recorder", job.encode(), str(attempt).encode(), str(world_size).encode()]
    key += sorted(_content_digest(d.source_path) for d in dumps)
    written, _already = write_once(store, {"collectives": pa.concat_tables(parts), "process_groups": groups}, key)
    return written


def _content_digest(path: str | Path) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    try:
        feed_file(h, path)
    except OSError:
        h.update(str(path).encode())
    return h.digest()
