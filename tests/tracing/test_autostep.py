"""Steps and phases inferred for scripts that mark none (issue 21 #1): optimizer steps as step
boundaries, the model's forward, backward, the optimizer step and DataLoader waits as phases;
explicit markers win; a loop without optimizer is said so once. Plus the bootstrap reaching only
training ranks (issue 13 #9) and stores of schema 5 migrating to ``steps.source``."""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import ranklens.tracing as rlt
from ranklens.tracing._autostep import NO_STEPS_MESSAGE, AutoStep
from ranklens.tracing.tracer import Tracer
from tests._jobs import TORCHRUN, ranklens, ranklens_run
from tests.tracing._trainers import hf_trainer_setup, tiny_lightning_module

ROOT = Path(__file__).resolve().parents[2]


def _rows(root: Path, table: str) -> list[dict]:
    out = []
    for p in sorted(root.rglob(f"{table}.*.jsonl")):
        out += [json.loads(x) for x in p.read_text().splitlines()[1:]]
    return out


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _loader(n_batches: int) -> torch.utils.data.DataLoader:
    data = torch.utils.data.TensorDataset(torch.randn(4 * n_batches, 8), torch.randn(4 * n_batches, 1))
    return torch.utils.data.DataLoader(data, batch_size=4)


@pytest.fixture
def traced(tmp_path):
    """An initialised single-rank tracer (no torch.distributed); shut down afterwards."""
    t = rlt.init(job_id="auto", spool_dir=str(tmp_path), rank=0, world_size=1, patch_distributed=False)
    assert t is not None and t.autostep is not None
    try:
        yield t
    finally:
        rlt.shutdown()


def _by_step(phases: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for p in sorted(phases, key=lambda p: p["start_ns"]):
        out.setdefault(p["step"], []).append(p)
    return out


@pytest.mark.slow
def test_plain_loop_gets_steps_phases_and_collectives_stamped_with_their_step(traced, tmp_path):
    model, lossf = _model(), torch.nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seq = iter(range(1, 10_000))

    def bucket(grad):  # what DDP's comm hook does during backward: a collective per bucket
        row = traced.collective_entered("0", next(seq), "all_reduce", 4, "float32", -1, True)
        traced.collective_completed(row)

    model[0].weight.register_hook(bucket)
    loader = _loader(5)
    for _epoch in range(2):
        for x, y in loader:
            lossf(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():  # evaluation: neither a step nor a phase
            for x, _y in loader:
                model(x)
    rlt.shutdown()

    steps = _rows(tmp_path, "steps")
    assert [s["step"] for s in steps] == list(range(10))
    assert {s["source"] for s in steps} == {"inferred"}
    phases = _by_step(_rows(tmp_path, "phases"))
    assert sorted(phases) == list(range(10))
    for s in steps:
        got = phases[s["step"]]
        assert [p["phase"] for p in got] == ["data", "forward", "backward", "optimizer"], got
        assert all(a["end_ns"] <= b["start_ns"] for a, b in itertools.pairwise(got))
        assert s["start_ns"] == got[0]["start_ns"] and s["end_ns"] == got[-1]["end_ns"]
    colls = _rows(tmp_path, "collectives")
    assert sorted(c["step"] for c in colls) == list(range(10))  # one bucket per step, in its step
    for c in colls:
        s = steps[c["step"]]
        assert s["start_ns"] <= c["enter_ns"] < s["end_ns"]


def test_accumulation_and_several_optimizers_count_optimizer_steps(traced, tmp_path):
    a, b = _model(), _model()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-3)
    it = iter(_loader(8))
    for _ in range(4):
        for _micro in range(2):  # two micro-batches per optimizer step
            x, y = next(it)
            (a(x) - y).pow(2).mean().backward()
            b(x).mean().backward()
        opt_a.step()
        opt_b.step()  # a second optimizer right after: the same step
        opt_a.zero_grad()
        opt_b.zero_grad()
    rlt.shutdown()
    assert [s["step"] for s in _rows(tmp_path, "steps")] == [0, 1, 2, 3]
    per = Counter((p["step"], p["phase"]) for p in _rows(tmp_path, "phases"))
    for k in range(4):
        assert per[(k, "data")] == 2 and per[(k, "forward")] == 4 and per[(k, "backward")] == 4
        assert per[(k, "optimizer")] == 2


def test_closure_optimizer_lightning_style_is_one_step_per_call(traced, tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randn(4, 1)

    def closure():
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)  # forward and backward run inside step(), as Lightning does
    rlt.shutdown()
    assert [s["step"] for s in _rows(tmp_path, "steps")] == [0, 1, 2]
    for k, got in _by_step(_rows(tmp_path, "phases")).items():
        names = {p["phase"]: p for p in got}
        assert set(names) == {"forward", "backward", "optimizer"}, (k, got)
        assert names["optimizer"]["start_ns"] >= names["backward"]["end_ns"]  # not the closure's time


def test_explicit_step_markers_win_with_no_inferred_rows(traced, tmp_path, embedded_store):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(_loader(4)):
        with rlt.step(i):
            (model(x) - y).pow(2).mean().backward()
            opt.step()
    assert traced.autostep.steps_on is False
    assert torch.autograd.backward.__module__ == "torch.autograd"  # hooks are gone at once
    rlt.shutdown()
    steps = _rows(tmp_path, "steps")
    assert [s["step"] for s in steps] == [0, 1, 2, 3] and all("source" not in s for s in steps)
    # the DataLoader waits are still timed (as before); nothing was inferred
    assert {p["phase"] for p in _rows(tmp_path, "phases")} == {"data"}
    from ranklens.collector import Shipper

    Shipper(tmp_path, embedded_store).ship_once()
    assert embedded_store.query("SELECT source, count() FROM steps GROUP BY source").rows() == [("explicit", 4)]


def test_explicit_phases_stop_phase_inference_but_steps_are_still_inferred(traced, tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _loader(3):
        with rlt.phase("forward"):
            loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
    rlt.shutdown()
    assert [(s["step"], s["source"]) for s in _rows(tmp_path, "steps")] == [
        (0, "inferred"),
        (1, "inferred"),
        (2, "inferred"),
    ]
    per = Counter((p["step"], p["phase"]) for p in _rows(tmp_path, "phases"))
    # one forward per step (the script's, not doubled); the DataLoader waits as before
    assert per == Counter({(k, ph): 1 for k in range(3) for ph in ("forward", "data")}), per


def test_no_optimizer_is_said_once_and_steps_stay_unknown(tmp_path, caplog):
    model = _model()
    with caplog.at_level(logging.WARNING, logger="ranklens.tracing"):
        rlt.init(job_id="noopt", spool_dir=str(tmp_path), rank=0, world_size=1, patch_distributed=False)
        try:
            for x, y in _loader(5):
                (model(x) - y).pow(2).mean().backward()
                with torch.no_grad():  # a hand-written update: no torch.optim
                    for p in model.parameters():
                        p -= 0.1 * p.grad
                        p.grad = None
        finally:
            rlt.shutdown()
    said = [r.getMessage() for r in caplog.records if "no optimizer step" in r.getMessage()]
    assert said == [NO_STEPS_MESSAGE]
    assert _rows(tmp_path, "steps") == []


def test_a_loop_without_optimizer_never_stamps_a_step_and_gives_up_early(tmp_path):
    t = Tracer(job_id="j", attempt=0, rank=0, world_size=1, spool_dir=str(tmp_path), flush_interval_s=60)
    said: list[str] = []
    auto = AutoStep(t, give_up_without_optimizer=3, say=said.append).install()
    t.autostep = auto
    orig_backward = auto._orig_backward
    model = _model()
    try:
        for _ in range(6):
            model(torch.randn(2, 8)).sum().backward()
            assert t._step == -1  # collectives issued here carry no step, not a made-up step 0
        assert said == [NO_STEPS_MESSAGE] and not auto.steps_on
        assert torch.autograd.backward is orig_backward
        assert not torch.nn.modules.module._global_forward_pre_hooks
    finally:
        auto.close()
        t.shutdown()
    assert said == [NO_STEPS_MESSAGE]  # once
    assert _rows(tmp_path, "steps") == [] and _rows(tmp_path, "phases") == []


def test_an_optimizer_that_never_steps_is_said_with_what_was_stamped(tmp_path):
    t = Tracer(job_id="j", attempt=0, rank=0, world_size=1, spool_dir=str(tmp_path), flush_interval_s=60)
    said: list[str] = []
    auto = AutoStep(t, give_up_after=4, say=said.append).install()
    t.autostep = auto
    model = _model()
    torch.optim.SGD(model.parameters(), lr=0.1)  # created, never stepped: step 0 opens at the forward
    try:
        model(torch.randn(2, 8)).sum().backward()
        assert t._step == 0
        for _ in range(4):
            model(torch.randn(2, 8)).sum().backward()
        assert t._step == -1 and not auto.steps_on
    finally:
        auto.close()
        t.shutdown()
    (msg,) = said
    assert "never stepped in 5 training forward passes" in msg and "carry step 0" in msg
    assert _rows(tmp_path, "steps") == []


def test_hooks_are_removed_at_shutdown(tmp_path):
    before = torch.autograd.backward
    pre = dict(sys.modules["torch.optim.optimizer"]._global_optimizer_pre_hooks)
    rlt.init(job_id="h", spool_dir=str(tmp_path), rank=0, world_size=1, patch_distributed=False)
    assert torch.autograd.backward is not before
    assert len(torch.nn.modules.module._global_forward_pre_hooks) == 1
    rlt.shutdown()
    assert torch.autograd.backward is before
    assert dict(sys.modules["torch.optim.optimizer"]._global_optimizer_pre_hooks) == pre
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert not torch.nn.modules.module._global_forward_hooks


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_data_parallel_model_is_found_at_its_first_forward(tmp_path, wrapper):
    """A real (one-rank gloo) DDP or FSDP2 (``fully_shard``) model: the global module hooks go at its
    first forward and only the model's own hooks stay; steps and phases as for a plain model; a
    profiler window every 3 inferred steps."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        t = rlt.init(job_id="dp", spool_dir=str(tmp_path), patch_distributed=False, profile_every=3)
        if wrapper == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(_model())
        else:
            from torch.distributed.fsdp import fully_shard

            model = _model()
            fully_shard(model[0])
            fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert torch.nn.modules.module._global_forward_pre_hooks
        for x, y in _loader(4):
            (model(x) - y).pow(2).mean().backward()
            opt.step()
        assert t.autostep.roots == [model]
        assert not torch.nn.modules.module._global_forward_pre_hooks
        rlt.shutdown()
    finally:
        rlt.shutdown()
        dist.destroy_process_group()
    assert [s["step"] for s in _rows(tmp_path, "steps")] == [0, 1, 2, 3]
    per = Counter((p["step"], p["phase"]) for p in _rows(tmp_path, "phases"))
    assert per == Counter({(k, ph): 1 for k in range(4) for ph in ("data", "forward", "backward", "optimizer")})
    assert sorted(p.name for p in tmp_path.rglob("kineto/*.json")) == [
        "rank0-step0.pt.trace.json",
        "rank0-step3.pt.trace.json",
    ]


def test_lightning_without_the_callback_gets_inferred_steps(traced, tmp_path):
    """Lightning runs the forward and backward inside ``optimizer.step(closure)``."""
    pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install lightning)")

    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(tiny_lightning_module(pl), _loader(8))
    rlt.shutdown()
    assert [(s["step"], s["source"]) for s in _rows(tmp_path, "steps")] == [(k, "inferred") for k in range(4)]
    per = Counter((p["step"], p["phase"]) for p in _rows(tmp_path, "phases"))
    assert per == Counter({(k, ph): 1 for k in range(4) for ph in ("data", "forward", "backward", "optimizer")}), per


def test_hf_trainer_without_the_callback_gets_inferred_steps(traced, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="accelerate is not installed (Trainer needs it)")
    transformers.Trainer(**hf_trainer_setup(transformers, tmp_path)).train()
    rlt.shutdown()
    assert [(s["step"], s["source"]) for s in _rows(tmp_path, "steps")] == [(k, "inferred") for k in range(3)]
    per = Counter((p["step"], p["phase"]) for p in _rows(tmp_path, "phases"))
    for k in range(3):
        assert per[(k, "forward")] == 1 and per[(k, "backward")] == 1 and per[(k, "optimizer")] == 1, per


@pytest.mark.parametrize(
    "env,argv,installed",
    [
        ({}, [], False),
        ({"RANK": "0"}, [], True),
        ({"LOCAL_RANK": "1"}, [], True),
        ({}, ["--multiprocessing-fork"], True),  # a torch.multiprocessing.spawn rank
    ],
)
def test_bootstrap_installs_its_hook_only_in_training_ranks(tmp_path, env, argv, installed):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os; os.environ['SHADOWED_RAN'] = '1'\n")
    from ranklens.launch import BOOTSTRAP_DIR

    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    code = (
        "import os, sys; "
        "print(os.environ.get('SHADOWED_RAN'), any(type(f).__name__ == '_Finder' for f in sys.meta_path))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        env={**base, **env, "PYTHONPATH": os.pathsep.join([BOOTSTRAP_DIR, str(other)])},
        check=True,
    )
    assert out.stdout.split() == ["1", str(installed)]  # the shadowed sitecustomize runs in every process


def test_store_of_schema_5_gets_steps_source(tmp_path):
    """A schema-5 store with a steps row (no ``source``): migrated, the row reads 'explicit'."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ranklens.schema import SCHEMA_VERSION
    from ranklens.store import open_store
    from ranklens.store.migrate import migrate

    assert SCHEMA_VERSION >= 6
    root = tmp_path / "store"
    shutil.copytree(ROOT / "tests/data/schema_v4/embedded", root)
    old = pa.table(
        {
            "job_id": ["old"],
            "attempt": pa.array([0], pa.int32()),
            "rank": pa.array([0], pa.int32()),
            "step": [3],
            "start_ns": [10],
            "end_ns": [20],
            "samples": [-1],
            "tokens": [-1],
            "loss": [0.5],
            "grad_norm": [float("nan")],
        }
    )
    pq.write_table(old, root / "parts/steps/part-old-steps.parquet")
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["tables"]["steps"].append(["part-old-steps.parquet", 1])
    (root / "manifest.json").write_text(json.dumps(manifest))
    done = migrate(f"embedded://{root}")
    assert any(d.startswith("steps/part-old-steps.parquet") and "source" in d for d in done), done
    store = open_store(f"embedded://{root}")
    assert store.query("SELECT step, loss, source FROM steps").rows() == [(3, 0.5, "explicit")]
    store.write("steps", [{"job_id": "new", "rank": 0, "step": 0, "start_ns": 1, "end_ns": 2, "source": "inferred"}])
    got = store.query("SELECT job_id, source FROM steps ORDER BY job_id").rows()
    assert got == [("new", "inferred"), ("old", "explicit")]


def test_server_store_of_schema_5_gets_steps_source(server_db_url):
    from ranklens.schema import render_server_ddl
    from ranklens.store import open_store
    from ranklens.store.migrate import migrate
    from ranklens.store.server import ServerConfig, ServerStore

    cfg = ServerConfig.from_url(server_db_url)
    db = cfg.database
    raw = ServerStore(cfg, create=False, check_version=False)
    ddl = render_server_ddl().replace(", source String", "")  # schema 5's steps table
    assert "source String" not in ddl
    ddl = ddl.replace("EXISTS ranklens;", f"EXISTS {db};").replace("ranklens.", f"{db}.")
    for stmt in ddl.split(";\n"):
        stmt = "\n".join(line for line in stmt.splitlines() if not line.startswith("--")).strip()
        if stmt:
            raw._execute(stmt, database=False)
    raw._execute(f"INSERT INTO {db}.ranklens_meta (key, value, updated_ns) VALUES", [("schema_version", "5", 1)])
    raw._execute(f"INSERT INTO {db}.steps (job_id, rank, step, start_ns, end_ns) VALUES", [("old", 0, 3, 10, 20)])
    raw.close()
    done = migrate(server_db_url)
    assert any("steps: ADD COLUMN source String DEFAULT 'explicit' AFTER grad_norm" in d for d in done), done
    store = open_store(server_db_url)
    assert store.query("SELECT step, source FROM steps").rows() == [(3, "explicit")]
    store.close()


# -- real jobs: unmodified scripts under `ranklens run -- torchrun` ------------------------------------
def _ranklens_run(tmp_path: Path, job: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    for k in ("RANKLENS_JOB_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "4", str(ROOT / "tests/jobs_plain_ddp.py")]
    proc = ranklens_run(f"embedded://{tmp_path}/store", tmp_path / "spool", cmd, job_id=job, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.e2e
def test_unmodified_ddp_job_gets_inferred_steps_and_its_slow_rank_named(tmp_path):
    from ranklens.store import open_store

    steps_n = 14
    proc = _ranklens_run(tmp_path, "auto", JOB_STEPS=str(steps_n), JOB_SLOW_PHASE="forward", JOB_OPT="adam")
    assert "no optimizer step" not in proc.stderr
    store = open_store(f"embedded://{tmp_path}/store")
    q = store.query
    assert q("SELECT rank, count(), min(step), max(step), groupUniqArray(source) FROM steps GROUP BY rank "
             "ORDER BY rank").rows() == [(r, steps_n, 0, steps_n - 1, ["inferred"]) for r in range(4)]  # fmt: skip
    per = q("SELECT rank, step, arraySort(groupArray(phase)) FROM phases GROUP BY rank, step").rows()
    assert len(per) == 4 * steps_n
    assert all(ph == ["backward", "data", "forward", "optimizer"] for *_, ph in per), per
    # DDP's gradient buckets carry the step whose backward issued them, inside that step on every rank
    buckets = q(
        "SELECT c.rank, c.step, count(), countIf(c.enter_ns >= s.start_ns AND c.end_ns <= s.end_ns) "
        "FROM collectives AS c ALL INNER JOIN steps AS s ON c.rank = s.rank AND c.step = s.step "
        "WHERE c.job_id = 'auto' AND c.op = 'all_reduce' AND c.async_op = 1 GROUP BY c.rank, c.step"
    ).rows()
    assert len(buckets) == 4 * steps_n and all(n >= 1 and inside == n for *_, n, inside in buckets), buckets
    assert len({n for _, _, n, _ in buckets}) <= 2  # the same buckets per step on every rank (step 0 may differ)
    unknown = q("SELECT count() FROM collectives WHERE job_id = 'auto' AND op = 'all_reduce' AND step < 0").scalar()
    assert unknown == 0
    slow = q("SELECT step, (end_ns - start_ns) / 1e6 FROM phases WHERE rank = 1 AND phase = 'forward' ORDER BY step")
    assert [s for s, ms in slow.rows() if ms >= 100] == list(range(8, steps_n))

    out = ranklens("analyze", "--store", f"embedded://{tmp_path}/store", "--job", "auto", "--json", timeout=180)
    assert out.stdout.lstrip().startswith("{"), (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    report = json.loads(out.stdout)
    assert report["step_source"] == "inferred"
    named = {s["rank"] for f in report["findings"] if f["kind"] == "straggler" for s in f["suspects"]}
    assert named == {1}, report["findings"]
    (f,) = [f for f in report["findings"] if f["kind"] == "straggler"]
    assert abs(f["first_seen_step"] - 8) <= 1 and "forward" in f["title"], f["title"]


@pytest.mark.e2e
def test_job_with_explicit_markers_stores_explicit_steps_only(tmp_path):
    from ranklens.store import open_store

    _ranklens_run(tmp_path, "expl", JOB_STEPS="5", JOB_EXPLICIT="1")
    q = open_store(f"embedded://{tmp_path}/store").query
    assert q("SELECT source, count() FROM steps GROUP BY source").rows() == [("explicit", 4 * 5)]
    dup = q("SELECT rank, step, phase, count() AS n FROM phases GROUP BY rank, step, phase HAVING n > 1").rows()
    assert dup == []
    assert q("SELECT count() FROM phases").scalar() == 4 * 5 * 4


def test_heartbeats_say_where_inside_a_step_a_rank_is_and_nothing_between_steps(traced):
    """The live hang detector names a rank stuck inside a step after 5 s, between steps (checkpoints,
    evaluation) after 10: the heartbeat's phase tells them apart, also in the gaps between phases."""
    model, lossf = _model(), torch.nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[tuple[str, str]] = []
    model[0].weight.register_hook(lambda g: seen.append(("in backward", traced._phase)))
    for it, (x, y) in enumerate(_loader(6)):
        loss = lossf(model(x), y)
        seen.append(("after forward", traced._phase))
        if it % 2 == 0:  # gradient accumulation over two micro-batches: forward, backward, forward, backward
            loss.backward()
            seen.append(("after backward", traced._phase))
            continue
        loss.backward()
        seen.append(("after backward", traced._phase))
        opt.step()
        opt.zero_grad()
        seen.append(("after optimizer", traced._phase))
        with torch.no_grad():
            model(x)  # evaluation between steps
        seen.append(("after evaluation", traced._phase))
    late = seen[len(seen) // 2 :]  # once the model and optimizer are known
    assert set(late) == {
        ("after forward", "after_forward"),
        ("in backward", "backward"),
        ("after backward", "after_backward"),
        ("after optimizer", ""),
        ("after evaluation", ""),
    }, seen
