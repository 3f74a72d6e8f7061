"""PyTorch flight-recorder (FR) dumps: the model, a safe reader and the parser (the ground floor).

The collector (``ranklens.collector.flight_recorder``) finds dump files, maps them to rows and
ingests them; the hang analyzer reads this model.

torch writes one dump per rank: ``torch._C._distributed_c10d._dump_fr_trace()`` (pickle bytes) or
``_dump_fr_trace_json()`` (JSON text), NCCL's dump-on-timeout names them ``<prefix><rank>``
(``nccl_trace_rank_3``, ``fr_trace_rank_3.json``). Both formats and both backends are read here:

- **Dumps are untrusted input.** Pickles are loaded by an unpickler that resolves no global at
  all, so only plain builtins (dict, list, tuple, str, int, float, bool, None, bytes) can come
  out of it; anything else is refused with :class:`~ranklens.errors.IngestError`.
- **gloo quirks** (torch 2.13, see tests/data/flight_recorder/PROVENANCE.md): ``pg_config`` is a
  placeholder (``{'': {'ranks': '[]'}}``), so membership is inferred from which ranks have
  entries of a process group; ``pg_status`` is keyed by the *local* pg id; ``retired`` is the
  only progress signal and a *failed* collective is retired too; the ring buffer wraps, so seq
  ids need not start at 1 and each rank's window differs.
- **The rank** comes from the dump's own ``rank`` field when it has one (newer torch), else from
  the trailing digits of the file name, as torch's own loader does.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
import reprlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ranklens.errors import IngestError

__all__ = [
    "DEFAULT_PG_DESC",
    "DUMP_NAME",
    "FRDump",
    "FREntry",
    "FRFrame",
    "FRPGConfig",
    "FRPGStatus",
    "ProcessGroupInfo",
    "UnreadableDump",
    "infer_process_groups",
    "infer_world_size",
    "load_dump",
    "parse_dump",
    "rank_from_name",
    "safe_unpickle",
]

DEFAULT_PG_DESC = "default_pg"
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxstring = 3, 6, 6, 4, 40


def _short(v: Any, limit: int) -> str:
    """A bounded repr for error messages: never recurses deeper than a few levels (a deeply
    nested value in a hostile dump must not raise RecursionError while we describe it)."""
    return _SHORT.repr(v)[:limit]


DUMP_NAME = re.compile(r"^(?!\.).*?(\d+)(\.json|\.pkl|\.pickle)?$")
_ALLOWED = (dict, list, tuple, str, int, float, bool, bytes, type(None))


@dataclass(frozen=True, slots=True)
class FRFrame:
    """One Python stack frame of the call that issued a collective."""

    name: str
    filename: str
    line: int


@dataclass(frozen=True, slots=True)
class FREntry:
    """One flight-recorder entry: a collective (or p2p op) as one rank issued it."""

    pg_name: str
    pg_desc: str
    collective_seq_id: int
    p2p_seq_id: int
    op: str
    profiling_name: str
    is_p2p: bool
    input_sizes: tuple[tuple[int, ...], ...]
    output_sizes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    retired: bool
    state: str
    time_created_ns: int
    time_started_ns: int = 0
    time_completed_ns: int = 0
    record_id: int = -1
    pg_id: int = -1
    timeout_ms: int = 0
    frames: tuple[FRFrame, ...] = ()

    @property
    def backend(self) -> str:
        """``gloo``, ``nccl``, ... from the profiling name's prefix ('' when there is none)."""
        return self.profiling_name.split(":", 1)[0] if ":" in self.profiling_name else ""


@dataclass(frozen=True, slots=True)
class FRPGStatus:
    """``pg_status`` of one process group, keyed by the rank's *local* pg id (gloo and NCCL)."""

    pg_id: str
    last_enqueued: int
    last_started: int
    last_completed: int


@dataclass(frozen=True, slots=True)
class FRPGConfig:
    """A ``pg_config`` item; ``ranks`` is empty where the backend does not fill it (gloo)."""

    pg_name: str
    desc: str
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FRDump:
    """One rank's flight-recorder dump. ``entries`` are sorted by ``record_id`` (oldest first)."""

    rank: int
    version: str
    entries: tuple[FREntry, ...]
    pg_status: tuple[FRPGStatus, ...] = ()
    pg_config: tuple[FRPGConfig, ...] = ()
    source_path: str = ""
    format: str = ""
    comm_lib_version: str = ""

    @property
    def backend(self) -> str:
        """The backend named by the entries' profiling names ('' without entries)."""
        return next((e.backend for e in self.entries if e.backend), "")

    @property
    def wrapped(self) -> bool:
        """True when the ring buffer overwrote older entries (the first record id is not 0)."""
        return bool(self.entries) and self.entries[0].record_id > 0


@dataclass(frozen=True, slots=True)
class ProcessGroupInfo:
    """A process group across dumps: its members and where that knowledge came from."""

    name: str
    desc: str
    members: tuple[int, ...]
    source: str  # "pg_config", "default group (world)" or "inferred from entries"


# ---------------------------------------------------------------------------------------- reading


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Resolves no global: a dump is plain data, a class or function in it is an attack or junk."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: flight-recorder dumps contain only plain builtins "
            "(dict, list, tuple, str, int, float, bool, None, bytes)"
        )


def safe_unpickle(data: bytes, source: str = "<bytes>") -> Any:
    """Unpickle ``data`` allowing only dict/list/tuple/str/int/float/bool/None/bytes.

    Args:
        data: pickle bytes (e.g. ``torch._C._distributed_c10d._dump_fr_trace()``).
        source: the file the bytes came from, for error messages.

    Returns:
        The unpickled object.

    Raises:
        IngestError: truncated or corrupt data, or any other type (a class, a set, a function).
    """
    try:
        obj = _NoGlobalsUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise IngestError(source, "pickle", str(e)) from None
    except EOFError:
        raise IngestError(source, "pickle", "truncated: the data ends before the pickle does") from None
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, OverflowError) as e:
        raise IngestError(source, "pickle", f"corrupt pickle data ({type(e).__name__}: {e})") from None
    except MemoryError:
        raise IngestError(source, "pickle", "corrupt pickle data (asks for more memory than exists)") from None
    # set/frozenset/bytearray have opcodes of their own: refuse them after the fact. Shared
    # sub-objects are visited once (a small pickle may reference one list exponentially often).
    seen: set[int] = set()
    stack = [obj]
    while stack:
        x = stack.pop()
        if type(x) not in _ALLOWED:
            raise IngestError(source, "pickle", f"refusing a {type(x).__name__}: dumps contain only plain builtins")
        if isinstance(x, (dict, list, tuple)):
            if id(x) in seen:
                continue
            seen.add(id(x))
            stack.extend(x.items() if isinstance(x, dict) else x)
    return obj


def rank_from_name(path: Path) -> int | None:
    m = DUMP_NAME.match(path.name)
    return int(m.group(1)) if m else None


def _looks_like_json(path: Path, data: bytes) -> bool:
    if path.suffix == ".json":
        return True
    head = data.lstrip()[:1]
    return head in (b"{", b"[")


def load_dump(path: str | Path, *, rank: int | None = None) -> FRDump:
    """Read one dump file, pickle or JSON (told apart by a ``.json`` suffix, else by content).

    Args:
        path: the dump file.
        rank: the rank, overriding the dump's own field and the file name.

    Returns:
        The validated dump.

    Raises:
        IngestError: unreadable, truncated, malformed, or without a way to tell its rank.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise IngestError(str(p), "", f"cannot read: {e.strerror or e}") from None
    if not data:
        raise IngestError(str(p), "", "empty file (a dump interrupted before it was written?)")
    try:
        if _looks_like_json(p, data):
            fmt = "json"
            try:
                obj = json.loads(data.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise IngestError(str(p), f"byte {e.start}", "not UTF-8 text, so not a JSON dump") from None
            except json.JSONDecodeError as e:
                raise IngestError(str(p), f"line {e.lineno} column {e.colno}", f"not valid JSON ({e.msg})") from None
        else:
            fmt = "pickle"
            obj = safe_unpickle(data, str(p))
        return parse_dump(obj, source_path=str(p), rank=rank, fmt=fmt)
    except RecursionError:
        # json.loads recurses per nesting level; a real dump is a few levels deep
        raise IngestError(
            str(p), "", "nested too deeply to be a flight-recorder dump (a real dump is a few levels deep)"
        ) from None


@dataclass(frozen=True, slots=True)
class UnreadableDump:
    """A dump file that could not be read: its rank when the file name tells it, and why."""

    path: str
    rank: int | None
    error: str


class _Fields:
    """Typed access to one dict of a dump, raising IngestError that says where and what."""

    def __init__(self, obj: Mapping[str, Any], source: str, where: str) -> None:
        self.obj, self.source, self.where = obj, source, where

    def fail(self, message: str) -> IngestError:
        return IngestError(self.source, self.where, message)

    def get(self, key: str, required: bool = True, default: Any = None) -> Any:
        if key not in self.obj:
            if required:
                raise self.fail(f"field {key!r} is missing")
            return default
        return self.obj[key]

    def as_int(self, key: str, required: bool = True, default: int = 0) -> int:
        v = self.get(key, required, default)
        if v is None:
            return default
        if isinstance(v, str):  # JSON dumps write pg_status numbers as strings
            try:
                return int(v)
            except ValueError:
                raise self.fail(f"field {key!r} must be an integer, got {_short(v, 60)}") from None
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(f"field {key!r} must be an integer, got {type(v).__name__} {_short(v, 60)}")
        return v

    def as_str(self, key: str, required: bool = True, default: str = "") -> str:
        v = self.get(key, required, default)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self.fail(f"field {key!r} must be a string, got {type(v).__name__} {_short(v, 60)}")
        return v

    def as_bool(self, key: str, required: bool = True, default: bool = False) -> bool:
        v = self.get(key, required, default)
        if not isinstance(v, bool):
            raise self.fail(f"field {key!r} must be true or false, got {type(v).__name__} {_short(v, 60)}")
        return v

    def sizes(self, key: str) -> tuple[tuple[int, ...], ...]:
        v = self.get(key, False, [])
        if not isinstance(v, (list, tuple)) or not all(
            isinstance(s, (list, tuple)) and all(type(n) is int for n in s) for s in v
        ):
            raise self.fail(f"field {key!r} must be a list of shapes (lists of integers), got {_short(v, 80)}")
        return tuple(tuple(s) for s in v)

    def strs(self, key: str) -> tuple[str, ...]:
        v = self.get(key, False, [])
        if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
            raise self.fail(f"field {key!r} must be a list of strings, got {_short(v, 80)}")
        return tuple(v)


def _parse_entry(obj: Any, source: str, i: int) -> FREntry:
    where = f"entries[{i}]"
    if not isinstance(obj, dict):
        raise IngestError(source, where, f"expected a dict, got {type(obj).__name__}")
    f = _Fields(obj, source, where)
    pg = f.get("process_group")
    if not (isinstance(pg, (list, tuple)) and len(pg) == 2 and all(isinstance(x, str) for x in pg)):
        raise f.fail(f"field 'process_group' must be a (name, desc) pair of strings, got {_short(pg, 80)}")
    profiling_name = f.as_str("profiling_name")
    frames_raw = f.get("frames", False, []) or []
    if not isinstance(frames_raw, (list, tuple)):
        raise f.fail(f"field 'frames' must be a list, got {type(frames_raw).__name__}")
    frames = []
    for j, fr in enumerate(frames_raw):
        if not isinstance(fr, dict):
            raise IngestError(source, f"{where}.frames[{j}]", f"expected a dict, got {type(fr).__name__}")
        ff = _Fields(fr, source, f"{where}.frames[{j}]")
        frames.append(FRFrame(ff.as_str("name", False), ff.as_str("filename", False), ff.as_int("line", False)))
    seq = f.as_int("collective_seq_id")
    if seq < 0:
        raise f.fail(f"field 'collective_seq_id' must be >= 0, got {seq}")
    return FREntry(
        pg_name=pg[0],
        pg_desc=pg[1],
        collective_seq_id=seq,
        p2p_seq_id=f.as_int("p2p_seq_id", False),
        op=profiling_name.split(":", 1)[-1],
        profiling_name=profiling_name,
        is_p2p=f.as_bool("is_p2p", False),
        input_sizes=f.sizes("input_sizes"),
        output_sizes=f.sizes("output_sizes"),
        input_dtypes=f.strs("input_dtypes"),
        output_dtypes=f.strs("output_dtypes"),
        retired=f.as_bool("retired"),
        state=f.as_str("state", False),
        time_created_ns=f.as_int("time_created_ns"),
        # None in pickles, 0 in JSON: both mean "not recorded" (gloo never records them).
        time_started_ns=f.as_int("time_discovered_started_ns", False),
        time_completed_ns=f.as_int("time_discovered_completed_ns", False),
        record_id=f.as_int("record_id", False, i),
        pg_id=f.as_int("pg_id", False, -1),
        timeout_ms=f.as_int("timeout_ms", False),
        frames=tuple(frames),
    )


def _parse_ranks(value: Any) -> tuple[int, ...]:
    # NCCL writes ranks as the *string* "[0, 1, 2]" (torch's analyzer evals it); never eval input.
    if isinstance(value, str):
        value = [int(x) for x in re.findall(r"-?\d+", value)]
    if not isinstance(value, (list, tuple)) or not all(type(x) is int for x in value):
        raise TypeError("ranks")
    return tuple(sorted(set(value)))


def _dicts_of(top: _Fields, key: str) -> list[tuple[Any, _Fields]]:
    """The entries of the optional dict-of-dicts field ``key`` (``pg_status``, ``pg_config``)."""
    raw = top.get(key, False, {}) or {}
    if not isinstance(raw, dict):
        raise top.fail(f"field {key!r} must be a dict, got {type(raw).__name__}")
    out = []
    for k, v in raw.items():
        if not isinstance(v, dict):
            raise IngestError(top.source, f"{key}[{k!r}]", f"expected a dict, got {type(v).__name__}")
        out.append((k, _Fields(v, top.source, f"{key}[{k!r}]")))
    return out


def parse_dump(obj: Any, *, source_path: str = "<memory>", rank: int | None = None, fmt: str = "") -> FRDump:
    """Validate an unpickled or JSON-decoded dump and build an :class:`FRDump`.

    Args:
        obj: the decoded dump (a dict with ``version`` and ``entries``).
        source_path: where it came from, for error messages and ``FRDump.source_path``.
        rank: the rank; default: the dump's ``rank`` field, else the file name's trailing digits.
        fmt: ``pickle`` or ``json``, recorded on the dump.

    Returns:
        The dump, entries sorted by record id.

    Raises:
        IngestError: a wrong structure or missing field, naming the entry and the field.
    """
    src = source_path
    if not isinstance(obj, dict):
        raise IngestError(src, "top level", f"expected a dict with 'version' and 'entries', got {type(obj).__name__}")
    top = _Fields(obj, src, "top level")
    version = top.get("version")
    if not isinstance(version, (str, int, float)) or isinstance(version, bool):
        raise top.fail(f"field 'version' must be a string, got {_short(version, 60)}")
    entries_raw = top.get("entries")
    if not isinstance(entries_raw, (list, tuple)):
        raise top.fail(f"field 'entries' must be a list, got {type(entries_raw).__name__}")
    entries = sorted((_parse_entry(e, src, i) for i, e in enumerate(entries_raw)), key=lambda e: e.record_id)

    status = []
    for key, sf in _dicts_of(top, "pg_status"):
        status.append(
            FRPGStatus(
                str(key),
                sf.as_int("last_enqueued_collective", False, -1),
                sf.as_int("last_started_collective", False, -1),
                sf.as_int("last_completed_collective", False, -1),
            )
        )

    config = []
    for key, cf in _dicts_of(top, "pg_config"):
        try:
            ranks = _parse_ranks(cf.get("ranks", False, []))
        except TypeError:
            raise cf.fail(f"field 'ranks' must list integers, got {_short(cf.obj.get('ranks'), 80)}") from None
        if key == "" and not ranks:
            continue  # gloo's placeholder {'': {'name': '', 'desc': '', 'ranks': '[]'}}
        config.append(FRPGConfig(str(key), cf.as_str("desc", False), ranks))

    if rank is None:
        own = obj.get("rank")
        if own is not None:
            rank = top.as_int("rank")
        else:
            rank = rank_from_name(Path(src))
    if rank is None:
        raise IngestError(
            src,
            "",
            "cannot tell the rank: the dump has no 'rank' field and the file name does not end "
            "in the rank (name it like fr_trace_rank_3 or fr_trace_rank_3.json)",
        )
    if rank < 0:
        raise IngestError(src, "", f"rank must be >= 0, got {rank}")
    return FRDump(
        rank=rank,
        version=str(version),
        entries=tuple(entries),
        pg_status=tuple(status),
        pg_config=tuple(config),
        source_path=src,
        format=fmt,
        comm_lib_version=str(obj.get("comm_lib_version", "") or ""),
    )


# ----------------------------------------------------------------------------- groups and rows


def _is_default(name: str, desc: str) -> bool:
    return desc == DEFAULT_PG_DESC or (name == "0" and not desc)


_GATHER_OPS = frozenset(
    {"all_gather", "allgather", "_allgather_base", "all_gather_into_tensor", "all_gather_into_tensor_coalesced"}
)
_SCATTER_OPS = frozenset(
    {"reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"}
)


def _group_size_hint(entries: Iterable[FREntry]) -> int:
    """A group's size from its own entries: an all-gather's output is the group size times its
    input (a reduce-scatter's input the group size times its output). 0 when nothing tells."""
    found: Counter[int] = Counter()
    for e in entries:
        if e.op not in _GATHER_OPS and e.op not in _SCATTER_OPS:
            continue
        n_in = sum(math.prod(s) for s in e.input_sizes)
        n_out = sum(math.prod(s) for s in e.output_sizes)
        big, small = (n_out, n_in) if e.op in _GATHER_OPS else (n_in, n_out)
        if small > 0 and big % small == 0 and big // small >= 2:
            found[big // small] += 1
    return found.most_common(1)[0][0] if found else 0


def infer_world_size(
    dumps: Sequence[FRDump], world_size: int | None = None, *, known_ranks: Iterable[int] = ()
) -> tuple[int, str]:
    """The world size of a job attempt and how it was found (see :func:`infer_process_groups`)."""
    return _infer(dumps, world_size, known_ranks)[1:]


def infer_process_groups(
    dumps: Sequence[FRDump], world_size: int | None = None, *, known_ranks: Iterable[int] = ()
) -> tuple[dict[str, ProcessGroupInfo], int]:
    """Members of every process group seen in the dumps, and the world size.

    The world size is, in this order: the one given; the membership of the default group in the
    dumps' process-group table (``pg_config``; gloo fills it, under the key ``''``, while the job
    has no other group); the highest rank ``pg_config`` lists; else the highest rank that dumped,
    raised to what the groups' own sizes require (an all-gather's output is the group size times
    its input: a group with fewer ranks seen than that is missing ranks that left no dump).

    Members come from ``pg_config`` when it lists them (NCCL); the default group holds every
    rank of the world; otherwise (gloo) the members are the ranks that have entries of the
    group, completed by the ranks without a dump when the group's size says how many are missing
    and exactly that many ranks left no dump.

    Args:
        dumps: the dumps of one job attempt.
        world_size: the number of ranks, when known.
        known_ranks: ranks known to exist that have no readable dump (e.g. a truncated one).

    Returns:
        ``({pg name: ProcessGroupInfo}, world size)``.
    """
    groups, world, _ = _infer(dumps, world_size, known_ranks)
    return groups, world


def _infer(
    dumps: Sequence[FRDump], world_size: int | None, known_ranks: Iterable[int]
) -> tuple[dict[str, ProcessGroupInfo], int, str]:
    config: dict[str, FRPGConfig] = {}
    descs: dict[str, str] = {}
    seen: dict[str, set[int]] = {}
    entries: dict[str, list[FREntry]] = {}
    dumped = {d.rank for d in dumps}
    known = dumped | set(known_ranks)
    for d in dumps:
        for c in d.pg_config:
            config.setdefault(c.pg_name, c)
        for e in d.entries:
            descs.setdefault(e.pg_name, e.pg_desc)
            seen.setdefault(e.pg_name, set()).add(d.rank)
            if d.rank == min(seen[e.pg_name]):
                entries.setdefault(e.pg_name, []).append(e)
    default = next(
        (
            n
            for n in sorted({*seen, *config})
            if _is_default(n, descs.get(n) or (config[n].desc if n in config else ""))
        ),
        None,
    )
    world_cfg = (config.get(default) if default is not None else None) or config.get("")
    hints = {n: _group_size_hint(es) for n, es in entries.items()}
    if world_size is not None:
        world, source = world_size, "given"
    elif world_cfg is not None and world_cfg.ranks:
        world, source = max(world_cfg.ranks) + 1, "process-group table (pg_config) of the default group"
        world = max(world, max(known, default=-1) + 1)
    elif any(c.ranks for c in config.values()):
        world = max(max(known, default=-1), *(max(c.ranks) for c in config.values() if c.ranks)) + 1
        source = "process-group table (pg_config): highest member + 1"
    else:
        world, source = max(known, default=-1) + 1, "highest dumped rank + 1"
        need = max(
            [hints.get(default, 0) if default else 0]
            # a group's unseen members are ranks without a readable dump; other groups' may be the same ranks
            + [len(dumped) + h - len(seen[n]) for n, h in hints.items() if n != default and h > len(seen[n])]
        )
        if need > world:
            world, source = need, "group sizes in the dumps (all-gather output / input)"
    no_dump = sorted(set(range(world)) - dumped)
    groups: dict[str, ProcessGroupInfo] = {}
    # pg_config's '' key is no group of its own: gloo's table of the default group
    for name in sorted({*seen, *(n for n in config if n)}, key=lambda s: (len(s), s)):
        desc = descs.get(name) or (config[name].desc if name in config else "")
        if name in config and config[name].ranks:
            groups[name] = ProcessGroupInfo(name, desc, config[name].ranks, "pg_config")
        elif name == default:
            groups[name] = ProcessGroupInfo(name, desc, tuple(range(world)), "default group (world)")
        else:
            members = set(seen[name])
            h = hints.get(name, 0)
            how = "inferred from entries"
            if h > len(members):
                if len(no_dump) == h - len(members):
                    members |= set(no_dump)
                    how = f"inferred from entries; its size ({h}) says the ranks without a dump are members"
                else:
                    how = f"inferred from entries; its size is {h}: {h - len(members)} member(s) left no dump"
            groups[name] = ProcessGroupInfo(name, desc, tuple(sorted(members)), how)
    return groups, world, source
