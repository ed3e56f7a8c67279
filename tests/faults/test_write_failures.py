"""Saves that fail part-way: every rank raises the same error, nothing old is lost or left over."""

from __future__ import annotations

import errno
import os
import random
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ddpstate
from ddpstate.errors import CheckpointWriteError
from ddpstate.manager import CheckpointManager
from tests.faults import _harness as h
from tests.multiproc import run_ranks


def test_random_write_failures_keep_the_previous_file(tmp_path: Path) -> None:
    """30 saves failing with ENOSPC/EIO at a random byte (through the faulty:// fsspec
    filesystem), on close, on rename, or with a real EFBIG under RLIMIT_FSIZE: each raises
    CheckpointWriteError naming the file; the old file is byte-identical; no temp is left."""
    rng = random.Random("ci-write-failures")
    faults = set()
    for _ in range(30):
        trial = h.write_failure_trial(rng, tmp_path / "trial")
        assert not trial.defects, (trial.fmt, trial.damage, trial.offset, trial.defects)
        faults.add(trial.damage)
    assert faults == set(h.WRITE_FAULTS)


def _failing_saves_on_every_rank(rank: int, world: int, folder: str) -> list[tuple[str, str]]:
    seen = []
    for fault in ("ENOSPC", "EIO", "close", "mv"):
        opts: dict[str, Any] = {"fail_after": 1000, "error": "ENOSPC", "fail_on": "write"}
        if fault in ("ENOSPC", "EIO"):
            opts["error"] = fault
        else:
            opts["fail_on"] = fault
        url = h.faulty_url(Path(folder, "model.pt"))
        try:
            ddpstate.save(h.sample_state(2, 4), url, storage_options=opts, timeout=60)
            seen.append(("returned", ""))
        except Exception as exc:
            seen.append((type(exc).__name__, str(exc)))
    return seen


@pytest.mark.slow
def test_a_failed_write_raises_the_same_error_on_every_rank(tmp_path: Path) -> None:
    """Two real gloo ranks; rank 0's write fails four ways: both ranks raise the same
    CheckpointWriteError (class and message, naming the file and the writer rank 0)."""
    ddpstate.save(h.sample_state(1), tmp_path / "model.pt")
    old = h.sha256(tmp_path / "model.pt")
    rank0, rank1 = run_ranks(_failing_saves_on_every_rank, 2, args=(str(tmp_path),))
    assert rank0 == rank1
    assert [name for name, _ in rank0] == ["CheckpointWriteError"] * 4
    for _, message in rank0:
        assert "model.pt" in message and "rank 0" in message, message
    assert h.sha256(tmp_path / "model.pt") == old
    assert os.listdir(tmp_path) == ["model.pt"]


def test_a_failing_file_fsync_keeps_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """os.fsync of the new file fails with EIO (patched, real files otherwise): the save
    raises CheckpointWriteError, the old file is byte-identical, no temp file is left."""
    target = tmp_path / "model.pt"
    ddpstate.save(h.sample_state(1), target)
    old = h.sha256(target)
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(CheckpointWriteError, match=r"model\.pt"):
        ddpstate.save(h.sample_state(2), target)
    assert h.sha256(target) == old
    assert os.listdir(tmp_path) == ["model.pt"]


@pytest.fixture
def immutable_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder even root cannot create files in (chattr +i), holding a checkpoint."""
    folder = tmp_path / "frozen"
    folder.mkdir()
    ddpstate.save(h.sample_state(1), folder / "model.pt")
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed, and root ignores chmod: no read-only folder")
    done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"this filesystem refuses chattr +i ({done.stderr.decode().strip()})")
    try:
        yield folder
    finally:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)


def test_a_read_only_folder(immutable_folder: Path) -> None:
    """Saving into an immutable folder raises CheckpointWriteError naming the folder; the
    old checkpoint is untouched; a manager in it fails the same way."""
    target = immutable_folder / "model.pt"
    old = h.sha256(target)
    with pytest.raises(CheckpointWriteError, match="frozen"):
        ddpstate.save(h.sample_state(2), target)
    assert h.sha256(target) == old
    with pytest.raises(CheckpointWriteError):
        CheckpointManager(immutable_folder).save(1, {"w": h.sample_state(2)})
    assert os.listdir(immutable_folder) == ["model.pt"]


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs mounted for this test (needs CAP_SYS_ADMIN)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_full_tmpfs(tiny_tmpfs: Path) -> None:
    """A real ENOSPC from a full 1 MiB tmpfs, at several fill levels: save and
    CheckpointManager.save raise CheckpointWriteError, the previous checkpoint is
    byte-identical and restorable, and the space of the partial write is given back."""
    target = tiny_tmpfs / "model.pt"
    ddpstate.save(h.sample_state(1), target)
    old = h.sha256(target)
    with CheckpointManager(tiny_tmpfs / "run") as manager:
        manager.save(1, {"weights": h.sample_state(1)})
    filler = tiny_tmpfs / "filler"
    rng = random.Random("ci-tmpfs")
    for _ in range(4):
        free = shutil.disk_usage(tiny_tmpfs).free
        filler.write_bytes(b"\0" * rng.randrange(0, max(1, free - 64 * 1024)))
        free_before = shutil.disk_usage(tiny_tmpfs).free
        with pytest.raises(CheckpointWriteError, match=r"model\.pt"):
            ddpstate.save(h.sample_state(2, 64), target)  # ~1.3 MB: never fits
        assert h.sha256(target) == old
        assert shutil.disk_usage(tiny_tmpfs).free == free_before
        with pytest.raises(CheckpointWriteError), CheckpointManager(tiny_tmpfs / "run") as m:
            m.save(2, {"weights": h.sample_state(2, 64)})
        state: dict[str, Any] = {"weights": None}
        assert CheckpointManager(tiny_tmpfs / "run").restore(state) == 1
        assert h.same(state["weights"], h.sample_state(1))
        assert sorted(os.listdir(tiny_tmpfs)) == ["filler", "model.pt", "run"]
        assert os.listdir(tiny_tmpfs / "run") == ["latest", "step_0000000001"]
