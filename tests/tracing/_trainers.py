"""The tiny models the trainer tests fit: one Lightning module and one Hugging Face Trainer setup
(model, dataset and arguments for 3 CPU steps), shared by the callback and the inferred-steps tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def tiny_lightning_module(pl: Any) -> Any:
    """A ``pl.LightningModule``: one linear layer, MSE loss, SGD (lr 0.1)."""

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny()


def hf_trainer_setup(transformers: Any, tmp_path: Path) -> dict[str, Any]:
    """``transformers.Trainer``'s keyword arguments for 3 steps of a linear model on 32 seeded rows (CPU)."""

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
    return {"model": Model(), "args": args, "train_dataset": Data()}
