"""tests/multiproc.run_ranks: ranks forked from the session's fork server are fresh.

Nothing one call changes in its ranks reaches the next call; the parent's
environment, working folder and captured output reach the ranks as they would
reach spawned ones; a rank that exits, raises or hangs is reported as before.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ddpstate
from tests.multiproc import RankFailed, run_ranks

_LEAKED: list[int] = []


class _Leaked:
    """A class a rank adds to torch's weights-only allowlist."""


def _leak_state(rank: int, world: int, folder: str) -> int:
    os.environ["DDPSTATE_POOL_LEAK"] = "1"
    _LEAKED.append(rank)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234 + rank)
    torch.use_deterministic_algorithms(True)
    torch.serialization.add_safe_globals([_Leaked])
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    os.chdir(folder)
    vars(ddpstate)["_pool_leak"] = rank
    return os.getpid()


def _observe_state(rank: int, world: int) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "env": os.environ.get("DDPSTATE_POOL_LEAK"),
        "global": list(_LEAKED),
        "dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "safe_globals": [g for g in torch.serialization.get_safe_globals() if g is _Leaked],
        "signal": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,
        "cwd": os.getcwd(),
        "ddpstate": hasattr(ddpstate, "_pool_leak"),
        "random": torch.rand(3),
    }


def test_a_call_leaves_nothing_for_the_next_call(tmp_path: Path) -> None:
    pids = run_ranks(_leak_state, 2, args=(str(tmp_path),))
    after = run_ranks(_observe_state, 2)
    for rank, seen in enumerate(after):
        assert seen["pid"] != pids[rank]
        assert seen["env"] is None
        assert seen["global"] == []
        assert seen["dtype"] == torch.float32
        assert seen["deterministic"] is False
        assert seen["safe_globals"] == []
        assert seen["signal"] is False
        assert seen["cwd"] == os.getcwd()
        assert seen["ddpstate"] is False
    # Each rank of each call draws its own random stream, as a fresh interpreter does.
    streams = [seen["random"] for seen in (*after, *run_ranks(_observe_state, 2))]
    assert len({tuple(stream.tolist()) for stream in streams}) == len(streams)


def _environment(rank: int, world: int) -> tuple[str | None, str | None, str, str]:
    return (
        os.environ.get("DDPSTATE_POOL_PARENT"),
        os.environ.get("DDPSTATE_POOL_CALL"),
        os.environ["RANK"],
        os.getcwd(),
    )


def test_the_parents_environment_and_folder_reach_the_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDPSTATE_POOL_PARENT", "set by the test")
    monkeypatch.chdir(tmp_path)
    results = run_ranks(_environment, 3, env={"DDPSTATE_POOL_CALL": "given"})
    assert results == [("set by the test", "given", str(rank), str(tmp_path)) for rank in range(3)]


def _parent_pid(rank: int, world: int) -> int:
    return os.getppid()


@pytest.mark.slow
def test_fresh_and_import_time_variables_spawn_a_new_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spawned = [os.getpid()] * 2
    assert run_ranks(_parent_pid, 2) != spawned
    assert run_ranks(_parent_pid, 2, fresh=True) == spawned
    assert run_ranks(_parent_pid, 2, env={"TORCH_CPP_LOG_LEVEL": "ERROR"}) == spawned
    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    assert run_ranks(_parent_pid, 2) == spawned
    monkeypatch.delenv("TORCH_SERIALIZATION_DEBUG")
    assert run_ranks(_parent_pid, 2) != spawned


def _print(rank: int, world: int) -> None:
    print(f"rank {rank} says hello", flush=True)
    print(f"rank {rank} warns", file=sys.stderr, flush=True)


def test_a_ranks_output_goes_to_the_tests_captured_output(
    capfd: pytest.CaptureFixture[str],
) -> None:
    run_ranks(_print, 2)
    out, err = capfd.readouterr()
    assert "rank 0 says hello" in out and "rank 1 says hello" in out
    assert "rank 0 warns" in err and "rank 1 warns" in err


def _exit_or_fail(rank: int, world: int) -> str:
    if rank == 1:
        os._exit(3)
    if rank == 2:
        raise ValueError("rank 2 broke on purpose")
    return "done"


def test_exits_and_failures_are_reported_and_the_next_call_runs() -> None:
    results = run_ranks(_exit_or_fail, 3, init_pg=False, expect_failure=True)
    assert results[0] == "done" and results[1] is None
    assert "ValueError: rank 2 broke on purpose" in results[2]
    with pytest.raises(RankFailed, match=r"(?s)rank 2 failed:.*rank 2 broke on purpose"):
        run_ranks(_exit_or_fail, 3, init_pg=False)
    assert [seen["env"] for seen in run_ranks(_observe_state, 3)] == [None] * 3


def _hang(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(60)
    return rank


@pytest.mark.slow
def test_a_hung_rank_is_killed_and_reported() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"ranks \[1\] hung past 2.0 s"):
        run_ranks(_hang, 2, init_pg=False, timeout=2.0)
    assert time.monotonic() - started < 30
    assert run_ranks(_parent_pid, 2) != [os.getpid()] * 2


def _group(rank: int, world: int) -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def test_each_call_gets_its_own_process_group() -> None:
    for world in (2, 3, 4, 2):
        assert run_ranks(_group, world) == [(rank, world) for rank in range(world)]
