"""``ranklens drill``: inject faults into a real training job and score what ranklens finds."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from ranklens._cli_common import EPILOG, errors, store_flag, store_option
from ranklens.config import ENV_OUTBOX
from ranklens.errors import ConfigError

__all__ = ["drill_command"]

_HELP = """Run a training command with faults injected (no change to the script) and score detection.

Each --fault is KIND:TARGET[:SEVERITY][@STEP or @SECONDSs]; TARGET is a rank (2) or a node
(node1: torchrun's --node-rank, every rank of that node; not for desync, size_mismatch, nan):

\b
  slow_gpu:2:1.5@8        rank 2's steps take 50% longer from step 8 (or 40ms;
                          slow_gpu:2:1.5:optimizer@8 for the optimizer, :backward)
  slow_data:1:0.2@8       each DataLoader batch on rank 1 takes 0.2 s longer
  hang:3@6                rank 3 stops before its next collective (hang:3:30@6: 30 s)
  crash:1:3@6             rank 1 exits with code 3 (crash:1:kill@6: SIGKILL)
  desync:2@6              rank 2 broadcasts where the others all-reduce
  size_mismatch:1@6       rank 1 all-reduces one element more than the others
  log:0:nccl_error@6      rank 0 logs an NCCL error (nccl_timeout, cuda_oom, xid)
  gpu:3:79@6              XID 79 on rank 3's GPU (a fake NVML on machines without GPUs)
  nan:1@10                rank 1's loss is NaN at step 10
  hang:node1@6            every rank of node 1 stops (also slow_gpu, slow_data, crash, log, gpu)
  slow_link:node2:40mbit@8
                          node 2's network link limited to 40 Mbit/s with tc from step 8 (a tc
                          rate: kbit, mbit, gbit, or bytes: kbps, mbps). Needs root and iproute2:
                          the drill builds a network-namespace bed (one namespace per node, host
                          name node<k>) and starts one torchrun agent per node (--nnodes N, default
                          3, --node-rank k); the command must be torchrun; exit 2 where the bed
                          cannot be built. Detected by a slow_link finding naming node 2 or a link
                          touching it.

Steps are optimizer steps. The command runs as under `ranklens run`; without one, the built-in
job (4 gloo ranks of ranklens.drill.workload, a plain DDP script; with a slow_link, 3 nodes x 1
rank exchanging 1 MiB per forward in each cross-node pair group) runs. Findings are watched live
(the loop of `analyze --follow`): a fault is detected when a finding names its target; time to
detect runs from its onset to the first pass showing it. A finding no fault explains is a false
alarm. A hang, crash, desync or size mismatch ends the job once detected (or --detect-timeout after onset).

--suite quick runs the built-in suite (7 jobs, 9 fault kinds, a few minutes); --suite network a
throttled link on the network bed (root); --suite FILE a TOML file of [[drill]] tables (name,
faults, command). Results go to the `drills` table.

With --recover POLICY the findings are acted on (deploy/policies/torchrun-restart.toml: torch
elastic restarts the worker group in place); a hang, crash or desync then passes only when
training resumed (the next attempt's first step), and the scorecard says after how long.
--suite recovery runs a hang, a desync and a crash that way.

Exit 0 when every fault was detected with the right target and kind and nothing else was found;
9 otherwise (a missed fault, a wrong culprit or kind, a false alarm, a job that failed by itself).
"""


def _scorecard(r: Any) -> list[str]:
    status = "PASS" if r.passed else "FAIL"
    how = "stopped by the drill" if r.stopped_by_drill else f"exit {r.exit_code}"
    lines = [f"{status}  {r.name or r.drill_id}  (job {r.job_id}, {r.wall_s:.0f} s, {how})"]
    rows = [("fault", "onset", "detected", "ttd", "kind", "culprit", "resumed" if r.recovering else "", "finding")]
    for s in r.scores:
        onset = "-" if s.onset is None else (f"step {s.onset.step}" if s.onset.step >= 0 else "yes")
        finding = f"{s.finding.kind}: {s.finding.title}" if s.finding else s.note
        rows.append(
            (
                s.fault.spec,
                onset,
                "yes" if s.detected else "NO",
                "-" if s.ttd_s is None else f"{s.ttd_s:.1f} s",
                ("ok" if s.kind_ok else "WRONG") if s.detected else "-",
                ("ok" if s.culprit_ok else "WRONG") if s.detected else "-",
                ("-" if s.resumed_s is None else f"{s.resumed_s:.1f} s") if r.recovering else "",
                finding if len(finding) <= 110 else finding[:107] + "...",
            )
        )
    cols = 7 if r.recovering else 6
    widths = [max(len(row[i]) for row in rows) for i in range(cols)]
    for row in rows:
        lines.append("  " + "  ".join(c.ljust(widths[i]) for i, c in enumerate(row[:cols])) + "  " + row[7])
    if r.false_findings:
        lines.append(f"  false findings ({len(r.false_findings)}):")
        lines += [f"    {f.kind}: {f.title[:140]}" for f in r.false_findings]
    else:
        lines.append("  false findings: none")
    if r.costless_findings:
        lines.append(
            f"  costless (warnings costing the job < 1% of step time, not counted): {len(r.costless_findings)}"
        )
        lines += [f"    {f.kind}: {f.title[:140]}" for f in r.costless_findings]
    if r.job_failed:
        lines.append(f"  job failed: {r.job_failed}")
    return lines


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def suite_summary(results: list[Any]) -> dict[str, Any]:
    """Precision (right detections over right detections plus false findings and wrong culprits),
    recall (faults detected with the right rank over faults that took effect), p50/p90 time to
    detect, over every drill of a suite."""
    applied = [s for r in results for s in r.scores if s.applied]
    right = [s for s in applied if s.detected and s.culprit_ok]
    wrong = sum(1 for s in applied if s.detected and not s.culprit_ok)
    false = sum(len(r.false_findings) for r in results)
    ttd = [s.ttd_s for s in right if s.ttd_s is not None]
    return {
        "drills": len(results),
        "passed": sum(1 for r in results if r.passed),
        "faults": sum(len(r.scores) for r in results),
        "applied": len(applied),
        "detected": len(right),
        "kind_ok": sum(1 for s in right if s.kind_ok),
        "false_findings": false,
        "precision": (len(right) / (len(right) + false + wrong)) if (right or false or wrong) else None,
        "recall": (len(right) / len(applied)) if applied else None,
        "ttd_p50_s": _pct(ttd, 0.5),
        "ttd_p90_s": _pct(ttd, 0.9),
        # |finding's onset step - fault's|, over the faults detected right where both name a step
        "onset_error_max_steps": max((abs(e) for s in right if (e := s.onset_error_steps) is not None), default=None),
        "kinds": sorted({s.fault.kind.value for s in applied}),
    }


@click.command("drill", epilog=EPILOG, help=_HELP, context_settings={"ignore_unknown_options": True})
@store_option
@click.option("--fault", "faults", multiple=True, metavar="SPEC", help="A fault to inject (repeatable).")
@click.option(
    "--suite", default=None, metavar="NAME|FILE", help="Run a suite: quick, network, recovery, or a TOML file."
)
@click.option(
    "--world",
    type=int,
    default=None,
    help="World size, to check fault ranks before the job starts "
    "(default: from torchrun's --nproc-per-node/--nnodes, else when the ranks start).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=None,
    help="Seconds each drill may run (default: the suite file's timeout_s, else 600).",
)
@click.option(
    "--detect-timeout",
    "detect_timeout_s",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds after a hang/crash/desync's onset before the drill gives up waiting for a finding.",
)
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds between live analysis passes.")
@click.option(
    "--recover",
    "recover_policy",
    default=None,
    metavar="POLICY",
    help="Act on the findings with this recovery policy (e.g. deploy/policies/torchrun-restart.toml): a "
    "hang, crash or desync must then end in training resumed, whose time is measured.",
)
@click.option(
    "--outbox",
    "outbox_dir",
    envvar=ENV_OUTBOX,
    default=None,
    help="With --recover: the webhook outbox directory (default: ~/.ranklens/outbox). Env: RANKLENS_OUTBOX.",
)
@click.option("--show-output", is_flag=True, help="Echo the job's output (it always goes to the job log).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per drill, then the suite summary.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@errors
def drill_command(
    store_url: str | None,
    faults: tuple[str, ...],
    suite: str | None,
    world: int | None,
    timeout_s: float | None,
    detect_timeout_s: float,
    interval: float,
    recover_policy: str | None,
    outbox_dir: str | None,
    show_output: bool,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    from ranklens.drill.faults import parse_drill_fault
    from ranklens.drill.suites import Drill, default_command, load_suite

    if suite and faults:
        raise ConfigError("--fault and --suite: give one (a suite file lists its own faults)")
    if not suite and not faults:
        raise ConfigError("give --fault SPEC (repeatable) or --suite quick|FILE; see ranklens drill --help")
    if world is not None and world < 1:
        raise ConfigError(f"--world {world}: must be >= 1")
    for opt, v in (("--timeout", timeout_s), ("--detect-timeout", detect_timeout_s), ("--interval", interval)):
        if v is not None and not v > 0:
            raise ConfigError(f"{opt} {v:g}: must be a number of seconds > 0")
    cmd = tuple(command[1:] if command and command[0] == "--" else command)
    policy = None
    if recover_policy:
        from ranklens.analyzers.recovery.policy import load_policy

        policy = load_policy(recover_policy)
    if suite:
        s = load_suite(suite)
        if s.needs_recovery and policy is None:
            raise ConfigError(
                f"--suite {suite} measures fault -> training resumed: give --recover POLICY "
                "(e.g. deploy/policies/torchrun-restart.toml)"
            )
        drills = [Drill(d.name, d.faults, cmd or d.command) for d in s.drills]
        suite_name, timeout = s.name, timeout_s if timeout_s is not None else s.timeout_s
    else:
        parsed = tuple(parse_drill_fault(f) for f in faults)
        drills = [Drill("", parsed, cmd or tuple(default_command(parsed)))]
        suite_name, timeout = "", timeout_s if timeout_s is not None else 600.0
    from ranklens.drill.faults import validate_targets
    from ranklens.drill.runner import job_shape

    for d in drills:  # every target checked before any job starts (on the network bed: its size)
        validate_targets(list(d.faults), *job_shape(d.command, d.faults, world))

    from ranklens.cli import _open
    from ranklens.drill.runner import run_drill
    from ranklens.drill.store import save_drill

    store = _open(store_url)
    say = (lambda m: None) if as_json else (lambda m: click.echo(m, err=True))
    results = []
    for n, d in enumerate(drills, 1):
        if len(drills) > 1:
            say(f"[{n}/{len(drills)}] {d.name}: {', '.join(f.spec for f in d.faults)}")
        r = run_drill(
            store,
            d.command,
            list(d.faults),
            name=d.name,
            world_size=world,
            timeout_s=timeout,
            detect_timeout_s=detect_timeout_s,
            interval_s=interval,
            echo=sys.stderr.buffer if show_output else None,
            log=say,
            save=False,
            policy=policy,
            outbox_dir=outbox_dir or os.path.join(os.path.expanduser("~"), ".ranklens", "outbox"),
        )
        save_drill(store, r, suite=suite_name)
        results.append(r)
        if as_json:
            click.echo(json.dumps(r.to_json()))
        else:
            click.echo("\n".join(_scorecard(r)))
            click.echo(f"  next: ranklens analyze{store_flag(store.url)} --job {r.job_id}")
    summary = suite_summary(results)
    if as_json:
        click.echo(json.dumps({"suite": suite_name, **summary}))
    elif len(results) > 1 or suite:

        def f(v: Any, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        click.echo(
            f"\nsuite {suite_name}: {summary['passed']}/{summary['drills']} drills passed; "
            f"{summary['detected']}/{summary['applied']} faults detected with the right rank "
            f"({summary['kind_ok']} of the right kind), {summary['false_findings']} false finding(s); "
            f"precision {f(summary['precision'], '.2f')}, recall {f(summary['recall'], '.2f')}, "
            f"time to detect p50 {f(summary['ttd_p50_s'], '.1f')} s, p90 {f(summary['ttd_p90_s'], '.1f')} s; "
            f"kinds: {', '.join(summary['kinds'])}"
        )
    sys.exit(0 if all(r.passed for r in results) else 9)
