"""SyncBatchNorm and the in-place BatchNorm error under real DDP on CUDA with NCCL.

One rank per GPU (two when the machine has two, else one: NCCL refuses two
ranks on one GPU). Skipped without CUDA.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpstate._ddp_buffers as bnmod
from ddpstate.batchnorm import (
    BatchNormBufferSyncError,
    explain_ddp_errors,
    revert_sync_batchnorm,
    sync_batchnorm_stats,
    wrap_ddp,
)
from tests.multiproc import run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not dist.is_nccl_available(),
        reason="needs CUDA and NCCL: SyncBatchNorm only runs on GPU modules, and the in-place "
        "error of DDP's buffer broadcast is a GPU training failure",
    ),
]


def _world() -> int:
    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def _nccl(fn: Callable[[int, int], Any], rank: int, world: int) -> Any:
    # run_ranks hosts the rendezvous store in the parent; join it and use NCCL.
    store = dist.TCPStore(
        "127.0.0.1",
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(seconds=60),
    )
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        return fn(rank, world)
    finally:
        dist.destroy_process_group()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 1),
    )


def _two_view_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    a = model(torch.randn(8, 3, 16, 16, device=f"cuda:{rank}"))
    b = model(torch.randn(8, 3, 16, 16, device=f"cuda:{rank}") * 2)
    optimizer.zero_grad()
    with explain_ddp_errors(model):
        (((a - b) ** 2).mean() + (a**2).mean()).backward()
    optimizer.step()


def _inner(model: nn.Module) -> nn.Module:
    # wrap_ddp returns the model itself in a one-rank group (one GPU): no DDP wrapper.
    return model.module if isinstance(model, DistributedDataParallel) else model


def _gathered_equal(t: torch.Tensor, world: int, *, exact: bool) -> bool:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    if exact:
        return all(torch.equal(parts[0], p) for p in parts)
    return all(torch.allclose(parts[0], p, rtol=1e-4, atol=1e-5) for p in parts)


def _sync_rank(rank: int, world: int) -> dict[str, Any]:
    model = wrap_ddp(_net(), batchnorm="sync")
    layer_types = [type(m).__name__ for m in _inner(model) if "Norm" in type(m).__name__]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(10 + rank)  # different data per rank
    for _ in range(3):
        _two_view_step(model, optimizer, rank)  # SyncBatchNorm: no in-place error
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    stats = torch.cat([b.detach().float().flatten() for b in _inner(model).buffers()])
    # Back to plain BatchNorm for single-device CPU inference: same eval outputs.
    model.eval()
    x = torch.randn(4, 3, 16, 16, device=f"cuda:{rank}")
    with torch.no_grad():
        on_gpu = model(x).cpu()
    plain = revert_sync_batchnorm(model).cpu().eval()
    with torch.no_grad():
        on_cpu = plain(x.cpu())
    return {
        "converted": layer_types,
        "reverted": [type(m).__name__ for m in plain if "Norm" in type(m).__name__],
        "params_equal": _gathered_equal(params, world, exact=True),
        "stats_equal": _gathered_equal(stats.cuda(rank), world, exact=False),
        "cpu_matches_gpu": torch.allclose(on_gpu, on_cpu, rtol=1e-4, atol=1e-5),
    }


def _sync_entry(rank: int, world: int) -> dict[str, Any]:
    return _nccl(_sync_rank, rank, world)  # type: ignore[no-any-return]


def test_syncbatchnorm_trains_under_ddp_and_reverts_for_cpu() -> None:
    for r in run_ranks(_sync_entry, _world(), timeout=240, init_pg=False):
        assert r["converted"] == ["SyncBatchNorm", "SyncBatchNorm"]
        assert r["reverted"] == ["BatchNorm2d", "BatchNorm2d"]
        assert r["params_equal"] and r["stats_equal"] and r["cpu_matches_gpu"]


def _emulated_pre_2_13_sync(ddp: DistributedDataParallel) -> None:
    # DDP before torch 2.13 copied rank 0's buffers in place with copy_ (which
    # bumps autograd version counters); see tests/batchnorm/test_batchnorm_dist.py.
    with torch.no_grad():
        for buf in ddp.module.buffers():
            incoming = buf.detach().clone()
            dist.broadcast(incoming, src=0)
            buf.copy_(incoming)


def _inplace_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"ddp_fixed_upstream": bnmod.DDP_SYNC_KEEPS_VERSIONS}
    device = f"cuda:{rank}"
    torch.manual_seed(20 + rank)
    x1, x2 = torch.randn(8, 3, 16, 16, device=device), torch.randn(8, 3, 16, 16, device=device)

    # Plain DDP with the default broadcast_buffers=True: two forwards, one backward.
    ddp = DistributedDataParallel(_net().to(device), device_ids=[rank])
    y1 = ddp(x1)
    if bnmod.DDP_SYNC_KEEPS_VERSIONS:
        _emulated_pre_2_13_sync(ddp)  # this torch's DDP no longer trips autograd by itself
    y2 = ddp(x2)
    try:
        with explain_ddp_errors(ddp):
            (y1.sum() + y2.sum()).backward()
        out["plain_ddp"] = "no error"
    except BatchNormBufferSyncError as exc:
        out["plain_ddp"] = (str(exc), str(exc.__cause__))

    # The same with real DDP only, to record what this torch does.
    ddp = DistributedDataParallel(_net().to(device), device_ids=[rank])
    try:
        (ddp(x1).sum() + ddp(x2).sum()).backward()
        out["real_ddp_only"] = "no error"
    except RuntimeError as exc:
        out["real_ddp_only"] = str(exc)

    # wrap_ddp's "auto" choice trains the two-view model.
    model = wrap_ddp(_net())
    out["auto_layers"] = sorted(
        {type(m).__name__ for m in _inner(model) if "Norm" in type(m).__name__}
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        _two_view_step(model, optimizer, rank)
    sync_batchnorm_stats(model)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    out["auto_params_equal"] = _gathered_equal(params, world, exact=True)
    # And "unsynced" explicitly (the CPU-style fix) on GPU.
    model = wrap_ddp(_net(), batchnorm="unsynced")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        _two_view_step(model, optimizer, rank)
    out["unsynced_ok"] = True
    return out


def _inplace_entry(rank: int, world: int) -> dict[str, Any]:
    return _nccl(_inplace_rank, rank, world)  # type: ignore[no-any-return]


def test_inplace_error_reproduced_explained_and_avoided() -> None:
    for r in run_ranks(_inplace_entry, _world(), timeout=240, init_pg=False):
        assert r["plain_ddp"] != "no error", "two forwards with broadcast_buffers=True did not fail"
        message, cause = r["plain_ddp"]
        assert "modified by an inplace operation" in cause
        assert "batchnorm='sync'" in message and "batchnorm='unsynced'" in message
        if r["ddp_fixed_upstream"]:
            assert r["real_ddp_only"] == "no error"  # pytorch#175851
        else:
            assert "modified by an inplace operation" in r["real_ddp_only"]
        expected = ["SyncBatchNorm"] if _world() > 1 else ["BatchNorm2d"]
        assert r["auto_layers"] == expected
        assert r["auto_params_equal"] and r["unsynced_ok"]
