"""SIGKILL during save, CheckpointManager.save (sync and async) and convert --in-place."""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import ddpstate
from ddpstate import storage
from tests.faults import _harness as h

RANDOM_TRIALS = 8


@pytest.mark.parametrize("kind", h.CRASH_KINDS)
def test_random_kills_lose_nothing(kind: str, tmp_path: Path) -> None:
    """Kills after random delays and at random file-system calls: the target is the whole
    old or the whole new content (by hash; by restored values for a manager), temp files
    are never listed, and the next save removes them."""
    cal = h.calibrate_crash(kind, tmp_path / "calibrate")
    rng = random.Random(f"ci-crash-{kind}")
    mid_write = 0
    for _ in range(RANDOM_TRIALS):
        trial = h.crash_trial(kind, tmp_path / "trial", rng, cal)
        assert not trial.defects, (trial.damage, trial.offset, trial.defects)
        mid_write += trial.verdicts.get("killed") == "mid-write"
    assert mid_write >= RANDOM_TRIALS // 2, "too few trials interrupted the write"


@pytest.mark.slow
@pytest.mark.parametrize("kind", h.CRASH_KINDS)
def test_a_kill_at_every_file_system_call_loses_nothing(kind: str, tmp_path: Path) -> None:
    """A kill just before and just after each os.open/fsync/replace/rename/link/unlink/
    rmdir/mkdir the write makes: every interruption point of the commit protocol."""
    cal = h.calibrate_crash(kind, tmp_path / "calibrate")
    rng = random.Random(0)
    outcomes = set()
    for k in range(1, cal.calls + 1):
        for when in ("before", "after"):
            trial = h.crash_trial(kind, tmp_path / "trial", rng, cal, kill_point=(k, when))
            assert not trial.defects, (k, when, trial.defects)
            outcomes.add(trial.verdicts.get("target"))
    assert outcomes == {"old", "new"}


def test_the_next_save_removes_a_dead_writers_temp_but_not_a_live_ones(tmp_path: Path) -> None:
    """Regression: a plain save killed mid-write left its hidden temp file forever. Now the
    next successful save of that target deletes temp files no process holds locked, and
    leaves alone the temp file of a writer that is still running."""
    target = tmp_path / "model.pt"
    ddpstate.save(h.sample_state(1), target)
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()

    def live_writer() -> None:
        os.close(ready_r)
        os.close(hold_w)
        with storage.atomic_write(target) as f:
            f.write(b"partial")
            f.flush()
            os.write(ready_w, b"x")
            os.read(hold_r, 1)  # blocks until the parent closes its end (or kills us)

    pid = h._fork(live_writer)
    reaped = False
    os.close(ready_w)
    os.close(hold_r)
    try:
        assert os.read(ready_r, 1) == b"x"
        temps = [p.name for p in tmp_path.iterdir() if storage.is_temp_name(p.name)]
        assert len(temps) == 1
        ddpstate.save(h.sample_state(2), target)
        assert (tmp_path / temps[0]).exists(), "a live writer's temp file was deleted"
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        reaped = True
        assert (tmp_path / temps[0]).exists()  # killed: the temp file stays behind...
        assert storage.listdir(tmp_path) == ["model.pt"]  # ...hidden from listings
        ddpstate.save(h.sample_state(3), target)
        assert sorted(os.listdir(tmp_path)) == ["model.pt"]  # ...until the next save
        assert h.same(ddpstate.load(target), h.sample_state(3))
    finally:
        os.close(hold_w)
        os.close(ready_r)
        if not reaped:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


@pytest.mark.slow
def test_killing_the_ddpstate_command_during_convert_in_place(tmp_path: Path) -> None:
    """The installed console script, killed with SIGKILL at spread-out moments of
    `ddpstate convert --in-place`: the file is always the whole old or the whole new one,
    and the next save removes the temp files the kills left."""
    target = tmp_path / "model.pt"
    state = {f"module.layer{i}.weight": torch.randn(256, 256) for i in range(24)}
    torch.save({"state_dict": state}, target)
    original = target.read_bytes()
    old = h.sha256(target)
    reference = tmp_path / "ref" / "model.pt"
    reference.parent.mkdir()
    reference.write_bytes(original)
    command = [*h.ddpstate_command(), "convert", "-q", "--strip-module", "--in-place"]
    start = time.monotonic()
    subprocess.run([*command, str(reference)], check=True)
    duration = time.monotonic() - start
    new = h.sha256(reference)
    seen = set()
    for fraction in (0.2, 0.5, 0.7, 0.85, 0.95, 1.05):
        proc = subprocess.Popen([*command, str(target)])
        time.sleep(duration * fraction)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        digest = h.sha256(target)
        assert digest in (old, new), f"killed at {fraction:.0%}: neither old nor new"
        assert storage.listdir(tmp_path) == ["model.pt", "ref"]
        seen.add("old" if digest == old else "new")
        target.write_bytes(original)  # the next trial starts from the old file again
    assert "old" in seen, "no kill landed before the commit"
    assert h.same(ddpstate.load(target, map_location="cpu"), torch.load(io.BytesIO(original)))
    ddpstate.save({"w": torch.ones(1)}, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "ref"]
