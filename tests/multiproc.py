"""Run a function on N real gloo ranks on 127.0.0.1 and bring failures home.

The parent process hosts the rendezvous TCPStore (on a free port chosen by the
OS, so no port races), so a rank that dies or never arrives leaves the store up
and the other ranks see a proper timeout, as they would under torchrun's agent.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_CTX = mp.get_context("spawn")


class RankFailed(AssertionError):
    """A child rank raised, died or hung; carries the child's traceback."""


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: Mapping[str, str],
    results: Any,
    init_pg: bool,
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            **env,
        }
    )
    try:
        if init_pg:
            store = dist.TCPStore(
                "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=60)
            )
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=120),
            )
        value = fn(rank, world_size, *args)
        # Tensors sent through a Queue travel as shared-memory handles that die with
        # this process; torch.save bytes survive it.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if init_pg and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple[Any, ...] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 90.0,
    init_pg: bool = True,
    expect_failure: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    ``fn`` must be a module-level function. Returns each rank's return value
    (``None`` for a rank that exited without reporting). A child's exception is
    re-raised here as :class:`RankFailed` with its traceback; ranks still alive
    after ``timeout`` seconds are killed and reported as hung.
    With ``expect_failure=True`` child exceptions are returned (as their
    traceback strings) instead of raised.
    """
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )
    port = store.port
    results = _CTX.Queue()
    procs = [
        _CTX.Process(
            target=_child,
            args=(fn, rank, world_size, port, args, dict(env or {}), results, init_pg),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    import time

    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
            outcomes[rank] = (ok, value)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                # Drain what is left, then stop waiting.
                try:
                    while True:
                        rank, ok, value = results.get(timeout=0.5)
                        outcomes[rank] = (ok, value)
                except queue.Empty:
                    break
    hung = [r for r, p in enumerate(procs) if p.is_alive() and r not in outcomes]
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
    del store
    if hung:
        raise RankFailed(f"ranks {hung} hung past {timeout} s and were killed")
    failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if failures and not expect_failure:
        rank = min(failures)
        raise RankFailed(f"rank {rank} failed:\n{failures[rank]}")
    if expect_failure:
        return [
            (
                outcomes[r][1]
                if not outcomes[r][0]
                else torch.load(io.BytesIO(outcomes[r][1]), weights_only=False)
            )
            if r in outcomes
            else None
            for r in range(world_size)
        ]
    # Trusted bytes: written by this test's own child processes just now.
    return [
        torch.load(io.BytesIO(outcomes[r][1]), weights_only=False) if r in outcomes else None
        for r in range(world_size)
    ]
