"""sync_batchnorm_stats, wrap_ddp's policies and the in-place explanation on 2 real gloo ranks."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpstate._ddp_buffers as bnmod
from ddpstate.batchnorm import (
    BatchNormBufferSyncError,
    explain_ddp_errors,
    sync_batchnorm_stats,
    wrap_ddp,
)
from ddpstate.errors import BatchNormPolicyError, DDPStateError
from tests.multiproc import run_ranks


def _net() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(
        nn.Linear(4, 8),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8, momentum=None),
        nn.ReLU(),
        nn.Linear(8, 1),
    )


def _stats(model: nn.Module) -> dict[str, list[float]]:
    return {
        k: v.double().flatten().tolist()
        for k, v in model.state_dict().items()
        if "running" in k or "num_batches" in k
    }


def _buffer_sync_flag(ddp: DistributedDataParallel) -> bool:
    # torch >= 2.13 stores forward_sync_buffers (broadcast_buffers is its alias).
    return bool(getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None)))


# --------------------------------------------------------------------------- sync_batchnorm_stats


def _stats_rank(rank: int, world: int) -> dict[str, Any]:
    model = _net()
    model.train()
    model[4].double()  # a float64 layer travels in its own precision
    # Different data per rank, and rank 1 takes one extra step: different statistics.
    torch.manual_seed(100 + rank)
    for _ in range(3 + rank):
        model[4](model[3](torch.relu(model[1](model[0](torch.randn(16, 4) * (rank + 1))))).double())
    before = _stats(model)
    wrapped = DistributedDataParallel(model, forward_sync_buffers=False)  # syncs through wrappers
    # DDP's init sync copied rank 0's buffers; undo that so the ranks differ again.
    with torch.no_grad():
        for name, value in model.state_dict().items():
            if name in before:
                value.copy_(torch.tensor(before[name], dtype=torch.float64).view_as(value))
    sync_batchnorm_stats(wrapped)
    mean_result = _stats(model)
    # op="broadcast": rank 0's values everywhere.
    with torch.no_grad():
        model[1].running_mean.fill_(float(rank + 10))
    sync_batchnorm_stats(model, op="broadcast")
    broadcast_mean = model[1].running_mean.tolist()
    # A rank whose model differs is named, not left hanging.
    odd = nn.Sequential(nn.BatchNorm1d(8 if rank == 0 else 9))
    try:
        sync_batchnorm_stats(odd, timeout=30)
        mismatch = ""
    except DDPStateError as exc:
        mismatch = str(exc)
    return {
        "before": before,
        "mean": mean_result,
        "broadcast": broadcast_mean,
        "mismatch": mismatch,
        "dtype": str(model[4].running_mean.dtype),
    }


@pytest.mark.slow
def test_sync_batchnorm_stats_averages_across_ranks() -> None:
    r0, r1 = run_ranks(_stats_rank, 2)
    assert r0["before"]["1.running_mean"] != r1["before"]["1.running_mean"]  # really different
    assert r0["mean"] == r1["mean"]  # bitwise the same on both ranks
    for key, values in r0["mean"].items():
        if "num_batches" in key:
            # The counts become consistent: the larger one (rank 1 took 4 steps).
            assert values == [4.0] == r1["before"][key]
            continue
        expected = (
            torch.tensor(r0["before"][key], dtype=torch.float64)
            + torch.tensor(r1["before"][key], dtype=torch.float64)
        ) / 2
        assert torch.allclose(
            torch.tensor(values, dtype=torch.float64), expected, rtol=1e-6, atol=1e-7
        ), key
    assert r0["dtype"] == "torch.float64"
    assert r0["broadcast"] == r1["broadcast"] == [10.0] * 8
    assert "ranks 1" in r0["mismatch"] and "same model" in r1["mismatch"]


# --------------------------------------------------------------------------- wrap_ddp policies


def _policies_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        wrap_ddp(_net(), batchnorm="sync")
        out["sync"] = "no error"
    except BatchNormPolicyError as exc:
        out["sync"] = str(exc)

    unsynced = wrap_ddp(_net(), batchnorm="unsynced")
    out["unsynced"] = (type(unsynced).__name__, _buffer_sync_flag(unsynced))
    auto = wrap_ddp(_net())
    out["auto"] = (type(auto).__name__, _buffer_sync_flag(auto), type(auto.module[1]).__name__)
    keep = wrap_ddp(_net(), batchnorm="keep")
    out["keep_default"] = _buffer_sync_flag(keep)
    keep_off = wrap_ddp(_net(), batchnorm="keep", broadcast_buffers=False)
    keep_new_name = wrap_ddp(_net(), batchnorm="keep", forward_sync_buffers=False)
    out["keep_off"] = (_buffer_sync_flag(keep_off), _buffer_sync_flag(keep_new_name))
    out["no_bn_auto"] = _buffer_sync_flag(wrap_ddp(nn.Linear(2, 2)))
    try:
        wrap_ddp(_net(), broadcast_buffers=True)
        out["contradiction"] = "no error"
    except BatchNormPolicyError as exc:
        out["contradiction"] = str(exc)
    try:
        wrap_ddp(nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2)), batchnorm="keep")
        out["keep_syncbn_cpu"] = "no error"
    except BatchNormPolicyError as exc:
        out["keep_syncbn_cpu"] = str(exc)

    # A two-view model: two forwards, one backward, under what "auto" picks (unsynced on CPU).
    model = wrap_ddp(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(7 + rank)
    for _ in range(3):
        a, b = model(torch.randn(16, 4)), model(torch.randn(16, 4) * 2)
        loss = ((a - b) ** 2).mean() + (a**2).mean()
        optimizer.zero_grad()
        with explain_ddp_errors(model):
            loss.backward()
        optimizer.step()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    out["params_equal"] = all(torch.equal(gathered[0], g) for g in gathered)
    out["params_moved"] = not torch.equal(
        params, torch.cat([p.flatten() for p in _net().parameters()])
    )
    out["stats_before_sync"] = _stats(model.module)
    sync_batchnorm_stats(model)
    out["stats_after_sync"] = _stats(model.module)
    return out


@pytest.mark.slow
def test_wrap_ddp_policies_on_cpu_and_two_forwards_train() -> None:
    r0, r1 = run_ranks(_policies_rank, 2, timeout=120)
    for r in (r0, r1):
        assert "needs GPU modules" in r["sync"] and "batchnorm='unsynced'" in r["sync"]
        assert r["unsynced"] == ("DistributedDataParallel", False)
        assert r["auto"] == ("DistributedDataParallel", False, "BatchNorm1d")
        assert r["keep_default"] is True
        assert r["keep_off"] == (False, False)
        assert r["no_bn_auto"] is True  # no BatchNorm: "auto" keeps DDP's default
        assert (
            "chose 'unsynced'" in r["contradiction"]
            and "broadcast_buffers=True" in r["contradiction"]
        )
        assert "SyncBatchNorm layers" in r["keep_syncbn_cpu"] and "unsynced" in r["keep_syncbn_cpu"]
        assert r["params_equal"] and r["params_moved"]
    # Unsynced BatchNorm: the ranks' statistics drift apart, and sync makes them agree.
    assert r0["stats_before_sync"] != r1["stats_before_sync"]
    assert r0["stats_after_sync"] == r1["stats_after_sync"]


# --------------------------------------------------------------------------- the in-place error


def _pre_2_13_buffer_sync(ddp: DistributedDataParallel) -> None:
    """What DDP's per-forward buffer sync did before torch 2.13 (pytorch#175024).

    Rank 0's buffers are broadcast and copied into every replica's buffers with
    ``copy_``, which bumps their autograd version counters. torch 2.13's DDP
    restores the counters afterwards (pytorch#175851), so on this torch DDP no
    longer raises by itself and the old copy is performed here.
    """
    with torch.no_grad():
        for buf in ddp.module.buffers():
            incoming = buf.detach().clone()
            dist.broadcast(incoming, src=0)
            buf.copy_(incoming)


def _explain_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(3 + rank)
    x1, x2 = torch.randn(8, 4), torch.randn(8, 4)

    ddp = wrap_ddp(_net(), batchnorm="keep")  # broadcast_buffers left on
    y1 = ddp(x1)
    _pre_2_13_buffer_sync(ddp)
    y2 = ddp(x2)
    try:
        with explain_ddp_errors(ddp):
            (y1.sum() + y2.sum()).backward()
        out["explained"] = None
    except BatchNormBufferSyncError as exc:
        out["explained"] = (
            str(exc),
            type(exc.__cause__).__name__,
            str(exc.__cause__),
            isinstance(exc, RuntimeError),
            isinstance(exc, DDPStateError),
        )

    # Broadcast off: not DDP's doing, so torch's error passes through unchanged.
    off = wrap_ddp(_net(), batchnorm="unsynced")
    y1 = off(x1)
    _pre_2_13_buffer_sync(off)
    y2 = off(x2)
    try:
        with explain_ddp_errors(off):
            (y1.sum() + y2.sum()).backward()
        out["unexplained"] = None
    except RuntimeError as exc:
        out["unexplained"] = (type(exc).__name__, str(exc))

    # wrap_ddp's own guard, as installed on a torch whose DDP still trips autograd.
    bnmod.DDP_SYNC_KEEPS_VERSIONS = False
    guarded = wrap_ddp(_net(), batchnorm="keep")
    with warnings.catch_warnings(record=True) as one_by_one:
        warnings.simplefilter("always")
        for _ in range(2):
            guarded(x1).sum().backward()  # forward, backward, forward, backward: fine
    with warnings.catch_warnings(record=True) as two_forwards:
        warnings.simplefilter("always")
        for _ in range(2):
            (guarded(x1).sum() + guarded(x2).sum()).backward()
    out["guard"] = ([str(w.message) for w in one_by_one], [str(w.message) for w in two_forwards])
    unguarded = wrap_ddp(_net(), batchnorm="unsynced")
    with warnings.catch_warnings(record=True) as none:
        warnings.simplefilter("always")
        (unguarded(x1).sum() + unguarded(x2).sum()).backward()
    out["unguarded"] = [str(w.message) for w in none if "ddpstate" in str(w.message)]
    return out


@pytest.mark.slow
def test_inplace_error_is_explained_and_chained() -> None:
    for rank, r in enumerate(run_ranks(_explain_rank, 2, timeout=120)):
        assert r["explained"] is not None, "the in-place autograd error did not happen"
        message, cause_type, cause, is_runtime, is_ddpstate = r["explained"]
        assert cause_type == "RuntimeError" and "modified by an inplace operation" in cause
        assert is_runtime and is_ddpstate
        assert "modified by an inplace operation" in message
        assert "broadcast_buffers=True" in message
        assert "BatchNorm layers ('1', '4')" in message
        assert "batchnorm='sync'" in message and "batchnorm='unsynced'" in message
        assert "sync_batchnorm_stats" in message
        assert r["unexplained"][0] == "RuntimeError"
        assert "modified by an inplace operation" in r["unexplained"][1]
        assert "ddpstate" not in r["unexplained"][1]
        assert r["unguarded"] == []
        one_by_one, two_forwards = r["guard"]
        assert one_by_one == []
        if rank:  # said once a job, by rank 0 (every rank runs the same steps)
            assert two_forwards == []
            continue
        assert len(two_forwards) == 1  # once, not on every step
        assert "forward started before the previous forward's backward" in two_forwards[0]
        assert "batchnorm='unsynced'" in two_forwards[0]


def test_buffer_sync_keyword_matches_this_torch() -> None:
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    expected = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    assert expected == bnmod.BUFFER_SYNC_KWARG
