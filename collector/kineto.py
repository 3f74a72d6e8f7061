"""Kineto (torch.profiler) Chrome traces into the ``trace_events`` table, streamed.

A trace can be hundreds of MB: it is never loaded whole. ``ijson`` walks ``traceEvents`` item by
item and rows are built in bounded batches. Ingest is two passes over the file: the first
validates all of it (JSON syntax, gzip integrity, event fields), the second writes; so a corrupt or
truncated trace raises :class:`IngestError` and writes nothing.

Times: Kineto's ``ts``/``dur`` are microseconds; when the trace has ``baseTimeNanoseconds``, ``ts`` is
relative to it. Kernels carry ``args.device``/``args.stream``/``args.correlation``; NCCL kernels
(``ncclKernel_<Coll>_...`` or ``ncclDevKernel_...``) also ``Collective name``, ``In msg nelems``,
``Group size`` in newer traces. Only complete events (``ph`` = ``X``) are kept.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from ranklens.errors import IngestError
from ranklens.records import to_arrow
from ranklens.store.api import Store
from ranklens.store.once import write_once

__all__ = ["ingest_kineto", "is_kineto_file", "iter_kineto_batches", "kineto_info"]

_NCCL = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)")
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def _open(path: Path) -> BinaryIO:
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")  # type: ignore[return-value]


def is_kineto_file(path: str | Path) -> bool:
    """True when ``path`` looks like a Chrome trace (has ``traceEvents`` near its start)."""
    p = Path(path)
    if p.name.endswith((".pt.trace.json", ".pt.trace.json.gz")):
        return True
    if not p.name.endswith((".json", ".json.gz")):
        return False
    try:
        with _open(p) as f:
            head = f.read(1 << 16)
    except (OSError, EOFError, zlib.error):
        return False
    return b'"traceEvents"' in head or b'"schemaVersion"' in head


def kineto_info(path: str | Path) -> dict[str, Any]:
    """Top-level metadata (distributedInfo, baseTimeNanoseconds, ...) without the events."""
    import ijson

    p = Path(path)
    out: dict[str, Any] = {}
    try:
        with _open(p) as f:
            for key, value in ijson.kvitems(f, "", use_float=True):
                if key != "traceEvents":
                    out[key] = value
    except (ijson.JSONError, ijson.IncompleteJSONError, OSError, EOFError, zlib.error) as e:
        raise IngestError(str(p), "", f"not a readable Kineto/Chrome trace: {e}") from None
    return out


def _rank_of(path: Path, info: dict[str, Any], rank: int | None) -> int:
    if rank is not None:
        return rank
    dist = info.get("distributedInfo") or {}
    if isinstance(dist, dict) and isinstance(dist.get("rank"), int):
        return int(dist["rank"])
    m = _RANK_IN_NAME.search(path.name)
    if m:
        return int(m.group(1))
    raise IngestError(
        str(path),
        "",
        "cannot tell the rank: no distributedInfo.rank in the trace and no rank<N> in the file name; pass --rank",
    )


def _int(v: Any, default: int = -1) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _row(ev: dict[str, Any], base_ns: int, ident: dict[str, Any], source: str) -> dict[str, Any] | None:
    if ev.get("ph") != "X":
        return None
    ts, dur = ev.get("ts"), ev.get("dur", 0)
    if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
        raise ValueError(f"event {str(ev.get('name'))[:60]!r} has a non-numeric ts/dur")
    raw_args = ev.get("args")
    args: dict[str, Any] = raw_args if isinstance(raw_args, dict) else {}
    name = str(ev.get("name", ""))
    collective = str(args.get("Collective name", "") or "")
    if not collective and ev.get("cat") == "kernel":
        m = _NCCL.match(name)
        if m:
            collective = m.group(1).lower()
    return {
        **ident,
        "ts_ns": base_ns + round(float(ts) * 1000),
        "dur_ns": round(float(dur) * 1000),
        "cat": str(ev.get("cat", "")),
        "name": name,
        "pid": str(ev.get("pid", "")),
        "tid": str(ev.get("tid", "")),
        "device": _int(args.get("device")),
        "stream": _int(args.get("stream")),
        "correlation": _int(args.get("correlation")),
        "external_id": _int(args.get("External id")),
        "collective": collective,
        "in_nelems": _int(args.get("In msg nelems")),
        "group_size": _int(args.get("Group size")),
        "source": source,
    }


def iter_kineto_batches(
    path: str | Path, *, job_id: str, attempt: int = 0, rank: int | None = None, batch_rows: int = 50_000
) -> Iterator[Any]:
    """Arrow batches of ``trace_events`` rows from one trace, streamed. Raises IngestError."""
    import ijson

    p = Path(path)
    info = kineto_info(p)
    base_ns = _int(info.get("baseTimeNanoseconds"), 0)
    ident = {"job_id": job_id, "attempt": attempt, "rank": _rank_of(p, info, rank)}
    rows: list[dict[str, Any]] = []
    n = 0
    try:
        with _open(p) as f:
            for ev in ijson.items(f, "traceEvents.item", use_float=True):
                n += 1
                if not isinstance(ev, dict):
                    raise IngestError(str(p), f"event {n}", "is not a JSON object")
                try:
                    row = _row(ev, base_ns, ident, p.name)
                except ValueError as e:
                    raise IngestError(str(p), f"event {n}", str(e)) from None
                if row is not None:
                    rows.append(row)
                if len(rows) >= batch_rows:
                    yield to_arrow("trace_events", rows, validate=False)
                    rows = []
    except (ijson.JSONError, ijson.IncompleteJSONError, OSError, EOFError, zlib.error) as e:
        raise IngestError(str(p), f"after event {n}", f"the trace is corrupt or truncated: {e}") from None
    if n == 0:
        raise IngestError(str(p), "", "no traceEvents in this file")
    if rows:
        yield to_arrow("trace_events", rows, validate=False)


def _default_job_id(path: Path) -> str:
    """Traces in one directory are one job (their ranks); the id is stable for that directory."""
    d = path.resolve().parent
    h = hashlib.sha1(str(d).encode()).hexdigest()[:8]
    return f"kineto-{d.name or 'trace'}-{h}"


def ingest_kineto(
    store: Store,
    paths: Sequence[str | Path],
    *,
    job_id: str | None = None,
    attempt: int = 0,
    rank: int | None = None,
    progress: Callable[[Path], None] | None = None,
) -> dict[str, int]:
    """Ingest Kineto traces (files, or directories searched for *.json / *.json.gz traces).

    Every file is validated completely before anything is written (first pass); then each is
    streamed into the store in bounded batches (second pass). Without ``job_id``, the traces of one
    directory form one job (``kineto-<directory>-<hash>``).

    Returns:
        ``{"trace_events": rows written}``.
    Raises:
        IngestError: a file is not a readable trace (nothing was written).
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(q for q in p.rglob("*") if q.is_file() and is_kineto_file(q)))
        elif p.exists():
            files.append(p)
        else:
            raise IngestError(str(p), "", "no such file or directory")
    if not files:
        raise IngestError(
            ", ".join(map(str, paths)), "", "no Kineto traces found (*.json or *.json.gz with traceEvents)"
        )
    for f in files:  # pass 1: validate everything, keep nothing
        for _batch in iter_kineto_batches(f, job_id=job_id or _default_job_id(f), attempt=attempt, rank=rank):
            pass
    total = 0
    for f in files:  # pass 2: write; a batch the store holds already (the same trace ingested before) is skipped
        job = job_id or _default_job_id(f)
        key = [b"kineto", _content_digest(f), job.encode(), str(attempt).encode(), str(rank).encode()]
        batches = iter_kineto_batches(f, job_id=job, attempt=attempt, rank=rank)
        for i, batch in enumerate(batches):
            written, _already = write_once(store, {"trace_events": batch}, [*key, str(i).encode()])
            total += written.get("trace_events", 0)
        if progress:
            progress(f)
    return {"trace_events": total}


def _content_digest(path: Path) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.digest()
