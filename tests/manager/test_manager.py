"""CheckpointManager in one process: layout, rotation, verified fallback, async saves, signals."""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ddpstate import formats
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    DDPStateError,
    InvalidArgumentError,
    KeyMismatchError,
)
from ddpstate.formats import detect_format
from ddpstate.manager import LATEST_NAME, MANIFEST_NAME, CheckpointManager, KeepBest
from ddpstate.sampler import ResumableDistributedSampler
from ddpstate.storage import is_temp_name

# --------------------------------------------------------------------------- helpers


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _train_state(seed: int) -> dict[str, Any]:
    model = _net(seed)
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    return {
        "model": model,
        "optimizer": adam,
        "scheduler": torch.optim.lr_scheduler.StepLR(adam, step_size=2, gamma=0.5),
        "scaler": torch.amp.GradScaler("cpu", growth_interval=1),
        "sampler": ResumableDistributedSampler(range(32), 1, 0, seed=7),
        "epoch": 0,
    }


def _train(state: dict[str, Any], steps: int) -> None:
    model, opt, scaler = state["model"], state["optimizer"], state["scaler"]
    it = iter(state["sampler"])
    for _ in range(steps):
        idx = torch.tensor([next(it) for _ in range(4)], dtype=torch.float32)
        x = torch.randn(4, 6) + idx[:, None]
        loss = model(x).square().mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        state["scheduler"].step()
    state["epoch"] = 1


def _flat(obj: Any) -> list[Any]:
    """Every leaf of a (nested) state dict, in order, for bitwise comparison."""
    if isinstance(obj, dict):
        return [(k, v) for key in obj for k, v in _flat_item(key, obj[key])]
    return [("", obj)]


def _flat_item(key: Any, value: Any) -> list[tuple[Any, Any]]:
    if isinstance(value, dict):
        return [((key, k), v) for k, v in _flat(value)]
    if isinstance(value, (list, tuple)):
        return [((key, i), v) for i, item in enumerate(value) for _, v in _flat(item)]
    return [(key, value)]


def _assert_bitwise(a: Any, b: Any) -> None:
    fa, fb = _flat(a), _flat(b)
    assert [k for k, _ in fa] == [k for k, _ in fb]
    for (key, x), (_, y) in zip(fa, fb, strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, key
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), (
                key
            )
        else:
            assert x == y, key


def _states(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}


@contextlib.contextmanager
def _file_size_limit(nbytes: int) -> Iterator[None]:
    """Make the kernel refuse writes past ``nbytes`` (EFBIG), as a full disk would."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


def _all_names(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*")]


# --------------------------------------------------------------------------- round trip


def test_round_trip_restores_every_entry_bitwise_and_the_rng(tmp_path: Path) -> None:
    state = _train_state(0)
    _train(state, 3)
    manager = CheckpointManager(tmp_path)
    manager.save(3, state, metrics={"loss": 1.5})
    expected = _states(state)
    draws = (random.random(), float(np.random.rand()), torch.rand(3))

    fresh = _train_state(1)
    assert manager.restore(fresh) == 3
    _assert_bitwise(_states(fresh), expected)
    assert fresh["epoch"] == 1  # a plain value comes back into the dict
    assert (random.random(), float(np.random.rand())) == draws[:2]
    assert torch.equal(torch.rand(3), draws[2])
    manager.close()


def test_layout_manifest_and_latest_pointer(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        manager.save(7, {"model": _net(0), "note": "hello"}, metrics={"acc": 0.25})
    folder = Path(manager.checkpoint_path(7))
    assert folder.name == "step_0000000007"
    assert sorted(p.name for p in folder.iterdir()) == [
        "_rng.pt",
        MANIFEST_NAME,
        "model.pt",
        "note.pt",
    ]
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["step"] == 7 and manifest["world_size"] == 1
    assert manifest["metrics"] == {"acc": 0.25}
    assert manifest["torch_version"] == torch.__version__
    assert manifest["files"]["model.pt"]["size"] == (folder / "model.pt").stat().st_size
    assert (tmp_path / LATEST_NAME).read_text() == "step_0000000007\n"


def test_models_are_saved_unwrapped_and_load_into_any_wrapping(tmp_path: Path) -> None:
    wrapped = nn.DataParallel(_net(0))
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"model": wrapped})
        saved = torch.load(Path(manager.checkpoint_path(1)) / "model.pt", weights_only=True)
        assert not any(k.startswith("module.") for k in saved)
        target = nn.DataParallel(_net(5))
        assert manager.restore({"model": target}) == 1
    _assert_bitwise(target.module.state_dict(), wrapped.module.state_dict())


def test_safetensors_format_writes_models_as_safetensors(tmp_path: Path) -> None:
    model = _net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path, format="safetensors") as manager:
        manager.save(2, {"model": model, "optimizer": opt})
        folder = Path(manager.checkpoint_path(2))
        assert detect_format(folder / "model.safetensors") == "safetensors"
        assert detect_format(folder / "optimizer.pt") == formats.TORCH_ZIP
        fresh = _net(3)
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        assert manager.restore({"model": fresh, "optimizer": fresh_opt}) == 2
    _assert_bitwise(fresh.state_dict(), model.state_dict())
    _assert_bitwise(fresh_opt.state_dict(), opt.state_dict())


def test_empty_or_missing_folder_restores_nothing(tmp_path: Path) -> None:
    model = _net(0)
    assert CheckpointManager(tmp_path / "absent").restore({"model": model}) is None
    assert CheckpointManager(tmp_path).restore({"model": model}) is None
    assert CheckpointManager(tmp_path).latest_step() is None


def test_restore_a_given_step_and_missing_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None) as manager:
        for step in (1, 2):
            manager.save(step, {"value": step * 10})
        state = {"value": 0}
        assert manager.restore(state, step=1) == 1 and state["value"] == 10
        with pytest.raises(CheckpointNotFoundError, match=r"step 9.*\[1, 2\]"):
            manager.restore(state, step=9)


def test_strict_entry_check_and_non_strict(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"a": 1, "b": 2})
        with pytest.raises(KeyMismatchError, match="missing from the checkpoint: \\['c'\\]"):
            manager.restore({"a": 0, "c": 0})
        state = {"a": 0, "c": 0}
        assert manager.restore(state, strict=False) == 1
        assert state == {"a": 1, "c": 0}


# --------------------------------------------------------------------------- rotation


def test_keep_last_keeps_exactly_the_newest(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=2) as manager:
        for step in range(0, 50, 10):
            manager.save(step, {"x": torch.tensor(step)})
            assert manager.steps() == [s for s in range(0, step + 1, 10)][-2:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        LATEST_NAME,
        "step_0000000030",
        "step_0000000040",
    ]


@pytest.mark.parametrize(("mode", "best"), [("min", [20, 50]), ("max", [10, 40])])
def test_keep_best_adds_the_best_by_metric(tmp_path: Path, mode: str, best: list[int]) -> None:
    losses = {10: 0.9, 20: 0.1, 30: 0.5, 40: 0.95, 50: 0.2, 60: 0.7, 70: 0.6}
    with CheckpointManager(tmp_path, keep_last=2, best=KeepBest(2, "loss", mode=mode)) as manager:
        for step, loss in losses.items():
            manager.save(step, {"x": step}, metrics={"loss": loss})
        assert manager.steps() == sorted({*best, 60, 70})


def test_keep_best_survives_a_new_manager(tmp_path: Path) -> None:
    first = CheckpointManager(tmp_path, keep_last=1, best=KeepBest(1, "loss"))
    first.save(1, {"x": 1}, metrics={"loss": 0.1})
    first.save(2, {"x": 2}, metrics={"loss": 0.5})
    first.close()
    second = CheckpointManager(tmp_path, keep_last=1, best=KeepBest(1, "loss"))
    second.save(3, {"x": 3}, metrics={"loss": 0.7})
    assert second.steps() == [1, 3]  # step 1's loss came from its manifest


def test_keep_best_needs_the_metric(tmp_path: Path) -> None:
    with pytest.raises(DDPStateError, match="metric="):
        CheckpointManager(tmp_path, keep_best=1)
    manager = CheckpointManager(tmp_path, best=KeepBest(1, "loss"))
    with pytest.raises(DDPStateError, match="metrics=\\{'loss': value\\}"):
        manager.save(1, {"x": 1}, metrics={"acc": 1.0})
    assert manager.steps() == []


# --------------------------------------------------------------------------- verification


def _truncate(folder: Path) -> str:
    path = folder / "model.pt"
    path.write_bytes(path.read_bytes()[:-100])
    return "model.pt is truncated"


def _flip_byte(folder: Path) -> str:
    path = folder / "model.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return "model.pt fails its checksum"


def _drop_manifest(folder: Path) -> str:
    (folder / MANIFEST_NAME).unlink()
    return "has no manifest.json"


@pytest.mark.parametrize("corrupt", [_truncate, _flip_byte, _drop_manifest])
def test_corrupted_newest_falls_back_with_a_warning_naming_the_damage(
    tmp_path: Path, corrupt: Any
) -> None:
    model = _net(0)
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"model": model})
        good = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model[0].weight.add_(1.0)
        manager.save(2, {"model": model})
        what = corrupt(Path(manager.checkpoint_path(2)))
        target = _net(9)
        with pytest.warns(UserWarning, match=f"step_0000000002: .*{what}.*restoring step 1"):
            assert manager.restore({"model": target}) == 1
    _assert_bitwise(target.state_dict(), good)


def test_explicit_corrupted_step_raises(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"model": _net(0)})
        _flip_byte(Path(manager.checkpoint_path(1)))
        with pytest.raises(CheckpointCorruptError, match="fails its checksum"):
            manager.restore({"model": _net(0)}, step=1)
        with pytest.raises(CheckpointCorruptError, match="none verifies"):
            manager.restore({"model": _net(0)})


def test_only_an_unfinished_save_means_no_checkpoint(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"model": _net(0)})
        _drop_manifest(Path(manager.checkpoint_path(1)))
        assert manager.steps() == []
        with pytest.warns(UserWarning, match="no manifest.json"):
            assert manager.restore({"model": _net(0)}) is None


def test_stale_temp_files_and_unfinished_saves_are_cleaned_by_the_next_save(
    tmp_path: Path,
) -> None:
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"x": 1})
        # What a writer killed mid-save leaves behind:
        (tmp_path / ".latest.ddpstate-tmp-0123456789abcdef").write_bytes(b"partial")
        crashed = Path(manager.checkpoint_path(2))
        crashed.mkdir()
        (crashed / "x.pt").write_bytes(b"half")
        (crashed / ".x.pt.ddpstate-tmp-fedcba9876543210").write_bytes(b"half")
        assert manager.steps() == [1] and manager.latest_step() == 1
        manager.save(3, {"x": 3})
    assert not any(is_temp_name(n) for n in _all_names(tmp_path))
    assert not crashed.exists()
    assert manager.steps() == [1, 3]


def test_restore_and_verify_leave_what_a_killed_save_left(tmp_path: Path) -> None:
    """Only a save cleans up (issue 43): a reader never deletes a killed save's leftovers."""
    from ddpstate.manager import verify_checkpoint

    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"x": 1})
        crashed = Path(manager.checkpoint_path(2))
        crashed.mkdir()
        (crashed / "x.pt").write_bytes(b"half")
        staged = tmp_path / ".step_0000000003.ddpstate-tmp-0123456789abcdef"
        staged.mkdir()
        before = _all_names(tmp_path)
        state = {"x": 0}
        assert manager.restore(state) == 1 and state["x"] == 1
        assert verify_checkpoint(tmp_path).ok
        assert _all_names(tmp_path) == before
        manager.save(4, {"x": 4})
    assert not crashed.exists() and not staged.exists()


def test_saving_an_existing_step_replaces_it(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        manager.save(5, {"x": 1, "old": 0})
        manager.save(5, {"x": 2})
        state = {"x": 0}
        assert manager.restore(state) == 5 and state["x"] == 2
        assert not (Path(manager.checkpoint_path(5)) / "old.pt").exists()


def test_a_failed_re_save_keeps_the_old_copy_committed(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        manager.save(5, {"w": torch.zeros(4)})
        before = {p.name: p.read_bytes() for p in Path(manager.checkpoint_path(5)).iterdir()}
        with _file_size_limit(64 << 10), pytest.raises(CheckpointWriteError, match="too large"):
            manager.save(5, {"w": torch.ones(1 << 20)})
        after = {p.name: p.read_bytes() for p in Path(manager.checkpoint_path(5)).iterdir()}
        assert after == before and manager.steps() == [5]
        assert not any(is_temp_name(n) for n in _all_names(tmp_path))
        state = {"w": None}
        assert manager.restore(state) == 5 and torch.equal(state["w"], torch.zeros(4))


def test_re_save_without_an_atomic_swap_and_recovery_of_a_crash_between_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Filesystems without renameat2(RENAME_EXCHANGE) take two renames; a crash
    # between them leaves the old copy under a retired name, which the next save
    # puts back.
    from ddpstate import storage

    monkeypatch.setattr(storage, "_rename_exchange", lambda first, second: False)
    with CheckpointManager(tmp_path) as manager:
        manager.save(5, {"x": 1})
        manager.save(5, {"x": 2})
        state = {"x": 0}
        assert manager.restore(state) == 5 and state["x"] == 2
        folder = Path(manager.checkpoint_path(5))
        folder.rename(tmp_path / f".{folder.name}.ddpstate-old-0123456789abcdef")
        assert manager.steps() == []
        manager.save(6, {"x": 3})
        assert manager.steps() == [5, 6]
        assert manager.restore(state, step=5) == 5 and state["x"] == 2
    assert not any(is_temp_name(n) for n in _all_names(tmp_path))


# --------------------------------------------------------------------------- write failures


def test_a_failed_write_raises_and_leaves_earlier_checkpoints(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"w": torch.zeros(4)})
        with _file_size_limit(64 << 10), pytest.raises(CheckpointWriteError, match="too large"):
            manager.save(2, {"w": torch.zeros(1 << 20)})
        assert manager.steps() == [1]
        assert not Path(manager.checkpoint_path(2)).exists()  # the failed save cleaned up
        assert not any(is_temp_name(n) for n in _all_names(tmp_path))
        state = {"w": None}
        assert manager.restore(state) == 1 and state["w"].numel() == 4


def test_a_file_in_the_way_is_reported_not_deleted(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        Path(manager.checkpoint_path(4)).write_text("mine")
        with pytest.raises(CheckpointWriteError, match="is not a folder"):
            manager.save(4, {"x": 1})
        assert Path(manager.checkpoint_path(4)).read_text() == "mine"


def test_invalid_arguments_are_refused(tmp_path: Path) -> None:
    for kwargs in ({"keep_last": 0}, {"mode": "best"}, {"format": "npz"}, {"keep_best": -1}):
        with pytest.raises(DDPStateError):
            CheckpointManager(tmp_path, **kwargs)
    manager = CheckpointManager(tmp_path)
    with pytest.raises(DDPStateError, match="step must be"):
        manager.save(-1, {"x": 1})
    with pytest.raises(DDPStateError, match="cannot be a file name"):
        manager.save(1, {"../x": 1})
    with pytest.raises(DDPStateError, match="not a number"):
        manager.save(1, {"x": 1}, metrics={"loss": "low"})
    manager.close()
    with pytest.raises(DDPStateError, match="closed"):
        manager.save(1, {"x": 1})


# --------------------------------------------------------------------------- async


def test_async_checkpoint_is_the_state_at_save_time(tmp_path: Path) -> None:
    model = nn.Linear(1024, 1024)  # 4 MiB: the write outlasts the in-place update below
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path, async_save=True) as manager:
        manager.save(1, {"model": model, "optimizer": opt})
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        expected_opt = {  # optimizer state is saved by parameter name
            n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()
        }
        opt.step()  # changes the parameters and momentum buffers in place, right away
        with torch.no_grad():
            model.weight.mul_(-3.0)
        manager.wait()
        folder = Path(manager.checkpoint_path(1))
        saved = torch.load(folder / "model.pt", weights_only=True)
        saved_opt = torch.load(folder / "optimizer.pt", weights_only=True)
    _assert_bitwise(dict(saved), expected)
    for k, buf in expected_opt.items():
        assert torch.equal(saved_opt["state"][k]["momentum_buffer"], buf)
    assert not torch.equal(saved["weight"], model.weight.detach())


def test_async_buffers_are_reused_and_saves_serialize(tmp_path: Path) -> None:
    model = nn.Linear(64, 64)
    with CheckpointManager(tmp_path, async_save=True, keep_last=None) as manager:
        manager.save(1, {"model": model})
        buffers = dict(manager._snapshot.buffers)
        with torch.no_grad():
            model.weight.add_(1.0)
        manager.save(2, {"model": model})  # waits for write 1 before reusing its buffers
        assert all(manager._snapshot.buffers[k] is buffers[k] for k in buffers)
        manager.wait()
        assert manager.steps() == [1, 2]
        w1 = torch.load(Path(manager.checkpoint_path(1)) / "model.pt", weights_only=True)
        w2 = torch.load(Path(manager.checkpoint_path(2)) / "model.pt", weights_only=True)
    assert torch.equal(w2["weight"], w1["weight"] + 1.0)


def test_async_write_error_is_raised_at_the_next_wait(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, async_save=True)
    with _file_size_limit(64 << 10):
        manager.save(1, {"w": torch.zeros(1 << 20)})  # returns: the write runs in the background
        with pytest.raises(CheckpointWriteError, match="File too large"):
            manager.wait()
    assert manager.steps() == []
    assert not any(is_temp_name(n) for n in _all_names(tmp_path))
    manager.save(2, {"w": torch.zeros(2)})  # the manager still works afterwards
    manager.close()
    assert manager.steps() == [2]


# --------------------------------------------------------------------------- signals


def test_sigterm_sets_should_stop_and_close_restores_the_handler(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    manager = CheckpointManager(tmp_path, handle_signals=True)
    assert not manager.should_stop()
    os.kill(os.getpid(), signal.SIGTERM)
    assert manager.should_stop()
    assert manager.should_stop()  # stays true
    manager.close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_higher_steps_from_an_earlier_run_are_pointed_out(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None) as manager:
        manager.save(200, {"x": 1})
        with pytest.raises(InvalidArgumentError, match=r"committed steps \[200\] above it"):
            manager.save(150, {"x": 2})  # not restored: maybe another run's, refused
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manager.save(150, {"x": 2}, rollback=True)
        assert any("step_0000000200 (a higher step)" in str(w.message) for w in caught)


# --------------------------------------------------------------------------- fsspec URLs


def test_fsspec_url_save_rotate_verify_and_restore() -> None:
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    url = "memory://ddpstate-test-manager/run"
    try:
        with CheckpointManager(url, keep_last=2, best=KeepBest(1, "loss")) as manager:
            for step, loss in ((1, 0.1), (2, 0.5), (3, 0.4), (4, 0.3)):
                manager.save(step, {"model": _net(step), "x": step}, metrics={"loss": loss})
            assert manager.steps() == [1, 3, 4]
            assert fs.cat("/ddpstate-test-manager/run/latest") == b"step_0000000004\n"
            fs.pipe("/ddpstate-test-manager/run/step_0000000004/model.pt", b"garbage")
            state = {"model": _net(0), "x": 0}
            with pytest.warns(UserWarning, match="model.pt is truncated"):
                assert manager.restore(state) == 3
        assert state["x"] == 3
        _assert_bitwise(state["model"].state_dict(), _net(3).state_dict())
    finally:
        fs.rm("/ddpstate-test-manager", recursive=True)


def test_a_plain_value_cannot_load_into_a_model(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"model": 3})
        with pytest.raises(DDPStateError, match="holds a int, not a state dict"):
            manager.restore({"model": _net(0)})
