"""Trainer integrations: a real Lightning fit and a real Hugging Face Trainer run, traced."""

from __future__ import annotations

import json

import pytest
import torch

from tests.tracing._trainers import hf_trainer_setup, tiny_lightning_module


def _rows(root, table):
    out = []
    for p in sorted(root.rglob(f"{table}.*.jsonl")):
        out += [json.loads(x) for x in p.read_text().splitlines()[1:]]
    return out


@pytest.fixture
def tracer(tmp_path):
    import ranklens.tracing as rlt

    t = rlt.init(job_id="integ", spool_dir=str(tmp_path), rank=0, world_size=1, patch_distributed=False)
    yield tmp_path
    rlt.shutdown()
    assert t is not None


@pytest.mark.slow
def test_lightning_callback(tracer):
    pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install lightning)")
    from ranklens.tracing.integrations import lightning_callback

    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    trainer = pl.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[lightning_callback()],
    )
    trainer.fit(tiny_lightning_module(pl), torch.utils.data.DataLoader(data, batch_size=8))
    import ranklens.tracing as rlt

    rlt.get_tracer().flush()
    steps = _rows(tracer, "steps")
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    phases = {p["phase"] for p in _rows(tracer, "phases")}
    assert {"forward", "backward", "optimizer"} <= phases


def test_hf_trainer_callback(tracer, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="accelerate is not installed (Trainer needs it)")
    from ranklens.tracing.integrations import hf_callback

    trainer = transformers.Trainer(**hf_trainer_setup(transformers, tmp_path), callbacks=[hf_callback()])
    trainer.train()
    import ranklens.tracing as rlt

    rlt.get_tracer().flush()
    assert [s["step"] for s in _rows(tracer, "steps")] == [0, 1, 2]
    assert "optimizer" in {p["phase"] for p in _rows(tracer, "phases")}
