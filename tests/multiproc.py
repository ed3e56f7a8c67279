"""Run a function on N real gloo ranks on 127.0.0.1 and bring failures home.

The parent process hosts the rendezvous TCPStore (on a free port chosen by the
OS, so no port races), so a rank that dies or never arrives leaves the store up
and the other ranks see a proper timeout, as they would under torchrun's agent.

Ranks are forked from one long-lived server process per pytest session that has
imported torch once (multiprocessing's forkserver with a preload list): a rank
starts in milliseconds instead of the seconds a fresh interpreter needs to import
torch, and it is still a fresh process per call, so nothing one test changes
(environment, torch settings, ddpstate's module state, signal handlers, a rank
that exits or is killed) reaches the next one. ``fresh=True`` spawns a new
interpreter instead, for a test whose environment must be set before torch is
imported.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist

_SPAWN = mp.get_context("spawn")
_FORKSERVER = mp.get_context("forkserver")
# Imported once in the fork server, shared by every rank forked from it. Only
# torch and test tooling: ddpstate and the test modules are imported in each rank,
# as in a fresh process. A name that fails to import is skipped by multiprocessing.
_FORKSERVER.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "torch.distributed.checkpoint",
        "torch.nn.parallel",
        "numpy",
        "pytest",
        "tests.multiproc",
    ]
)

# Environment variables that torch reads while it is imported: a rank that needs
# one of them other than the fork server had must start a fresh interpreter.
_READ_AT_IMPORT = ("TORCH_", "OMP_", "MKL_", "CUDA_", "PYTORCH_", "NCCL_", "GLOO_")
_server_environ: dict[str, str] | None = None


def _needs_fresh_interpreter(env: Mapping[str, str]) -> bool:
    """Whether the ranks need a variable torch reads at import that the fork server lacks."""
    global _server_environ
    wanted = {k: v for k, v in {**os.environ, **env}.items() if k.startswith(_READ_AT_IMPORT)}
    if _server_environ is None:
        # The fork server starts with the next forked rank, in this environment.
        _server_environ = {k: v for k, v in os.environ.items() if k.startswith(_READ_AT_IMPORT)}
    return wanted != _server_environ


class RankFailed(AssertionError):
    """A child rank raised, died or hung; carries the child's traceback."""


class _InheritedFd:
    """The parent's file descriptor, handed to a forked rank as a spawned one inherits it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        # Called while the forkserver Popen pickles the process: DupFd sends the
        # descriptor along with the fork request.
        return (_attach_fd, (reduction.DupFd(self.fd),))


def _attach_fd(dup: Any) -> int:
    return int(dup.detach())


@dataclass(frozen=True)
class _Parent:
    """What a spawned process inherits from the parent at start and a forked rank must be given."""

    environ: dict[str, str]
    stdout: int | _InheritedFd
    stderr: int | _InheritedFd


def _take_after(parent: _Parent) -> None:
    """Make a rank forked from the fork server look like one spawned by ``parent`` now."""
    # Output goes where the parent's goes now (pytest's capture of this test), not
    # where it went when the fork server started.
    for target, fd in ((1, parent.stdout), (2, parent.stderr)):
        assert isinstance(fd, int)
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(parent.environ)
    # A fresh interpreter seeds torch's and numpy's generators from the OS; a forked
    # rank would otherwise share the fork server's stream with every other rank.
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: Mapping[str, str],
    results: Any,
    init_pg: bool,
    parent: _Parent | None,
) -> None:
    if parent is not None:
        _take_after(parent)
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
            # No rank runs fn before every rank has connected: a rank whose fn returns
            # at once would otherwise close its sockets while a slower peer is still
            # connecting to it ("Gloo connectFullMesh failed ... closed by peer").
            store.set(f"connected/{rank}", "1")
            store.wait([f"connected/{r}" for r in range(world_size)])
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
        sys.stdout.flush()
        sys.stderr.flush()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple[Any, ...] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 90.0,
    init_pg: bool = True,
    expect_failure: bool = False,
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    ``fn`` must be a module-level function. Returns each rank's return value
    (``None`` for a rank that exited without reporting). A child's exception is
    re-raised here as :class:`RankFailed` with its traceback; ranks still alive
    after ``timeout`` seconds are killed and reported as hung.
    With ``expect_failure=True`` child exceptions are returned (as their
    traceback strings) instead of raised. Each rank is a new process forked from
    the session's fork server; ``fresh=True`` (implied by a variable torch reads
    at import, in ``env`` or ``os.environ``, that the fork server did not start
    with) spawns a new interpreter per rank instead.
    """
    env = dict(env or {})
    fresh = fresh or _needs_fresh_interpreter(env)
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )
    port = store.port
    ctx = _SPAWN if fresh else _FORKSERVER
    results = ctx.Queue()
    parent = None if fresh else _Parent(dict(os.environ), _InheritedFd(1), _InheritedFd(2))
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, port, args, env, results, init_pg, parent),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
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
    for r, p in enumerate(procs):
        p.join(timeout=0 if r in hung else 10)
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
