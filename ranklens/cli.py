"""The ``ranklens`` command line. Every command takes ``--store URL`` (env ``RANKLENS_STORE``).

Exit codes (scripts may rely on them): 0 success, 1 unexpected error, 2 bad usage or
configuration, 3 store error, 4 store unavailable, 5 schema version mismatch, 6 malformed input
(nothing written), 7 the demo's job failed, 8 nothing to analyze.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import click

from ranklens import __version__
from ranklens._cli_common import EPILOG, agent_options, errors, password_note, policy_options, store_flag, store_option
from ranklens.config import DEFAULT_SPOOL_DIR, ENV_ALERTS_TOKEN, ENV_CHECKPOINT_PATH, ENV_OUTBOX, ENV_SPOOL
from ranklens.errors import NotFound
from ranklens.errors import StoreUnavailable as StoreUnavailableError

__all__ = ["main"]

_EPILOG = EPILOG
_store_option = store_option
_errors = errors


def _open(store_url: str | None, *, create: bool = True) -> Any:
    """The command's store, closed when the command ends (its connections too, on an error: an
    in-process caller, e.g. click's test runner or a notebook, does not keep a socket open until
    the garbage collector finds the traceback that holds it)."""
    from ranklens.store import open_store

    store = open_store(store_url, create=create)
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.call_on_close(store.close)
    return store


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (bytes, bytearray)):
        return o.decode(errors="replace")
    return str(o)


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}, epilog=_EPILOG)
@click.version_option(__version__, prog_name="ranklens")
def cli() -> None:
    """ranklens: which rank, GPU, node or link is slowing or hanging a distributed training job,
    since when, and what it costs.

    \b
    Quick start:
      ranklens demo                 run a real 4-rank job with a slowed rank, and diagnose it
      ranklens analyze --json       findings of the latest job in the store
      ranklens sql "SELECT ..."     query the store
    """


@cli.command()
def version() -> None:
    """Print the version of ranklens and of its schema."""
    from ranklens.schema import SCHEMA_VERSION

    click.echo(f"ranklens {__version__} (schema {SCHEMA_VERSION})")


@cli.command(epilog=_EPILOG)
@_store_option
@click.option("--ranks", type=click.IntRange(2, 64), default=4, show_default=True, help="Ranks (processes) of the job.")
@click.option("--slow-rank", type=int, default=2, show_default=True, help="The rank to slow down.")
@click.option(
    "--slowdown",
    type=float,
    default=2.0,
    show_default=True,
    help="Time factor of the slowed phase (2.0 = it takes twice as long).",
)
@click.option("--slow-from-step", type=int, default=5, show_default=True, help="First slowed step.")
@click.option(
    "--slow-phase",
    type=click.Choice(["forward", "backward", "data"]),
    default="forward",
    show_default=True,
    help="Which phase of the slowed rank is slow (compute forward/backward, or data loading).",
)
@click.option("--steps", type=click.IntRange(5, 100000), default=30, show_default=True, help="Training steps.")
@click.option(
    "--compute-ms",
    type=click.FloatRange(1, 10000),
    default=80.0,
    show_default=True,
    help="Per-step device time of a healthy rank.",
)
@click.option("--healthy", is_flag=True, help="Slow no rank: the run must produce no straggler finding.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@_errors
def demo(
    store_url: str | None,
    ranks: int,
    slow_rank: int,
    slowdown: float,
    slow_from_step: int,
    steps: int,
    compute_ms: float,
    healthy: bool,
    as_json: bool,
    slow_phase: str,
) -> None:
    """Run a real multi-rank training job (gloo, CPU, DDP + an extra process group) with one rank
    slowed, collect it into the store while it runs, analyze it and print what is wrong."""
    from ranklens.demo import run_demo

    store = _open(store_url)
    say = (lambda s: click.echo(s, err=True)) if as_json else click.echo
    say(f"ranklens demo: store {store.url}")
    bar_state = {"last": 0}

    def on_step(s: int) -> None:
        if not as_json and sys.stdout.isatty():
            click.echo(f"\r  training: step {s}/{steps}", nl=False)
        elif s - bar_state["last"] >= max(1, steps // 5) or s == steps:
            say(f"  training: step {s}/{steps}")
        bar_state["last"] = s

    result = run_demo(
        store,
        ranks=ranks,
        slow_rank=None if healthy else slow_rank,
        slowdown=slowdown,
        steps=steps,
        slow_from_step=slow_from_step,
        compute_ms=compute_ms,
        slow_phase=slow_phase,
        log=lambda s: say("  " + s),
        on_step=on_step,
    )
    if not as_json and sys.stdout.isatty():
        click.echo()
    rows = sum(result.rows.values())
    if as_json:
        click.echo(
            json.dumps(
                {
                    "job_id": result.job_id,
                    "store": store.url,
                    "ranks": ranks,
                    "steps": steps,
                    "slow_rank": result.slow_rank,
                    "wall_s": round(result.wall_s, 3),
                    "rows": result.rows,
                    "findings": [f.to_json() for f in result.findings],
                    "host_cpu_contention": [c.to_json() for c in result.contention],
                },
                default=_json_default,
            )
        )
        return
    click.echo(f"job {result.job_id} finished in {result.wall_s:.1f} s; {rows:,} records collected into the store.")
    _print_findings(result.findings)
    for c in result.contention:
        click.echo(f"\nNote: {c.line()}")
    q = store_flag(store.url)
    click.echo("\nLook further:")
    prog = _prog()
    click.echo(f"  {prog} analyze{q} --job {result.job_id} --json")
    click.echo(
        f'  {prog} sql{q} "SELECT rank, phase, round(avg(end_ns - start_ns) / 1e6, 1) AS ms FROM phases '
        f"WHERE job_id = '{result.job_id}' GROUP BY rank, phase ORDER BY phase, rank\""
    )
    click.echo(f"  job log: {result.log_dir}")
    if note := password_note(store.url):
        click.echo(f"  {note}")


def _prog() -> str:
    """How the user can call ranklens again: ``ranklens`` when it is on PATH, else the path used."""
    import os
    import shutil

    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "ranklens"
    on_path = shutil.which("ranklens")
    if os.path.basename(argv0) != "ranklens" or (on_path and os.path.samefile(on_path, argv0)):
        return "ranklens"
    rel = os.path.relpath(argv0)
    return argv0 if rel.startswith("..") else rel


def _print_findings(findings: list[Any], coverage: Any = None) -> None:
    degraded = coverage is not None and coverage.degraded
    if degraded:
        click.echo(f"\nThis analysis is degraded (steps: {coverage.step_source}):")
        for note in coverage.notes:
            click.echo(f"  - {note}")
    if not findings:
        if degraded:
            click.echo("\nNo findings in what could be analyzed; see above for what this analysis could not see.")
        else:
            click.echo("\nNo findings: no rank kept the others waiting.")
        return
    click.echo(f"\nFindings ({len(findings)}), most costly first:")
    for f in findings:
        click.echo(f"  [{f.severity.value.upper()}] {f.kind}: {f.title}")
        click.echo(
            f"      impact: {f.impact_s:.2f} s of job time lost so far ({f.impact_gpu_s:.2f} GPU-s), "
            f"confidence {f.confidence:.2f}, {f.state}, id {f.id}"
        )


@cli.command(epilog=_EPILOG)
@_store_option
@click.option(
    "--job", "job_id", default=None, help="Job id (default: the job with the most recent step or collective)."
)
@click.option("--attempt", type=int, default=None, help="Restart attempt (default: the latest of the job).")
@click.option(
    "--flight-recorder",
    "fr_dir",
    type=click.Path(exists=True),
    default=None,
    help="Post-mortem: analyze PyTorch flight-recorder dumps (pickle or JSON, NCCL or gloo) in this "
    "directory instead of the store; findings: hang, crash, desync, size_mismatch. Dumps under "
    "<spool>/<job>/<attempt>/fr/ name their job; with --store, the job's ledger gives the step. An "
    "unreadable dump is reported (exit 6, nothing saved) and the others are still analysed.",
)
@click.option(
    "--world-size",
    type=click.IntRange(1),
    default=None,
    help="With --flight-recorder: ranks of the job (default: from the dumps' process-group tables and "
    "group sizes, else the highest dumped rank + 1).",
)
@click.option(
    "--traces",
    is_flag=True,
    help="Analyze the job's torch.profiler (Kineto) traces instead of its ledger: Holistic Trace "
    "Analysis' temporal breakdown (idle / compute / non-compute %), comm/comp overlap, kernel-type and "
    "top-kernel breakdowns, idle time per stream, kernel launch statistics and queue lengths, for every "
    "traced rank, computed in the store, and the job's ledger over the same window; findings: "
    "trace_idle, kernel_straggler, exposed_communication. Default job: the last one traced "
    "(docs/traces.md).",
)
@click.option(
    "--rank",
    "ranks",
    type=click.IntRange(0),
    multiple=True,
    help="With --traces: only this rank (repeatable; default: every traced rank).",
)
@click.option("--json", "as_json", is_flag=True, help='Print {"findings": [...]} as one JSON object.')
@click.option("--no-save", is_flag=True, help="Do not write the findings to the store.")
@click.option(
    "--follow",
    is_flag=True,
    help="Keep analyzing the (live) job; print findings as they open, change and resolve, and each "
    "host CPU contention note once (JSON Lines with --json). Started before the job has written "
    "anything, it waits for it. Stop with Ctrl-C.",
)
@click.option(
    "--interval",
    type=click.FloatRange(0.1, 3600),
    default=2.0,
    show_default=True,
    help="Seconds between passes with --follow.",
)
@click.option(
    "--act",
    is_flag=True,
    help="Hand the findings to the recovery policy (webhooks, hooks); the policy "
    "is dry-run unless it says otherwise. Needs --policy.",
)
@policy_options(required=False)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="With --follow: serve the findings as Prometheus metrics on this port (0: any free port).",
)
@click.option(
    "--metrics-addr",
    default="127.0.0.1",
    show_default=True,
    help="With --metrics-port: the address the metrics endpoint binds (loopback by default, like the "
    "dashboard; 0.0.0.0 for every interface).",
)
@_errors
def analyze(
    store_url: str | None,
    job_id: str | None,
    attempt: int | None,
    fr_dir: str | None,
    world_size: int | None,
    traces: bool,
    ranks: tuple[int, ...],
    as_json: bool,
    no_save: bool,
    follow: bool,
    interval: float,
    act: bool,
    policy_file: str | None,
    outbox_dir: str | None,
    metrics_port: int | None,
    metrics_addr: str,
) -> None:
    """Analyze a job in the store (stragglers; hangs, crashes and desyncs while it runs), its
    profiler traces (--traces) or flight-recorder dumps (post-mortem), and print its findings."""
    from ranklens.analyzers import latest_job, save_findings
    from ranklens.analyzers.job import analyze_job

    if act and not policy_file:
        raise click.UsageError("--act needs --policy FILE (or RANKLENS_POLICY)")
    if metrics_port is not None and not follow:
        raise click.UsageError("--metrics-port goes with --follow")

    if ranks and not traces:
        raise click.UsageError("--rank goes with --traces")
    if traces:
        if fr_dir is not None or follow or act:
            raise click.UsageError(
                "--traces analyzes stored profiler traces: not with --flight-recorder, --follow or --act"
            )
        from ranklens.traces_cli import analyze_traces

        analyze_traces(_open(store_url, create=False), job_id, attempt, ranks, as_json=as_json, save=not no_save)
        return
    if fr_dir is not None:
        _analyze_flight_recorder(store_url, fr_dir, job_id, attempt, world_size, as_json, no_save)
        return
    if follow:  # started before the job has written anything: wait for it instead of exiting
        from ranklens.live_service import wait_for_job

        try:
            wait_for_job(
                lambda: _open(store_url, create=False), job_id, interval=interval, say=lambda s: click.echo(s, err=True)
            )
        except KeyboardInterrupt:
            return
    store = _open(store_url, create=False)
    if job_id is None:
        latest = latest_job(store)
        if latest is None:
            from ranklens.analyzers.traces import latest_trace_job

            if latest_trace_job(store) is not None:
                raise NotFound(
                    f"the store {store.url} holds profiler traces but no job ledger; "
                    f"`ranklens analyze --traces --store {store.url}` analyzes the traces"
                )
            raise NotFound(f"the store {store.url} holds no job yet; run `ranklens demo` or ingest records")
        job_id, found_attempt = latest
        attempt = found_attempt if attempt is None else attempt
    elif attempt is None:
        from ranklens.store.api import sql_string

        n, top = store.query(
            f"SELECT count(), max(attempt) FROM collectives WHERE job_id = {sql_string(job_id)}"
        ).rows()[0]
        if not n:
            raise NotFound(
                f"no records of job {job_id!r} in {store.url}; "
                '`ranklens sql "SELECT DISTINCT job_id FROM collectives"` lists the jobs'
            )
        attempt = int(top)
    engine = _engine(policy_file, store, outbox_dir) if act else None
    try:
        if follow:
            _follow(
                store,
                job_id,
                attempt,
                as_json=as_json,
                save=not no_save,
                interval=interval,
                engine=engine,
                metrics_port=metrics_port,
                metrics_addr=metrics_addr,
            )
            return
        contention: list[Any] = []  # findings host CPU contention explains: notes, not findings
        findings = analyze_job(store, job_id, attempt, contention=contention)
        from ranklens.live_service import job_history

        # what earlier passes (analyze --follow during the job) found stays visible afterwards
        history = job_history(store, job_id, attempt, findings)
        from ranklens.analyzers.coverage import analysis_coverage

        coverage = analysis_coverage(store, job_id, attempt)
        if not no_save:
            save_findings(store, findings)
        report = engine.process(findings) if engine is not None else None
        if as_json:
            out: dict[str, Any] = {
                "job_id": job_id,
                "attempt": attempt,
                "step_source": coverage.step_source,
                "coverage": coverage.to_json(),
                "host_cpu_contention": [c.to_json() for c in contention],
                "findings": history.to_json(),
            }
            if report is not None:
                out["recovery"] = report.to_json()
            click.echo(json.dumps(out, default=_json_default))
            return
        click.echo(f"job {job_id} attempt {attempt}")
        _print_findings(findings, coverage)
        for c in contention:
            click.echo(f"\nNote: {c.line()}")
        _print_history(history)
        if report is not None:
            _print_report(report)
    finally:
        if engine is not None:
            engine.close()


def _print_history(history: Any) -> None:
    """The job's earlier findings this pass did not see (e.g. a hang found live that ended with
    the job), with when each opened and closed."""
    if not history.earlier:
        return

    def at(ns: int | None) -> str:
        import time

        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9)) if ns else "?"

    click.echo(f"\nEarlier findings of this job ({len(history.earlier)}), from earlier passes, not seen by this one:")
    for s in history.earlier:
        f = s.finding
        if s.closed_ns is not None:
            closed = f"resolved {at(s.closed_ns)}"
        else:
            closed = f"still open, last seen {at(f.last_seen_ns)}"
        click.echo(f"  [{f.severity.value.upper()}] {f.kind}: {f.title}")
        click.echo(f"      opened {at(s.opened_ns)}, {closed}; confidence {f.confidence:.2f}, id {f.id}")


def _engine(policy_file: str | None, store: Any, outbox_dir: str | None) -> Any:
    import os

    from ranklens.analyzers.recovery import RecoveryEngine, load_policy

    if not policy_file:
        raise click.UsageError("needs --policy FILE (or RANKLENS_POLICY)")
    outbox = outbox_dir or os.path.join(os.path.expanduser("~"), ".ranklens", "outbox")
    return RecoveryEngine(load_policy(policy_file), store, outbox)


def _print_report(report: Any) -> None:
    data = report.to_json()
    decisions = data.get("decisions", [])
    click.echo(f"\nRecovery ({len(decisions)} decision(s)):")
    for d in decisions:
        summary = ", ".join(
            f"{k}={v}" for k, v in d.items() if k in ("level", "target", "dry_run", "outcome", "reason")
        )
        click.echo(f"  {summary}")


def _follow(
    store: Any,
    job_id: str,
    attempt: int,
    *,
    as_json: bool,
    save: bool,
    interval: float,
    engine: Any = None,
    metrics_port: int | None = None,
    metrics_addr: str = "127.0.0.1",
    window_steps: int = 500,
) -> None:
    import time

    from ranklens.live_service import LiveAnalysis

    exporter = None
    if metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from ranklens._metrics_http import serve_metrics
        from ranklens.analyzers.recovery import FindingsExporter

        registry = CollectorRegistry()
        exporter = FindingsExporter(registry)
        server = serve_metrics(registry, port=metrics_port, addr=metrics_addr)  # MetricsBindError: exit 2
        click.echo(f"metrics on {server.url}", err=True)
    if not as_json:
        click.echo(f"following job {job_id} attempt {attempt} every {interval:g} s (Ctrl-C to stop)", err=True)
    live = LiveAnalysis(store, job_id, attempt, save=save, engine=engine, exporter=exporter, window_steps=window_steps)

    def emit(event: str, f: Any) -> None:
        if as_json:
            click.echo(json.dumps({"event": event, "finding": f.to_json()}, default=_json_default))
        else:
            stamp = time.strftime("%H:%M:%S")
            click.echo(f"{stamp} {event:8s} [{f.severity.value.upper()}] {f.kind}: {f.title}")

    def note(c: Any) -> None:  # a straggler / slow link the host's CPU contention explains: not a finding
        if as_json:
            click.echo(json.dumps({"event": "note", "host_cpu_contention": c.to_json()}, default=_json_default))
        else:
            click.echo(f"{time.strftime('%H:%M:%S')} note     {c.line()}")

    try:
        live.run(emit, interval=interval, note=note)
    except KeyboardInterrupt:
        return


def _analyze_flight_recorder(
    store_url: str | None,
    fr_dir: str,
    job_id: str | None,
    attempt: int | None,
    world_size: int | None,
    as_json: bool,
    no_save: bool,
) -> None:
    from ranklens.errors import IngestError
    from ranklens.fr_report import analyze_dumps

    report = analyze_dumps(
        fr_dir,
        job_id=job_id,
        attempt=attempt,
        world_size=world_size,
        # post-mortem needs no store; one named is created to save into, as before
        open_store=(lambda: _open(store_url, create=not no_save)) if store_url else None,
        save=not no_save,
    )
    if as_json:
        click.echo(json.dumps(report.to_json(), default=_json_default))
    else:
        click.echo(report.to_text())
    if report.unreadable:
        click.echo(
            f"ranklens: error: {len(report.unreadable)} flight-recorder dump(s) could not be read (the others "
            "were analysed; nothing was saved): " + "; ".join(u.error for u in report.unreadable),
            err=True,
        )
        sys.exit(IngestError.exit_code)


@cli.command(epilog=_EPILOG)
@_store_option
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "parquet", "flight-recorder", "kineto"]),
    default=None,
    help="Input format (default: detected: .jsonl/.parquet files are the open format, "
    "other files flight-recorder dumps).",
)
@click.option("--table", default=None, help="Table of the records, when neither header nor file name tells.")
@click.option(
    "--job",
    "job_id",
    default=None,
    help="Flight-recorder dumps: the job id (default: derived from the dumps).",
)
@click.option("--world-size", type=click.IntRange(1), default=None, help="Flight-recorder dumps: ranks of the job.")
@click.option(
    "--rank",
    type=click.IntRange(0),
    default=None,
    help="Kineto traces: the rank, when neither distributedInfo nor the file name tells.",
)
@_errors
def ingest(
    store_url: str | None,
    paths: tuple[str, ...],
    fmt: str | None,
    table: str | None,
    job_id: str | None,
    world_size: int | None,
    rank: int | None,
) -> None:
    """Load records into the store: the open JSON Lines / Parquet format (docs/ingest-format.md),
    PyTorch flight-recorder dumps (pickle or JSON, NCCL or gloo) or Kineto / torch.profiler traces
    (.json or .json.gz, streamed). The format is detected when --format is omitted.

    Every file is validated before anything is written: a malformed file is named with its
    line/row (or event) and field, and nothing is written. Everything is ingested once: a file
    (or a trace's batch, or a set of dumps) whose rows are already in the store, from the same
    content under the same job, is skipped.
    """
    from ranklens.ingest import expand, ingest_paths

    fmt = fmt or _detect_format(paths)
    if "pyarrow" not in sys.modules:
        import os

        # a one-shot process: Arrow's buffers from the system allocator, which takes back what a
        # batch freed (mimalloc, Arrow's default, kept it: a 35 MB trace peaked at 164 MB, now
        # 117; 200k JSON Lines rows 234-248 MB, now 181-189); read once, as pyarrow loads (a
        # user's own setting wins)
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    store = _open(store_url)
    if fmt == "kineto":
        from ranklens.collector.kineto import ingest_kineto

        written = ingest_kineto(store, list(paths), job_id=job_id, rank=rank)
        what = "Kineto traces"
    elif fmt == "flight-recorder":
        from ranklens.collector.flight_recorder import ingest_flight_recorder

        written = ingest_flight_recorder(store, list(paths), job_id=job_id, world_size=world_size)
        what = "flight-recorder dumps"
    else:
        files = expand(list(paths))
        already: dict[str, int] = {}
        with click.progressbar(length=len(files), label="validating", file=sys.stderr, show_pos=True) as bar:
            written = ingest_paths(
                store, files, fmt=fmt, table=table, progress=lambda _p: bar.update(1), already=already
            )
        what = f"{len(files)} file(s)"
        for name, n in sorted(already.items()):
            click.echo(f"{name}: {n:,} rows already in the store (ingested before): not written again")
    for name, n in sorted(written.items()):
        click.echo(f"{name}: {n:,} rows")
    click.echo(f"ingested {what} into {store.url}")


@cli.command(epilog=_EPILOG)
@_store_option
@click.argument("query")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of row objects.")
@click.option("--max-rows", type=int, default=1000, show_default=True, help="Rows to print at most (table output).")
@_errors
def sql(store_url: str | None, query: str, as_json: bool, max_rows: int) -> None:
    """Run one read-only SQL query (ClickHouse dialect) against the store and print the rows.

    One statement only: SELECT, WITH, SHOW, DESCRIBE or EXISTS; several statements, or one that
    would change the store (INSERT, DROP, ALTER, ...), are refused with exit code 2.

    Tables: collectives, phases, steps, process_groups, ranks, gpu_samples, gpu_events,
    log_events, heartbeats, findings, actions, drops (see `ranklens schema`).
    """
    from ranklens.store.api import read_only_statement

    query = read_only_statement(query)  # before opening: a refused statement never reaches the store
    store = _open(store_url, create=False)
    r = store.query(query)
    if as_json:
        click.echo(json.dumps([{k: _clean(v) for k, v in row.items()} for row in r.to_pylist()], default=_json_default))
        return
    cols = r.columns
    rows = [[_fmt(v) for v in row] for row in r.rows()[:max_rows]]
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(cols)]
    click.echo("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    click.echo("  ".join("-" * w for w in widths))
    for row in rows:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    more = f" (showing {max_rows})" if r.num_rows > max_rows else ""
    click.echo(f"({r.num_rows} row{'s' if r.num_rows != 1 else ''}{more})", err=True)


def _detect_format(paths: tuple[str, ...]) -> str | None:
    """None (the open format) when every file is .jsonl/.parquet; Kineto for Chrome traces;
    else flight-recorder dumps (pickle without extension, or JSON with FR's keys)."""
    from pathlib import Path

    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else files.append(p)
    files = [f for f in files if not f.name.startswith(".") and f.suffix not in (".md", ".txt", ".log")]
    if not files or all(f.suffix in (".jsonl", ".parquet", ".pq") for f in files):
        return None
    from ranklens.formats.kineto import is_kineto_file

    if any(is_kineto_file(f) for f in files):
        return "kineto"
    return "flight-recorder"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


@cli.command(epilog=_EPILOG)
@_store_option
@agent_options
@click.option(
    "--follow",
    is_flag=True,
    help="Run as the node agent until interrupted (SIGTERM/Ctrl-C): ship spools, tail logs, sample GPUs, "
    "serve metrics.",
)
@click.option("--interval", type=click.FloatRange(0.05, 3600), default=None, help="Seconds between shipping passes.")
@_errors
def collect(
    store_url: str | None,
    config_file: str | None,
    spool_dir: str | None,
    follow: bool,
    interval: float | None,
    log_globs: tuple[str, ...],
    rules_file: str | None,
    nvml: bool | None,
    metrics_port: int | None,
    metrics_addr: str | None,
    log_level: str,
    log_format: str,
    host: str | None = None,
) -> None:
    """The per-node collector: ships rank spools into the store, every row exactly once (a segment
    is deleted only after the store has it; one the collector is unsure about is looked up before
    it is sent again); with --follow, runs as the node agent that also filters logs at the source,
    samples GPU health (NVML) and exposes Prometheus metrics."""
    from ranklens.collector.agent import Agent, load_config
    from ranklens.logs import setup_logging

    setup_logging(log_level, log_format)

    cfg = load_config(
        config_file,
        spool_dir=spool_dir,
        log_globs=list(log_globs) or None,
        rules_file=rules_file,
        nvml=nvml,
        metrics_port=metrics_port,
        metrics_addr=metrics_addr,
        ship_interval_s=interval,
        host=host,
    )
    store = _open_for_agent(store_url) if follow else _open(store_url)
    if not follow:
        shipper = cfg.shipper(store)
        r = shipper.ship_all(wait_s=30.0)  # a pass takes 2000 segments: drain the spool
        if r.busy and not r.segments:
            raise StoreUnavailableError(
                f"another collector has been shipping {cfg.spool_dir} for 30 s; try again, or let it ship"
            )
        passes = f" in {r.passes} passes" if r.passes > 1 else ""
        parts = [f"{r.segments} segment(s){passes}", ", ".join(f"{k} {v}" for k, v in sorted(r.rows.items()))]
        if r.busy:
            parts.append("another collector took the spool over and ships the rest")
        elif r.more and r.ok:
            parts.append("more segments than this run took (still being written?): run it again")
        if shipper.undeletable:
            parts.append(f"{shipper.undeletable} stored but not deletable (check the spool's permissions)")
        if r.quarantined:
            parts.append(f"{r.quarantined} quarantined")
        if r.waiting:
            parts.append(f"{r.waiting} empty and just written: left for the next run (still being written?)")
        if r.already_stored:
            parts.append(f"{r.already_stored} already stored (not sent again)")
        if r.evicted:
            parts.append("over the disk budget, removed " + ", ".join(f"{n} {t}" for t, n in sorted(r.evicted.items())))
        click.echo("collect: " + "; ".join(p for p in parts if p), err=True)
        if r.error:
            raise StoreUnavailableError(r.error)
        return
    click.echo(f"ranklens collector: spool {cfg.spool_dir} -> {store.url} (Ctrl-C to stop)", err=True)
    Agent(cfg, store=store).run()


def _open_for_agent(store_url: str | None) -> Any:
    """The node agent's store. A ClickHouse server that cannot be reached yet does not stop the
    agent: it collects into the spool and connects when the server comes up. A wrong URL, wrong
    credentials or a schema mismatch still stop it at once."""
    from ranklens.store import LazyStore, default_store_url

    url = store_url or default_store_url()
    from ranklens.errors import StoreAuthError

    try:
        return _open(url)
    except StoreUnavailableError as e:
        if isinstance(e, StoreAuthError) or not url.startswith(("clickhouse://", "clickhouses://")):
            raise  # refused credentials will not get better by waiting
        click.echo(f"ranklens collector: {e}; collecting into the spool, connecting when it is up", err=True)
        return LazyStore(url)


@cli.command("collector", epilog=_EPILOG)
@_store_option
@agent_options
@click.pass_context
def collector(ctx: click.Context, **kwargs: Any) -> None:
    """Run the per-node collector agent (the same as `ranklens collect --follow`): ship rank spools,
    filter logs at the source, sample GPU health, serve Prometheus metrics, until SIGTERM/Ctrl-C."""
    ctx.invoke(collect, follow=True, interval=None, **kwargs)


@cli.group()
def logs() -> None:
    """Log filtering at the source, offline."""


@logs.command("classify")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--rules",
    "rules_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Rules file (TOML) instead of the built-in rules.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per kept event.")
@_errors
def logs_classify(files: tuple[str, ...], rules_file: str | None, as_json: bool) -> None:
    """Run the source log filter over FILES and print the events it keeps (classes, severity,
    context, collapsed repeats); everything else is dropped and counted."""
    # the lines are made in one place, for this command and the console script's fast path
    from ranklens._entry import classify_output, kept_note

    n = 0
    for line in classify_output(files, rules_file, as_json):
        n += 1
        click.echo(line)
    if not as_json:
        click.echo(kept_note(n), err=True)


@cli.command(epilog=_EPILOG)
@_store_option
@policy_options(required=True)
@click.option(
    "--drain",
    "drain_s",
    type=click.FloatRange(0),
    default=30.0,
    show_default=True,
    help="Keep retrying pending deliveries for at most this many seconds.",
)
@_errors
def deliver(store_url: str | None, policy_file: str, outbox_dir: str | None, drain_s: float) -> None:
    """Retry the webhook deliveries still pending in the outbox (after a restart or an outage)."""
    engine = _engine(policy_file, _open(store_url), outbox_dir)
    try:
        stats = engine.drain(drain_s)
    finally:
        engine.close()
    click.echo(f"delivered: {stats.acknowledged} acknowledged, {stats.retrying} still retrying, {stats.failed} failed")


@cli.command(epilog=_EPILOG)
@_store_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", type=click.IntRange(1, 65535), default=8501, show_default=True, help="Port to listen on.")
@_errors
def dashboard(store_url: str | None, host: str, port: int) -> None:
    """Serve the Streamlit dashboards (jobs, findings, timeline, heat maps, links, hangs, GPU and
    logs) over the store, live while jobs run."""
    from ranklens.dashboards import run_dashboard

    sys.exit(run_dashboard(store_url, host=host, port=port))


@cli.command("alerts-receiver", epilog=_EPILOG)
@_store_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=9095, show_default=True, help="Port to listen on.")
@_errors
def alerts_receiver(store_url: str | None, host: str, port: int) -> None:
    """Receive Alertmanager webhooks (e.g. DCGM XID alerts) and attach them to findings.

    Alertmanager must send `Authorization: Bearer $RANKLENS_ALERTS_TOKEN` (at least 16 characters)
    to http://HOST:PORT/alertmanager.
    """
    import os

    from ranklens.analyzers.recovery import AlertAttacher, AlertmanagerReceiver

    receiver = AlertmanagerReceiver(AlertAttacher(_open(store_url)), token=os.environ.get(ENV_ALERTS_TOKEN, ""))
    click.echo(f"receiving Alertmanager webhooks on http://{host}:{port}/alertmanager (Ctrl-C to stop)", err=True)
    try:
        receiver.serve_forever(host, port)
    except KeyboardInterrupt:
        pass


def _preflight_before_run(store: Any, checks_spec: str, job_id: str) -> None:
    """``ranklens run --preflight``: check this node; print the verdict; stop (exit 11) on a failed node."""
    import os

    from ranklens.collector.preflight import Status, resolve_checks
    from ranklens.preflight import EXIT_FAIL, PreflightPlan, report_text, run_preflight

    plan = PreflightPlan(
        checks=resolve_checks(checks_spec),
        checkpoint_path=os.environ.get(ENV_CHECKPOINT_PATH, ""),
        job_id=job_id,
    )
    report = run_preflight(plan, say=lambda s: click.echo(f"ranklens run: {s}", err=True))
    if store is not None:
        from ranklens.analyzers.findings import save_findings

        try:
            store.write("preflight", report.rows())
            save_findings(store, report.findings())
        except Exception as e:
            click.echo(f"ranklens run: pre-flight results not stored: {e}", err=True)
    node = report.nodes[0]
    verdict = report.verdict(node)
    if report.exit_code == EXIT_FAIL:
        click.echo(report_text(report), err=True)
        reasons = "; ".join(report.reasons(node))
        click.echo(
            f"ranklens run: pre-flight FAILED on {node}: {reasons}. Not starting the command "
            "(fix the node, or run without --preflight to start anyway).",
            err=True,
        )
        sys.exit(EXIT_FAIL)
    warns = report.reasons(node, Status.WARN)
    click.echo(
        f"ranklens run: pre-flight {verdict.value} on {node} ({len(report.results)} results in "
        f"{report.duration_s:.1f} s)" + (f"; warnings: {'; '.join(warns)}" if warns else ""),
        err=True,
    )


@cli.command(
    epilog=_EPILOG,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@_store_option
@click.option(
    "--spool",
    "spool_dir",
    envvar=ENV_SPOOL,
    default=DEFAULT_SPOOL_DIR,
    show_default=True,
    help="Spool root the ranks write (env RANKLENS_SPOOL).",
)
@click.option("--job-id", default=None, help="Job id shared by all ranks (default: generated; env RANKLENS_JOB_ID).")
@click.option("--no-collect", is_flag=True, help="Only spool; do not ship into the store.")
@click.option(
    "--preflight",
    "preflight",
    is_flag=True,
    help="Check this node first (`ranklens preflight`); a failed node does not start the command (exit 11).",
)
@click.option(
    "--preflight-checks",
    default="all",
    show_default=True,
    metavar="NAME,...",
    help="With --preflight: the checks (names or groups, as `ranklens preflight --checks`).",
)
@click.option(
    "--recover",
    "recover_policy",
    default=None,
    metavar="POLICY",
    help="Analyze the job live and carry out the policy's recovery (its [[executor]] tables: torchrun "
    "restarts the worker group in place); prints MTTD/MTTR at the end. See deploy/policies/torchrun-restart.toml.",
)
@click.option(
    "--outbox",
    "outbox_dir",
    envvar=ENV_OUTBOX,
    default=None,
    help="With --recover: the durable webhook outbox directory (default: ~/.ranklens/outbox). Env: RANKLENS_OUTBOX.",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@_errors
def run(
    store_url: str | None,
    spool_dir: str,
    job_id: str | None,
    no_collect: bool,
    preflight: bool,
    preflight_checks: str,
    recover_policy: str | None,
    outbox_dir: str | None,
    command: tuple[str, ...],
) -> None:
    """Trace an unmodified training command: ranklens run -- torchrun --nproc-per-node 4 train.py

    Every rank calls ranklens.tracing.init() right after init_process_group (DDP included), and
    the spool is shipped into the store while the command runs (unless another collector already
    serves the spool). Exits with the command's exit code. RANKLENS_DISABLE=1 turns tracing off.

    Tracing never keeps the command from starting: with a spool that cannot be written it runs
    untraced (one warning); with the store down its records stay in the spool and are shipped
    when the store is up (one warning; a ClickHouse server is retried while the command runs).
    """
    from ranklens.launch import run_traced

    store, ship_later = (None, None) if no_collect else _open_for_run(store_url)
    if preflight:
        from ranklens.launch import resolve_job_id

        job_id = resolve_job_id(job_id)  # the same id for the check and the job
        _preflight_before_run(store, preflight_checks, job_id)
    supervise = None
    if recover_policy is not None:
        from ranklens.launch import resolve_job_id

        job_id = resolve_job_id(job_id)  # the supervisor is made (policy, outbox checked) before the job starts
        sup = _recovery_supervisor(recover_policy, store, no_collect, ship_later, spool_dir, outbox_dir, job_id)
        supervise = lambda _job: sup.start()  # noqa: E731
    result = run_traced(
        command, store, spool_dir=spool_dir, job_id=job_id, log=lambda s: click.echo(s, err=True), supervise=supervise
    )
    if recover_policy is not None and store is not None:
        from ranklens.recover import earlier_runs, job_recovery_summary, recovery_times

        try:
            # a requeued Slurm job's earlier runs first: their remediations (the requeue) end in this run
            for run_id in [*earlier_runs(result.job_id), result.job_id]:
                times = recovery_times(store, run_id)
                for t in times:
                    click.echo(f"ranklens run: recovery: {t.line()}", err=True)
                if times:
                    click.echo(f"ranklens run: recovery: {job_recovery_summary(run_id, times)}", err=True)
        except Exception as e:  # the job's own exit code is what `run` exits with, whatever the store does
            click.echo(f"ranklens run: warning: cannot measure the recovery times ({type(e).__name__}: {e})", err=True)
    if result.collector and result.store_error:
        ship_later = getattr(store, "url", None) or ship_later
        click.echo(
            f"ranklens run: job {result.job_id} exited {result.returncode}; the store is still unavailable "
            f"({result.store_error}): {result.left_segments} segment(s) wait in {spool_dir}",
            err=True,
        )
    elif result.collector:
        rows = ", ".join(f"{k} {v:,}" for k, v in sorted(result.rows.items())) or "no records"
        click.echo(f"ranklens run: job {result.job_id} exited {result.returncode}; collected {rows}", err=True)
        if store is not None and result.rows.get("collectives"):
            click.echo(f"ranklens run: next: {_prog()} analyze{store_flag(store.url)} --job {result.job_id}", err=True)
            if note := password_note(store.url):
                click.echo(f"ranklens run: {note}", err=True)
    if ship_later and result.traced and (result.store_error or not result.collector):
        click.echo(
            f"ranklens run: ship them with: {_prog()} collect{store_flag(ship_later)} --spool {spool_dir} "
            "(a collector serving this spool does it by itself)",
            err=True,
        )
        if note := password_note(ship_later):
            click.echo(f"ranklens run: {note}", err=True)
    sys.exit(result.returncode)


def _recovery_supervisor(
    policy_file: str,
    store: Any,
    no_collect: bool,
    ship_later: str | None,
    spool_dir: str,
    outbox_dir: str | None,
    job_id: str,
) -> Any:
    """``ranklens run --recover``'s supervisor, made before the command starts: a bad policy or an
    outbox that cannot be opened stops it there (exit 2)."""
    import os

    from ranklens.analyzers.recovery.policy import load_policy
    from ranklens.config import ENV_FR_STUCK_S
    from ranklens.errors import ConfigError, RanklensError
    from ranklens.recover import RecoverySupervisor

    if no_collect:
        raise ConfigError("--recover analyzes the job live from the store: not with --no-collect")
    if store is None:
        raise ConfigError(
            f"--recover analyzes the job live from the store, and the store {ship_later or ''} cannot be opened; "
            "fix it (or pass --store URL) before running with --recover"
        )
    policy = load_policy(policy_file)
    if not policy.executors:
        click.echo(
            f"ranklens run: warning: {policy_file} has no [[executor]]: recovery is decided, not carried out", err=True
        )
    # the ranks dump their stacks when a collective is stuck this long: before the hang is detected
    # (10 s) and the worker restarted, so the stacks survive the restart
    os.environ.setdefault(ENV_FR_STUCK_S, "5")
    outbox = outbox_dir or os.path.join(os.path.expanduser("~"), ".ranklens", "outbox")

    def say(m: str) -> None:
        click.echo(f"ranklens run: {m}", err=True)

    try:
        sup = RecoverySupervisor(store, job_id, policy, outbox_dir=outbox, spool_dir=spool_dir, log=say)
    except (RanklensError, OSError) as e:
        raise ConfigError(f"--recover: cannot open the recovery outbox {outbox}: {e}; pass --outbox DIR") from None
    mode = "dry run: decisions are recorded, nothing is done" if policy.dry_run else "live"
    names = ", ".join(x.name for x in policy.executors) or "none"
    say(f"recovery: policy {policy_file} ({mode}), executors: {names}")
    return sup


def _open_for_run(store_url: str | None) -> tuple[Any, str | None]:
    """``ranklens run``'s store, and the URL to ship to later when it is down. A store that is down
    does not hold training back (issue 22, defect 7): a ClickHouse server is retried while the
    command runs (LazyStore, as the collector does); an embedded store that cannot be opened leaves
    the records in the spool. A wrong URL, refused credentials or a schema mismatch still stop it."""
    from ranklens.errors import StoreAuthError
    from ranklens.store import LazyStore, default_store_url

    url = store_url or default_store_url()
    try:
        return _open(url), None
    except StoreUnavailableError as e:
        if isinstance(e, StoreAuthError):
            raise
        if url.startswith(("clickhouse://", "clickhouses://")):
            lazy = LazyStore(url)
            click.echo(
                f"ranklens run: warning: {e}; the command starts anyway: its records are spooled and shipped "
                "when the store is up",
                err=True,
            )
            return lazy, lazy.url
        click.echo(f"ranklens run: warning: {e}; the command starts anyway, its records stay in the spool", err=True)
        return None, url


@cli.command(epilog=_EPILOG)
@click.option("--target", type=click.Choice(["server", "cluster", "embedded"]), default="server", show_default=True)
@click.option("--database", default="ranklens", show_default=True)
@click.option("--cluster", default="ranklens", show_default=True, help="Cluster name (--target cluster).")
@click.option(
    "--migrate",
    is_flag=True,
    help="Instead of printing DDL: bring the store (--store) of an older schema version up to this one, "
    "keeping every row (new columns take their defaults).",
)
@click.option(
    "--server-version",
    default="18.16",
    show_default=True,
    help="ClickHouse version the DDL is for (--target server or cluster): below 21.8 the 18.16 floor; from 21.8 day "
    "partitions, TTL, codecs and LowCardinality (docs/capacity.md, Schema for weeks).",
)
@click.option(
    "--retention",
    multiple=True,
    metavar="TABLE=DAYS",
    help="Days a table's rows are kept on a current server (0: forever); repeatable. Default per table.",
)
@_store_option
@_errors
def schema(
    target: str,
    database: str,
    cluster: str,
    migrate: bool,
    server_version: str,
    retention: tuple[str, ...],
    store_url: str | None,
) -> None:
    """Print the DDL of ranklens' tables for a ClickHouse server, a cluster, or the embedded store;
    or, with --migrate, upgrade a store made by an older ranklens."""
    if migrate:
        from ranklens.schema import SCHEMA_VERSION
        from ranklens.store import default_store_url
        from ranklens.store.migrate import migrate as run_migration
        from ranklens.store.server import redact_url

        url = store_url or default_store_url()
        done = run_migration(url)
        for line in done:
            click.echo(f"migrate: {line}", err=True)
        tail = "" if done else " (nothing to do)"
        # the URL may carry the store password: print it redacted, as every other command does
        click.echo(f"migrate: {redact_url(url)} is at schema version {SCHEMA_VERSION}{tail}", err=True)
        return
    from ranklens.schema import TABLES, parse_retention, parse_server_version, render_cluster_ddl_for, render_ddl_for

    keep = parse_retention(retention)
    version = parse_server_version(server_version)
    if target == "server":
        click.echo(render_ddl_for(database, version, keep), nl=False)
    elif target == "cluster":
        click.echo(render_cluster_ddl_for(database, cluster, version, keep), nl=False)
    else:
        for t in TABLES.values():
            click.echo(
                f"-- {t.doc}\nCREATE VIEW {t.name} AS SELECT * FROM file('<store>/parts/{t.name}/<parts>', "
                f"Parquet, '{t.structure()}');"
            )


from ranklens.simulate_cli import simulate_command  # noqa: E402 - registered below the group

cli.add_command(simulate_command, "simulate")

from ranklens.probe_cli import probe_command  # noqa: E402

cli.add_command(probe_command, "probe")

from ranklens.preflight_cli import preflight_command  # noqa: E402

cli.add_command(preflight_command, "preflight")

from ranklens.drill_cli import drill_command  # noqa: E402

cli.add_command(drill_command, "drill")


def main() -> None:
    import logging

    # clickhouse-driver logs a traceback per failed connect; our error line says it once.
    logging.getLogger("clickhouse_driver").setLevel(logging.CRITICAL)
    cli(prog_name="ranklens")


if __name__ == "__main__":
    main()
