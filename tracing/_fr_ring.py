"""Reading torch's flight-recorder ring incrementally, off the training thread's GIL.

torch (2.5+) records every c10d collective it enqueues on gloo and NCCL in a process-wide ring
(``TORCH_FR_BUFFER_SIZE`` entries, 2000 by default), whatever API issued it: ``torch.distributed``
functions, FSDP2's ``all_gather_single``/``reduce_scatter_single``, functional collectives
(DTensor, tensor parallel), DDP's C++ reducer, coalesced groups. Each entry has the group's name
and ``collective_seq_id`` (the same on every member), the op, input sizes and dtypes and the CPU
time it was created (the rank's arrival). torch offers no incremental read: a dump serialises the
whole ring. So:

- the dump goes through the ``fr_trace_json`` control-plane handler, whose C++ body runs with the
  GIL released (``_dump_fr_trace_json`` holds it: 30-90 ms for a full ring, a stall of the
  training thread; measured in bench/tracing_bench.py);
- only the entries after the last one seen are parsed (a byte search for ``"record_id":N``);
- a cheap status read (the per-group count of enqueued ops, no entries) tells whether anything new
  is there, so the ring is dumped only when it has filled up enough or when rows are due.

The ring outlives a tracer: after ``shutdown`` and a new ``init`` in the same process (a new job id:
a notebook, a harness running scenarios in one set of processes) the new tracer's reader starts
after the newest entry present when it was created, so the previous job's collectives (and those
issued untraced in between) are not taken for the new job's. Until a tracer of the process has shut
down, a reader reads the whole ring: collectives issued before ``init`` (DDP's parameter broadcast)
belong to the job.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

__all__ = ["RingReader", "mark_job_ended", "new_entries", "ring_capacity"]

log = logging.getLogger("ranklens.tracing")

ENV_BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DEFAULT_CAPACITY = 2000  # torch's default (FlightRecorder.hpp)
_FIRST_KEY = b'{"collective_seq_id":'  # nlohmann sorts keys: every entry object starts with it
_ID_KEY = b'"record_id":'
_JOB_ENDED = [False]  # a tracer of this process was shut down: the ring holds another job's entries


def mark_job_ended() -> None:
    """A tracer of this process shut down (``ranklens.tracing.shutdown``): a reader created from
    now on starts after what the ring holds (the ring is process-wide and outlives tracers)."""
    _JOB_ENDED[0] = True


def ring_capacity(environ: Any = None) -> int:
    """Entries the ring holds, from the variables torch reads (0: the ring is off)."""
    env = os.environ if environ is None else environ
    for var in ENV_BUFFER:
        v = env.get(var)
        if v not in (None, ""):
            try:
                return max(0, int(v))
            except ValueError:
                return DEFAULT_CAPACITY  # torch falls back to its default on a bad value too
    return DEFAULT_CAPACITY


def _handler(name: str) -> Any:
    """A control-plane handler called in-process, or None where torch has none of that name."""
    import torch._C._distributed_c10d as c10d

    # private control-plane API, not in torch's stubs
    if name not in c10d._get_handler_names():  # type: ignore[attr-defined]
        return None
    fn = c10d._get_handler(name)  # type: ignore[attr-defined]

    class _Request(c10d._Request):
        def __init__(self) -> None:
            super().__init__()

        def body(self) -> bytes:
            return b""

        def get_param(self, key: str) -> str:
            return ""

        def params(self) -> dict[str, str]:
            return {}

    class _Response(c10d._Response):
        def __init__(self) -> None:
            super().__init__()
            self.content: Any = None
            self.status = 200

        def set_content(self, content: Any, content_type: str) -> None:
            self.content = content

        def set_status(self, status: int) -> None:
            self.status = status

    def call() -> bytes | None:
        resp = _Response()
        fn(_Request(), resp)
        if resp.status != 200 or resp.content is None:
            return None
        c = resp.content
        return c if isinstance(c, bytes) else str(c).encode()

    return call


def _as_bytes(data: Any) -> bytes:
    """A dump as bytes (the handlers answer bytes; a str from another torch is encoded)."""
    return data if isinstance(data, bytes) else str(data).encode()


def _int_at(data: bytes, pos: int) -> int:
    end = pos
    while end < len(data) and data[end] in b"-0123456789":
        end += 1
    return int(data[pos:end])


def new_entries(data: bytes, last_id: int) -> tuple[list[dict[str, Any]], int]:
    """Entries of a JSON dump whose ``record_id`` is above ``last_id``, oldest first, and how many
    were overwritten before they could be read (ids skipped between ``last_id`` and the oldest new
    one). Parses only the new part when the layout is torch's (compact, keys sorted), else the
    whole dump."""
    entries = _new_part(data, last_id)
    if entries is None:  # another layout: parse it all
        entries = json.loads(data).get("entries") or []
    entries = [e for e in entries if int(e.get("record_id", -1)) > last_id]
    entries.sort(key=lambda e: int(e["record_id"]))
    lost = int(entries[0]["record_id"]) - last_id - 1 if entries else 0
    return entries, max(0, lost)


def _new_part(data: bytes, last_id: int) -> list[dict[str, Any]] | None:
    first = data.find(_ID_KEY)
    if first < 0:
        return None if b'"entries":[{' in data.replace(b" ", b"") else []
    try:
        newest = _int_at(data, data.rfind(_ID_KEY) + len(_ID_KEY))
    except ValueError:
        return None
    if newest <= last_id:
        return []
    pos = data.find(_ID_KEY + b"%d," % (last_id + 1))
    if pos < 0:  # the next one was overwritten: start from the oldest present
        pos = first
    start = data.rfind(_FIRST_KEY, 0, pos)
    end = data.find(b'}],"', pos)
    if start < 0 or end < 0:
        return None
    try:
        return json.loads(b"[" + data[start : end + 1] + b"]")
    except ValueError:
        return None


class RingReader:
    """Reads the new entries of torch's flight-recorder ring (one process-wide ring for gloo; a
    CUDA build has one more, for NCCL, read the same way when its handler is there).

    Args:
        dump: returns the JSON dump (default: the ``fr_trace_json`` handler, GIL released).
        status: returns the count of collectives recorded so far over all groups and whether one
            is in flight (default: torch's status-only dump, no entries: microseconds).
    """

    def __init__(self, dump: Any = None, status: Any = None, nccl: Any = None) -> None:
        self._dumps = [d for d in (dump, nccl) if d is not None]
        self._status = status
        self.last_ids = [-1] * len(self._dumps)
        self.last_data: list[bytes] = [b""] * len(self._dumps)  # each ring's latest dump
        self.skipped_seqs: dict[str, int] = {}  # newest seq per group of the entries skip_present skipped

    @classmethod
    def create(cls) -> RingReader | None:
        """The reader of this process's rings, or None where torch records none (no flight
        recorder in this torch, or ``TORCH_FR_BUFFER_SIZE=0``)."""
        if ring_capacity() <= 0:
            return None
        try:
            import torch._C._distributed_c10d as c10d

            dump = _handler("fr_trace_json")
            if dump is None and hasattr(c10d, "_dump_fr_trace_json"):
                dump = c10d._dump_fr_trace_json  # holds the GIL while it runs, but works
            if dump is None:
                return None
            nccl = _handler("dump_nccl_trace_json")
        except Exception:
            log.exception("ranklens: torch's flight recorder cannot be read here")
            return None
        reader = cls(dump=dump, status=_status if hasattr(c10d, "_dump_fr_trace_json") else None, nccl=nccl)
        if _JOB_ENDED[0]:  # a tracer of this process ended: what the ring holds is not this job's
            reader.skip_present()
        return reader

    def skip_present(self) -> dict[str, int]:
        """Start after the newest entry each ring holds now (a ring that cannot be dumped: from its
        start, logged). Returns, and keeps as ``skipped_seqs``, the newest ``collective_seq_id`` per
        group among the skipped entries: group seqs go on across tracers, and the ledger counts the
        seqs it never saw from them."""
        seqs: dict[str, int] = {}
        for i, dump in enumerate(self._dumps):
            try:
                data = dump()
                if not data:
                    continue
                entries, _lost = new_entries(_as_bytes(data), -1)
                if entries:
                    self.last_ids[i] = max(self.last_ids[i], int(entries[-1]["record_id"]))
                for e in entries:
                    pg = str((e.get("process_group") or [""])[0])
                    seq = int(e.get("collective_seq_id") or 0)
                    if pg and not e.get("is_p2p") and seq > seqs.get(pg, 0):
                        seqs[pg] = seq
            except Exception:
                log.exception("ranklens: torch's flight recorder cannot be read; this tracer reads it from its start")
        self.skipped_seqs = seqs
        return seqs

    def status(self) -> tuple[int, bool] | None:
        """Collectives recorded so far (all groups) and whether one of them is still in flight;
        None when unknown."""
        if self._status is None:
            return None
        try:
            return self._status()
        except Exception:
            return None

    def read(self) -> tuple[list[dict[str, Any]], int]:
        """New entries of every ring since the last read (oldest first per ring; each tagged with
        its ring's index as ``_ring``) and how many were overwritten unread."""
        out: list[dict[str, Any]] = []
        lost = 0
        for i, dump in enumerate(self._dumps):
            data = dump()
            if not data:
                continue
            data = _as_bytes(data)
            self.last_data[i] = data
            entries, n = new_entries(data, self.last_ids[i])
            for e in entries:
                e["_ring"] = i
            if entries:
                self.last_ids[i] = int(entries[-1]["record_id"])
            out += entries
            lost += n
        return out, lost


def _status() -> tuple[int, bool]:
    import torch._C._distributed_c10d as c10d

    groups = json.loads(c10d._dump_fr_trace_json(includeCollectives=False)).get("pg_status") or {}  # type: ignore[attr-defined]
    enqueued = [int(g.get("last_enqueued_collective", 0)) for g in groups.values()]
    completed = [int(g.get("last_completed_collective", 0)) for g in groups.values()]
    return sum(enqueued), any(e > c for e, c in zip(enqueued, completed))
