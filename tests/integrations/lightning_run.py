"""A tiny Lightning DDP run through DDPStateCheckpointIO, then a resume: for test_lightning.py.

torchrun --nproc-per-node=2 tests/integrations/lightning_run.py OUT: trains a linear
model for 3 epochs (DDP on CPU, gloo), a checkpoint per epoch in OUT/checkpoints; damages
the newest checkpoint (truncated, as a torn write leaves it); resumes a fresh model and
Trainer from last_verified_checkpoint and trains to the same end. Rank 0 writes both
runs' final states, the checkpoint resumed from and the warnings to OUT/result.pt.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ddpstate.integrations.lightning import DDPStateCheckpointIO, last_verified_checkpoint


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()  # a checkpoint entry Lightning writes and reads back
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class StartStep(Callback):
    """Records the global step training starts from (after a resume: the checkpoint's)."""

    step = -1

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.step = trainer.global_step


def fit(out: Path, ckpt_path: str | None) -> tuple[dict[str, Any], int]:
    L.seed_everything(0, verbose=False)  # also the seed of the data order
    model = Tiny()
    if ckpt_path is not None:  # weights unlike the first run's: only the resume restores them
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
    start = StartStep()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=3,
        # As a callback: the checkpoint plugin, and the check before the first step.
        callbacks=[
            DDPStateCheckpointIO(),
            ModelCheckpoint(dirpath=out / "checkpoints", save_top_k=-1),
            start,
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    torch.manual_seed(0)  # the same data in both runs
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=ckpt_path)
    final = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": trainer.optimizers[0].state_dict(),
        "global_step": trainer.global_step,
        "checkpoint_io": type(trainer.strategy.checkpoint_io).__name__,
    }
    return final, start.step


def main(out: Path) -> None:
    torch.set_num_threads(1)
    first, _ = fit(out, None)
    rank = int(os.environ["RANK"])
    folder = out / "checkpoints"
    if rank == 0:
        newest = max(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
        os.truncate(newest, newest.stat().st_size // 2)
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resume = last_verified_checkpoint(folder)
    second, start = fit(out, resume)
    if rank == 0:
        result = {
            "first": first,
            "second": second,
            "resumed_from": resume,
            "start_step": start,
            "warnings": [str(w.message) for w in caught],
        }
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
