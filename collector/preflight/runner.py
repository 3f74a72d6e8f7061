"""Run the node-scope checks of one node: each timed, none able to stop the others.

Also the entry point of a node worker started through a launcher::

    python -m ranklens.collector.preflight --node NAME [--checks ...] [--checkpoint-path P] ...

which prints ``RANKLENS-PREFLIGHT-RESULT <json>`` (the :class:`NodeReport`) on standard output,
the way the link probe's workers report (nothing shared with the coordinator but the launcher).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

from ranklens.collector.preflight.api import Check, CheckResult, Context, NodeReport, Status, resolve_checks
from ranklens.config import ENV_FAKE_NVML

__all__ = ["ENV_FAKE_NVML", "RESULT_TAG", "context_nvml", "main", "run_node"]

RESULT_TAG = "RANKLENS-PREFLIGHT-RESULT"
# A JSON file describing fake GPUs (see ranklens.collector.fake_nvml.from_spec): the node's checks
# read NVML through the shipped fake instead of pynvml. For drills and tests on machines without a
# GPU; read once, when a node run starts.


def context_nvml(env: dict[str, str] | None = None) -> Any:
    """The NVML module a node run uses: the fake of ``$RANKLENS_FAKE_NVML`` if set, else None
    (pynvml, imported by the GPU checks when they first need it)."""
    env = dict(os.environ) if env is None else env
    spec = env.get(ENV_FAKE_NVML, "")
    if not spec:
        return None
    from ranklens.collector.fake_nvml import from_spec

    return from_spec(spec)


def run_node(ctx: Context, checks: list[Check] | None = None) -> NodeReport:
    """Run ``checks`` (default: all) that are node-scope on this node; returns the report.

    Every check runs even if another failed or raised: an exception becomes an ``error`` result
    naming the check and the exception.
    """
    if checks is None:
        checks = resolve_checks(None)
    started = ctx.clock()
    t_start = time.perf_counter()
    results: list[CheckResult] = []
    for c in checks:
        if c.scope != "node" or c.fn is None:
            continue
        t0 = time.perf_counter()
        got = _run_check(c, ctx)
        if not got:
            got = [ctx.result(c.name, Status.SKIP, "skipped: nothing to check on this node")]
        dt = time.perf_counter() - t0
        results.extend(_timed(r, dt / len(got)) for r in got)
    _shutdown_nvml(ctx)
    ctx.facts.setdefault("clock_ns", ctx.clock())
    return NodeReport(ctx.node, tuple(results), dict(ctx.facts), started, round(time.perf_counter() - t_start, 3))


def _run_check(c: Check, ctx: Context) -> list[CheckResult]:
    """One check's results, run on a daemon thread so that one stuck in the kernel (a hung NFS
    ``stat``, an NVML call on a wedged GPU) is reported after its timeout instead of holding the run;
    an exception becomes an ``error`` result naming the check and the exception."""
    out: list[list[CheckResult]] = []

    def target() -> None:
        try:
            out.append(list(c.fn(ctx) if c.fn is not None else []))
        except Exception as e:  # a check must not stop the others; say which broke, and how
            tb = traceback.extract_tb(e.__traceback__)[-1]
            out.append(
                [
                    ctx.result(
                        c.name,
                        Status.ERROR,
                        f"the check could not run: {type(e).__name__}: {e} "
                        f"({os.path.basename(tb.filename)}:{tb.lineno})",
                        fix="report this with the message; the other checks ran",
                    )
                ]
            )

    limit = ctx.check_timeout_s + 10 * ctx.burn_s
    th = threading.Thread(target=target, name=f"ranklens-preflight-{c.name}", daemon=True)
    th.start()
    th.join(limit)
    if out:
        return out[0]
    return [
        ctx.result(
            c.name,
            Status.ERROR,
            f"did not finish within {limit:g} s (left running): a hung filesystem, driver or device?",
            threshold=f"finishes within {limit:g} s",
            fix="look for processes in state D (ps -eo pid,stat,wchan,cmd) and the kernel log (dmesg) on this node",
        )
    ]


def _timed(r: CheckResult, dt: float) -> CheckResult:
    import dataclasses

    return r if r.duration_s else dataclasses.replace(r, duration_s=round(dt, 4))


def _shutdown_nvml(ctx: Context) -> None:
    nv = ctx.cache.pop("nvml_started", None)
    if nv is not None:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ranklens.collector.preflight", description="pre-flight node worker")
    p.add_argument("--node", required=True)
    p.add_argument("--checks", default="all")
    p.add_argument("--checkpoint-path", default="")
    p.add_argument("--mount", action="append", default=[])
    p.add_argument("--gpus", type=int, default=-1)
    p.add_argument("--burn", type=float, default=1.0)
    p.add_argument("--threshold", action="append", default=[], metavar="NAME=VALUE")
    return p


def main(argv: list[str] | None = None) -> int:
    """A node worker: run this node's checks, print the report as one tagged JSON line."""
    args = _parser().parse_args(argv)
    thresholds = {}
    for t in args.threshold:
        k, _, v = t.partition("=")
        thresholds[k] = float(v)
    ctx = Context(
        node=args.node,
        nvml=context_nvml(),
        checkpoint_path=args.checkpoint_path,
        mounts=tuple(args.mount),
        gpus_expected=args.gpus,
        burn_s=args.burn,
        thresholds=thresholds,
    )
    # "none": the coordinator wants only the node's facts (it runs fleet/net checks alone)
    report = run_node(ctx, [] if args.checks == "none" else resolve_checks(args.checks))
    report.facts["clock_ns"] = time.time_ns()  # as late as possible: fleet.clock_offset compares it on arrival
    print(f"{RESULT_TAG} {json.dumps(report.to_json(), separators=(',', ':'))}", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
