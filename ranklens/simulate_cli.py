"""``ranklens simulate``: write a simulated 3D-parallel job (with faults) into the store, plus its ground truth.

Registered in :mod:`ranklens.cli` as ``cli.add_command(simulate_command, "simulate")``. The model and
the fault grammar are documented in :mod:`ranklens.simulate`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import click

from ranklens._cli_common import EPILOG as _EPILOG
from ranklens._cli_common import errors as _errors
from ranklens.config import ENV_STORE

__all__ = ["simulate_command"]

_FAULT_HELP = (
    "Inject a fault (repeatable): slow_gpu:RANK[:FACTOR], slow_node:NODE[:FACTOR], "
    "slow_data:RANK[:SECONDS], slow_link:NODE[:FACTOR], stage_imbalance[:FACTOR] (by design, not a "
    "fault), clock_skew:NODE:MS; append @STEP for the onset step. NODE is node0003 or 3."
)


@click.command("simulate", epilog=_EPILOG)
@click.option("--ranks", type=click.IntRange(1), required=True, help="World size of the simulated job.")
@click.option("--steps", type=click.IntRange(1), default=100, show_default=True, help="Training steps.")
@click.option("--dp", type=click.IntRange(1), default=None, help="Data-parallel size [default: ranks / (pp * tp)].")
@click.option("--pp", type=click.IntRange(1), default=1, show_default=True, help="Pipeline-parallel size (stages).")
@click.option("--tp", type=click.IntRange(1), default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--fault", "faults", multiple=True, metavar="KIND:TARGET[:SEVERITY][@STEP]", help=_FAULT_HELP)
@click.option("--onset", type=click.IntRange(0), default=None, help="Onset step of faults given without @STEP [0].")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed (same seed, same records).")
@click.option("--job", "job_id", default=None, help="Job id [default: sim-<date>-<time>-<hex>].")
@click.option("--step-ms", type=click.FloatRange(0.001), default=500.0, show_default=True, help="Healthy step time.")
@click.option(
    "--tp-collectives",
    type=click.IntRange(1),
    default=2,
    show_default=True,
    help="Tensor-parallel all_reduces per stage per microbatch, in forward and in backward.",
)
@click.option("--microbatches", type=click.IntRange(1), default=1, show_default=True, help="GPipe microbatches.")
@click.option(
    "--noise",
    type=click.FloatRange(0, 1, max_open=True),
    default=0.02,
    show_default=True,
    help="Sigma of the lognormal jitter on compute times.",
)
@click.option("--ranks-per-node", type=click.IntRange(1), default=8, show_default=True, help="Ranks per host.")
@click.option(
    "--store",
    "store_url",
    envvar=ENV_STORE,
    default=None,
    metavar="URL",
    help="embedded:///dir (default: ./ranklens-store) or clickhouse://user:pass@host:9000/db. "
    f"Env: {ENV_STORE}. With --out, the store is written only when --store is given.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Write <table>.parquet files (the open ingest format) and truth.json into DIR.",
)
@click.option(
    "--truth",
    "truth_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the ground truth (JSON) here [default: DIR/truth.json with --out, else ./<job>.truth.json].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result (with the truth) as one JSON object.")
@click.pass_context
@_errors
def simulate_command(
    ctx: click.Context,
    ranks: int,
    steps: int,
    dp: int | None,
    pp: int,
    tp: int,
    faults: tuple[str, ...],
    onset: int | None,
    seed: int,
    job_id: str | None,
    step_ms: float,
    tp_collectives: int,
    microbatches: int,
    noise: float,
    ranks_per_node: int,
    store_url: str | None,
    out_dir: str | None,
    truth_file: str | None,
    as_json: bool,
) -> None:
    """Simulate a data x pipeline x tensor parallel training job with injected faults, write its
    records (collectives, phases, steps, ranks, process groups) into the store or as Parquet files,
    and write the ground truth an analyzer should find.

    \b
    Example:
      ranklens simulate --ranks 1024 --steps 100 --pp 4 --tp 8 \\
          --fault slow_gpu:17:1.3@20 --fault stage_imbalance:1.2 --truth truth.json
      ranklens analyze --job <printed job id>
    """
    from ranklens.simulate import SimParams, check_job, parse_fault, simulate

    # bad sizes or faults fail before a store is opened or anything is written
    parsed = [parse_fault(f, onset_step=onset) for f in faults]
    layout, _ = check_job(ranks=ranks, steps=steps, dp=dp, pp=pp, tp=tp, faults=parsed, ranks_per_node=ranks_per_node)
    params = SimParams(tp_collectives=tp_collectives, microbatches=microbatches, noise=noise)
    params.validate()
    source = ctx.get_parameter_source("store_url")
    want_store = out_dir is None or source in (
        click.core.ParameterSource.COMMANDLINE,
        click.core.ParameterSource.ENVIRONMENT,
    )
    store = None
    if want_store:
        from ranklens.cli import _open

        store = _open(store_url)
    say = functools.partial(click.echo, err=True) if as_json else click.echo
    say(
        f"ranklens simulate: {ranks:,} ranks (dp {layout.dp} x pp {pp} x tp {tp}, {layout.nodes:,} nodes)"
        f" x {steps:,} steps" + (f", faults: {', '.join(f.spec for f in parsed)}" if parsed else ", healthy")
    )
    last = {"step": 0}

    def progress(done: int, total: int) -> None:
        if done == total or done - last["step"] >= max(1, total // 10):
            click.echo(f"  step {done:,}/{total:,}", err=True)
            last["step"] = done

    try:
        result = simulate(
            store,
            ranks=ranks,
            steps=steps,
            dp=dp,
            pp=pp,
            tp=tp,
            faults=parsed,
            seed=seed,
            job_id=job_id,
            step_ms=step_ms,
            out_dir=out_dir,
            params=params,
            ranks_per_node=ranks_per_node,
            progress=progress,
        )
    finally:
        if store is not None:
            store.close()
    if truth_file:
        truth_path = result.write_truth(truth_file)
    elif out_dir:
        truth_path = Path(out_dir) / "truth.json"
    else:
        truth_path = result.write_truth(f"{result.job_id}.truth.json")
    truth = result.truth
    if as_json:
        click.echo(
            json.dumps(
                {
                    "job_id": result.job_id,
                    "store": store.url if store is not None else None,
                    "out": out_dir,
                    "rows": result.rows,
                    "seconds": round(result.seconds, 3),
                    "truth_file": str(truth_path),
                    "truth": truth,
                }
            )
        )
        return
    where = " and ".join(x for x in (store.url if store is not None else "", f"{out_dir}/" if out_dir else "") if x)
    click.echo(f"job {result.job_id}: {sum(result.rows.values()):,} rows written to {where} in {result.seconds:.1f} s")
    for name, n in result.rows.items():
        click.echo(f"  {name}: {n:,}")
    culprits = []
    if truth["culprit_ranks"]:
        culprits.append(f"ranks {_short(truth['culprit_ranks'])}")
    if truth["culprit_nodes"]:
        culprits.append(f"nodes {_short(truth['culprit_nodes'])}")
    click.echo(f"ground truth: {truth_path} (culprits: {', '.join(culprits) or 'none, a healthy job'})")
    if store is not None:
        from ranklens._cli_common import password_note, store_flag

        click.echo(f"\nAnalyze it:\n  ranklens analyze --job {result.job_id}{store_flag(store.url)}")
        if note := password_note(store.url):
            click.echo(f"  {note}")
    else:
        click.echo(f"\nLoad and analyze it:\n  ranklens ingest {out_dir}\n  ranklens analyze --job {result.job_id}")


def _short(items: list[Any], limit: int = 8) -> str:
    shown = ", ".join(str(x) for x in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}] ({len(items)})" if len(items) > limit else f"[{shown}]"
