"""Collective misuse and failures on real 2-rank gloo groups (issue 15, rows 5 to 7):
per-rank paths, a collective called under ``if rank == 0:``, and a dead store host."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ddpstate
from ddpstate.errors import DDPStateError
from tests.multiproc import run_ranks

# --------------------------------------------------------------------------- row 5


def _own_paths(rank: int, world: int, folder: str) -> tuple[str, str]:
    try:
        ddpstate.save({"w": torch.full((2,), float(rank))}, Path(folder, f"rank{rank}.pt"))
    except DDPStateError as exc:
        return type(exc).__name__, str(exc)
    return "returned", ""


@pytest.mark.slow
def test_each_rank_saving_its_own_path_is_refused_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_own_paths, 2, args=(str(tmp_path),))
    for kind, message in results:
        assert kind == "InvalidArgumentError", message
        assert "rank 0:" in message and "rank0.pt" in message
        assert "rank 1:" in message and "rank1.pt" in message
        assert "barrier=False" in message
    assert results[0] == results[1]
    assert sorted(os.listdir(tmp_path)) == [], "nothing may be written"


def _own_load_paths(rank: int, world: int, folder: str) -> tuple[str, str]:
    ddpstate.save({"w": torch.ones(2)}, Path(folder, "shared.pt"))
    try:
        ddpstate.load(Path(folder, "shared.pt" if rank == 0 else "other.pt"), src_rank=0)
    except DDPStateError as exc:
        return type(exc).__name__, str(exc)
    return "returned", ""


@pytest.mark.slow
def test_ranks_loading_different_paths_are_refused_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_own_load_paths, 2, args=(str(tmp_path),))
    for kind, message in results:
        assert kind == "InvalidArgumentError" and "other.pt" in message, message
        assert "'ddpstate.load'" in message or "ddpstate.load" in message


# --------------------------------------------------------------------------- row 6


def _only_rank_zero_saves(rank: int, world: int, folder: str) -> Any:
    if rank == 1:
        time.sleep(5)  # never calls save: the usual port of `if rank == 0: torch.save(...)`
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        try:
            ddpstate.save({"w": torch.ones(2)}, Path(folder, "model.pt"), timeout=3.5)
        except ddpstate.BarrierTimeoutError as exc:
            raised = (time.monotonic() - start, exc.missing_ranks)
    return raised, [str(w.message) for w in caught if "still waiting" in str(w.message)]


@pytest.mark.slow
def test_waiting_rank_warns_naming_the_missing_rank_and_the_collective(tmp_path: Path) -> None:
    results = run_ranks(
        _only_rank_zero_saves,
        2,
        args=(str(tmp_path),),
        env={"DDPSTATE_WARN_AFTER": "0.5"},
        timeout=60,
    )
    (elapsed, missing), messages = results[0]
    assert missing == (1,) and elapsed >= 3.5
    # At 0.5 s, then at each doubling (1 s, 2 s) before the 3.5 s timeout.
    assert len(messages) == 3, messages
    for message in messages:
        assert "rank 0: still waiting at 'ddpstate.save'" in message
        assert "for rank 1 of 2" in message and "`if rank == 0:`" in message


# --------------------------------------------------------------------------- row 7

_SPAWN = mp.get_context("spawn")


def _host_store(port: Any) -> None:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    port.put(store.port)
    time.sleep(300)


def _store_host_dies(rank: int, world: int, port: int, host_pid: int, folder: str) -> Any:
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    ddpstate.barrier(timeout=30)
    if rank == 1:
        time.sleep(0.5)  # rank 0 is waiting inside save by now
        os.kill(host_pid, signal.SIGKILL)
        time.sleep(0.5)
    start = time.monotonic()
    try:
        ddpstate.save({"w": torch.ones(2)}, Path(folder, "model.pt"), timeout=60)
    except DDPStateError as exc:
        return type(exc).__name__, time.monotonic() - start, str(exc)
    return "returned", time.monotonic() - start, ""


@pytest.mark.slow
def test_a_dead_store_host_is_reported_at_once_as_a_lost_connection(tmp_path: Path) -> None:
    ports = _SPAWN.Queue()
    host = _SPAWN.Process(target=_host_store, args=(ports,), daemon=True)
    host.start()
    try:
        port = ports.get(timeout=60)
        results = run_ranks(
            _store_host_dies,
            2,
            args=(port, host.pid, str(tmp_path)),
            init_pg=False,
            timeout=90,
        )
    finally:
        host.kill()
        host.join(10)
    for rank, (kind, elapsed, message) in enumerate(results):
        assert kind == "StoreConnectionError", (rank, message)
        assert elapsed < 10, (rank, elapsed)  # at once, not after the 60 s timeout
        assert f"rank {rank}: lost the connection to the rendezvous store" in message
        assert "'ddpstate.save'" in message and "did not reach" not in message
