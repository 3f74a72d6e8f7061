"""Live detection latency, the whole command: a real 4-rank job under ``ranklens run`` and
``ranklens analyze --follow`` beside it; time from the fault's onset to the first finding the
follow loop prints.

    python bench/live_bench.py [--rounds 3] [--scenario hang|straggler|all] [--disk-pressure]
                               [--baseline-rev REV] [--interval 2]

Each round starts both commands as a user would (``analyze --follow --json`` first: it waits
for the job), runs ``ranklens run --store embedded://... -- torchrun --standalone
--nproc-per-node 4 bench/_live_job.py`` (an unmodified DDP script, traced zero-code), and reads
the follow loop's JSON Lines as they come. The faulty rank writes its onset (epoch ns) to a
marker file; the latency is the time the matching ``new`` event was read minus that onset, so
start-up (torch import, rendezvous) is not counted, but the tracer's spool, the collector's
shipping, the store and the analyzer's passes are.

Scenarios: ``hang`` (rank 2 stops before its backward at iteration 20: the others wait in DDP's
bucket all-reduce; the finding wanted is a ``hang`` naming rank 2) and ``straggler`` (rank 1's
forward takes 2x from iteration 20; a ``straggler`` naming rank 1). A finding of another kind or
rank, or one opened before the onset, is a *wrong* finding and reported as such (another kind
naming the faulty rank, e.g. a straggler before the hang, is noted and the wait goes on).

``--disk-pressure`` runs a writer beside the job that rewrites a 256 MiB file in the spool's file
system with an fsync every 8 MiB (the dirty-page and journal pressure under which heartbeats
used to stall behind the ranks' own spool writes). ``--baseline-rev REV`` alternates rounds of
this tree with rounds of the code at git revision REV (laid out as an installed package and put
first on PYTHONPATH), and prints both: the before/after of a change, measured side by side.
Each round also prints the largest gap between two heartbeats of a rank that the store held up
to the finding (the ranks' tracers write one every 0.5 s): a stall of the heartbeats shows there.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "bench" / "_live_job.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SCENARIOS = {  # scenario -> (LIVE_MODE, faulty rank, finding kind wanted)
    "hang": ("hang", 2, "hang"),
    "straggler": ("straggler", 1, "straggler"),
}
STARTUP_S = 300.0  # readiness only: four ranks importing torch on a loaded 2-core machine
DETECT_S = 120.0  # after the onset: no finding by then counts as a miss


@dataclass
class Round:
    latency_s: float | None  # None: no right finding within DETECT_S of the onset
    wrong: list[str] = field(default_factory=list)  # findings of another kind/rank, or before the onset
    note: str = ""
    hb_gap_s: float | None = None  # the largest gap between two heartbeats of a rank in the store


def heartbeat_gap_s(store: str, job: str, until_ns: int, env: dict[str, str], cwd: Path) -> float | None:
    """The largest gap between consecutive heartbeats of any rank of ``job`` up to ``until_ns``, as
    the store holds them (`ranklens sql`): what the hang detector saw of the ranks' liveness."""
    q = (
        "SELECT max(g) AS gap FROM (SELECT rank, arrayReduce('max', arrayDifference(arraySort(groupArray(ts_ns)))) "
        f"AS g FROM heartbeats WHERE job_id = '{job}' AND ts_ns <= {int(until_ns)} GROUP BY rank)"
    )
    out = subprocess.run(
        [sys.executable, "-m", "ranklens.cli", "sql", "--store", store, "--json", q],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = json.loads(out.stdout) if out.returncode == 0 else []
    return float(rows[0]["gap"]) / 1e9 if rows and rows[0]["gap"] is not None else None


def baseline_tree(rev: str, into: Path) -> Path:
    """The sources at ``rev`` laid out as the installed ``ranklens`` package (pyproject's
    package-dir mapping), so that ``PYTHONPATH=<tree>`` runs them instead of this checkout."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    mapping = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    tree = into / "tree"
    (tree / "ranklens").parent.mkdir(parents=True, exist_ok=True)
    os.symlink(src / mapping["ranklens"], tree / "ranklens")
    for pkg, folder in mapping.items():
        if pkg != "ranklens" and not (src / mapping["ranklens"] / pkg.split(".", 1)[1]).exists():
            os.symlink(src / folder, src / mapping["ranklens"] / pkg.split(".", 1)[1])
    return tree


def _env(tree: Path | None, **extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH", "")) if p)
    return env


def _check_tree(tree: Path | None, cwd: Path) -> None:
    """The code a round runs is the code meant (a baseline tree is not shadowed by the checkout)."""
    out = subprocess.run(
        [sys.executable, "-c", "import ranklens.tracing.tracer as t; print(t.__file__)"],
        env=_env(tree),
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    want = str(tree.parent) if tree is not None else str(ROOT)  # the tree links into its sources
    if not os.path.realpath(out).startswith(os.path.realpath(want)):
        raise SystemExit(f"live_bench: ranklens.tracing.tracer comes from {out}, not from {want}")


class DiskPressure:
    """Rewrites a 256 MiB file in ``folder`` with an fsync every 8 MiB until stopped."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "pressure.bin"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disk-pressure", daemon=True)
        self.written = 0

    def __enter__(self) -> DiskPressure:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        self.path.unlink(missing_ok=True)

    def _run(self) -> None:
        block = os.urandom(8 << 20)
        while not self._stop.is_set():
            with open(self.path, "wb") as f:
                for _ in range(32):
                    if self._stop.is_set():
                        break
                    f.write(block)
                    os.fsync(f.fileno())
                    self.written += len(block)


def _kill_job(job_id: str) -> None:
    """SIGKILL what is left of the job: this user's processes whose environment names the job
    (``ranklens run`` gives every process it starts RANKLENS_JOB_ID; torchrun's ranks run in
    sessions of their own, so a process-group kill would miss them)."""
    needle = f"RANKLENS_JOB_ID={job_id}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                os.kill(int(d.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def one_round(scenario: str, tree: Path | None, *, interval: float, disk_pressure: bool) -> Round:
    mode, bad, want = SCENARIOS[scenario]
    tmp = Path(tempfile.mkdtemp(prefix="ranklens-live-"))
    job = f"live-{scenario}-{uuid.uuid4().hex[:6]}"
    store = f"embedded://{tmp}/store"
    marker = tmp / "onset"
    env = _env(tree, LIVE_MODE=mode, LIVE_RANK=str(bad), LIVE_FROM="20", LIVE_MARKER=str(marker))
    cli = [sys.executable, "-m", "ranklens.cli"]
    follow_cmd = [*cli, "analyze", "--store", store, "--job", job, "--follow", "--json", "--interval", f"{interval:g}"]
    run_cmd = [*cli, "run", "--store", store, "--spool", str(tmp / "spool"), "--job-id", job, "--"]
    run_cmd += [TORCHRUN, "--standalone", "--nproc-per-node", "4", str(JOB)]
    events: queue.Queue[tuple[int, str]] = queue.Queue()
    with open(tmp / "follow.err", "w") as ferr, open(tmp / "run.log", "w") as rlog:
        # run outside the checkout: `python -m` puts the working directory first on sys.path
        follow = subprocess.Popen(follow_cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=ferr, text=True)
        run = subprocess.Popen(run_cmd, env=env, cwd=tmp, stdout=rlog, stderr=subprocess.STDOUT)

        def read() -> None:
            assert follow.stdout is not None
            for line in follow.stdout:
                events.put((time.time_ns(), line))

        threading.Thread(target=read, daemon=True).start()
        pressure = DiskPressure(tmp) if disk_pressure else None
        if pressure is not None:
            pressure.__enter__()
        result = Round(None)
        found_ns = 0
        try:
            start = time.monotonic()
            onset_deadline = None
            while True:
                if onset_deadline is None and marker.exists():
                    onset_deadline = time.monotonic() + DETECT_S
                if (onset_deadline or start + STARTUP_S) < time.monotonic():
                    result.note = "no onset (job did not start)" if onset_deadline is None else "missed"
                    return result
                if run.poll() is not None and events.empty():
                    result.note = f"ranklens run exited {run.returncode} (see {tmp / 'run.log'})"
                    return result
                try:
                    seen_ns, line = events.get(timeout=0.5)
                except queue.Empty:
                    continue
                ev = json.loads(line)
                if ev.get("event") != "new":
                    continue
                f = ev["finding"]
                ranks = sorted({s["rank"] for s in f["suspects"]})
                onset = int(marker.read_text()) if marker.exists() else None
                if f["kind"] == want and bad in ranks and onset is not None:
                    result.latency_s = (seen_ns - onset) / 1e9
                    found_ns = seen_ns
                    return result
                if onset is None or bad not in ranks:  # another kind naming the faulty rank is not wrong
                    result.wrong.append(f"{f['kind']} ranks {ranks}" + (" before the onset" if onset is None else ""))
                else:
                    result.note += f" (first: {f['kind']} ranks {ranks})"
        finally:
            if pressure is not None:
                pressure.__exit__()
            run.send_signal(signal.SIGINT)  # ranklens run stops torchrun, which stops its ranks
            try:
                run.wait(30)
            except subprocess.TimeoutExpired:
                pass
            _kill_job(job)
            run.kill()
            run.wait()
            follow.terminate()
            try:
                follow.wait(30)
            except subprocess.TimeoutExpired:
                follow.kill()
                follow.wait()
            if found_ns:
                result.hb_gap_s = heartbeat_gap_s(store, job, found_ns, env, tmp)
            if result.latency_s is not None and not result.wrong:
                subprocess.run(["rm", "-rf", str(tmp)], check=False)
            else:
                result.note += f" (logs kept in {tmp})"


def _summary(xs: list[float]) -> str:
    if not xs:
        return "no detections"
    p90 = statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0]
    return f"median {statistics.median(xs):.1f} s, p90 {p90:.1f} s, max {max(xs):.1f} s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per scenario (and per tree with --baseline-rev)")
    ap.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    ap.add_argument("--disk-pressure", action="store_true", help="a writer fsyncing 8 MiB blocks beside the job")
    ap.add_argument("--baseline-rev", help="also run the code at this git revision, alternating rounds")
    ap.add_argument("--interval", type=float, default=2.0, help="analyze --follow --interval (default: its own 2 s)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    scratch = Path(tempfile.mkdtemp(prefix="ranklens-live-bench-"))
    trees: dict[str, Path | None] = {"this tree": None}
    if args.baseline_rev:
        trees = {f"baseline {args.baseline_rev}": baseline_tree(args.baseline_rev, scratch), **trees}
    for tree in trees.values():
        _check_tree(tree, scratch)
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    pressure = " under disk pressure" if args.disk_pressure else ""
    for scenario in scenarios:
        got: dict[str, list[Round]] = {name: [] for name in trees}
        for i in range(args.rounds):
            for name, tree in trees.items():  # alternating A/B: both see the same machine load
                r = one_round(scenario, tree, interval=args.interval, disk_pressure=args.disk_pressure)
                got[name].append(r)
                shown = "-" if r.latency_s is None else f"{r.latency_s:.1f} s"
                if r.hb_gap_s is not None:
                    shown += f" (largest heartbeat gap {r.hb_gap_s:.2f} s)"
                extra = f"; wrong findings: {r.wrong}" if r.wrong else ""
                print(f"  {scenario} round {i + 1} [{name}]: {shown}{extra} {r.note}".rstrip(), flush=True)
        for name, rounds in got.items():
            xs = [r.latency_s for r in rounds if r.latency_s is not None]
            wrong = sum(len(r.wrong) for r in rounds)
            gaps = [r.hb_gap_s for r in rounds if r.hb_gap_s is not None]
            gap = f"; largest heartbeat gap {max(gaps):.2f} s" if gaps else ""
            print(
                f"{scenario}{pressure} [{name}]: onset -> first finding (analyze --follow) {_summary(xs)}; "
                f"{len(xs)}/{len(rounds)} detected, {wrong} wrong finding(s){gap}",
                flush=True,
            )
    subprocess.run(["rm", "-rf", str(scratch)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
