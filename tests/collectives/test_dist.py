"""Rank queries, init_distributed and the store-based collectives, on 1 to 4 real ranks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

import ddpstate
from ddpstate._dist.launch import _first_slurm_host
from tests.multiproc import run_ranks

# --------------------------------------------------------------------------- one process


def test_single_process_defaults() -> None:
    assert (ddpstate.get_rank(), ddpstate.get_local_rank(), ddpstate.get_world_size()) == (0, 0, 1)
    assert ddpstate.is_main_process() and ddpstate.is_local_main_process()
    assert not ddpstate.is_distributed()


def test_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (ddpstate.get_rank(), ddpstate.get_local_rank(), ddpstate.get_world_size()) == (3, 1, 4)
    assert not ddpstate.is_main_process() and not ddpstate.is_local_main_process()


def test_slurm_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert (ddpstate.get_rank(), ddpstate.get_local_rank(), ddpstate.get_world_size()) == (5, 0, 8)
    assert not ddpstate.is_main_process() and ddpstate.is_local_main_process()


def test_torchrun_variables_win_over_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun launched inside an srun allocation: torchrun's numbering is the real one.
    for name, value in {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "1",
        "RANK": "6",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "2",
    }.items():
        monkeypatch.setenv(name, value)
    assert (ddpstate.get_rank(), ddpstate.get_local_rank(), ddpstate.get_world_size()) == (6, 2, 8)


def test_bad_rank_variable_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ddpstate.DDPStateError, match="RANK='zero'"):
        ddpstate.get_rank()


def test_default_timeout_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ddpstate.default_timeout() == 1800.0
    monkeypatch.setenv("DDPSTATE_TIMEOUT", "12.5")
    assert ddpstate.default_timeout() == 12.5
    monkeypatch.setenv("DDPSTATE_TIMEOUT", "-1")
    with pytest.raises(ddpstate.DDPStateError, match="DDPSTATE_TIMEOUT"):
        ddpstate.default_timeout()


def test_collectives_are_identity_without_process_group() -> None:
    ddpstate.barrier(timeout=0.1)
    assert ddpstate.broadcast_object({"a": 1}) == {"a": 1}
    assert ddpstate.all_gather_object(7) == [7]
    with ddpstate.main_process_first():
        pass


def test_broadcast_object_takes_src_rank_and_the_old_src_keyword() -> None:
    assert ddpstate.broadcast_object(5, src_rank=0) == 5
    with pytest.warns(DeprecationWarning, match=r"src=\) is deprecated; pass src_rank="):
        assert ddpstate.broadcast_object(5, src=0) == 5
    with pytest.raises(ddpstate.InvalidArgumentError, match="pass src_rank= only"):
        ddpstate.broadcast_object(5, src_rank=1, src=2)


def test_rank_zero_only_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    @ddpstate.rank_zero_only
    def answer() -> int:
        return 42

    assert answer() == 42
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert answer() is None


def test_init_distributed_not_launched_initialises_nothing() -> None:
    ctx = ddpstate.init_distributed()
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.backend) == (0, 0, 1, None)
    assert not ctx.is_distributed and ctx.is_main_process
    assert str(ctx.device) == "cpu"
    assert not dist.is_initialized()
    assert ddpstate.init_distributed() == ctx


def test_interactive_single_slurm_task_is_not_a_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    ctx = ddpstate.init_distributed()
    assert ctx.backend is None and not dist.is_initialized()


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("gpu7", "gpu7"), ("node[01-04,07]", "node01"), ("a[3,5],b2", "a3"), ("x-1,x-2", "x-1")],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert _first_slurm_host(nodelist) == first


# --------------------------------------------------------------------------- real ranks


def _queries(rank: int, world: int) -> tuple[int, int, int, bool]:
    assert ddpstate.is_distributed()
    return (
        ddpstate.get_rank(),
        ddpstate.get_local_rank(),
        ddpstate.get_world_size(),
        ddpstate.is_main_process(),
    )


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_rank_queries_on_real_ranks(world: int) -> None:
    results = run_ranks(_queries, world)
    assert results == [(r, r, world, r == 0) for r in range(world)]


def _collectives(rank: int, world: int) -> dict[str, object]:
    ddpstate.barrier(timeout=30)
    got = ddpstate.broadcast_object({"from": rank} if rank == 1 else None, src_rank=1, timeout=30)
    gathered = ddpstate.all_gather_object(rank * 10, timeout=30)
    ddpstate.barrier(timeout=30)  # a second round reuses nothing from the first
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The old keyword still works (with a DeprecationWarning), and so does the position.
        old = ddpstate.broadcast_object("x" if rank == 2 else None, src=2, timeout=30)
        positional = ddpstate.broadcast_object("y" if rank == 2 else None, 2, timeout=30)
    deprecated = [str(w.message) for w in caught if w.category is DeprecationWarning]

    @ddpstate.rank_zero_only
    def only_zero() -> str:
        return "ran"

    return {
        "bcast": got,
        "gather": gathered,
        "zero": only_zero(),
        "old": (old, positional, deprecated),
    }


@pytest.mark.slow
def test_collectives_on_three_ranks() -> None:
    results = run_ranks(_collectives, 3)
    for rank, result in enumerate(results):
        assert result["bcast"] == {"from": 1}
        assert result["gather"] == [0, 10, 20]
        assert result["zero"] == ("ran" if rank == 0 else None)
        assert result["old"] == ("x", "y", ["broadcast_object(src=) is deprecated; pass src_rank="])


def _first(rank: int, world: int, folder: str) -> list[str]:
    marker = Path(folder, "cache.txt")
    with ddpstate.main_process_first(timeout=30):
        if rank == 0:
            time.sleep(0.5)  # the others must wait, not race ahead
            marker.write_text("built by rank 0")
        seen = marker.read_text()
    return [seen]


@pytest.mark.slow
def test_main_process_first_orders_ranks(tmp_path: Path) -> None:
    assert run_ranks(_first, 2, args=(str(tmp_path),)) == [["built by rank 0"]] * 2


def _first_fails(rank: int, world: int) -> str:
    try:
        with ddpstate.main_process_first(timeout=30):
            if rank == 0:
                raise ValueError("disk full while preprocessing")
        return "block ran"
    except ValueError as exc:
        return f"own error: {exc}"
    except ddpstate.DDPStateError as exc:
        return f"told: {exc}"


@pytest.mark.slow
def test_main_process_first_propagates_leader_failure() -> None:
    zero, one = run_ranks(_first_fails, 2)
    assert zero == "own error: disk full while preprocessing"
    assert one.startswith("told:") and "disk full while preprocessing" in one


def _skip_barrier(rank: int, world: int, timeout: float) -> object:
    if rank == 1:
        time.sleep(timeout + 2)  # alive, but never arrives
        return None
    start = time.monotonic()
    try:
        ddpstate.barrier(timeout=timeout)
    except ddpstate.BarrierTimeoutError as exc:
        return (time.monotonic() - start, str(exc), exc.missing_ranks)
    return "no error"


@pytest.mark.slow
def test_barrier_timeout_names_missing_rank() -> None:
    timeout = 3.0
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    elapsed, message, missing = run_ranks(_skip_barrier, 2, args=(timeout,), timeout=60)[0]
    assert missing == (1,)
    assert "rank 1 of 2 did not reach" in message and "not inside `if rank == 0:`" in message
    assert timeout <= elapsed <= timeout + 5
    left = {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()} - before
    assert not [pid for pid in left if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def _four_ranks_two_missing(rank: int, world: int) -> object:
    if rank in (1, 3):
        time.sleep(4)
        return None
    try:
        ddpstate.barrier(timeout=2, name="ddpstate.load")
    except ddpstate.BarrierTimeoutError as exc:
        return exc.missing_ranks, str(exc)
    return "no error"


@pytest.mark.slow
def test_every_arriving_rank_names_all_missing_ranks() -> None:
    results = run_ranks(_four_ranks_two_missing, 4, timeout=60)
    for rank in (0, 2):
        missing, message = results[rank]
        assert missing == (1, 3)
        assert "ranks 1, 3 of 4" in message and "'ddpstate.load'" in message


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _slurm_launch(rank: int, world: int, port: int) -> tuple[int, int, int, str | None, bool]:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name)
    os.environ.update(
        {
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS": str(world),
            "SLURM_STEP_ID": "0",
            "SLURM_JOB_ID": "77",
            "SLURM_JOB_NODELIST": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    ctx = ddpstate.init_distributed(timeout=60)
    again = ddpstate.init_distributed()
    ddpstate.barrier(timeout=30)
    return ctx.rank, ctx.local_rank, ctx.world_size, ctx.backend, again == ctx


@pytest.mark.slow
def test_init_distributed_under_slurm_variables() -> None:
    results = run_ranks(_slurm_launch, 2, args=(_free_port(),), init_pg=False)
    assert results == [(0, 0, 2, "gloo", True), (1, 1, 2, "gloo", True)]


_TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import ddpstate
    ctx = ddpstate.init_distributed(timeout=60)
    print(f"ctx rank={ctx.rank} world={ctx.world_size} backend={ctx.backend} device={ctx.device}")
    ddpstate.barrier(timeout=20)
    if ctx.rank == 1:
        time.sleep(6)          # never reaches the second barrier in time
        sys.exit(0)
    try:
        ddpstate.barrier(timeout=2)
    except ddpstate.BarrierTimeoutError as exc:
        print("timeout:", exc.missing_ranks)
        sys.exit(3)
    """
)


@pytest.mark.slow
def test_torchrun_launch_and_barrier_timeout(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        "--max-restarts=0",
        str(script),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    out = proc.stdout
    assert "ctx rank=0 world=2 backend=gloo device=cpu" in out, proc.stderr[-3000:]
    assert "ctx rank=1 world=2 backend=gloo device=cpu" in out
    assert "timeout: (1,)" in out
    assert proc.returncode != 0  # rank 0 exited 3, so torchrun reports the failure
