"""Kineto (torch.profiler) Chrome traces: the reader that streams them as ``trace_events`` rows.

A trace can be hundreds of MB: it is never loaded whole. ``ijson`` walks ``traceEvents`` item by
item and rows are built in bounded batches; a corrupt or truncated trace raises :class:`IngestError`
(:func:`spill_kineto` reads a file once into a temporary Arrow file, so that an ingest validates
every trace before it writes any).

Times: Kineto's ``ts``/``dur`` are microseconds; when the trace has ``baseTimeNanoseconds``, ``ts`` is
relative to it. Kernels carry ``args.device``/``args.stream``/``args.correlation``; NCCL kernels
(``ncclKernel_<Coll>_...`` or ``ncclDevKernel_...``) also ``Collective name``, ``In msg nelems``,
``Group size`` in newer traces, and since torch 2.5 ``Process Group Name`` and ``Seq`` (the collective's
number in its group: with the name, the ledger's ``(pg, seq)``), as do the ``record_param_comms`` CPU
ops. Only complete events (``ph`` = ``X``) are kept.
"""

from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ranklens.errors import IngestError

__all__ = [
    "INFO_KEYS",
    "SpillError",
    "SpilledTrace",
    "is_kineto_file",
    "iter_kineto_batches",
    "kineto_info",
    "spill_kineto",
]

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


INFO_KEYS = ("distributedInfo", "baseTimeNanoseconds")


def kineto_info(path: str | Path, keys: tuple[str, ...] = INFO_KEYS) -> dict[str, Any]:
    """Top-level metadata (by default distributedInfo and baseTimeNanoseconds, which may come
    after the events) without building the events.

    One read of the raw bytes says which keys the file names at all (a key that appears nowhere is
    not parsed for); each key that does is parsed for by ijson's C parser, which stops at the key's
    first top-level value: at the head for distributedInfo (Kineto writes it before the events),
    at the end for baseTimeNanoseconds. Two full coroutine parses were ~2 s of a 35 MB trace's
    3.6 s ingest. Building the whole ``traceEvents`` array, as ``kvitems`` does, took ~6x the
    trace's JSON size in memory. A key is looked for as JSON writers write it (its name between
    quotes, unescaped). The events' own pass validates the whole file."""
    import ijson

    p = Path(path)
    found: dict[str, Any] = {}
    try:
        for k in _named_keys(p, keys):
            with _open(p) as f:
                for value in ijson.items(f, k, use_float=True):
                    found[k] = value
                    break
    except (ijson.JSONError, ijson.IncompleteJSONError, OSError, EOFError, zlib.error) as e:
        raise IngestError(str(p), "", f"not a readable Kineto/Chrome trace: {e}") from None
    return {k: found[k] for k in keys if k in found}


def _named_keys(p: Path, keys: tuple[str, ...]) -> list[str]:
    """The ``keys`` whose quoted name appears anywhere in the file's (decompressed) bytes."""
    needles = {k: b'"' + k.encode() + b'"' for k in keys}
    keep = max(map(len, needles.values()), default=1) - 1  # a name across two reads
    seen: set[str] = set()
    tail = b""
    with _open(p) as f:
        while len(seen) < len(keys) and (chunk := f.read(1 << 20)):
            window = tail + chunk
            seen.update(k for k, n in needles.items() if k not in seen and n in window)
            tail = window[-keep:] if keep else b""
    return [k for k in keys if k in seen]


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


def _us_to_ns(us: int | float) -> int:
    # integer microseconds convert exactly: an epoch timestamp (~1.7e15 us) times 1000 is past
    # float64's 53-bit mantissa, and float arithmetic would move it by up to 128 ns
    return us * 1000 if isinstance(us, int) else round(us * 1000)


# the per-event columns of a trace_events row, in the order _row returns them (job_id, attempt,
# rank and source are the same for every event of a file)
_FIELDS = (
    "ts_ns",
    "dur_ns",
    "cat",
    "name",
    "pid",
    "tid",
    "device",
    "stream",
    "correlation",
    "external_id",
    "collective",
    "in_nelems",
    "group_size",
    "pg",
    "seq",
)


def _fast_int(v: Any) -> int:
    return v if type(v) is int else _int(v)


def _row(ev: dict[str, Any], base_ns: int) -> tuple[Any, ...] | None:
    if ev.get("ph") != "X":
        return None
    ts, dur = ev.get("ts"), ev.get("dur", 0)
    if (
        not isinstance(ts, (int, float))
        or not isinstance(dur, (int, float))
        or isinstance(ts, bool)
        or isinstance(dur, bool)
    ):
        raise ValueError(f"event {str(ev.get('name'))[:60]!r} has a non-numeric ts/dur")
    raw_args = ev.get("args")
    args: dict[str, Any] = raw_args if isinstance(raw_args, dict) else {}
    name = str(ev.get("name", ""))
    cat = str(ev.get("cat", ""))
    collective = str(args.get("Collective name", "") or "")
    if not collective and cat == "kernel":
        m = _NCCL.match(name)
        if m:
            collective = m.group(1).lower()
    return (
        base_ns + _us_to_ns(ts),
        _us_to_ns(dur),
        cat,
        name,
        str(ev.get("pid", "")),
        str(ev.get("tid", "")),
        _fast_int(args.get("device", -1)),
        _fast_int(args.get("stream", -1)),
        _fast_int(args.get("correlation", -1)),
        _fast_int(args.get("External id", -1)),
        collective,
        _fast_int(args.get("In msg nelems", -1)),
        _fast_int(args.get("Group size", -1)),
        str(args.get("Process Group Name", "") or "") if collective else "",
        _fast_int(args.get("Seq", -1)) if collective else -1,
    )


def _batch(rows: list[tuple[Any, ...]], ident: dict[str, Any], source: str) -> Any:
    """An Arrow batch of trace_events from _row tuples, built column by column."""
    from ranklens.records import arrow_schema, arrow_table

    n = len(rows)
    cols: dict[str, Any] = {k: [v] * n for k, v in ident.items()}
    cols.update(zip(_FIELDS, (list(c) for c in zip(*rows))))
    cols["source"] = [source] * n
    return arrow_table(cols, schema=arrow_schema("trace_events"))


def iter_kineto_batches(
    path: str | Path,
    *,
    job_id: str,
    attempt: int = 0,
    rank: int | None = None,
    batch_rows: int = 50_000,
    info: dict[str, Any] | None = None,
) -> Iterator[Any]:
    """Arrow batches of ``trace_events`` rows from one trace, streamed (``info``: the file's
    :func:`kineto_info`, when the caller has it already). Raises IngestError."""
    import pyarrow as pa

    p = Path(path)
    # a batch is built in pieces of Arrow (a Python tuple per event costs ~10x its Arrow row: 50,000
    # of them were ~50 MB of a one-shot ingest's peak); a batch's rows and bounds stay the same
    piece = _PIECE_ROWS if batch_rows % _PIECE_ROWS == 0 else batch_rows
    pieces: list[Any] = []
    held = 0
    for ident, rows in _row_lists(p, job_id, attempt, rank, piece, info):
        pieces.append(_batch(rows, ident, p.name))
        held += len(rows)
        if held >= batch_rows:
            yield pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)
            pieces, held = [], 0
    if pieces:
        yield pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)


_PIECE_ROWS = 10_000


class SpillError(IngestError):
    """The parsed trace could not be kept in its temporary file (the disk, not the trace)."""


class SpilledTrace:
    """A trace read once, its batches kept in an Arrow IPC file: iterating gives the batches
    :func:`iter_kineto_batches` gives (same rows, same bounds), read back from the file one batch
    at a time, as often as asked."""

    def __init__(self, source: Path, spill: Path, tables: list[int], rows: list[int]) -> None:
        self.source = source
        self.path = spill
        self._tables = tables  # record batches per yielded table
        self.batch_rows = rows  # rows per yielded table

    @property
    def rows(self) -> int:
        return sum(self.batch_rows)

    def __iter__(self) -> Iterator[Any]:
        import pyarrow as pa

        if not self._tables:  # a trace without complete events
            return
        with pa.OSFile(str(self.path)) as src:
            reader = pa.ipc.open_file(src)
            k = 0
            for n in self._tables:
                yield pa.Table.from_batches([reader.get_batch(j) for j in range(k, k + n)], schema=reader.schema)
                k += n


def spill_kineto(
    path: str | Path,
    spill: str | Path,
    *,
    job_id: str,
    attempt: int = 0,
    rank: int | None = None,
    info: dict[str, Any] | None = None,
) -> SpilledTrace:
    """Read a whole trace once, as :func:`iter_kineto_batches` would, into the Arrow IPC file
    ``spill`` (lz4): the validation pass of an ingest that writes nothing until every trace is
    whole, whose writes then replay the file instead of parsing the JSON a second time (the parse
    is most of an ingest). Raises IngestError: the trace is not readable; SpillError (an
    IngestError) when ``spill`` cannot be written (a full or missing temporary directory)."""
    import pyarrow as pa

    p, out = Path(path), Path(spill)
    tables: list[int] = []
    rows: list[int] = []
    writer = None
    try:
        with pa.OSFile(str(out), "wb") as sink:
            try:
                for t in iter_kineto_batches(p, job_id=job_id, attempt=attempt, rank=rank, info=info):
                    if writer is None:
                        options = pa.ipc.IpcWriteOptions(compression="lz4")
                        writer = pa.ipc.new_file(sink, t.schema, options=options)
                    batches = t.to_batches()
                    for b in batches:
                        writer.write_batch(b)
                    tables.append(len(batches))
                    rows.append(t.num_rows)
            finally:
                if writer is not None:
                    writer.close()
    except OSError as e:  # pyarrow's I/O errors are OSErrors too
        out.unlink(missing_ok=True)
        raise SpillError(
            str(p), "", f"cannot keep the parsed trace in {out.parent} ({e}); point TMPDIR at a disk with room"
        ) from None
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return SpilledTrace(p, out, tables, rows)


def _row_lists(
    p: Path, job_id: str, attempt: int, rank: int | None, batch_rows: int, info: dict[str, Any] | None
) -> Iterator[tuple[dict[str, Any], list[tuple[Any, ...]]]]:
    import ijson

    info = kineto_info(p) if info is None else info
    base_ns = _int(info.get("baseTimeNanoseconds"), 0)
    ident = {"job_id": job_id, "attempt": attempt, "rank": _rank_of(p, info, rank)}
    rows: list[tuple[Any, ...]] = []
    n = 0
    try:
        with _open(p) as f:
            for ev in ijson.items(f, "traceEvents.item", use_float=True):
                n += 1
                if not isinstance(ev, dict):
                    raise IngestError(str(p), f"event {n}", "is not a JSON object")
                try:
                    row = _row(ev, base_ns)
                except ValueError as e:
                    raise IngestError(str(p), f"event {n}", str(e)) from None
                if row is not None:
                    rows.append(row)
                if len(rows) >= batch_rows:
                    yield ident, rows
                    rows = []
    except (ijson.JSONError, ijson.IncompleteJSONError, OSError, EOFError, zlib.error) as e:
        raise IngestError(str(p), f"after event {n}", f"the trace is corrupt or truncated: {e}") from None
    if n == 0:
        raise IngestError(str(p), "", "no traceEvents in this file")
    if rows:
        yield ident, rows
