"""Issue 28 rows 1, 2 and 4 on real 2-rank gloo groups: every collective call says what it
is (a skipped call is named on every rank, quickly), and a checkpoint folder the ranks do
not share is named as such (never as damage)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ddpstate
from ddpstate.errors import DDPStateError
from tests.multiproc import run_ranks

TIMEOUT = 60.0


def _outcome(fn: Any) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        fn()
    except DDPStateError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "returned", "", time.monotonic() - start


# --------------------------------------------------------------------------- row 1


def _save_vs_barrier(rank: int, world: int, folder: str) -> tuple[str, str, float]:
    if rank == 0:
        return _outcome(lambda: ddpstate.save({"w": torch.ones(2)}, "ck.pt", timeout=TIMEOUT))
    return _outcome(lambda: ddpstate.barrier(timeout=TIMEOUT))


@pytest.mark.slow
def test_save_on_one_rank_and_barrier_on_the_other_raise_on_both_naming_both_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    results = run_ranks(_save_vs_barrier, 2, args=(str(tmp_path),))
    for kind, message, elapsed in results:
        assert kind == "InvalidArgumentError", message
        assert "rank 0 is in ddpstate.save('ck.pt')" in message, message
        assert "rank 1 in ddpstate.barrier()" in message, message
        assert "if rank == 0:" in message and "barrier=False" in message
        assert elapsed < TIMEOUT / 4, "released at once, not at the timeout"
    assert results[0][1] == results[1][1]
    assert not (tmp_path / "ck.pt").exists(), "the writer never wrote: the call was wrong"


# --------------------------------------------------------------------------- row 2


def _save_load_vs_load(rank: int, world: int, folder: str) -> tuple[str, str, float]:
    path = str(Path(folder, "ck.pt"))

    def calls() -> None:
        if rank == 0:
            ddpstate.save({"w": torch.ones(2)}, path, timeout=TIMEOUT)
        ddpstate.load(path, timeout=TIMEOUT)

    return _outcome(calls)


@pytest.mark.slow
def test_a_skipped_save_before_a_load_is_named_as_a_skipped_call(tmp_path: Path) -> None:
    results = run_ranks(_save_load_vs_load, 2, args=(str(tmp_path),))
    for kind, message, elapsed in results:
        assert kind == "InvalidArgumentError", message
        assert "rank 0 is in ddpstate.save(" in message and "rank 1 in ddpstate.load(" in message
        assert "skipped" in message and "different arguments" not in message
        assert elapsed < TIMEOUT / 4


def _manager_steps(rank: int, world: int, folder: str, second: str) -> tuple[str, str, float]:
    manager = ddpstate.CheckpointManager(folder, timeout=TIMEOUT)
    model = torch.nn.Linear(2, 2)

    def calls() -> None:
        if rank == 0:
            manager.save(1, {"model": model})
        if second == "save":
            manager.save(2, {"model": model})
        else:
            manager.restore({"model": model})

    return _outcome(calls)


@pytest.mark.slow
@pytest.mark.parametrize("second", ["save", "restore"])
def test_a_manager_save_skipped_on_one_rank_is_named(tmp_path: Path, second: str) -> None:
    results = run_ranks(_manager_steps, 2, args=(str(tmp_path / "ckpts"), second))
    other = "CheckpointManager.save(step=2)" if second == "save" else "CheckpointManager.restore()"
    for kind, message, elapsed in results:
        assert kind == "InvalidArgumentError", message
        assert "CheckpointManager.save(step=1)" in message and other in message, message
        assert "skipped a call" in message or "skipped on some rank" in message
        assert elapsed < TIMEOUT / 4
    assert results[0][1] == results[1][1]


# --------------------------------------------------------------------------- row 4


def _node_local(rank: int, world: int, folder: str, what: str) -> Any:
    # Each rank its own working folder and a relative path: a folder on each node's own disk.
    own = Path(folder, f"node{rank}")
    own.mkdir(exist_ok=True)
    os.chdir(own)
    model = torch.nn.Linear(2, 2)
    if what == "save":
        return _outcome(lambda: ddpstate.save({"w": torch.ones(2)}, "ck.pt", timeout=TIMEOUT))
    if what == "load":
        if rank == 0:
            ddpstate.save({"w": torch.ones(2)}, "ck.pt", barrier=False)
        return _outcome(lambda: ddpstate.load("ck.pt", timeout=TIMEOUT))
    manager = ddpstate.CheckpointManager("ckpts", timeout=TIMEOUT)
    if what == "manager save":
        return _outcome(lambda: manager.save(1, {"model": model}))
    return _outcome(lambda: manager.restore({"model": model}))


@pytest.mark.slow
@pytest.mark.parametrize("what", ["save", "load", "manager save", "manager restore"])
def test_a_node_local_folder_is_named_as_not_shared_on_every_rank(
    tmp_path: Path, what: str
) -> None:
    if what == "manager restore":  # an intact checkpoint on rank 0's disk only
        with ddpstate.CheckpointManager(tmp_path / "node0" / "ckpts") as manager:
            manager.save(1, {"model": torch.nn.Linear(2, 2)})
    results = run_ranks(_node_local, 2, args=(str(tmp_path), what))
    for kind, message, _ in results:
        assert kind == "CheckpointNotFoundError", message
        assert "rank 1 cannot see" in message and "rank 0" in message, message
        assert "not shared storage between the ranks" in message, message
        assert "damaged" not in message.replace("nothing is damaged", "")
    assert results[0][1] == results[1][1]


def _node_local_restore(rank: int, world: int, folder: str) -> Any:
    os.chdir(Path(folder, f"node{rank}"))
    manager = ddpstate.CheckpointManager("ckpts", timeout=TIMEOUT)
    return _outcome(lambda: manager.restore({"model": torch.nn.Linear(2, 2)}))


@pytest.mark.slow
def test_a_checkpoint_only_another_rank_sees_is_not_a_fresh_start(tmp_path: Path) -> None:
    # Rank 0 (which chooses the step) sees an empty folder; rank 1's disk holds step 3.
    (tmp_path / "node0" / "ckpts").mkdir(parents=True)
    with ddpstate.CheckpointManager(tmp_path / "node1" / "ckpts") as manager:
        manager.save(3, {"model": torch.nn.Linear(2, 2)})
    results = run_ranks(_node_local_restore, 2, args=(str(tmp_path),))
    for kind, message, _ in results:
        assert kind == "CheckpointNotFoundError", message
        assert "rank 1 (step 3) see committed checkpoints" in message, message
        assert "not shared storage between the ranks" in message, message
    assert results[0][1] == results[1][1]
