"""Flight-recorder analysis at scale: synthesize dumps of 1,024 and 10,240 ranks, time the analysis.

    python bench/fr_bench.py [--ranks 1024 10240] [--steps 12] [--ring 64] [--tp 8]

Each job is a hybrid TP/DP training loop like the recorded gloo scenarios (tests/data/
flight_recorder): per step a world broadcast, a tp all_gather, the world gradient all_reduce, a dp
reduce-scatter (as all_reduce) and all_gather, and a world loss all_reduce; tp groups of ``--tp``
consecutive ranks, dp groups strided. The collectives are *simulated* (a blocking collective
completes once every member issued it) until the job stands still, so which entries are retired
and which are in flight is what a real job would dump. One rank is the culprit:

- ``hang``: it stops before the gradient all_reduce of the last step (stuck in compute);
- ``desync``: it skips that all_reduce and goes on to its dp reduce-scatter (a wait cycle with its
  dp group, the hard case for telling origin from consequence).

Dumps are built in memory as FRDump objects, each keeping its last ``--ring`` entries (FR's ring
buffer). Prints one line per measurement; nothing is timed inside the test suite.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections import defaultdict

from ranklens.analyzers.hangs import analyze_flight_recorder
from ranklens.formats.flight_recorder import FRDump, FREntry

T0 = 1_796_000_000_000_000_000
STEP = (  # (group role, op, input sizes, dtype)
    ("world", "broadcast", ((4,),), "Long"),
    ("tp", "all_gather", ((64,),), "Float"),
    ("world", "all_reduce", ((520,),), "Float"),
    ("dp", "all_reduce", ((6272,),), "Float"),
    ("dp", "all_gather", ((3136,),), "Float"),
    ("world", "all_reduce", ((1,),), "Float"),
)


def synthesize(world: int, *, steps: int, ring: int, tp: int, culprit: int, fault: str) -> list[FRDump]:
    """Simulate the job until it stands still; return every rank's dump (last ``ring`` entries)."""
    n_tp = world // tp

    def group(role: str, r: int) -> tuple[str, str]:
        if role == "world":
            return "0", "default_pg"
        if role == "tp":
            return str(1 + r // tp), f"tp_{r // tp}"
        return str(1 + n_tp + r % tp), f"dp_{r % tp}"

    size = {"world": world, "tp": tp, "dp": n_tp}
    programs: list[list[int]] = []
    grad = (steps - 1) * len(STEP) + 2  # the gradient all_reduce of the last step
    for r in range(world):
        prog = [i % len(STEP) for i in range(steps * len(STEP))]
        if r == culprit:
            if fault == "hang":
                del prog[grad:]
            else:
                del prog[grad]
        programs.append(prog)

    log: list[list[list]] = [[] for _ in range(world)]  # per rank: [pg, seq, step index, t, retired]
    at: dict[tuple[str, int], list[list]] = defaultdict(list)
    seq: dict[tuple[int, str], int] = defaultdict(int)
    pos = [0] * world
    blocked = [False] * world
    clock = T0
    moved = True
    while moved:
        moved = False
        for r in range(world):
            if blocked[r] or pos[r] >= len(programs[r]):
                continue
            i = programs[r][pos[r]]
            pos[r] += 1
            role = STEP[i][0]
            name = group(role, r)[0]
            seq[(r, name)] += 1
            key = (name, seq[(r, name)])
            clock += 1_000
            rec = [r, i, clock, False]
            log[r].append([name, key[1], i, clock, rec])
            members = at[key]
            members.append(rec)
            blocked[r] = True
            moved = True
            if len(members) == size[role]:
                for m in members:
                    m[3] = True
                    blocked[m[0]] = False
                del at[key]

    dumps = []
    for r in range(world):
        entries = []
        start = max(0, len(log[r]) - ring)
        for rid in range(start, len(log[r])):
            name, s, i, t, rec = log[r][rid]
            role, op, sizes, dt = STEP[i]
            entries.append(
                FREntry(
                    pg_name=name,
                    pg_desc=group(role, r)[1],
                    collective_seq_id=s,
                    p2p_seq_id=0,
                    op=op,
                    profiling_name=f"nccl:{op}",
                    is_p2p=False,
                    input_sizes=sizes,
                    output_sizes=sizes,
                    input_dtypes=(dt,),
                    output_dtypes=(dt,),
                    retired=rec[3],
                    state="completed" if rec[3] else "scheduled",
                    time_created_ns=t,
                    record_id=rid,
                )
            )
        dumps.append(FRDump(rank=r, version="2.10", entries=tuple(entries), source_path=f"mem://rank{r}"))
    return dumps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 10240])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ring", type=int, default=64, help="entries kept per rank (FR ring buffer)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--faults", nargs="+", default=["hang", "desync"], choices=["hang", "desync"])
    args = ap.parse_args(argv)
    ok = True
    for world in args.ranks:
        for fault in args.faults:
            culprit = world // 2 + 3
            t0 = time.perf_counter()
            dumps = synthesize(world, steps=args.steps, ring=args.ring, tp=args.tp, culprit=culprit, fault=fault)
            t1 = time.perf_counter()
            findings = analyze_flight_recorder(dumps, world_size=world)
            t2 = time.perf_counter()
            entries = sum(len(d.entries) for d in dumps)
            got = [(f.kind, [s.rank for s in f.suspects]) for f in findings]
            right = got == [(fault, [culprit])]
            ok &= right
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(
                f"fr_bench ranks={world:>6} fault={fault:<6} entries={entries:>8,} "
                f"synthesize={t1 - t0:6.2f}s analyze={t2 - t1:6.2f}s "
                f"findings={got} {'OK' if right else 'WRONG'} peak_rss={rss:,.0f}MiB"
            )
            if findings:
                print(f"  {findings[0].title[:160]}")
            del dumps, findings
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
