"""Accelerate's quick start with checkpoints that survive a crash: two lines change.

    pip install "torch==2.13.0" -e ".[accelerate]"   # from a checkout; or, once on PyPI:
    pip install "ddpstate[accelerate]"
    accelerate launch examples/accelerate_ddpstate.py --project runs/acc   # or: python ...
    accelerate launch examples/accelerate_ddpstate.py --project runs/acc   # resumes

``accelerator.save_state()`` becomes ``save_state(accelerator)`` (each checkpoint staged,
fsynced and committed by a manifest; ``total_limit`` rotates only after the commit) and
``accelerator.load_state()`` becomes ``load_state(accelerator)`` (the newest checkpoint that
verifies; a truncated or half-written one is skipped with a warning).
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from ddpstate.integrations.accelerate import load_state, save_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--project", default="runs/accelerate", help="checkpoints go here")
    parser.add_argument("--steps", type=int, default=60, help="train until this many steps")
    parser.add_argument("--save-every", type=int, default=20)
    args = parser.parse_args()

    config = ProjectConfiguration(
        project_dir=args.project, automatic_checkpoint_naming=True, total_limit=2
    )
    accelerator = Accelerator(project_config=config, cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    if os.path.isdir(os.path.join(args.project, "checkpoints")):
        accelerator.print(f"resumed from {load_state(accelerator)} at step {accelerator.step}")
    while accelerator.step < args.steps:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.step += 1  # save_state records it; load_state restores it
            if accelerator.step % args.save_every == 0:
                folder = save_state(accelerator)
                accelerator.print(f"step {accelerator.step}: loss {loss.item():.4f}, {folder}")
            if accelerator.step >= args.steps:
                break


if __name__ == "__main__":
    main()
