"""What the integrations share: sealing a folder another program wrote, the newest that verifies."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from ddpstate._manifest import MANIFEST_NAME, verify_checkpoint
from ddpstate.cli import main
from ddpstate.errors import CheckpointFormatError, CheckpointNotFoundError
from ddpstate.integrations._common import newest_verified, seal_folder


def _folder(path: Path, step: int) -> Path:
    path.mkdir(parents=True)
    torch.save({"w": torch.full((64,), float(step))}, path / "model.pt")
    (path / "state.json").write_text(f'{{"step": {step}}}')
    return path


def test_a_sealed_folder_verifies_and_lists_every_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(tmp_path / "checkpoint-1", 1)
    files = seal_folder(folder, format="test", world_size=2)
    assert sorted(files) == ["model.pt", "state.json"]
    assert files["state.json"]["size"] == len('{"step": 1}')
    assert verify_checkpoint(folder).ok
    assert main(["verify", str(folder)]) == 0
    assert "ok:" in capsys.readouterr().out
    # Sealing again (the same step saved again) replaces the manifest.
    (folder / "state.json").write_text('{"step": 10}')
    assert not verify_checkpoint(folder).ok
    seal_folder(folder, format="test")
    assert verify_checkpoint(folder).ok


def test_sealing_refuses_a_sub_folder_and_a_missing_folder(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "checkpoint-1", 1)
    (folder / "global_step1").mkdir()
    with pytest.raises(CheckpointFormatError, match="global_step1 is a folder"):
        seal_folder(folder, format="test")
    assert not (folder / MANIFEST_NAME).exists()
    with pytest.raises(CheckpointNotFoundError):
        seal_folder(tmp_path / "absent", format="test")


@pytest.mark.parametrize("damage", ["truncated", "removed", "no manifest"])
def test_newest_verified_skips_an_incomplete_folder_naming_it(tmp_path: Path, damage: str) -> None:
    old, new = (_folder(tmp_path / f"checkpoint-{s}", s) for s in (1, 2))
    for folder in (old, new):
        seal_folder(folder, format="test")
    if damage == "truncated":
        os.truncate(new / "model.pt", 100)
    elif damage == "removed":
        (new / "state.json").unlink()
    else:
        (new / MANIFEST_NAME).unlink()
    reason = {"truncated": "model.pt", "removed": "state.json", "no manifest": "never committed"}
    with pytest.warns(UserWarning, match=rf"checkpoint-2: .*{reason[damage]}") as caught:
        found = newest_verified([str(new), str(old)], what="test checkpoint")
    assert found == str(old)
    assert len(caught) == 1


def test_newest_verified_checks_files_and_returns_none_when_nothing_verifies(
    tmp_path: Path,
) -> None:
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    torch.save({"w": torch.ones(64)}, good)
    bad.write_bytes(good.read_bytes()[:-30])
    assert newest_verified([str(good), str(bad)], what="file") == str(good)
    with pytest.warns(UserWarning, match="bad.pt"):
        assert newest_verified([str(bad)], what="file") is None
    with pytest.warns(UserWarning, match="missing.pt"):
        assert newest_verified([str(tmp_path / "missing.pt")], what="file") is None
    assert newest_verified([], what="file") is None


def test_a_missing_framework_gives_both_install_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpstate.integrations import accelerate

    monkeypatch.setitem(sys.modules, "accelerate", None)  # as when it is not installed
    with pytest.raises(ImportError) as caught:
        accelerate.save_state(None)
    message = str(caught.value)
    assert "ddpstate.integrations.accelerate needs accelerate" in message
    assert 'from a checkout of ddpstate: pip install -e ".[accelerate]"' in message
    assert 'once ddpstate is on PyPI: pip install "ddpstate[accelerate]"' in message


def test_a_file_named_like_a_checkpoint_folder_is_not_resumed_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file (or fifo) named checkpoint-9 in a Trainer output_dir was the checkpoint ddpstate
    resumed from (a torch.save file verifies), though the Trainer needs a folder and its own
    get_last_checkpoint skips anything else; the same for Accelerate's checkpoint_9."""
    pytest.importorskip("transformers")
    from ddpstate.integrations.transformers import last_verified_checkpoint

    out = tmp_path / "output_dir"
    seal_folder(_folder(out / "checkpoint-1", 1), format="test")
    torch.save({"w": torch.ones(2)}, out / "checkpoint-9")
    os.mkfifo(out / "checkpoint-8")
    assert last_verified_checkpoint(out) == str(out / "checkpoint-1")
    assert main(["verify", str(out), "--json", "-q"]) == 0
    assert '"resume_from": "checkpoint-1"' in capsys.readouterr().out
    checkpoints = tmp_path / "project" / "checkpoints"
    seal_folder(_folder(checkpoints / "checkpoint_1", 1), format="test")
    torch.save({"w": torch.ones(2)}, checkpoints / "checkpoint_9")
    assert main(["verify", str(checkpoints.parent), "--json", "-q"]) == 0
    assert '"checkpoints": {\n    "checkpoint_1": true\n  }' in capsys.readouterr().out


def test_rotation_removing_a_linked_checkpoint_keeps_the_folder_it_names_committed(
    tmp_path: Path,
) -> None:
    """remove_checkpoint on a link checkpoint-0 -> checkpoint-1 deleted checkpoint-1's manifest
    through the link (then failed on rmtree of a link): the Trainer's rotation, which keeps
    checkpoint-1, left it uncommitted, never resumed from."""
    pytest.importorskip("transformers")
    from ddpstate.integrations.transformers import _rotate

    out = tmp_path / "output_dir"
    for step in (1, 2):
        seal_folder(_folder(out / f"checkpoint-{step}", step), format="test")
    (out / "checkpoint-0").symlink_to(out / "checkpoint-1", target_is_directory=True)
    _rotate(str(out / "checkpoint-2"), 2, None)
    assert sorted(os.listdir(out)) == ["checkpoint-1", "checkpoint-2"]
    assert verify_checkpoint(out / "checkpoint-1").ok and verify_checkpoint(out / "checkpoint-2").ok
