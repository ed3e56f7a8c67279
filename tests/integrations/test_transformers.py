"""DDPStateCallback and last_verified_checkpoint with the real Hugging Face Trainer (1 process)."""

from __future__ import annotations

import copy
import importlib
import os
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from ddpstate._manifest import MANIFEST_NAME
from ddpstate.cli import main
from tests.integrations.test_lightning import _same
from tests.multiproc import run_ranks

pytestmark = pytest.mark.slow  # importing transformers alone takes seconds


@pytest.fixture(scope="module")
def hf() -> ModuleType:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return importlib.import_module("ddpstate.integrations.transformers")


def _train(hf: ModuleType, out: Path, resume: str | None = None) -> tuple[Any, int]:
    """Train a 1-layer GPT-2 for 6 steps, a checkpoint every 2; the trainer and steps run."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    class CountSteps(TrainerCallback):
        steps = 0

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.steps += 1

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
        str(out), max_steps=6, save_steps=2, per_device_train_batch_size=4, use_cpu=True,
        report_to="none", logging_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    count = CountSteps()
    trainer = Trainer(
        model,
        args,
        train_dataset=[{"input_ids": i, "labels": i} for i in ids],
        callbacks=[hf.DDPStateCallback(), count],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, count.steps


def _final(trainer: Any) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "global_step": trainer.state.global_step,
    }


def test_sealed_checkpoints_verify_and_a_resume_skips_incomplete_ones_bitwise(
    hf: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _final(_train(hf, tmp_path)[0])
    folders = [tmp_path / f"checkpoint-{step}" for step in (2, 4, 6)]
    for folder in folders:
        assert (folder / MANIFEST_NAME).exists()
        assert main(["verify", str(folder)]) == 0, capsys.readouterr()
    assert hf.last_verified_checkpoint(tmp_path) == str(folders[2])
    # checkpoint-6: a file torn; checkpoint-4: killed before the callback committed it.
    model_file = folders[2] / "model.safetensors"
    os.truncate(model_file, model_file.stat().st_size - 100)
    (folders[1] / MANIFEST_NAME).unlink()
    assert main(["verify", str(folders[2])]) == 1
    with pytest.warns(UserWarning) as caught:
        resume = hf.last_verified_checkpoint(tmp_path)
    assert resume == str(folders[0])
    said = [str(w.message) for w in caught]
    assert len(said) == 2
    assert "checkpoint-6" in said[0] and "model.safetensors" in said[0]
    assert "checkpoint-4" in said[1] and "never committed" in said[1]
    # The Trainer's own resume: TrainerState restored, 4 steps run, not 6 from step 0.
    trainer, steps = _train(hf, tmp_path, resume)
    assert steps == 4
    second = _final(trainer)
    assert first["global_step"] == second["global_step"] == 6
    assert _same(first["model"], second["model"])
    assert _same(first["optimizer"], second["optimizer"])
    for folder in folders:  # the resumed run saved (and sealed) 4 and 6 again
        assert main(["verify", str(folder)]) == 0


def _save_on_two_ranks(rank: int, world_size: int, out: str) -> list[str]:
    from ddpstate.integrations.transformers import DDPStateCallback

    folder = os.path.join(out, "checkpoint-7")
    os.makedirs(folder, exist_ok=True)
    if rank == 1:
        time.sleep(1.0)  # the Trainer has no barrier before on_save: rank 1 writes late
    torch.save({"cpu": torch.random.get_rng_state()}, os.path.join(folder, f"rng_state_{rank}.pth"))
    # The TrainingArguments fields on_save reads, as the Trainer sets them on each rank.
    args = SimpleNamespace(output_dir=out, should_save=rank == 0, world_size=world_size)
    DDPStateCallback().on_save(args, SimpleNamespace(global_step=7), None)
    return sorted(os.listdir(folder))


def test_on_save_waits_for_every_rank_before_sealing(hf: ModuleType, tmp_path: Path) -> None:
    listed = run_ranks(_save_on_two_ranks, 2, args=(str(tmp_path),), timeout=120)
    assert listed[0] == ["manifest.json", "rng_state_0.pth", "rng_state_1.pth"]
    assert main(["verify", str(tmp_path / "checkpoint-7")]) == 0


def test_no_checkpoint_is_a_fresh_start(hf: ModuleType, tmp_path: Path) -> None:
    assert hf.last_verified_checkpoint(tmp_path / "absent") is None
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "runs").mkdir()
    with pytest.warns(UserWarning, match="checkpoint-3"):
        assert hf.last_verified_checkpoint(tmp_path) is None


def test_a_missing_transformers_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "ddpstate.integrations.transformers", raising=False)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r'pip install "ddpstate\[transformers\]"'):
        importlib.import_module("ddpstate.integrations.transformers")
