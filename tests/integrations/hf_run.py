"""A tiny Hugging Face Trainer run through DDPStateCallback, and its resume in a new process.

For test_transformers.py and tests/faults/test_kill_hf_trainer.py: :func:`train` trains a
1-layer GPT-2 on the CPU (a checkpoint every ``save_steps``); :func:`resume_report`, run in
a process of its own after one was killed, resumes from ``last_verified_checkpoint`` and
says what the Trainer restored.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import signal
import tempfile
import traceback
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from ddpstate.integrations.transformers import DDPStateCallback, last_verified_checkpoint
from tests.faults import _harness as h


class _Watch(TrainerCallback):
    """Counts the steps run; keeps the global step and weights the Trainer starts from."""

    def __init__(self) -> None:
        self.steps = 0
        self.start_step = -1
        self.start_weights: dict[str, torch.Tensor] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # After a resume has loaded the weights, optimizer and TrainerState.
        self.start_step = state.global_step
        self.start_weights = {k: v.clone() for k, v in kwargs["model"].state_dict().items()}

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.steps += 1


def train(
    out: Path | str,
    resume: Optional[str] = None,
    *,
    max_steps: int = 6,
    save_steps: int = 2,
    save_total_limit: Optional[int] = None,
) -> tuple[Trainer, _Watch]:
    """Train a 1-layer GPT-2 for ``max_steps`` steps; the trainer and what it started from."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    if resume is not None:  # weights unlike the first run's: only the resume restores them
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
    ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(
        str(out), max_steps=max_steps, save_steps=save_steps, save_total_limit=save_total_limit,
        per_device_train_batch_size=4, use_cpu=True, report_to="none", logging_strategy="no",
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    watch = _Watch()
    trainer = Trainer(
        model,
        args,
        train_dataset=[{"input_ids": i, "labels": i} for i in ids],
        callbacks=[DDPStateCallback(), watch],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, watch


def resume_report(out: Path | str, **train_kwargs: Any) -> dict[str, Any]:
    """Resume from ``last_verified_checkpoint(out)`` and train to the end.

    Returns the folder resumed from (None: a fresh start), the global step the Trainer
    started at, whether its weights then equalled that folder's ``model.safetensors``
    bitwise, the steps run, the final global step, ``args.save_total_limit`` after, and the
    :func:`digest` of the final weights.
    """
    resume = last_verified_checkpoint(out)
    # Read now: the run's rotation may delete the folder once a newer one is sealed.
    saved = {} if resume is None else load_file(os.path.join(resume, "model.safetensors"))
    trainer, watch = train(out, resume, **train_kwargs)
    same = None
    if resume is not None:
        same = all(torch.equal(watch.start_weights[k], v) for k, v in saved.items())
    return {
        "resume": resume,
        "start_step": watch.start_step,
        "weights_equal": same,
        "steps": watch.steps,
        "global_step": trainer.state.global_step,
        "save_total_limit": trainer.args.save_total_limit,
        "final": digest(trainer.model.state_dict()),
    }


def digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 of every tensor's name, dtype, shape and bytes (equal: bitwise-equal states)."""
    sha = hashlib.sha256()
    for key, value in state.items():
        sha.update(f"{key} {value.dtype} {tuple(value.shape)}".encode())
        sha.update(value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def in_new_process(fn: Any, *args: Any, limit: float = 300.0, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a forked child (a new process, as after a crash); its result.

    The result travels back pickled in a temporary file; an exception in the child is
    raised here as a ``RuntimeError`` with its traceback, and so is a child still running
    after ``limit`` seconds (it is killed).
    """
    handle, result = tempfile.mkstemp(suffix=".pkl")
    os.close(handle)

    def body() -> None:
        try:
            message = ("ok", fn(*args, **kwargs))
        except BaseException:
            message = ("error", traceback.format_exc())
        with open(result, "wb") as f:
            pickle.dump(message, f)

    try:
        pid = h._fork(body)
        status = h._wait(pid, limit)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        with open(result, "rb") as f:
            data = f.read()
    finally:
        os.unlink(result)
    if not data:
        raise RuntimeError(f"the child {pid} gave no result (wait status {status})")
    kind, value = pickle.loads(data)
    if kind != "ok":
        raise RuntimeError(f"the child failed:\n{value}")
    return value
