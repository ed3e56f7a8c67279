"""The manager's commits are durable: the fsyncs a power loss needs, in the order it needs them.

os.fsync and os.unlink are wrapped to record (and then make) each real call, with the
path an fsynced descriptor names, so the tests see the order on the real filesystem.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import ddpstate
from ddpstate import storage
from tests.faults import _harness as h

Events = list[tuple[str, str]]


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Events:
    seen: Events = []
    real_fsync, real_unlink = os.fsync, os.unlink

    def fsync(fd: Any) -> None:
        number = fd if isinstance(fd, int) else fd.fileno()
        seen.append(("fsync", os.readlink(f"/proc/self/fd/{number}")))
        real_fsync(fd)

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(("unlink", os.fspath(path)))
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "unlink", unlink)
    return seen


def _index(events: Events, event: tuple[str, str]) -> int:
    assert event in events, (event, events)
    return events.index(event)


def test_a_new_step_written_in_place_fsyncs_the_root_before_older_steps_go(
    tmp_path: Path, events: Events
) -> None:
    """A new step is written in place (no rename into the root fsyncs it): the root's entry
    for it is made durable by the fsync of the root that writing `latest` does, before any
    older step is deleted. A guard on that order (it already held before issue 41)."""
    run = tmp_path / "run"
    with ddpstate.CheckpointManager(run, keep_last=1) as manager:
        manager.save(1, {"w": torch.ones(2)})
        events.clear()
        manager.save(2, {"w": torch.ones(2) * 2})
    committed = _index(events, ("fsync", str(run / "step_0000000002")))
    root = _index(events, ("fsync", str(run)))
    rotated = _index(events, ("unlink", str(run / "step_0000000001" / "manifest.json")))
    assert committed < root < rotated


def test_a_rollback_fsyncs_each_uncommitted_step_folder(tmp_path: Path, events: Events) -> None:
    """Regression: a rollback unlinked the newer steps' manifests without fsyncing their
    folders; after a power loss they could come back committed, above the step rolled to."""
    run = tmp_path / "run"
    with ddpstate.CheckpointManager(run, keep_last=None) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"w": torch.ones(2) * step})
        events.clear()
        manager.save(1, {"w": torch.zeros(2)}, rollback=True)
        assert manager.steps() == [1]
    for step in (2, 3):
        folder = run / f"step_{step:010d}"
        unlinked = _index(events, ("unlink", str(folder / "manifest.json")))
        synced = _index(events, ("fsync", str(folder)))
        assert unlinked < synced


def _killed_between_link_and_rename(target: Path) -> None:
    real_link = os.link

    def link(*args: Any, **kwargs: Any) -> None:
        real_link(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    os.link = link  # type: ignore[assignment]
    ddpstate.save({"w": torch.full((9 << 20,), 2.0)}, target)


def test_a_retired_copy_a_kill_left_is_freed_by_the_next_save_in_its_folder(
    tmp_path: Path,
) -> None:
    """Regression: a writer killed between _retire's link and its rename left a second name
    of the old (36 MiB) file, a full copy once the target was replaced, kept until the
    next save of that same target. Now the next save of any file in the folder frees it."""
    target = tmp_path / "model.pt"
    ddpstate.save({"w": torch.full((9 << 20,), 1.0)}, target)
    pid = h._fork(lambda: _killed_between_link_and_rename(target))
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    left = [p.name for p in tmp_path.iterdir() if storage.retired_original(p.name) == "model.pt"]
    assert len(left) == 1, sorted(os.listdir(tmp_path))
    assert torch.equal(ddpstate.load(target)["w"], torch.full((9 << 20,), 1.0))
    ddpstate.save({"b": torch.ones(1)}, tmp_path / "other.pt")
    storage.wait_for_freed()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "other.pt"]
