"""Trainer integrations: a real Lightning fit and a real Hugging Face Trainer run, traced."""

from __future__ import annotations

import json

import pytest
import torch


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

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

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
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
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

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def forward(self, x, labels=None):
            out = self.layer(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"x": torch.randn(8, generator=g), "labels": torch.randn(1, generator=g)}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=8,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
    )
    trainer = transformers.Trainer(model=Model(), args=args, train_dataset=Data(), callbacks=[hf_callback()])
    trainer.train()
    import ranklens.tracing as rlt

    rlt.get_tracer().flush()
    assert [s["step"] for s in _rows(tracer, "steps")] == [0, 1, 2]
    assert "optimizer" in {p["phase"] for p in _rows(tracer, "phases")}
