"""``init_distributed`` under the official DDP tutorial's launcher: ``torch.multiprocessing.spawn``.

The workers are started by real ``mp.spawn`` (2 processes) with ``MASTER_ADDR`` /
``MASTER_PORT`` in the environment, as the tutorial does; each writes what it saw to
a file of its own, which the test reads.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ddpstate
from ddpstate.errors import InvalidArgumentError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(index: int, world_size: int, folder: str, pass_rank: bool) -> None:
    report: dict[str, object] = {}
    try:
        if pass_rank:
            ctx = ddpstate.init_distributed(rank=index, world_size=world_size, timeout=60)
        else:
            ctx = ddpstate.init_distributed(timeout=60)
        model = ddpstate.wrap_ddp(nn.Linear(2, 2))
        report = {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "group_size": dist.get_world_size() if dist.is_initialized() else 1,
            "ddp": isinstance(model, nn.parallel.DistributedDataParallel),
            "local_rank": ddpstate.get_local_rank(),
        }
        if ctx.is_distributed:
            gathered = ddpstate.all_gather_object(ctx.rank)
            report["gathered"] = gathered
    except InvalidArgumentError as exc:
        report = {"error": type(exc).__name__, "message": str(exc)}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(folder, f"worker{index}.json").write_text(json.dumps(report))


def _spawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pass_rank: bool) -> list[dict]:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    mp.spawn(_worker, args=(2, str(tmp_path), pass_rank), nprocs=2, join=True)
    return [json.loads(Path(tmp_path, f"worker{i}.json").read_text()) for i in range(2)]


@pytest.mark.slow
def test_mp_spawn_workers_passing_rank_form_one_two_rank_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reports = _spawn(tmp_path, monkeypatch, pass_rank=True)
    assert [r["rank"] for r in reports] == [0, 1], reports
    for r in reports:
        assert r["world_size"] == 2 and r["group_size"] == 2, r
        assert r["ddp"] is True, "wrap_ddp must wrap in DDP on a 2-rank group"
        assert r["gathered"] == [0, 1]
    assert [r["local_rank"] for r in reports] == [0, 1]


@pytest.mark.slow
def test_mp_spawn_workers_without_rank_are_refused_instead_of_running_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reports = _spawn(tmp_path, monkeypatch, pass_rank=False)
    for r in reports:
        assert r.get("error") == "InvalidArgumentError", f"ran alone as a 1-rank job: {r}"
        message = str(r["message"])
        assert "MASTER_ADDR" in message and "MASTER_PORT" in message
        assert "init_distributed(rank=rank, world_size=world_size)" in message
        assert "mp.spawn" in message and "torchrun" in message


def test_master_addr_without_a_rank_is_refused_in_this_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(InvalidArgumentError, match=r"inside mp\.spawn, or launch with torchrun"):
        ddpstate.init_distributed()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"rank": 0}, "pass both rank= and world_size="),
        ({"rank": 2, "world_size": 2}, "rank must be in 0..1"),
        ({"rank": 0, "world_size": 0}, "the number of processes"),
        ({"init_method": "tcp://127.0.0.1:1"}, "needs rank= and world_size= too"),
        ({"rank": 0, "world_size": 2}, "set MASTER_ADDR and MASTER_PORT"),
    ],
)
def test_wrong_rank_arguments_name_the_fix(kwargs: dict, fix: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fix.replace(".", r"\.")):
        ddpstate.init_distributed(**kwargs)
    assert not dist.is_initialized()


def test_a_one_process_group_through_init_method(tmp_path: Path) -> None:
    ctx = ddpstate.init_distributed(
        rank=0, world_size=1, init_method=f"file://{tmp_path / 'rendezvous'}", backend="gloo"
    )
    try:
        assert (ctx.rank, ctx.world_size, ctx.backend) == (0, 1, "gloo")
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert ctx.device == torch.device("cpu")
    finally:
        dist.destroy_process_group()
