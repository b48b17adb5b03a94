"""Lightning with mixprec's scaler: the model and data of docs/lightning.md (its blocks show the
same code: tests/docs/test_doc_snippets.py holds them equal).

A small regressor trained for one epoch of 4 batches in fp16 on the CPU, through Lightning's
own ``MixedPrecision`` plugin with a ``mixprec.GradScaler``; the second batch overflows in fp16,
so its step is skipped.

Run: ``python examples/lightning_regressor.py`` (needs ``pip install 'mixprec[lightning]'``).
"""

from __future__ import annotations

import torch

import mixprec

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def overflowing_data() -> torch.utils.data.DataLoader:
    """4 batches of 8; the second overflows in fp16."""
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    x[8:16] *= 1e5  # this batch overflows in fp16: its step is skipped
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def main() -> None:
    scaler = mixprec.GradScaler()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        plugins=[pl.plugins.MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), overflowing_data())
    print(scaler.stats())
    assert scaler.stats().steps_skipped >= 1


if __name__ == "__main__":
    main()
