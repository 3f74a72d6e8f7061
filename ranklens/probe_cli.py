"""``ranklens probe``: confirm a suspected slow link with a short pairwise bandwidth test.

The probe runs outside the job, one process per node involved (``torch.distributed`` gloo
send/recv, each send acknowledged), started through a launcher: ``local`` (every endpoint on
this machine: single-host checks), ``ssh`` (``ssh NODE``), or any command template with
``{node}`` (``"srun -w {node} --"``, ``"kubectl exec {node} --"``).

Nothing is shared between this machine and the nodes but the launcher: the plan goes inline in
the worker's command, the first node's worker binds the rendezvous port on that node and reports
it, and the measurements come back on each worker's standard output (issue 22 #11).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import click

from ranklens._cli_common import EPILOG, errors, store_option
from ranklens.errors import ConfigError, NotFound

__all__ = ["probe_command"]


def _launcher(spec: str) -> Any:
    from ranklens.analyzers.probe import local_launcher

    if spec == "local":
        return local_launcher
    if spec == "ssh":
        return lambda node, argv: ["ssh", "-o", "BatchMode=yes", node, "--", shlex.join(argv)]
    if "{node}" not in spec:
        raise ConfigError(f"--launcher {spec!r}: use local, ssh, or a command template with {{node}}")
    try:
        shlex.split(spec)
    except ValueError as e:
        raise ConfigError(f"--launcher {spec!r}: {e} (it is split like a shell command line)") from None
    return lambda node, argv: shlex.split(spec.replace("{node}", shlex.quote(node))) + argv


def _pair(text: str, role: str) -> Any:
    from ranklens.analyzers.probe import ProbePair

    a, sep, b = text.partition(":")
    if not sep or not a or not b:
        raise ConfigError(f"{text!r}: a pair is NODE_A:NODE_B")
    try:
        return ProbePair(a, b, role)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@click.command("probe", epilog=EPILOG)
@store_option
@click.option("--finding", "finding_ref", default=None, help="A slow-link finding (its id or an id prefix) to confirm.")
@click.option("--pair", "pairs", multiple=True, metavar="A:B", help="Probe between nodes A and B (repeatable).")
@click.option("--reference", "references", multiple=True, metavar="C:D", help="A healthy pair to compare with.")
@click.option(
    "--address",
    "addresses",
    multiple=True,
    metavar="NODE=ADDR",
    help="How the other nodes reach NODE (default: the node's name; with --launcher local: 127.0.0.1).",
)
@click.option(
    "--launcher",
    default="local",
    show_default=True,
    help="How to run the probe on a node: local, ssh, or a template such as 'srun -w {node} --'. The nodes "
    "need ranklens and torch, not a file system shared with this machine; the first pair's first node "
    "hosts the rendezvous on a free port of its own.",
)
@click.option("--bytes", "size", default="16MiB", show_default=True, help="Bytes per send.")
@click.option("--iters", type=click.IntRange(1, 1000), default=5, show_default=True, help="Sends per direction.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(1, 3600), default=120.0, show_default=True)
@click.option("--python", "python", default=None, help="Python on the nodes (default: this one).")
@click.option("--attach", is_flag=True, help="Record the result on the finding in the store (a new version).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@errors
def probe_command(
    store_url: str | None,
    finding_ref: str | None,
    pairs: tuple[str, ...],
    references: tuple[str, ...],
    addresses: tuple[str, ...],
    launcher: str,
    size: str,
    iters: int,
    timeout_s: float,
    python: str | None,
    attach: bool,
    as_json: bool,
) -> None:
    """Confirm (or refute) a suspected slow link: measure the suspect pair(s) against a healthy
    reference pair, outside the job. Give a finding (--finding, pairs are planned from it and the
    job's nodes) or the pairs themselves (--pair, --reference)."""
    import sys

    from ranklens.analyzers.probe import plan_probe, run_probe
    from ranklens.collector.shipper import parse_bytes

    if not finding_ref and not pairs:
        raise ConfigError("give --finding ID or at least one --pair A:B")
    if attach and not finding_ref:
        raise ConfigError("--attach needs --finding")
    finding = None
    store = None
    plan = [_pair(p, "suspect") for p in pairs] + [_pair(p, "reference") for p in references]
    if finding_ref:
        from ranklens.analyzers.findings import load_finding
        from ranklens.cli import _open
        from ranklens.store.api import sql_string

        store = _open(store_url, create=False)
        try:
            finding = load_finding(store, finding_ref)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if finding is None:
            raise NotFound(f"no finding {finding_ref!r} in {store.url}")
        if not plan:
            nodes = [
                str(h)
                for (h,) in store.query(
                    f"SELECT DISTINCT host FROM ranks WHERE job_id = {sql_string(finding.job_id)} "
                    f"AND attempt = {int(finding.attempt)} AND host != '' ORDER BY host"
                ).rows()
            ]
            try:
                plan = plan_probe(finding, nodes)
            except ValueError as e:
                raise ConfigError(f"cannot plan a probe for finding {finding.id}: {e}") from None
    addr: dict[str, str] = {}
    for a in addresses:
        node, sep, value = a.partition("=")
        if not sep or not node or not value:
            raise ConfigError(f"--address {a!r}: expected NODE=ADDR")
        addr[node] = value
    for p in plan:
        for n in (p.a, p.b):
            addr.setdefault(n, "127.0.0.1" if launcher == "local" else n)
    nodes_txt = ", ".join(f"{p.a}<->{p.b} ({p.role})" for p in plan)
    click.echo(f"probe: {nodes_txt}; {iters} x {size} per direction via {launcher}", err=True)
    report = run_probe(
        plan,
        addr,
        launcher=_launcher(launcher),
        nbytes=parse_bytes(size, "--bytes"),
        iters=iters,
        timeout_s=timeout_s,
        python=python or sys.executable,
    )
    if as_json:
        click.echo(json.dumps(report.to_evidence(), indent=2))
    else:
        for r in report.results:
            click.echo(f"  {r.src} -> {r.dst:12s} {r.role:9s} {r.bandwidth_Bps / 1e6:10.1f} MB/s")
        ratio = f"{report.ratio:.1f}x" if report.ratio == report.ratio else "n/a"
        verdict = "CONFIRMED" if report.confirmed else "not confirmed"
        click.echo(
            f"suspect {report.suspect_Bps / 1e6:.1f} MB/s, reference {report.reference_Bps / 1e6:.1f} MB/s "
            f"(reference/suspect {ratio}): {verdict}"
        )
    if attach and finding is not None and store is not None:
        from ranklens.analyzers.findings import save_findings
        from ranklens.analyzers.probe import attach_probe

        save_findings(store, [attach_probe(finding, report)])
        click.echo(f"probe: recorded on finding {finding.id}", err=True)
