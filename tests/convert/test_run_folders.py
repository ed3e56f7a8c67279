"""``ddpstate verify``/``inspect`` on the folders the integrations write, from real runs.

A Lightning ``ModelCheckpoint`` dirpath (``DDPStateCheckpointIO``), an Accelerate project's
``checkpoints/`` (``ddpstate.integrations.accelerate.save_state``, automatic naming) and a
Hugging Face Trainer ``output_dir`` (``DDPStateCallback``): each checkpoint judged, the one
the integration resumes from named, what the framework's own rule takes when it is damaged,
and the leftovers of killed saves listed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpstate.cli import main
from tests.multiproc import run_ranks

pytest.importorskip("lightning")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

LEFTOVER = ".checkpoint_2.ddpstate-tmp-0123456789abcdef"


def _lightning(out: str) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from ddpstate.integrations.lightning import DDPStateCheckpointIO

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[DDPStateCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=out, save_top_k=-1, save_last=True)],
    )  # fmt: skip
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))


def _accelerate(project: str) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from ddpstate.integrations.accelerate import save_state

    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
    acc = Accelerator(cpu=True, project_config=config)
    acc.prepare(torch.nn.Linear(4, 2), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    save_state(acc)
    save_state(acc)


def _runs(rank: int, world: int, root: str) -> None:
    """The three folders, made in one process (each framework imported once)."""
    from tests.integrations.hf_run import train

    _lightning(os.path.join(root, "lightning"))
    _accelerate(os.path.join(root, "accelerate"))
    trainer, _ = train(os.path.join(root, "hf"), max_steps=2, save_steps=1)
    trainer.save_model()  # the final model, beside the checkpoint-N folders


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    run_ranks(_runs, 1, args=(str(root),), timeout=300)
    return root


@pytest.fixture()
def runs(made: Path, tmp_path: Path) -> Path:
    """A fresh copy of the three run folders, free to damage."""
    return Path(shutil.copytree(made, tmp_path / "runs", symlinks=True))


def _verify(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any], str]:
    """``verify --json``'s status and report, and the text output."""
    status = main(["verify", str(path), "-q", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert main(["verify", str(path), "-q"]) == status
    return status, report, capsys.readouterr().out


def test_each_checkpoint_judged_and_the_resume_choice_named(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = {
        "lightning": ({"epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"}, "last.ckpt"),
        "accelerate/checkpoints": ({"checkpoint_0", "checkpoint_1"}, "checkpoint_1"),
        "hf": ({"checkpoint-1", "checkpoint-2"}, "checkpoint-2"),
    }
    for folder, (names, newest) in expected.items():
        status, report, text = _verify(runs / folder, capsys)
        assert status == 0, text
        assert set(report["checkpoints"]) == names and all(report["checkpoints"].values())
        assert report["resume_from"] == newest, text
        assert f"resumes from {newest}" in text and f"  ok  {newest}" in text
    # An Accelerate project_dir means its checkpoints/.
    assert _verify(runs / "accelerate", capsys)[1]["resume_from"] == "checkpoint_1"


def test_a_damaged_newest_checkpoint_fails_and_resume_falls_back(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = {  # folder, the file cut short, what resume takes instead, the framework's own rule
        "hf": ("checkpoint-2/model.safetensors", "checkpoint-1",
               "the Trainer's own resume_from_checkpoint=True takes checkpoint-2"),
        "accelerate/checkpoints": ("checkpoint_1/model.safetensors", "checkpoint_0",
                                   "Accelerate's own load_state() (automatic_checkpoint_naming) "
                                   "takes checkpoint_1"),
        "lightning": ("last.ckpt", "epoch=1-step=4.ckpt", 'Lightning\'s own ckpt_path="last" '
                      "takes last.ckpt"),
    }  # fmt: skip
    for folder, (damaged, fallback, own) in cases.items():
        path = runs / folder / damaged
        os.truncate(path, path.stat().st_size - 10)
        status, report, text = _verify(runs / folder, capsys)
        bad = damaged.split("/")[0]
        assert status == 1 and report["checkpoints"][bad] is False, text
        assert report["resume_from"] == fallback, text
        assert f"BAD: {runs / folder} (" in text and f"  - {bad}: " in text
        assert f"note: {own}, which fails verification; resume from {fallback}" in text

    # The output_dir's own model (save_model) is checked too, its problems unprefixed.
    final = runs / "hf" / "model.safetensors"
    os.truncate(final, final.stat().st_size - 10)
    status, report, text = _verify(runs / "hf", capsys)
    assert status == 1 and any(p.startswith("model.safetensors: ") for p in report["problems"])


def test_leftovers_and_unsealed_checkpoints_are_notes(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoints = runs / "accelerate" / "checkpoints"
    older = LEFTOVER.replace("_2.", "_0.")  # a killed save_state's staging folder
    (checkpoints / older).mkdir()
    (checkpoints / older / "model.safetensors").write_bytes(b"partial")
    status, report, text = _verify(checkpoints, capsys)
    assert status == 0 and report["resume_from"] == "checkpoint_1", text
    assert f"note: {older}: left by a killed save" in text

    # A Trainer folder the callback never sealed (killed first): whole, but not resumed from.
    (runs / "hf" / "checkpoint-2" / "manifest.json").unlink()
    status, report, text = _verify(runs / "hf", capsys)
    assert status == 0 and report["resume_from"] == "checkpoint-1", text
    assert (
        "note: checkpoint-2: no ddpstate manifest.json (a save killed before it was sealed" in text
    )
    assert "note: the Trainer's own resume_from_checkpoint=True takes checkpoint-2\n" in text


def test_a_leftover_accelerates_own_load_state_would_take_fails_verify(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Accelerate's own load_state() takes the entry of checkpoints/ whose first number is
    highest: a killed save's .checkpoint_2.ddpstate-tmp-... over checkpoint_1 (it then fails on
    the partial file). verify exited 0, saying only that the leftover was there."""
    checkpoints = runs / "accelerate" / "checkpoints"
    (checkpoints / LEFTOVER).mkdir()
    (checkpoints / LEFTOVER / "model.safetensors").write_bytes(b"partial")
    status, report, text = _verify(checkpoints, capsys)
    assert status == 1 and report["resume_from"] == "checkpoint_1", text
    assert report["checkpoints"] == {"checkpoint_0": True, "checkpoint_1": True}
    assert f"  - {LEFTOVER}: Accelerate's own load_state() (automatic_checkpoint_naming) " in text


def test_inspect_shows_the_newest_checkpoint_of_each_folder(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for folder, newest, shown in (
        ("lightning", "its newest, last.ckpt", "last.ckpt"),
        ("accelerate/checkpoints", "its newest, checkpoint_1", "checkpoint_1/model.safetensors"),
        ("hf", "its own model", "model.safetensors"),  # save_model's, beside the checkpoints
    ):
        assert main(["inspect", str(runs / folder)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"file       {runs / folder / shown}\n"), out
        assert f"shown: {newest} (`ddpstate verify` names the one resume takes)" in out


def test_without_lightning_installed_the_folder_is_still_judged(runs: Path) -> None:
    # A backup machine without lightning: each .ckpt is checked all the same; the resume
    # choice, which only the integration (importing lightning) makes, is said to be unknown.
    code = (
        "import sys\n"
        "sys.modules['lightning'] = None  # as if not installed: importing it fails\n"
        "from ddpstate.cli import main\n"
        f"sys.exit(main(['verify', {str(runs / 'lightning')!r}, '-q']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "  ok  last.ckpt\n" in done.stdout
    assert "not named: ddpstate.integrations.lightning needs lightning" in done.stdout
    assert "resumes from" not in done.stdout
