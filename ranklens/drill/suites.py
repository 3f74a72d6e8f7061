"""Drill suites: the built-in ``quick`` suite and users' own TOML files.

A suite file::

    command = ["python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "train.py"]
    timeout_s = 300            # per drill (optional)

    [[drill]]
    name = "slow rank"
    faults = ["slow_gpu:2:1.6@8"]

    [[drill]]
    name = "hang"
    faults = ["hang:3@6"]
    command = ["torchrun", "--nproc-per-node", "4", "other.py"]   # optional, per drill

Each drill is one run of its command with its faults; ``{drill_dir}`` in a command is the drill's
own fresh directory (for a checkpoint a restarted attempt resumes from). ``--suite recovery`` (a hang,
a desync and a crash on a job torch elastic may restart) needs ``--recover POLICY``. ``--suite
network`` throttles a node's link on the drill's network-namespace bed (root, ``ip netns``, ``tc``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from ranklens.drill.faults import DrillFault, parse_drill_fault
from ranklens.errors import ConfigError

__all__ = [
    "NETWORK",
    "QUICK",
    "RECOVERY",
    "Drill",
    "Suite",
    "default_command",
    "load_suite",
    "network_command",
    "quick_command",
    "standalone_command",
]


def standalone_command(module: str, ranks: int, *args: str, elastic: Sequence[str] = ()) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node RANKS [ELASTIC] -m MODULE ARGS``:
    a one-node torchrun job of this interpreter."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        *elastic,
        "-m",
        module,
        *args,
    ]


def quick_command(steps: int = 40, ranks: int = 4, *, restarts: int = 0) -> list[str]:
    """The built-in job: 4 gloo ranks of :mod:`ranklens.drill.workload` (no ranklens code); with
    ``restarts``, torch elastic may restart the worker group that often and the job checkpoints in
    the drill's directory every 5 steps (a restarted attempt resumes from it)."""
    elastic = ["--max-restarts", str(restarts)] if restarts else []
    ckpt = ["--checkpoint", "{drill_dir}/checkpoint.pt"] if restarts else []
    return standalone_command("ranklens.drill.workload", ranks, "--steps", str(steps), *ckpt, elastic=elastic)


def network_command(steps: int = 40, nodes: int = 3, ranks_per_node: int = 1, exchange_mb: float = 1.0) -> list[str]:
    """The built-in job on several nodes: ``ranks_per_node`` gloo ranks of
    :mod:`ranklens.drill.workload` per node, each forward all-reducing ``exchange_mb`` MiB in every
    cross-node pair group (so that a slow link can be localized). The drill adds each agent's
    ``--node-rank`` and rendezvous on its network bed."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nodes),
        "--nproc-per-node",
        str(ranks_per_node),
        "-m",
        "ranklens.drill.workload",
        "--steps",
        str(steps),
        "--exchange-mb",
        f"{exchange_mb:g}",
    ]


def default_command(faults: Sequence[DrillFault]) -> list[str]:
    """The built-in job for ``faults``: on the network bed when one throttles a link, else one node."""
    from ranklens.drill.network import needs_bed

    return network_command() if needs_bed(faults) else quick_command()


@dataclass(frozen=True)
class Drill:
    name: str
    faults: tuple[DrillFault, ...]
    command: tuple[str, ...] = ()


@dataclass(frozen=True)
class Suite:
    name: str
    drills: tuple[Drill, ...]
    command: tuple[str, ...] = ()
    timeout_s: float = 600.0
    extra: dict[str, Any] = field(default_factory=dict)
    needs_recovery: bool = False  # measures fault -> training resumed: needs --recover POLICY


def _quick() -> Suite:
    def d(name: str, *specs: str, steps: int = 30) -> Drill:
        return Drill(name, tuple(parse_drill_fault(s) for s in specs), tuple(quick_command(steps)))

    return Suite(
        "quick",
        (
            # non-fatal faults share a job: a straggler, error lines in another rank's log, an XID on a third
            d("slow forward, NCCL error line, XID", "slow_gpu:2:1.6@8", "log:0:nccl_error@6", "gpu:3:79@6", steps=36),
            d(
                "slow data loading, CUDA OOM line, NaN loss",
                "slow_data:1:0.05@8",
                "log:3:cuda_oom@6",
                "nan:2@10",
                steps=36,
            ),
            d("hang before a collective", "hang:3@6", steps=200),
            d("crash with exit code 3", "crash:1:3@6", steps=200),
            d("SIGKILL", "crash:2:kill@6", steps=200),
            d("desync", "desync:2@6", steps=200),
            d("size mismatch", "size_mismatch:1@6", steps=200),
        ),
    )


def _recovery() -> Suite:
    def d(name: str, spec: str) -> Drill:
        return Drill(name, (parse_drill_fault(spec),), tuple(quick_command(40, restarts=2)))

    return Suite(
        "recovery",
        (
            d("hang, restarted in place", "hang:3@12"),
            d("desync, restarted in place", "desync:2@12"),
            d("crash, restarted by torch elastic", "crash:1:3@12"),
        ),
        needs_recovery=True,
    )


def _network() -> Suite:
    # 3 nodes x 1 rank: the fewest where group testing can name a node (the throttled node's two pair
    # groups slow, the third pair fast); onset at step 8 leaves 4 windows of healthy baseline
    return Suite(
        "network",
        (
            Drill(
                "node 2's link throttled to 40 Mbit/s",
                (parse_drill_fault("slow_link:node2:40mbit@8"),),
                tuple(network_command(30)),
            ),
        ),
    )


QUICK = _quick()
RECOVERY = _recovery()
NETWORK = _network()
_BUILTIN = {"quick": QUICK, "recovery": RECOVERY, "network": NETWORK}


def load_suite(name_or_path: str) -> Suite:
    """The built-in suite ``name_or_path`` or the TOML file at that path.

    Raises:
        ConfigError: an unknown suite, an unreadable or malformed file, a bad fault (exit 2).
    """
    if name_or_path in _BUILTIN:
        return _BUILTIN[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(
            f"--suite {name_or_path!r}: no built-in suite of that name ({', '.join(_BUILTIN)}) and no such file"
        )
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--suite {path}: cannot read it: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--suite {path}: not valid TOML: {e}") from None

    def bad(why: str) -> ConfigError:
        return ConfigError(f"--suite {path}: {why} (see `ranklens drill --help` for the file's form)")

    def command(v: Any, where: str) -> tuple[str, ...]:
        if v is None:
            return ()
        if not isinstance(v, list) or not v or not all(isinstance(a, str) for a in v):
            raise bad(f'{where}command must be a non-empty list of strings, e.g. ["torchrun", "train.py"]')
        return tuple(v)

    unknown = set(doc) - {"command", "timeout_s", "drill", "name"}
    if unknown:
        raise bad(f"unknown key(s) {', '.join(sorted(unknown))} (allowed: command, timeout_s, name, [[drill]])")
    top = command(doc.get("command"), "")
    timeout = doc.get("timeout_s", 600)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise bad(f"timeout_s {timeout!r} must be a positive number of seconds")
    raw = doc.get("drill")
    if not isinstance(raw, list) or not raw:
        raise bad("no [[drill]] tables")
    drills = []
    for n, d in enumerate(raw, 1):
        if not isinstance(d, dict):
            raise bad(f"drill {n} is not a table")
        extra = set(d) - {"name", "faults", "command"}
        if extra:
            raise bad(f"drill {n}: unknown key(s) {', '.join(sorted(extra))} (allowed: name, faults, command)")
        faults = d.get("faults")
        if not isinstance(faults, list) or not faults or not all(isinstance(f, str) for f in faults):
            raise bad(f'drill {n}: faults must be a non-empty list of fault strings, e.g. ["hang:1@5"]')
        try:
            parsed = tuple(parse_drill_fault(f) for f in faults)
        except ConfigError as e:
            raise bad(f"drill {n}: {e}") from None
        cmd = command(d.get("command"), f"drill {n}: ") or top
        if not cmd:
            raise bad(f"drill {n}: no command (give `command` at the top or in the drill)")
        drills.append(Drill(str(d.get("name") or f"drill {n}"), parsed, cmd))
    return Suite(str(doc.get("name") or path.stem), tuple(drills), top, float(timeout))
