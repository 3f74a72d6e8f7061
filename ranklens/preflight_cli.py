"""``ranklens preflight``: check the nodes before a job starts (GPUs, host, storage, environment,
software on each node; versions, clocks, compute, all-reduce and pairwise bandwidth across them),
print a verdict per node, write a blacklist, store the results and the findings."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from ranklens._cli_common import EPILOG, errors, policy_options, store_option
from ranklens.config import ENV_CHECKPOINT_PATH, ENV_STORE
from ranklens.errors import ConfigError

__all__ = ["preflight_command"]

PREFLIGHT_EPILOG = (
    "Verdict exit codes: 0 every node passed, 10 warnings only, 11 a node failed (see --blacklist). " + EPILOG
)


def _nodes(spec: str | None) -> list[str]:
    if not spec:
        return []
    if os.path.isdir(spec):
        raise ConfigError(f"--nodes {spec!r} is a directory; give a file with one node per line, or a,b,c")
    if os.path.isfile(spec):
        text = Path(spec).read_text()
        names = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    elif os.sep in spec or spec.endswith((".txt", ".list")):
        raise ConfigError(f"--nodes {spec!r}: no such file (give a file with one node per line, or a,b,c)")
    else:
        names = [x.strip() for x in spec.split(",")]
    out: list[str] = []
    for n in names:
        if n and (n.startswith("-") or any(c.isspace() or c in "'\"$`;|&<>{}" for c in n)):
            raise ConfigError(
                f"--nodes: {n!r} is not a node name (no spaces, quotes or shell characters, no leading -)"
            )
        if n and n not in out:
            out.append(n)
    if not out:
        raise ConfigError(f"--nodes {spec!r} names no node")
    return out


def _thresholds(items: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for t in items:
        k, sep, v = t.partition("=")
        try:
            out[k.strip()] = float(v)
        except ValueError:
            sep = ""
        if not sep or not k.strip():
            raise ConfigError(f"--threshold {t!r}: expected NAME=NUMBER (e.g. memory_warn_gib=16)")
    return out


@click.command("preflight", epilog=PREFLIGHT_EPILOG)
@store_option
@click.option(
    "--nodes",
    "nodes_spec",
    default=None,
    metavar="FILE|LIST",
    help="Nodes to check: a,b,c or a file with one per line. Default: this machine only, in-process.",
)
@click.option(
    "--checks",
    "checks_spec",
    default="all",
    show_default=True,
    metavar="NAME,...",
    help="Check names or groups (host, storage, env, software, gpu, fleet, net); --list prints them.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--blacklist",
    "blacklist_path",
    default=None,
    metavar="FILE",
    help="Write the failed nodes here: JSON if FILE ends in .json, else one node per line (empty: none failed).",
)
@click.option(
    "--launcher",
    default="local",
    show_default=True,
    help="How to run a node's checks with --nodes: local (this machine), ssh, or a template such as "
    "'srun --nodes=1 --ntasks=1 --overlap -w {node} --'. The nodes need ranklens.",
)
@click.option(
    "--address",
    "addresses",
    multiple=True,
    metavar="NODE=ADDR",
    help="How the other nodes reach NODE for the link probe (default: the node's name; local: 127.0.0.1).",
)
@click.option(
    "--checkpoint-path",
    default=lambda: os.environ.get(ENV_CHECKPOINT_PATH, ""),
    show_default="$RANKLENS_CHECKPOINT_PATH",
    help="The job's checkpoint directory: exists, free space, write speed (storage checks skip without it).",
)
@click.option("--mount", "mounts", multiple=True, metavar="DIR", help="A mount the job needs (repeatable).")
@click.option("--gpus", type=int, default=-1, show_default=True, help="GPUs each node must have (-1: any).")
@click.option(
    "--burn",
    "burn_s",
    type=click.FloatRange(0.05, 60),
    default=1.0,
    show_default=True,
    help="Seconds of compute burn per device.",
)
@click.option("--threshold", "thresholds", multiple=True, metavar="NAME=VALUE", help="Override a limit (repeatable).")
@click.option(
    "--bytes",
    "probe_size",
    default="16MiB",
    show_default=True,
    help="Bytes per send of the link probe, and of its all-reduce.",
)
@click.option(
    "--iters",
    "probe_iters",
    type=click.IntRange(1, 1000),
    default=5,
    show_default=True,
    help="Link-probe sends per direction.",
)
@click.option(
    "--min-bandwidth", default=None, metavar="BYTES/S", help="Expected floor of a node pair's bandwidth, e.g. 1GB."
)
@click.option(
    "--metrics-file",
    default=None,
    metavar="FILE.prom",
    help="Write the results as Prometheus metrics (text format) for node_exporter's textfile collector.",
)
@click.option("--job-id", default="", help="The job this check is for (stored with the results and findings).")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(5, 3600),
    default=120.0,
    show_default=True,
    help="Limit per node, and for the link probe.",
)
@click.option("--python", "python", default=None, help="Python on the nodes (default: this one).")
@click.option("--act", is_flag=True, help="Hand the failed nodes' findings to the recovery policy (needs --policy).")
@policy_options(required=False)
@click.option("--list", "list_checks", is_flag=True, help="List the checks and their limits, and exit.")
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Progress on stderr (default: on when stderr is a terminal); with several nodes, also every pass and skip.",
)
@errors
def preflight_command(
    store_url: str | None,
    nodes_spec: str | None,
    checks_spec: str,
    as_json: bool,
    blacklist_path: str | None,
    launcher: str,
    addresses: tuple[str, ...],
    checkpoint_path: str,
    mounts: tuple[str, ...],
    gpus: int,
    burn_s: float,
    thresholds: tuple[str, ...],
    probe_size: str,
    probe_iters: int,
    min_bandwidth: str | None,
    metrics_file: str | None,
    job_id: str,
    timeout_s: float,
    python: str | None,
    act: bool,
    policy_file: str | None,
    outbox_dir: str | None,
    list_checks: bool,
    verbose: bool,
) -> None:
    """Check nodes before a job starts: each node's GPUs (NVML), host, storage, environment and
    software, then versions, clocks and compute across the nodes, an all-reduce over them and the
    bandwidth of a ring of node pairs. Prints a verdict per node; exit 0 pass, 10 warnings, 11 a
    node failed."""
    from ranklens.collector.preflight import resolve_checks
    from ranklens.preflight import PreflightPlan, report_text, run_preflight, write_blacklist, write_metrics

    checks = resolve_checks(checks_spec)
    if list_checks:
        for c in checks:
            click.echo(f"{c.name:<28} {c.scope:<5} {c.doc}")
        return
    if act and not policy_file:
        raise click.UsageError("--act needs --policy FILE (or RANKLENS_POLICY)")
    if act and not (store_url or os.environ.get(ENV_STORE)):
        raise click.UsageError("--act needs a store (--store or RANKLENS_STORE): the policy reads findings there")
    for opt, path in (("--blacklist", blacklist_path), ("--metrics-file", metrics_file)):
        # checked before a minute of checks, not after
        if path and not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            raise ConfigError(f"{opt} {path!r}: its directory does not exist or is not writable")
    nodes = _nodes(nodes_spec)
    addr: dict[str, str] = {}
    for a in addresses:
        node, sep, value = a.partition("=")
        if not sep or not node or not value:
            raise ConfigError(f"--address {a!r}: expected NODE=ADDR")
        addr[node] = value
    from ranklens.probe_cli import _launcher

    launch = _launcher(launcher) if nodes else None
    if nodes and launcher == "local":
        launch = None
    from ranklens.collector.shipper import parse_bytes

    probe_bytes = int(parse_bytes(probe_size, "--bytes"))
    if probe_bytes < 4:
        raise ConfigError(f"--bytes {probe_size!r}: at least 4 bytes (one float32) per send")
    min_Bps = 0.0
    if min_bandwidth:
        min_Bps = float(parse_bytes(min_bandwidth, "--min-bandwidth"))
    store = None
    if store_url or os.environ.get(ENV_STORE):
        from ranklens.cli import _open

        store = _open(store_url)  # first: a store that is down fails before a minute of checks
    plan = PreflightPlan(
        checks=checks,
        nodes=nodes,
        launcher=launch,
        addresses=addr,
        checkpoint_path=checkpoint_path,
        mounts=tuple(mounts),
        gpus_expected=gpus,
        burn_s=burn_s,
        thresholds=_thresholds(thresholds),
        timeout_s=timeout_s,
        python=python or sys.executable,
        min_Bps=min_Bps,
        probe_bytes=probe_bytes,
        probe_iters=probe_iters,
        job_id=job_id,
    )
    talk = verbose or sys.stderr.isatty()
    report = run_preflight(plan, say=(lambda s: click.echo(s, err=True)) if talk else (lambda s: None))
    if blacklist_path:
        write_blacklist(report, blacklist_path)
    if metrics_file:
        write_metrics(report, metrics_file)
    recovery = None
    if store is not None:
        from ranklens.analyzers.findings import save_findings

        store.write("preflight", report.rows())
        findings = report.findings()
        if findings:
            save_findings(store, findings)
        if act and findings:
            from ranklens.cli import _engine

            engine = _engine(policy_file, store, outbox_dir)
            try:
                recovery = engine.process(findings).to_json()
            finally:
                engine.close()
    if as_json:
        doc = report.to_json()
        if store is not None:
            doc["store"] = store.url
        if recovery is not None:
            doc["recovery"] = recovery
        click.echo(json.dumps(doc, default=str))
    else:
        click.echo(report_text(report, verbose=verbose))
        if blacklist_path:
            click.echo(f"blacklist: {len(report.blacklist)} node(s) written to {blacklist_path}")
        if store is not None:
            import shlex

            from ranklens._cli_common import password_note, store_flag

            q = f"SELECT host, check_name, subject, status, message FROM preflight WHERE run_id = '{report.run_id}'"
            click.echo(f"stored as run {report.run_id}: ranklens sql{store_flag(store.url)} {shlex.quote(q)}")
            if note := password_note(store.url):
                click.echo(note)
    sys.exit(report.exit_code)
