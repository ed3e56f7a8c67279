"""Atomic, durable writes and the storage helpers, on real local files."""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ddpstate import storage
from ddpstate._storage import local as local_write
from ddpstate.checkpoint import load
from ddpstate.errors import CheckpointNotFoundError, CheckpointWriteError, DDPStateError


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_atomic_write_replaces_target_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.bin"
    target.write_bytes(b"old")
    with storage.atomic_write(target) as f:
        f.write(b"new contents")
        # While writing, the target still holds the old bytes.
        assert target.read_bytes() == b"old"
        temps = [p.name for p in tmp_path.iterdir() if storage.is_temp_name(p.name)]
        assert len(temps) == 1 and temps[0].startswith(".ckpt.bin.ddpstate-tmp-")
    assert target.read_bytes() == b"new contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.bin"]


def test_atomic_write_failure_keeps_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.bin"
    target.write_bytes(b"precious")
    before = _sha(target)

    class Boom(Exception):
        pass

    with pytest.raises(Boom), storage.atomic_write(target) as f:
        f.write(b"x" * 5_000_000)
        raise Boom("serializer died half-way")
    assert _sha(target) == before
    assert os.listdir(tmp_path) == ["ckpt.bin"]


def test_atomic_write_keeps_restrictive_mode(tmp_path: Path) -> None:
    target = tmp_path / "secret.pt"
    target.write_bytes(b"old")
    target.chmod(0o600)
    with storage.atomic_write(target) as f:
        f.write(b"new")
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_atomic_write_into_missing_or_non_folder_raises_write_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"")
    with (
        pytest.raises(CheckpointWriteError, match="a_file"),
        storage.atomic_write(blocker / "ckpt.pt") as f,
    ):
        f.write(b"never")
    with (
        pytest.raises(CheckpointWriteError, match="missing"),
        storage.atomic_write(tmp_path / "missing" / "ckpt.pt") as f,
    ):
        f.write(b"never")


def test_atomic_write_syncs_file_then_renames_then_syncs_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A spy that records and then calls the real functions: the order is the contract.
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append(("fsync", kind))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append(("replace", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    with storage.atomic_write(tmp_path / "x.pt") as f:
        f.write(b"data")
    assert events == [("fsync", "file"), ("replace", "x.pt"), ("fsync", "dir")]


def test_atomic_write_without_fsync_still_renames_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fsync=False (convert --no-fsync) drops both syncs, never the temp file + rename.
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync")
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        assert storage.is_temp_name(os.path.basename(src))
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "x.pt"
    target.write_bytes(b"old")
    with storage.atomic_write(target, fsync=False) as f:
        f.write(b"new")
    assert events == ["replace"]
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["x.pt"]


def test_is_temp_name() -> None:
    assert storage.is_temp_name(".model.pt.ddpstate-tmp-0123456789abcdef")
    assert storage.is_temp_name("/some/dir/.m.safetensors.ddpstate-tmp-ffffffffffffffff")
    assert not storage.is_temp_name("model.pt")
    assert not storage.is_temp_name(".model.pt")
    assert not storage.is_temp_name("model.pt.ddpstate-tmp-0123456789abcdef")  # no dot
    assert not storage.is_temp_name(".model.pt.ddpstate-tmp-xyz")
    assert storage.is_temp_name(".model.pt.ddpstate-old-0123456789abcdef")


def test_helpers_on_local_paths(tmp_path: Path) -> None:
    folder = storage.join(str(tmp_path), "run", "ckpts")
    storage.makedirs(folder)
    storage.makedirs(folder)  # exists already: fine
    assert storage.isdir(folder)
    for name in ("b.pt", "a.pt", ".a.pt.ddpstate-tmp-00000000000000aa"):
        Path(folder, name).write_bytes(b"1")
    assert storage.listdir(folder) == ["a.pt", "b.pt"]
    assert storage.listdir(folder, include_temp=True)[0].startswith(".a.pt.ddpstate-tmp-")
    assert storage.exists(storage.join(folder, "a.pt"))
    storage.remove(storage.join(folder, "a.pt"))
    assert not storage.exists(storage.join(folder, "a.pt"))
    storage.remove(storage.join(folder, "a.pt"), missing_ok=True)
    with pytest.raises(CheckpointNotFoundError):
        storage.remove(storage.join(folder, "a.pt"))
    with pytest.raises(DDPStateError, match="recursive=True"):
        storage.remove(folder)
    storage.remove(str(tmp_path / "run"), recursive=True)
    assert not storage.exists(str(tmp_path / "run"))
    with pytest.raises(CheckpointNotFoundError):
        storage.listdir(str(tmp_path / "run"))
    with pytest.raises(CheckpointNotFoundError):
        storage.open_read(tmp_path / "nope.pt")
    assert storage.join("memory://bucket/run", "x.pt") == "memory://bucket/run/x.pt"


def test_file_url_is_treated_as_local(tmp_path: Path) -> None:
    url = "file://" + str(tmp_path / "u.bin")
    with storage.atomic_write(url) as f:
        f.write(b"via file url")
    with storage.open_read(url) as f:
        assert f.read() == b"via file url"


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, torch
    from ddpstate.checkpoint import save
    # ~320 MB in 80 tensors: long enough to be caught in the middle of writing.
    state = {f"layer{i}.weight": torch.full((1024, 1024), float(i)) for i in range(80)}
    print("ready", flush=True)
    save(state, sys.argv[1])
    print("done", flush=True)
    """
)


@pytest.mark.slow
def test_sigkill_mid_write_leaves_old_bytes_and_no_mistakable_temp(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    torch.save({"old": torch.arange(10)}, target)
    old_hash = _sha(target)
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 60
        killed_at = None
        while time.monotonic() < deadline and killed_at is None:
            for entry in os.scandir(tmp_path):
                if storage.is_temp_name(entry.name) and entry.stat().st_size > 32 << 20:
                    child.send_signal(signal.SIGKILL)
                    killed_at = entry.stat().st_size
                    break
            if child.poll() is not None:
                break
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert killed_at is not None, "the writer finished before it could be killed"
    assert child.returncode == -signal.SIGKILL
    # The target is the old file, whole; the partial data sits only in a hidden temp file.
    assert _sha(target) == old_hash
    leftovers = [n for n in os.listdir(tmp_path) if n != "model.pt"]
    assert leftovers and all(storage.is_temp_name(n) and n.startswith(".") for n in leftovers)
    assert storage.listdir(tmp_path) == ["model.pt"]
    assert torch.equal(load(target)["old"], torch.arange(10))
    # A later save still works and replaces the target with the complete new bytes.
    from ddpstate.checkpoint import save

    save({"new": torch.ones(3)}, target)
    assert list(load(target)) == ["new"]


def test_large_replaced_file_is_freed_after_commit(tmp_path: Path) -> None:
    target = tmp_path / "big.bin"
    old = b"o" * (local_write._RETIRE_MIN_BYTES + 1)
    target.write_bytes(old)
    inode = target.stat().st_ino
    with storage.atomic_write(target) as f:
        f.write(b"new")
    assert target.read_bytes() == b"new"
    # The old copy may still exist under a hidden temp name while it is freed...
    assert storage.listdir(tmp_path) == ["big.bin"]
    storage.wait_for_freed()
    # ...and is gone once the background thread is done.
    assert os.listdir(tmp_path) == ["big.bin"]
    assert target.stat().st_ino != inode


def test_failed_write_over_large_file_leaves_it_alone(tmp_path: Path) -> None:
    target = tmp_path / "big.bin"
    target.write_bytes(b"o" * (local_write._RETIRE_MIN_BYTES + 1))
    before = _sha(target)
    with pytest.raises(ValueError), storage.atomic_write(target) as f:
        f.write(b"partial")
        raise ValueError("stop")
    storage.wait_for_freed()
    assert _sha(target) == before and os.listdir(tmp_path) == ["big.bin"]
    assert target.stat().st_nlink == 1


def test_a_temp_file_taken_for_stale_before_its_lock_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process's save may take a just-created temp file for a dead writer's and
    # delete it in the instant before the writer locks it; the writer starts again.
    real_flock = local_write.flock
    calls: list[str] = []

    def flock_after_a_rival_deleted_it(fd: int, *, wait: bool) -> bool:
        if wait and not calls:
            victim = next(p for p in tmp_path.iterdir() if storage.is_temp_name(p.name))
            calls.append(victim.name)
            victim.unlink()
        return real_flock(fd, wait=wait)

    monkeypatch.setattr(local_write, "flock", flock_after_a_rival_deleted_it)
    with storage.atomic_write(tmp_path / "x.pt") as f:
        f.write(b"saved")
    assert calls and (tmp_path / "x.pt").read_bytes() == b"saved"
    assert os.listdir(tmp_path) == ["x.pt"]


def test_staged_folder_replaces_the_target_whole_manifest_last(tmp_path: Path) -> None:
    target = tmp_path / "step_1"
    target.mkdir()
    (target / "old.pt").write_bytes(b"old")
    with storage.staged_folder(target) as staged:
        assert Path(staged.path).parent == tmp_path and storage.is_temp_name(staged.path)
        (Path(staged.path) / "model.pt").write_bytes(b"new")
        assert sorted(p.name for p in target.iterdir()) == ["old.pt"]  # untouched meanwhile
        staged.commit(b"{}")
    assert sorted(p.name for p in target.iterdir()) == ["manifest.json", "model.pt"]
    assert (target / "manifest.json").read_bytes() == b"{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_a_commit_deletes_killed_saves_staging_of_any_target_in_its_folder(tmp_path: Path) -> None:
    """Issue 43: an unlocked staging folder (its save killed) of another target stayed forever;
    so did a retired folder whose target a later save had committed again."""
    killed = tmp_path / ".checkpoint_3.ddpstate-tmp-0123456789abcdef"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"half")
    only_copy = tmp_path / ".gone.ddpstate-old-0123456789abcdef"  # "gone" itself is missing
    only_copy.mkdir()
    live = storage.stage_folder(tmp_path / "checkpoint_5")  # a save still running: locked
    with storage.staged_folder(tmp_path / "checkpoint_4") as staged:
        (Path(staged.path) / "model.pt").write_bytes(b"new")
    assert not killed.exists()
    assert Path(live.path).is_dir() and only_copy.is_dir()
    outdated = tmp_path / ".checkpoint_4.ddpstate-old-fedcba9876543210"
    outdated.mkdir()  # a copy retired by a killed re-save of checkpoint_4, since replaced
    with storage.staged_folder(tmp_path / "checkpoint_6") as staged:
        (Path(staged.path) / "model.pt").write_bytes(b"newer")
    assert not outdated.exists() and only_copy.is_dir() and Path(live.path).is_dir()
    live.discard()


def test_staged_folder_failure_leaves_the_old_target_and_no_staging(tmp_path: Path) -> None:
    target = tmp_path / "shards"
    target.mkdir()
    (target / "keep.bin").write_bytes(b"keep")
    with pytest.raises(OSError, match="disk full"), storage.staged_folder(target) as staged:
        (Path(staged.path) / "half.bin").write_bytes(b"half")
        raise OSError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]
    assert (target / "keep.bin").read_bytes() == b"keep"


def test_staged_folder_without_commit_swaps_in_a_folder_with_no_manifest(tmp_path: Path) -> None:
    target = tmp_path / "new" / "dcp_out"
    with storage.staged_folder(target, fsync=False) as staged:
        (Path(staged.path) / ".metadata").write_bytes(b"m")
    assert sorted(p.name for p in target.iterdir()) == [".metadata"]


def test_staged_folder_on_fsspec_keeps_the_old_copy_committed_until_one_pointer_put() -> None:
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    url = "memory://ddpstate-staged/step_1"
    old_manifest = b'{"files": {"old.pt": {}}}'
    fs.pipe(
        {
            "/ddpstate-staged/step_1/old.pt": b"old",
            "/ddpstate-staged/step_1/manifest.json": old_manifest,
        }
    )
    try:
        with storage.staged_folder(url) as staged:
            version = staged.path.rsplit("/", 1)[-1]
            assert staged.path == f"{url}/{version}" and version.startswith("v-")
            with storage.atomic_write(storage.join(staged.path, "model.pt")) as f:
                f.write(b"new")
            # The old checkpoint is committed and whole until the commit itself.
            assert fs.cat("/ddpstate-staged/step_1/manifest.json") == old_manifest
            assert fs.cat("/ddpstate-staged/step_1/old.pt") == b"old"
            staged.commit(b'{"v": 1}')
        assert storage.committed_folder(url) == staged.path
        assert fs.cat(f"/ddpstate-staged/step_1/{version}/manifest.json") == b'{"v": 1}'
        # The replaced checkpoint's files go only after the commit.
        assert storage.listdir(url) == ["manifest.json", version]
        with pytest.raises(ValueError), storage.staged_folder(url) as failed:
            assert failed.path != staged.path
            raise ValueError("the write failed")
        assert storage.listdir(url) == ["manifest.json", version]  # discarded; the commit stands
        assert storage.committed_folder(url) == staged.path
    finally:
        if fs.exists("/ddpstate-staged"):
            fs.rm("/ddpstate-staged", recursive=True)


def test_readers_of_one_memory_file_keep_their_own_positions() -> None:
    # fsspec's memory filesystem returns one shared file object per path; check_files reads
    # pieces of a file in threads, which raced there (a piece read another's bytes).
    import uuid

    import fsspec

    url = f"memory://readers-{uuid.uuid4().hex}/model.pt"
    fsspec.filesystem("memory").pipe(url, bytes(range(200)))
    first = storage.open_read(url)
    second = storage.open_read(url)
    first.seek(150)
    assert second.read(10) == bytes(range(10))
    assert first.read() == bytes(range(150, 200))


_SAVE_IN_A_LOOP = textwrap.dedent(
    """
    import os, sys
    from ddpstate import storage
    target, times = sys.argv[1], int(sys.argv[2])
    for _ in range(times):
        with storage.atomic_write(target, fsync=False) as f:
            f.write(b"x" * 100)
    """
)


@pytest.mark.slow
def test_two_processes_saving_other_files_in_one_folder_never_delete_each_others_temp(
    tmp_path: Path,
) -> None:
    """A save's clean-up took another live save's temp file for a killed one's: the writer
    closed it (dropping its lock) before the rename, and its rename then failed."""
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _SAVE_IN_A_LOOP, str(tmp_path / name), "3000"],
            stderr=subprocess.PIPE,
        )
        for name in ("a.bin", "b.bin")
    ]
    errors = [w.communicate(timeout=120)[1].decode() for w in writers]
    assert [w.returncode for w in writers] == [0, 0], errors
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "b.bin"]
