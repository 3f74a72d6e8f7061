"""Kineto (torch.profiler) Chrome traces into the ``trace_events`` table, streamed.

Ingest reads each file once, validating all of it (JSON syntax, gzip integrity, event fields)
while its batches go to a temporary Arrow file; only when every file is whole are the batches
written from there; so a corrupt or truncated trace raises :class:`IngestError` and writes
nothing. The reader (times, kernels, NCCL fields) is the ground floor's
:mod:`ranklens.formats.kineto`.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from ranklens.errors import IngestError
from ranklens.formats.digest import feed_file
from ranklens.formats.kineto import is_kineto_file, kineto_info, spill_kineto
from ranklens.store.api import Store
from ranklens.store.once import write_once

__all__ = ["ingest_kineto"]


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

    Every file is read and validated completely before anything is written (first pass, its
    batches kept in a temporary Arrow file under ``$TMPDIR``); then each file's batches are
    written from there (second pass, no second parse). Without ``job_id``, the traces of one
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
    total = 0
    with tempfile.TemporaryDirectory(prefix="ranklens-kineto-") as tmp:
        spills = []
        # pass 1: read and validate every file, write nothing
        for n, f in enumerate(files):
            job = job_id or _default_job_id(f)
            key = [b"kineto", _content_digest(f), job.encode(), str(attempt).encode(), str(rank).encode()]
            info = kineto_info(f)  # the metadata (it may follow the events)
            spilled = spill_kineto(f, Path(tmp) / f"{n}.arrow", job_id=job, attempt=attempt, rank=rank, info=info)
            spills.append((key, spilled))
        # pass 2: write from the spilled batches; a batch the store holds already (the same trace
        # ingested before) is skipped
        for key, spilled in spills:
            for i, batch in enumerate(spilled):
                written, _already = write_once(store, {"trace_events": batch}, [*key, str(i).encode()])
                total += written.get("trace_events", 0)
            spilled.path.unlink(missing_ok=True)
            if progress:
                progress(spilled.source)
    return {"trace_events": total}


def _content_digest(path: Path) -> bytes:
    return bytes(feed_file(hashlib.blake2b(digest_size=16), path).digest())
