"""DDPStateCallback and last_verified_checkpoint with the real Hugging Face Trainer (1 process)."""

from __future__ import annotations

import copy
import importlib
import os
import signal
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from ddpstate._manifest import MANIFEST_NAME
from ddpstate.cli import main
from ddpstate.integrations._common import seal_folder
from tests.faults import _harness as h
from tests.integrations.test_lightning import _same
from tests.multiproc import run_ranks

pytestmark = pytest.mark.slow  # importing transformers alone takes seconds


@pytest.fixture(scope="module")
def hf() -> ModuleType:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return importlib.import_module("ddpstate.integrations.transformers")


@pytest.fixture(scope="module")
def run(hf: ModuleType) -> ModuleType:
    """tests/integrations/hf_run.py: the Trainer runs (it imports transformers)."""
    return importlib.import_module("tests.integrations.hf_run")


def _final(trainer: Any) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "global_step": trainer.state.global_step,
    }


def test_sealed_checkpoints_verify_and_a_resume_skips_incomplete_ones_bitwise(
    hf: ModuleType, run: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _final(run.train(tmp_path)[0])
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
    trainer, watch = run.train(tmp_path, resume)
    assert watch.steps == 4
    second = _final(trainer)
    assert first["global_step"] == second["global_step"] == 6
    assert _same(first["model"], second["model"])
    assert _same(first["optimizer"], second["optimizer"])
    for folder in folders:  # the resumed run saved (and sealed) 4 and 6 again
        assert main(["verify", str(folder)]) == 0


def _killed_while_sealing(run: ModuleType, out: Path, folder: str) -> None:
    """Train with save_total_limit=1; SIGKILL this process as the seal reads ``folder``'s files."""
    from ddpstate import storage

    real = storage.size_and_crc32

    def crc_or_die(f: Any) -> Any:
        if f"{os.sep}{folder}{os.sep}" in f.name:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(f)

    storage.size_and_crc32 = crc_or_die  # type: ignore[assignment]
    run.train(out, save_total_limit=1)


def test_a_kill_while_sealing_with_save_total_limit_1_resumes_from_the_checkpoint_before(
    run: ModuleType, tmp_path: Path
) -> None:
    """Regression (issue 41): the Trainer deleted checkpoint-2 (save_total_limit=1) before
    on_save sealed checkpoint-4, so a kill during the seal left no verified checkpoint and
    the run started again at step 0. The callback now rotates only after the seal."""
    pid = h._fork(lambda: _killed_while_sealing(run, tmp_path, "checkpoint-4"))
    status = h._wait(pid, 300)
    assert status is not None and os.WIFSIGNALED(status), status
    assert os.WTERMSIG(status) == signal.SIGKILL
    assert not (tmp_path / "checkpoint-4" / MANIFEST_NAME).exists()  # killed mid-seal
    report = run.in_new_process(run.resume_report, tmp_path, save_total_limit=1)
    del report["final"]
    assert report == {
        "resume": str(tmp_path / "checkpoint-2"),
        "start_step": 2,
        "weights_equal": True,
        "steps": 4,
        "global_step": 6,
        "save_total_limit": 1,  # the callback gave the Trainer its limit back
    }
    # The resumed run sealed 4 and 6, each time deleting the one before only afterwards.
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint")] == [
        "checkpoint-6"
    ]
    assert main(["verify", str(tmp_path / "checkpoint-6")]) == 0


def _checkpoint(out: Path, step: int, *, sealed: bool) -> Path:
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    torch.save({"w": torch.full((8,), float(step))}, folder / "model.pt")
    if sealed:
        seal_folder(folder, format="test")
    return folder


def _args(out: Path, limit: int | None) -> SimpleNamespace:
    """The TrainingArguments fields the callback reads, as the Trainer sets them."""
    return SimpleNamespace(
        output_dir=str(out), should_save=True, world_size=1, save_total_limit=limit
    )


def test_save_total_limit_is_applied_after_the_seal_keeping_the_newest_and_the_best(
    hf: ModuleType, tmp_path: Path
) -> None:
    """The callback takes save_total_limit over (the Trainer sees None until on_train_end)
    and rotates after each seal: the folder just sealed and the best are kept, interrupted
    (unsealed) folders go first, even a stale higher-numbered one, which the Trainer's own
    rotation would have kept as "the most recent" instead of the one it had just written."""
    best = _checkpoint(tmp_path, 1, sealed=True)
    _checkpoint(tmp_path, 2, sealed=True)
    _checkpoint(tmp_path, 3, sealed=False)  # killed before its seal
    _checkpoint(tmp_path, 9, sealed=False)  # left by an abandoned run
    _checkpoint(tmp_path, 4, sealed=False)  # just written by the Trainer
    callback, args = hf.DDPStateCallback(), _args(tmp_path, 3)
    callback.on_train_begin(args, SimpleNamespace(), None)
    assert args.save_total_limit is None  # so the Trainer deletes nothing before on_save
    state = SimpleNamespace(global_step=4, best_model_checkpoint=str(best))
    callback.on_save(args, state, None)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["checkpoint-1", "checkpoint-2", "checkpoint-4"]
    assert all(main(["verify", str(tmp_path / name)]) == 0 for name in names)
    # End of training with a limit of 1: the Trainer's rule keeps only the best.
    callback, args = hf.DDPStateCallback(), _args(tmp_path, 1)
    callback.on_train_begin(args, SimpleNamespace(), None)
    callback.on_train_end(args, state, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]
    assert args.save_total_limit == 1


def _save_on_two_ranks(rank: int, world_size: int, out: str) -> list[str]:
    from ddpstate.integrations.transformers import DDPStateCallback

    folder = os.path.join(out, "checkpoint-7")
    os.makedirs(folder, exist_ok=True)
    if rank == 1:
        time.sleep(1.0)  # the Trainer has no barrier before on_save: rank 1 writes late
    torch.save({"cpu": torch.random.get_rng_state()}, os.path.join(folder, f"rng_state_{rank}.pth"))
    # The TrainingArguments fields on_save reads, as the Trainer sets them on each rank.
    args = SimpleNamespace(output_dir=out, should_save=rank == 0, world_size=world_size)
    DDPStateCallback().on_save(
        args, SimpleNamespace(global_step=7, best_model_checkpoint=None), None
    )
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
    # from a checkout, then from PyPI
    both = r'pip install -e "\.\[transformers\]".*pip install "ddpstate\[transformers\]"'
    with pytest.raises(ImportError, match=both):
        importlib.import_module("ddpstate.integrations.transformers")
