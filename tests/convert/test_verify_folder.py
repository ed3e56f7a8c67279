"""Verifying CheckpointManager folders: every flipped byte, truncation, a missing manifest, CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpstate import storage
from ddpstate.cli import main
from ddpstate.errors import CheckpointFormatError, CheckpointNotFoundError
from ddpstate.manager import (
    LATEST_NAME,
    MANIFEST_NAME,
    CheckpointManager,
    verify_checkpoint,
)

EXE = shutil.which("ddpstate")
STEPS = (1, 2, 3)


def run(*args: Any) -> subprocess.CompletedProcess[str]:
    """Run the installed console script (each call imports torch: keep calls few)."""
    assert EXE is not None, "the ddpstate console script is not installed (pip install -e .)"
    env = {k: v for k, v in os.environ.items() if k != "DDPSTATE_DEBUG"}
    return subprocess.run(
        [EXE, *map(str, args)], capture_output=True, text=True, timeout=120, env=env
    )


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    opt.step()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A manager directory with three committed steps of a tiny model and its optimizer."""
    root = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with CheckpointManager(root, keep_last=None) as manager:
        for step in STEPS:
            _train_step(model, opt)
            manager.save(step, {"model": model, "optimizer": opt, "epoch": step})
    return root


@pytest.fixture()
def run_dir(saved: Path, tmp_path: Path) -> Path:
    """A fresh copy of the saved directory, free to damage."""
    return Path(shutil.copytree(saved, tmp_path / "run"))


def _step(root: Path, step: int) -> Path:
    return root / f"step_{step:010d}"


def test_intact_step_and_directory_verify(run_dir: Path) -> None:
    for step in STEPS:
        result = verify_checkpoint(_step(run_dir, step))
        assert result.ok and result.problems == () and result.steps == (step,)
        assert result.files == 4  # model, optimizer, epoch, RNG states
    whole = verify_checkpoint(run_dir)
    assert whole.ok and whole.steps == STEPS and whole.files == 12


# Every offset of the small files; every 7th of the RNG file (14 KB: mostly Mersenne
# Twister state, so one byte in 7 covers its header, records and directory alike).
@pytest.mark.slow
@pytest.mark.parametrize(("name", "stride"), [("model.pt", 1), ("optimizer.pt", 1), ("_rng.pt", 7)])
def test_every_flipped_byte_of_a_saved_file_is_caught(
    run_dir: Path, name: str, stride: int
) -> None:
    folder = _step(run_dir, 2)
    path = folder / name
    original = path.read_bytes()
    missed = []
    for offset in range(0, len(original), stride):
        damaged = bytearray(original)
        damaged[offset] ^= 0xFF
        path.write_bytes(bytes(damaged))
        result = verify_checkpoint(folder)
        if not any(p.startswith(f"{name} fails its checksum") for p in result.problems):
            missed.append(offset)
    path.write_bytes(original)
    assert missed == [], f"flips at offsets {missed[:10]} of {name} went unnoticed"
    assert verify_checkpoint(folder).ok


def test_every_flipped_byte_of_the_manifest_is_caught(run_dir: Path) -> None:
    folder = _step(run_dir, 2)
    path = folder / MANIFEST_NAME
    original = path.read_bytes()
    missed = []
    for offset in range(len(original)):
        for mask in (0x01, 0x20, 0xFF):  # low bit, case/space-to-letter, every bit
            damaged = bytearray(original)
            damaged[offset] ^= mask
            path.write_bytes(bytes(damaged))
            problems = verify_checkpoint(folder).problems
            if not problems or MANIFEST_NAME not in problems[0]:
                missed.append((offset, mask))
    path.write_bytes(original)
    assert missed == [], f"manifest flips {missed[:10]} went unnoticed"


def test_every_flipped_byte_of_the_latest_pointer_is_caught(run_dir: Path) -> None:
    path = run_dir / LATEST_NAME
    original = path.read_bytes()
    assert original == b"step_0000000003\n"
    for offset in range(len(original)):
        for mask in (0x01, 0xFF):
            damaged = bytearray(original)
            damaged[offset] ^= mask
            path.write_bytes(bytes(damaged))
            found = verify_checkpoint(run_dir)
            if bytes(damaged) == b"step_0000000002\n":
                # An older committed step: what a kill before the pointer update leaves, a
                # note (restore() does not read the pointer).
                assert found.ok and any(n.startswith(f"{LATEST_NAME} names") for n in found.notes)
                continue
            problems = found.problems
            assert len(problems) == 1 and problems[0].startswith(LATEST_NAME), (offset, mask)


def test_all_problems_are_reported_not_just_the_first(run_dir: Path) -> None:
    folder = _step(run_dir, 3)
    model = folder / "model.pt"
    model.write_bytes(model.read_bytes()[:-10])
    (folder / "optimizer.pt").unlink()
    rng = folder / "_rng.pt"
    data = bytearray(rng.read_bytes())
    data[100] ^= 0x04
    rng.write_bytes(bytes(data))
    problems = verify_checkpoint(folder).problems
    assert len(problems) == 3
    assert problems[0].startswith("_rng.pt fails its checksum")
    assert problems[1].startswith("model.pt is truncated: ")
    assert problems[2] == "optimizer.pt is missing"
    whole = verify_checkpoint(run_dir)
    assert [p.split(": ", 1)[0] for p in whole.problems] == ["step_0000000003"] * 3


def test_missing_manifest_fails_the_step_but_only_notes_it_in_the_directory(
    run_dir: Path,
) -> None:
    folder = _step(run_dir, 3)
    (folder / MANIFEST_NAME).unlink()
    direct = verify_checkpoint(folder)
    assert not direct.ok and direct.steps == ()
    assert direct.problems == (
        f"it has no {MANIFEST_NAME}, so it is not committed (an interrupted save: killed, "
        f"crashed or still running)",
    )
    # latest still names the uncommitted step 3, which is the real failure here.
    whole = verify_checkpoint(run_dir)
    assert whole.steps == (1, 2)
    assert whole.problems == (f"{LATEST_NAME} names step_0000000003, which is not committed",)
    assert any(n.startswith("step_0000000003: not committed") for n in whole.notes)
    (run_dir / LATEST_NAME).write_bytes(b"step_0000000002\n")
    assert verify_checkpoint(run_dir).ok


def test_stray_temp_files_are_noted_not_failures(run_dir: Path) -> None:
    folder = _step(run_dir, 2)
    inner = ".model.pt.ddpstate-tmp-0123456789abcdef"
    outer = ".latest.ddpstate-tmp-fedcba9876543210"
    assert storage.is_temp_name(inner) and storage.is_temp_name(outer)
    (folder / inner).write_bytes(b"partial write")
    (run_dir / outer).write_bytes(b"step_")
    step_result = verify_checkpoint(folder)
    assert step_result.ok and any(n.startswith(inner) for n in step_result.notes)
    whole = verify_checkpoint(run_dir)
    assert whole.ok and any(n.startswith(outer) for n in whole.notes)


def test_unlisted_checkpoint_files_fail_other_files_are_noted(run_dir: Path) -> None:
    folder = _step(run_dir, 1)
    (folder / "README.txt").write_text("notes about this run")
    result = verify_checkpoint(folder)
    assert result.ok and any(n.startswith("README.txt") for n in result.notes)
    shutil.copy(folder / "model.pt", folder / "model.safetensors")
    result = verify_checkpoint(folder)
    assert result.problems == (
        f"model.safetensors is not listed in {MANIFEST_NAME}: a checkpoint file this save did "
        f"not write (copied in, or left from another save); move it out of the folder",
    )


def test_stale_latest_pointer_is_a_note_and_verify_names_the_step_restore_takes(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What a kill between step 3's commit and the pointer update leaves: step 3 committed
    # and whole, `latest` still naming step 2. `verify && cp` must not fail for it.
    (run_dir / LATEST_NAME).write_bytes(b"step_0000000002\n")
    found = verify_checkpoint(run_dir)
    assert found.ok and any(
        "step_0000000003 is the newest committed step" in n for n in found.notes
    )
    assert main(["verify", str(run_dir), "-q"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ok: {run_dir} (CheckpointManager folder")
    assert "note: restore() takes step_0000000003 (the newest step that verifies)" in out
    assert "  ok  step_0000000003  <- resume" in out
    state: dict[str, Any] = {"model": torch.nn.Linear(3, 2), "epoch": 0}
    with CheckpointManager(run_dir) as manager:
        assert manager.restore(state, strict=False) == 3

    # A damaged committed step is a failure; verify names the older step restore falls back to.
    model = _step(run_dir, 3) / "model.pt"
    model.write_bytes(model.read_bytes()[:-8])
    assert main(["verify", str(run_dir), "-q", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["resume_from"] == "step_0000000002"
    assert report["checkpoints"] == {
        "step_0000000001": True, "step_0000000002": True, "step_0000000003": False
    }  # fmt: skip
    assert report["problems"][0].startswith("step_0000000003: model.pt is truncated")
    with CheckpointManager(run_dir) as manager, pytest.warns(UserWarning, match="skipping"):
        assert manager.restore(state, strict=False) == 2


# Saves steps 1-3 and is SIGKILLed as step 3's `latest` update starts (step 3 committed).
_KILLED_BEFORE_LATEST = """
import os, signal, sys, torch, ddpstate
from ddpstate import storage
real = storage.atomic_write
def atomic_write(path, *args, **kwargs):
    if os.path.basename(path) == "latest" and os.path.isdir(
        os.path.join(os.path.dirname(path), "step_0000000003")
    ):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, *args, **kwargs)
storage.atomic_write = atomic_write
manager = ddpstate.CheckpointManager(sys.argv[1])
for step in (1, 2, 3):
    manager.save(step, {"model": torch.nn.Linear(3, 2), "epoch": step})
"""


@pytest.mark.slow
def test_a_kill_between_commit_and_latest_update_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_BEFORE_LATEST, str(folder)], capture_output=True,
        timeout=120,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    assert (folder / LATEST_NAME).read_bytes() == b"step_0000000002\n"
    assert (_step(folder, 3) / MANIFEST_NAME).exists()
    assert main(["verify", str(folder), "-q"]) == 0  # `verify && cp` goes on
    out = capsys.readouterr().out
    assert "note: restore() takes step_0000000003 (the newest step that verifies)" in out
    assert f"note: {LATEST_NAME} names step_0000000002, but step_0000000003 is the newest" in out


def test_inspect_of_a_manager_directory_shows_its_newest_committed_step(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(run_dir)]) == 0
    out = capsys.readouterr().out
    newest = _step(run_dir, 3)
    assert out.startswith(f"file       {newest / 'model.pt'}\n")
    assert (
        f"note: {run_dir}: CheckpointManager directory, committed steps 1, 2, 3; shown: its "
        f"newest committed step step_0000000003" in out
    )
    assert "ddpstate manifest: present (`ddpstate verify` checks it); step 3" in out
    assert "ddpstate manifest: none" not in out
    assert "note: file model.pt: entry 'model' (module)" in out


def test_restore_uses_the_same_check(run_dir: Path) -> None:
    # A whitespace change keeps the manifest valid JSON with the same values; both
    # verify and restore still refuse it, and restore falls back to step 2.
    path = _step(run_dir, 3) / MANIFEST_NAME
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n", 1))
    assert json.loads(path.read_bytes())["step"] == 3
    assert not verify_checkpoint(_step(run_dir, 3)).ok
    state: dict[str, Any] = {"model": torch.nn.Linear(3, 2), "epoch": 0}
    damaged = f"step_0000000003: its {MANIFEST_NAME} is damaged"
    with CheckpointManager(run_dir) as manager, pytest.warns(UserWarning, match=damaged):
        assert manager.restore(state, strict=False) == 2
    assert state["epoch"] == 2


def test_not_a_manager_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match="not a CheckpointManager folder"):
        verify_checkpoint(tmp_path)
    with pytest.raises(CheckpointNotFoundError):
        verify_checkpoint(tmp_path / "nothing")
    (tmp_path / "x.pt").write_bytes(b"x")
    with pytest.raises(CheckpointFormatError, match="is a file"):
        verify_checkpoint(tmp_path / "x.pt")


def test_cli_verify_on_manager_folders(run_dir: Path, tmp_path: Path) -> None:
    good_step = run("verify", _step(run_dir, 1))
    assert good_step.returncode == 0, good_step
    assert good_step.stdout.startswith(f"ok: {_step(run_dir, 1)} (CheckpointManager folder")
    good_dir = run("verify", run_dir, "--json")
    assert good_dir.returncode == 0, good_dir
    report = json.loads(good_dir.stdout)
    assert report["ok"] is True and report["format"] == "manager" and report["problems"] == []

    # Damage: one flipped byte at a sampled offset, a truncation, a missing manifest.
    model = _step(run_dir, 2) / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 3] ^= 0x10
    model.write_bytes(bytes(data))
    optimizer = _step(run_dir, 1) / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:50])
    (_step(run_dir, 3) / MANIFEST_NAME).unlink()
    bad = run("verify", run_dir)
    assert bad.returncode == 1, bad
    lines = bad.stdout.splitlines()
    assert lines[0] == f"BAD: {run_dir} (CheckpointManager folder): 3 problem(s)"
    assert lines[1].startswith("  - step_0000000001: optimizer.pt is truncated: 50 bytes")
    assert lines[2].startswith("  - step_0000000002: model.pt fails its checksum")
    assert lines[3] == f"  - {LATEST_NAME} names step_0000000003, which is not committed"
    assert "note: step_0000000003: not committed (an interrupted save" in bad.stdout
    bad_step = run("verify", _step(run_dir, 3), "--json")
    assert bad_step.returncode == 1
    assert "not committed (an interrupted save" in json.loads(bad_step.stdout)["problems"][0]

    (tmp_path / "empty").mkdir()
    not_manager = run("verify", tmp_path / "empty")
    assert not_manager.returncode == 2, not_manager
    assert not_manager.stderr.startswith("ddpstate: error: ")
    assert "not a CheckpointManager folder" in not_manager.stderr


def test_verify_checkpoint_on_a_manager_folder_does_not_import_torch(saved: Path) -> None:
    # The manifest checks live in the torch-free ddpstate._manifest: ddpstate.verify_checkpoint
    # must not pay torch's import (nor need torch).
    code = (
        "import sys\n"
        "import ddpstate\n"
        f"assert ddpstate.verify_checkpoint({str(saved)!r}).ok\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(loaded[:3])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_a_retired_copy_of_a_step_is_named_as_the_committed_step_not_a_temp_to_delete(
    run_dir: Path,
) -> None:
    """Where the two names cannot be swapped in one step, a re-save of step 3 killed between
    replace_folder's renames leaves step 3 only as .step_3.ddpstate-old-<hex>. verify called it
    "a temporary file ... (the next save deletes it)": the next save puts it back as step 3, and
    deleting it by hand, as the note invites, loses step 3."""
    retired = run_dir / f".{_step(run_dir, 3).name}.ddpstate-old-0123456789abcdef"
    _step(run_dir, 3).rename(retired)
    notes = " | ".join(verify_checkpoint(run_dir).notes)
    assert f"{retired.name} is the committed {_step(run_dir, 3).name}" in notes
    assert "do not delete it" in notes and "the next save deletes it" not in notes
    # As the note says: the next save puts it back, committed, bitwise as it was.
    CheckpointManager(run_dir).save(4, {"w": torch.zeros(2)})
    assert not retired.exists() and verify_checkpoint(_step(run_dir, 3)).ok


def test_restore_after_a_re_save_killed_between_its_renames_takes_the_retired_step(
    run_dir: Path,
) -> None:
    """Where the two names cannot be swapped in one step, a re-save of step 3 killed between
    replace_folder's renames leaves the committed step 3 only as .step_3.ddpstate-old-<hex>.
    restore() resumed from step 2 although latest named step 3; it reads the retired copy in
    place (a reader renames and deletes nothing), as ddpstate verify's choice says."""
    retired = run_dir / f".{_step(run_dir, 3).name}.ddpstate-old-0123456789abcdef"
    _step(run_dir, 3).rename(retired)
    before = sorted(p.name for p in run_dir.iterdir())
    for step in (None, 3):
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state: dict[str, Any] = {"model": model, "optimizer": opt, "epoch": 0}
        manager = CheckpointManager(run_dir)
        with pytest.warns(UserWarning, match=f"reading step 3 from {retired}"):
            assert manager.restore(state, step=step) == 3 and state["epoch"] == 3
        assert manager.restored_from is not None and manager.restored_from.path == str(retired)
        saved = torch.load(retired / "model.pt", weights_only=True)
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing renamed or deleted

    # verify checks the retired copy as step 3 and names it what restore() takes.
    whole = verify_checkpoint(run_dir)
    assert whole.ok and whole.steps == STEPS, whole.problems
    shown = run("verify", run_dir)
    assert shown.returncode == 0, shown
    assert "restore() takes step_0000000003" in shown.stdout
    (retired / "model.pt").write_bytes(b"damaged")
    damaged = verify_checkpoint(run_dir)
    assert damaged.problems[0].startswith(f"step_0000000003: {retired.name}: model.pt")
