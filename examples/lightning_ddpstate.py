"""Lightning's quick start (an autoencoder) with ddpstate's checkpoints: two lines differ.

Every checkpoint is written atomically and fsynced (a crash or power loss leaves the old
one or the new one), and a rerun resumes from the newest checkpoint that verifies,
skipping a damaged one with a warning. Built-in random data, on the CPU::

    pip install "torch==2.13.0" -e ".[lightning]"   # from a checkout; or, once on PyPI:
    pip install "ddpstate[lightning]"
    python examples/lightning_ddpstate.py --max-epochs 2   # trains, a checkpoint per epoch
    python examples/lightning_ddpstate.py --max-epochs 4   # resumes at epoch 2
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpstate.integrations.lightning import DDPStateCheckpointIO, last_verified_checkpoint


class LitAutoEncoder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 64))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = nn.functional.mse_loss(self.decoder(self.encoder(x)), x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--dirpath", default="runs/lightning_ddpstate")
    args = parser.parse_args()
    data = DataLoader(TensorDataset(torch.rand(512, 64)), batch_size=32, shuffle=True)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=args.max_epochs,
        # ddpstate writes and reads every checkpoint (and checks before the first epoch that
        # the state can be saved and loaded weights-only)
        callbacks=[DDPStateCheckpointIO(), ModelCheckpoint(dirpath=args.dirpath, save_last=True)],
        logger=False,
    )
    # The newest checkpoint that verifies, or None on the first run.
    ckpt_path = last_verified_checkpoint(args.dirpath)
    trainer.fit(LitAutoEncoder(), data, ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()
