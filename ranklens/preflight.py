"""The pre-flight coordinator: check every node before a job starts, then the checks across them.

Each node runs its own checks (:mod:`ranklens.collector.preflight`): in this process when no nodes
are given (this machine), else as ``python -m ranklens.collector.preflight`` through a launcher
(``ip netns exec``, ``ssh``, ``srun``), all nodes at once. A node whose worker cannot be started,
fails, or does not answer in time is *unreachable* (``net.reachable`` fails) and the others go on.
Then the fleet checks compare the reports (versions, clocks, compute) and a link probe runs
between the reachable nodes: an all-reduce over all of them and the bandwidth of a ring of pairs,
which names the node whose every link is slow.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ranklens.collector.preflight import CHECKS, Check, CheckResult, Context, NodeReport, Status, fleet, run_node, worst
from ranklens.collector.preflight.runner import RESULT_TAG, context_nvml
from ranklens.config import ENV_FAKE_NVML, node_name

__all__ = [
    "EXIT_FAIL",
    "EXIT_WARN",
    "PreflightPlan",
    "PreflightReport",
    "report_text",
    "run_preflight",
    "this_node",
    "write_blacklist",
    "write_metrics",
]

EXIT_WARN = 10
EXIT_FAIL = 11

Launcher = Callable[[str, list[str]], list[str]]


def this_node() -> str:
    """This machine's node name, as the job's records name it ($RANKLENS_HOST, else the hostname)."""
    return node_name()


@dataclass
class PreflightPlan:
    """What to check, where and how. ``nodes`` empty: this machine, in-process."""

    checks: list[Check]
    nodes: list[str] = field(default_factory=list)
    launcher: Launcher | None = None
    addresses: dict[str, str] = field(default_factory=dict)
    node_env: Callable[[str], dict[str, str]] | None = None
    checkpoint_path: str = ""
    mounts: tuple[str, ...] = ()
    gpus_expected: int = -1
    burn_s: float = 1.0
    thresholds: dict[str, float] = field(default_factory=dict)
    timeout_s: float = 120.0
    python: str = sys.executable
    probe_bytes: int = 16 << 20
    probe_iters: int = 5
    slow_ratio: float = 2.0
    min_Bps: float = 0.0
    job_id: str = ""


@dataclass
class PreflightReport:
    """Every result of a run, by node, and what follows from them (verdicts, blacklist, exit code)."""

    run_id: str
    started_ns: int
    nodes: list[str]
    results: list[CheckResult]
    duration_s: float = 0.0
    job_id: str = ""
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)

    def of(self, node: str) -> list[CheckResult]:
        return [r for r in self.results if r.node == node]

    def verdict(self, node: str) -> Status:
        return worst([r.status for r in self.of(node)])

    @property
    def verdicts(self) -> dict[str, Status]:
        return {n: self.verdict(n) for n in self.nodes}

    def reasons(self, node: str, at_least: Status = Status.FAIL) -> list[str]:
        """``check: message`` of the node's results as bad as ``at_least`` (fail; or warn and worse)."""
        from ranklens.collector.preflight.api import SEVERITY

        return [
            f"{r.check}{'[' + r.subject + ']' if r.subject else ''}: {r.message}"
            for r in self.of(node)
            if SEVERITY[r.status] >= SEVERITY[at_least] and r.status is not Status.SKIP
        ]

    @property
    def blacklist(self) -> list[str]:
        return [n for n in self.nodes if self.verdict(n) is Status.FAIL]

    @property
    def exit_code(self) -> int:
        v = worst(list(self.verdicts.values()))
        return EXIT_FAIL if v is Status.FAIL else EXIT_WARN if v is Status.WARN else 0

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in Status}
        for r in self.results:
            out[r.status.value] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "job_id": self.job_id,
            "started_ns": self.started_ns,
            "duration_s": self.duration_s,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "checks": len({r.check for r in self.results}),
            "nodes": [
                {
                    "node": n,
                    "verdict": self.verdict(n).value,
                    "reasons": self.reasons(n, Status.WARN),
                    "results": [r.to_json() for r in self.of(n)],
                }
                for n in self.nodes
            ],
            "blacklist": self.blacklist,
        }

    def blacklist_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "nodes": self.blacklist,
            "reasons": {n: self.reasons(n) for n in self.blacklist},
        }

    def rows(self) -> list[dict[str, Any]]:
        """The ``preflight`` table's rows of this run."""
        verdict = {n: v.value for n, v in self.verdicts.items()}
        return [
            {
                "run_id": self.run_id,
                "job_id": self.job_id,
                "ts_ns": self.started_ns,
                "host": r.node,
                "check_name": r.check,
                "subject": r.subject,
                "status": r.status.value,
                "verdict": verdict.get(r.node, ""),
                "message": r.message,
                "value": r.value,
                "unit": r.unit,
                "threshold": r.threshold,
                "fix": r.fix,
                "duration_s": r.duration_s,
            }
            for r in self.results
        ]

    def findings(self) -> list[Any]:
        """One ``preflight_failed`` finding per failed node, for the findings table and the
        recovery policy (drain / replace the node before the job starts)."""
        from ranklens.analyzers.findings import Finding, Severity, Suspect, finding_id

        job = self.job_id or f"preflight-{self.run_id}"
        out = []
        for n in self.blacklist:
            reasons = self.reasons(n)
            failed = sorted({r.check for r in self.of(n) if r.status is Status.FAIL})
            out.append(
                Finding(
                    id=finding_id(job, 0, "preflight_failed", n),
                    job_id=job,
                    attempt=0,
                    kind="preflight_failed",
                    severity=Severity.CRITICAL,
                    confidence=1.0,
                    title=f"node {n} failed pre-flight: {reasons[0] if reasons else ', '.join(failed)}"[:300],
                    suspects=(Suspect(rank=-1, node=n),),
                    first_seen_step=-1,
                    last_seen_step=-1,
                    first_seen_ns=self.started_ns,
                    last_seen_ns=self.started_ns,
                    evidence={
                        "preflight_run": self.run_id,
                        "failed_checks": failed,
                        "reasons": reasons,
                        "sql": f"SELECT * FROM preflight WHERE run_id = '{self.run_id}' AND host = '{n}'",
                    },
                    detector="preflight",
                )
            )
        return out


def _node_argv(plan: PreflightPlan, node: str, names: list[str]) -> list[str]:
    env = {"OMP_NUM_THREADS": "1", **(plan.node_env(node) if plan.node_env else {})}
    fake = os.environ.get(ENV_FAKE_NVML)
    if fake:
        env[ENV_FAKE_NVML] = fake
    argv = ["env", *(f"{k}={v}" for k, v in env.items()), plan.python, "-m", "ranklens.collector.preflight"]
    argv += ["--node", node, "--checks", ",".join(names) or "none", "--gpus", str(plan.gpus_expected)]
    argv += ["--burn", str(plan.burn_s)]
    if plan.checkpoint_path:
        argv += ["--checkpoint-path", plan.checkpoint_path]
    for m in plan.mounts:
        argv += ["--mount", m]
    for k, v in plan.thresholds.items():
        argv += ["--threshold", f"{k}={v}"]
    return argv


def _unreachable(node: str, why: str) -> NodeReport:
    r = CheckResult(
        check="net.reachable",
        node=node,
        status=Status.FAIL,
        message=f"unreachable: {why}"[:1500],
        fix="check that the node is up and the launcher reaches it (ssh / srun by hand), and that it has ranklens",
    )
    return NodeReport(node, (r,), {})


REPORT_GRACE_S = 5.0  # how long a launcher may linger after its node's report arrived


def _take_report(
    n: str,
    w: Any,
    reports: dict[str, NodeReport],
    failed: dict[str, str],
    names: list[str],
    say: Callable[[str], None],
) -> None:
    """File node ``n``'s report from its worker ``w`` into ``reports``, or why not into ``failed``."""
    doc = w.result()
    if doc is None:
        failed[n] = f"the node's checks exited {w.proc.returncode} without a report: {w.output()[-600:]}"
        return
    try:
        got = NodeReport.from_json(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        failed[n] = f"the node's report is malformed ({type(e).__name__}: {e}); another ranklens version there?"
        return
    if names and not got.results:
        failed[n] = "the node's report has no results"
        return
    # filed under the name it was launched as, whatever the node calls itself
    results = tuple(dataclasses.replace(x, node=n) for x in got.results)
    reports[n] = dataclasses.replace(got, node=n, results=results)
    bad = sum(1 for r in results if r.status is Status.FAIL)
    say(f"preflight: {n} checked in {got.duration_s:.1f} s ({bad} failed)")


def _run_nodes(
    plan: PreflightPlan, names: list[str], say: Callable[[str], None]
) -> tuple[list[NodeReport], dict[str, int]]:
    """Every node's checks, all nodes at once through the launcher; the arrival time of each report."""
    from ranklens.analyzers.probe import _Worker, local_launcher

    launcher = plan.launcher or local_launcher
    workers: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for n in plan.nodes:
        try:
            cmd = launcher(n, _node_argv(plan, n, names))
            workers[n] = _Worker(n, cmd, {**os.environ}, result_tag=RESULT_TAG)
        except OSError as e:
            failed[n] = f"the launcher could not start: {e}"
    deadline = time.monotonic() + plan.timeout_s
    received: dict[str, int] = {}
    reports: dict[str, NodeReport] = {}
    pending = dict(workers)
    seen: dict[str, float] = {}  # node -> monotonic time its report arrived
    while pending and time.monotonic() < deadline:
        for n, w in list(pending.items()):
            if w.proc.poll() is None and w.result() is None:
                continue
            if w.result() is not None and n not in received:
                received[n] = time.time_ns()
                seen[n] = time.monotonic()
            if w.proc.poll() is None:
                if time.monotonic() - seen[n] < REPORT_GRACE_S:
                    continue
                w.stop()  # the report is in; a launcher that lingers after it (ssh teardown) is let go
            else:
                w.wait(deadline)
            del pending[n]
            _take_report(n, w, reports, failed, names, say)
        time.sleep(0.02)
    for n, w in pending.items():
        w.stop()
        if w.result() is not None:  # it arrived within REPORT_GRACE_S of the deadline: it counts
            _take_report(n, w, reports, failed, names, say)
        else:
            failed[n] = f"no report within --timeout {plan.timeout_s:g} s: {w.output()[-600:]}"
    out = []
    for n in plan.nodes:
        if n in reports:
            ok = CheckResult("net.reachable", n, Status.PASS, "the node's checks ran through the launcher")
            r = reports[n]
            out.append(dataclasses.replace(r, results=(*r.results, ok)))
        else:
            say(f"preflight: {n} unreachable: {failed.get(n, '?')[:200]}")
            out.append(_unreachable(n, failed.get(n, "?")))
    return out, received


def _probe(plan: PreflightPlan, reachable: list[str], reports: list[NodeReport], wanted: set[str]) -> list[CheckResult]:
    from ranklens.analyzers.probe import ProbeError, ProbePair, local_launcher, run_probe

    launcher: Callable[[str, list[str]], list[str]] = plan.launcher or local_launcher
    base_launcher: Callable[[str, list[str]], list[str]]
    single = len(reachable) == 1
    if single:  # one node: two processes on it, over its loopback
        n = reachable[0]
        pairs_nodes = [(f"{n}#0", f"{n}#1")]
        addresses = {f"{n}#0": "127.0.0.1", f"{n}#1": "127.0.0.1"}

        def _split_launcher(node: str, argv: list[str]) -> list[str]:
            return launcher(node.partition("#")[0], argv)

        base_launcher = _split_launcher

        node_env: Callable[[str], dict[str, str]] | None = None
        plan_env = plan.node_env
        if plan_env is not None:
            node_env = lambda node: plan_env(node.partition("#")[0])  # noqa: E731
    else:
        pairs_nodes = fleet.ring_pairs(reachable)
        addresses = {x: plan.addresses.get(x, "127.0.0.1" if plan.launcher is None else x) for x in reachable}
        base_launcher = launcher
        node_env = plan.node_env
    gpu_nodes = all(
        int(r.facts.get("gpu_count") or 0) > 0 and (r.facts.get("software") or {}).get("torch_cuda") for r in reports
    )
    boots = [r.facts.get("boot_id") or r.node for r in reports]
    # NCCL refuses two ranks on one GPU: processes that share a machine (one node split in two,
    # nodes that are namespaces of one host) measure over gloo
    backend = "nccl" if gpu_nodes and reports and not single and len(set(boots)) == len(boots) else "gloo"
    try:
        rep = run_probe(
            [ProbePair(a, b, "survey") for a, b in pairs_nodes],
            addresses,
            launcher=base_launcher,
            env=node_env,
            nbytes=plan.probe_bytes,
            iters=plan.probe_iters,
            timeout_s=plan.timeout_s,
            python=plan.python,
            allreduce_bytes=plan.probe_bytes if "net.allreduce" in wanted else 0,
            backend=backend,
        )
    except (ProbeError, OSError, ValueError) as e:
        return [
            CheckResult(
                name,
                n,
                Status.ERROR,
                f"the link probe could not run across {', '.join(reachable)}: {e}"[:1500],
                fix="run `ranklens probe --pair A:B` between two of the nodes to find which one breaks it",
            )
            for name in sorted(wanted & {"net.allreduce", "net.pair_bandwidth"})
            for n in reachable
        ]
    out: list[CheckResult] = []
    if "net.allreduce" in wanted:
        by_node: dict[str, list[Any]] = {}
        for a in rep.allreduce:
            by_node.setdefault(a.node.partition("#")[0], []).append(a)
        for n in reachable:
            got = by_node.get(n, [])
            if not got:
                out.append(CheckResult("net.allreduce", n, Status.ERROR, "no all-reduce result from this node"))
                continue
            ok = all(a.correct for a in got)
            a = got[0]
            where = "between two processes on this node" if single else f"over {len(reachable)} nodes"
            out.append(
                CheckResult(
                    "net.allreduce",
                    n,
                    Status.PASS if ok else Status.FAIL,
                    f"{a.backend} all-reduce of {a.nbytes >> 20} MiB {where}: {a.seconds * 1e3:.1f} ms"
                    + ("" if ok else "; WRONG SUM"),
                    value=round(a.seconds * 1e3, 3),
                    unit="ms",
                    threshold="completes with the right sum",
                    fix=""
                    if ok
                    else "a wrong all-reduce result means corrupted data on the path: drain the node and test it",
                )
            )
    if "net.pair_bandwidth" in wanted:
        if single:
            out += fleet.pair_bandwidth(reachable, [])
        else:
            import numpy as np

            pb = []
            for src, dst in pairs_nodes:
                times = [t for r in rep.results if {r.src, r.dst} == {src, dst} for t in r.iter_seconds]
                nbytes = next((r.nbytes for r in rep.results if {r.src, r.dst} == {src, dst}), plan.probe_bytes)
                t = float(np.median(times)) if times else float("inf")
                pb.append(fleet.PairBandwidth(src, dst, nbytes / t if t > 0 else float("inf")))
            out += fleet.pair_bandwidth(reachable, pb, slow_ratio=plan.slow_ratio, min_Bps=plan.min_Bps)
    return out


def run_preflight(plan: PreflightPlan, say: Callable[[str], None] = lambda s: None) -> PreflightReport:
    """Run ``plan``: every node's checks, then the fleet and network checks; returns the report."""
    started = time.time_ns()
    t0 = time.perf_counter()
    wanted = {c.name for c in plan.checks}
    node_checks = [c for c in plan.checks if c.scope == "node"]
    in_process = not plan.nodes
    if in_process:
        node = this_node()
        say(f"preflight: checking {node} (this machine), {len(node_checks)} node checks")
        ctx = Context(
            node=node,
            nvml=context_nvml(),
            checkpoint_path=plan.checkpoint_path,
            mounts=plan.mounts,
            gpus_expected=plan.gpus_expected,
            burn_s=plan.burn_s,
            thresholds=dict(plan.thresholds),
        )
        reports = [run_node(ctx, node_checks)]
        nodes = [node]
        received: dict[str, int] = {}
        if "net.reachable" in wanted:
            skip = CheckResult("net.reachable", node, Status.SKIP, "skipped: this machine, checked in-process")
            reports = [dataclasses.replace(reports[0], results=(*reports[0].results, skip))]
    else:
        nodes = list(plan.nodes)
        say(f"preflight: checking {len(nodes)} node(s) ({', '.join(nodes[:8])}{' ...' if len(nodes) > 8 else ''})")
        reports, received = _run_nodes(plan, [c.name for c in node_checks], say)
        if "net.reachable" not in wanted:  # asked or not, an unreachable node fails
            reports = [
                dataclasses.replace(
                    r, results=tuple(x for x in r.results if x.check != "net.reachable" or x.status is Status.FAIL)
                )
                for r in reports
            ]
    results = [x for r in reports for x in r.results]
    reachable_reports = [r for r in reports if r.facts or in_process]
    reachable = [r.node for r in reachable_reports]
    if "fleet.software_consistency" in wanted:
        results += fleet.software_consistency(reachable_reports)
    if "fleet.clock_offset" in wanted:
        lim = plan.thresholds
        results += fleet.clock_offset(
            reachable_reports,
            received,
            warn_ms=float(lim.get("clock_warn_ms", 100.0)),
            fail_ms=float(lim.get("clock_fail_ms", 1000.0)),
            in_process=in_process,
        )
    if "fleet.compute" in wanted:
        results += fleet.compute_vs_fleet(
            reachable_reports,
            warn_ratio=float(plan.thresholds.get("compute_warn_ratio", 0.8)),
            fail_ratio=float(plan.thresholds.get("compute_fail_ratio", 0.5)),
        )
    net = wanted & {"net.allreduce", "net.pair_bandwidth"}
    if net and reachable:
        say(f"preflight: link probe over {len(reachable)} node(s)")
        results += _probe(plan, reachable, reachable_reports, net)
    # node checks first (in registration order), then the fleet's
    order = {c.name: (c.scope == "fleet", i) for i, c in enumerate(CHECKS.values())}
    node_order = {n: i for i, n in enumerate(nodes)}
    results.sort(key=lambda r: (node_order.get(r.node, 1 << 30), order.get(r.check, (True, 1 << 30)), r.subject))
    return PreflightReport(
        run_id=uuid.uuid4().hex[:12],
        started_ns=started,
        nodes=nodes,
        results=results,
        duration_s=round(time.perf_counter() - t0, 2),
        job_id=plan.job_id,
        facts={r.node: r.facts for r in reports},
    )


def report_text(report: PreflightReport, *, verbose: bool = False) -> str:
    """The report as a table a person reads: one line per result, then the verdict per node. Over
    several nodes, passes and skips are folded into the counts unless ``verbose`` (a fleet of 100
    nodes would otherwise print 4,500 lines to find the few that matter)."""
    lines = []
    fold = len(report.nodes) > 1 and not verbose
    folded = 0
    widths = (max([len(r.node) for r in report.results] + [4]), max([len(r.check) for r in report.results] + [5]))
    lines.append(f"{'NODE':<{widths[0]}}  {'CHECK':<{widths[1]}}  {'STATUS':<6}  RESULT")
    for r in report.results:
        if fold and r.status in (Status.PASS, Status.SKIP):
            folded += 1
            continue
        subject = f"[{r.subject}] " if r.subject else ""
        lines.append(
            f"{r.node:<{widths[0]}}  {r.check:<{widths[1]}}  {r.status.value.upper():<6}  {subject}{r.message}"
        )
        if r.status in (Status.WARN, Status.FAIL, Status.ERROR) and (r.fix or r.threshold):
            extra = "; ".join(
                x for x in (f"limit {r.threshold}" if r.threshold else "", f"fix: {r.fix}" if r.fix else "") if x
            )
            lines.append(f"{'':<{widths[0]}}  {'':<{widths[1]}}  {'':<6}    {extra}")
    c = report.counts()
    lines.append("")
    lines.append(
        f"{len({r.check for r in report.results})} checks, {len(report.results)} results in {report.duration_s:.1f} s: "
        + ", ".join(f"{v} {k}" for k, v in c.items() if v)
        + (f" ({folded} passes and skips not listed: -v lists them)" if folded else "")
    )
    for n in report.nodes:
        v = report.verdict(n)
        why = report.reasons(n, Status.WARN if v is Status.WARN else Status.FAIL)
        lines.append(f"node {n}: {v.value.upper()}" + (f" ({len(why)}: {'; '.join(why)[:400]})" if why else ""))
    return "\n".join(lines)


def write_blacklist(report: PreflightReport, path: str) -> None:
    """The failed nodes: JSON (``{"nodes": [...], "reasons": {...}}``) when ``path`` ends in .json,
    else one node name per line (``srun --exclude=$(paste -sd, FILE)``). Written even when empty."""
    from ranklens.formats.blacklist import write_blacklist as write_file

    data = report.blacklist_json()
    write_file(path, data.pop("nodes"), data.pop("reasons"), data)


STATUS_CODE = {Status.PASS: 0, Status.WARN: 1, Status.FAIL: 2, Status.ERROR: 3, Status.SKIP: -1}


def write_metrics(report: PreflightReport, path: str) -> None:
    """The report as Prometheus metrics in the text format, written atomically to ``path``: the
    file node_exporter's textfile collector reads (``--collector.textfile.directory``), so the
    verdicts are scraped, graphed and alerted on like the collector's own metrics.

    ``ranklens_preflight_node_verdict`` (0 pass, 1 warn, 2 fail), ``ranklens_preflight_check_status``
    per node x check x subject (0 pass, 1 warn, 2 fail, 3 error, -1 skip), the measured
    ``ranklens_preflight_value``, and the run's time and duration."""
    try:
        from prometheus_client import CollectorRegistry, Gauge, write_to_textfile
    except ImportError:
        from ranklens.errors import ConfigError

        raise ConfigError("--metrics-file needs prometheus-client: pip install 'ranklens[collector]'") from None
    reg = CollectorRegistry()
    verdict = Gauge(
        "ranklens_preflight_node_verdict",
        "Node verdict of the last pre-flight run: 0 pass, 1 warn, 2 fail",
        ["node"],
        registry=reg,
    )
    status = Gauge(
        "ranklens_preflight_check_status",
        "Pre-flight check result: 0 pass, 1 warn, 2 fail, 3 error, -1 skip",
        ["node", "check", "subject"],
        registry=reg,
    )
    value = Gauge(
        "ranklens_preflight_value",
        "The number a pre-flight check measured",
        ["node", "check", "subject", "unit"],
        registry=reg,
    )
    when = Gauge("ranklens_preflight_last_run_timestamp_seconds", "When the pre-flight run started", registry=reg)
    took = Gauge("ranklens_preflight_duration_seconds", "How long the pre-flight run took", registry=reg)
    for n, v in report.verdicts.items():
        verdict.labels(n).set(STATUS_CODE[v])
    for r in report.results:
        status.labels(r.node, r.check, r.subject).set(STATUS_CODE[r.status])
        if r.value == r.value and abs(r.value) != float("inf"):
            value.labels(r.node, r.check, r.subject, r.unit).set(r.value)
    when.set(report.started_ns / 1e9)
    took.set(report.duration_s)
    write_to_textfile(path, reg)
