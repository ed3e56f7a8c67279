"""The Hugging Face Trainer with ddpstate's checkpoints: one callback, one resume line.

Each ``checkpoint-N/`` the Trainer writes is fsynced and sealed with ddpstate's
manifest (sizes and CRC-32s, written last), so ``ddpstate verify`` can check it and a
rerun resumes, through the Trainer's own resume (global step, optimizer, scheduler,
data position), from the newest folder that verifies, skipping one a crash left
incomplete. A tiny GPT-2 built in code on random tokens, on the CPU, no download::

    pip install "torch==2.13.0" -e ".[transformers]"   # from a checkout; or, once on PyPI:
    pip install "ddpstate[transformers]"
    python examples/transformers_ddpstate.py --max-steps 20   # checkpoints at 10 and 20
    ddpstate verify runs/transformers_ddpstate/checkpoint-20
    python examples/transformers_ddpstate.py --max-steps 40   # resumes at step 20
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ddpstate.integrations.transformers import DDPStateCallback, last_verified_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--output-dir", default="runs/transformers_ddpstate")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256))
    tokens = torch.randint(0, 256, (256, 32))
    training_args = TrainingArguments(
        args.output_dir,
        max_steps=args.max_steps,
        save_steps=10,
        per_device_train_batch_size=8,
        use_cpu=True,
        report_to="none",
    )
    trainer = Trainer(
        model,
        training_args,
        train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
        callbacks=[DDPStateCallback()],  # seals every checkpoint-N/ once written
    )
    # The newest checkpoint-N that verifies, or None on the first run.
    trainer.train(resume_from_checkpoint=last_verified_checkpoint(args.output_dir))


if __name__ == "__main__":
    main()
