"""Mistakes refused or handled on real 2-rank gloo groups (issue "No silent wrong results").

FSDP2 state (row 1), values weights_only loading could not restore (row 2) and
BatchNorm statistics that differ across ranks (row 10).
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ddpstate
from ddpstate.errors import DDPStateError, ShardedStateError
from tests.multiproc import run_ranks


@dataclass
class RunConfig:
    """A user's own data-only type (module level, so both ranks can import it)."""

    lr: float
    name: str


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except DDPStateError as exc:
        return type(exc).__name__, str(exc)
    return "", ""


# --------------------------------------------------------------------------- row 1: FSDP2


def _fsdp2_worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    manager = ddpstate.CheckpointManager(os.path.join(folder, "run"))
    # Sharded state goes through torch.distributed.checkpoint where it can (a folder given to
    # save(), models and their optimizers in CheckpointManager; tests/manager/test_dcp_manager.py);
    # these are the places it cannot, refused on every rank before anything is written.
    out = {
        "save": _outcome(lambda: ddpstate.save(model.state_dict(), os.path.join(folder, "m.pt"))),
        "save_st": _outcome(
            lambda: ddpstate.save(model.state_dict(), os.path.join(folder, "m.safetensors"))
        ),
        "save_model_state": _outcome(
            lambda: ddpstate.save_model_state(model, os.path.join(folder, "s.pt"))
        ),
        "manager_optimizer": _outcome(lambda: manager.save(2, {"optimizer": opt})),
        "manager_value": _outcome(lambda: manager.save(3, {"weights": model.state_dict()})),
    }
    out["steps"] = manager.steps()
    manager.close()
    return out


@pytest.mark.slow
def test_fsdp2_state_is_refused_where_dcp_cannot_serve_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_fsdp2_worker, 2, args=(str(tmp_path),), timeout=180)
    for rank, out in enumerate(results):
        assert out["steps"] == [], rank
        for case in ("save", "save_st", "save_model_state", "manager_optimizer", "manager_value"):
            kind, message = out[case]
            assert kind == "ShardedStateError", (rank, case, kind, message)
            assert "DTensor" in message and "torch.distributed.checkpoint" in message
        for case in ("save", "save_st", "save_model_state"):
            assert "give a folder path" in out[case][1].lower()
        # The first sharded key is named.
        assert "obj['0.weight']" in out["save"][1]
        assert "state['optimizer']" in out["manager_optimizer"][1]
        assert "state['weights']['0.weight']" in out["manager_value"][1]
    assert issubclass(ShardedStateError, ddpstate.CheckpointFormatError)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # not even the manager folder


# --------------------------------------------------------------------------- row 2: unsafe values


def _values_worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    config = RunConfig(lr=0.1, name="exp")
    plain = ddpstate.CheckpointManager(os.path.join(folder, "plain"))
    refused = _outcome(lambda: plain.save(1, {"best": np.float64(0.9), "config": {"run": config}}))
    steps_after_refusal = plain.steps()
    plain.save(2, {"best": np.float64(0.9), "arr": np.arange(3)})
    got: dict[str, Any] = {"best": None, "arr": None}
    plain.restore(got)
    allowed = ddpstate.CheckpointManager(os.path.join(folder, "allowed"), safe_globals=[RunConfig])
    allowed.save(1, {"config": config})
    back: dict[str, Any] = {"config": None}
    allowed.restore(back)
    return {
        "refused": refused,
        "steps_after_refusal": steps_after_refusal,
        "got": got,
        "config": back["config"],
    }


@pytest.mark.slow
def test_values_restore_cannot_read_are_refused_at_save_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_values_worker, 2, args=(str(tmp_path),), timeout=120)
    for out in results:
        kind, message = out["refused"]
        assert kind  # a DDPStateError on every rank
        assert "state['config']['run']" in message and "RunConfig" in message
        assert "safe_globals=[RunConfig]" in message
        assert out["steps_after_refusal"] == []
        assert out["got"]["best"] == np.float64(0.9) and type(out["got"]["best"]) is np.float64
        assert np.array_equal(out["got"]["arr"], np.arange(3))
        assert out["config"] == RunConfig(lr=0.1, name="exp")


# --------------------------------------------------------------------------- row 10: BatchNorm


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))


def _bn_worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ddpstate.wrap_ddp(_net(), batchnorm="auto")  # CPU: unsynced BatchNorm
    torch.manual_seed(100 + rank)  # each rank sees its own data: statistics drift apart
    model(torch.randn(8, 4) * (rank + 1)).sum().backward()
    bn = ddpstate.unwrap_model(model)[1]
    before = bn.running_mean.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddpstate.save_model_state(model, os.path.join(folder, "bn.pt"))
    save_warnings = [str(w.message) for w in caught]
    saved_by_save = ddpstate.load(os.path.join(folder, "bn.pt"))["1.running_mean"]
    # The manager averages the statistics of a wrap_ddp model itself, before saving.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ddpstate.CheckpointManager(os.path.join(folder, "run")) as manager:
            manager.save(1, {"model": model})
    manager_warnings = [str(w.message) for w in caught]
    saved = ddpstate.load(os.path.join(folder, "run", "step_0000000001", "model.pt"))
    # A DDP model made by hand with buffer broadcast off: the manager warns instead.
    plain = torch.nn.parallel.DistributedDataParallel(_net(), broadcast_buffers=False)
    torch.manual_seed(200 + rank)
    plain(torch.randn(8, 4) * (rank + 1)).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ddpstate.CheckpointManager(os.path.join(folder, "plain")) as manager:
            manager.save(1, {"model": plain})
    plain_warnings = [str(w.message) for w in caught]
    # DDP's default buffer broadcast makes rank 0's statistics the model's: no warning.
    default = torch.nn.parallel.DistributedDataParallel(_net())
    default(torch.randn(8, 4) * (rank + 1)).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddpstate.save_model_state(default, os.path.join(folder, "default.pt"))
    default_warnings = [str(w.message) for w in caught if "BatchNorm" in str(w.message)]
    return {
        "default_warnings": default_warnings,
        "before": before,
        "saved_by_save": saved_by_save,
        "save_warnings": save_warnings,
        "manager_warnings": manager_warnings,
        "saved": saved["1.running_mean"],
        "live": bn.running_mean.clone(),
        "plain_warnings": plain_warnings,
    }


@pytest.mark.slow
def test_unsynced_batchnorm_is_warned_about_or_synced_by_the_manager(tmp_path: Path) -> None:
    results = run_ranks(_bn_worker, 2, args=(str(tmp_path),), timeout=120)
    assert not torch.equal(results[0]["before"], results[1]["before"])
    mean = (results[0]["before"] + results[1]["before"]) / 2
    for rank, out in enumerate(results):
        # save_model_state: rank 0's statistics went to the file; rank 0 says so, once a job.
        assert torch.equal(out["saved_by_save"], results[0]["before"])
        named = [m for m in out["save_warnings"] if "BatchNorm running statistics differ" in m]
        if rank == 0:
            assert len(named) == 1 and "'1'" in named[0] and "sync_batchnorm_stats" in named[0]
        else:
            assert named == []
        # CheckpointManager: the average of both ranks, the same live on both, no warning.
        assert torch.allclose(out["saved"], mean) and torch.equal(out["live"], out["saved"])
        assert not [m for m in out["manager_warnings"] if "BatchNorm" in m]
        # The manager's save is one round to the writer, so the writer (rank 0) warns.
        plain = [m for m in out["plain_warnings"] if "BatchNorm running statistics differ" in m]
        if rank == 0:
            assert len(plain) == 1 and "entry 'model'" in plain[0]
        else:
            assert plain == []
        assert out["default_warnings"] == []


# ----------------------------------------------- BatchNorm checks only after the ranks agree


def _bn_order_worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    torch.manual_seed(rank)
    model = _net()
    model(torch.randn(8, 4))  # the ranks' statistics differ
    # An EMA model kept on rank 0 only: the entries differ, and the BatchNorm
    # check must not run (and hang or crash) before the save sees that.
    state: dict[str, Any] = {"model": model}
    if rank == 0:
        state["ema"] = _net()
    manager = ddpstate.CheckpointManager(os.path.join(folder, "ema"), timeout=20)
    ema = _outcome(lambda: manager.save(1, state))
    # Identical NaN statistics (a diverged run) are the same on both ranks: no warning.
    nan = _net()
    bn = nan[1]
    with torch.no_grad():
        bn.running_var.fill_(float("nan"))
        bn.running_mean.fill_(1.0)
    # Different statistics with equal sums on the two ranks: a warning.
    swapped = _net()
    with torch.no_grad():
        swapped[1].running_mean.copy_(torch.arange(6.0) if rank == 0 else torch.arange(6.0).flip(0))
    out: dict[str, list[str]] = {}
    for name, net in (("nan", nan), ("swapped", swapped)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddpstate.save_model_state(net, os.path.join(folder, f"{name}.pt"))
        out[name] = [str(w.message) for w in caught if "BatchNorm" in str(w.message)]
    # An async save snapshots the statistics after averaging them, not before.
    wrapped = ddpstate.wrap_ddp(_net(), batchnorm="auto")
    torch.manual_seed(300 + rank)
    wrapped(torch.randn(8, 4) * (rank + 1)).sum().backward()
    with ddpstate.CheckpointManager(os.path.join(folder, "async"), async_save=True) as writer:
        writer.save(1, {"model": wrapped})
    saved = ddpstate.load(os.path.join(folder, "async", "step_0000000001", "model.pt"))
    live = ddpstate.unwrap_model(wrapped)[1].running_mean
    return {"ema": ema, **out, "async_synced": torch.equal(saved["1.running_mean"], live)}


def _bn_alone_worker(rank: int, world: int, folder: str) -> tuple[str, str]:
    # save_model_state on rank 0 only: the save's own agreement fails, named as the save.
    if rank == 1:
        time.sleep(8)  # in no collective while rank 0 waits for it
        return "", ""
    torch.manual_seed(rank)
    model = _net()
    model(torch.randn(8, 4))
    return _outcome(
        lambda: ddpstate.save_model_state(model, os.path.join(folder, "alone.pt"), timeout=3)
    )


@pytest.mark.slow
def test_batchnorm_checks_run_after_the_ranks_agree(tmp_path: Path) -> None:
    results = run_ranks(_bn_order_worker, 2, args=(str(tmp_path),), timeout=150)
    for rank, out in enumerate(results):
        kind, message = out["ema"]
        assert kind == "InvalidArgumentError", (rank, out["ema"])
        assert "['ema', 'model']" in message and "['model']" in message
        assert out["nan"] == []
        if rank == 0:  # said once a job, by rank 0
            assert len(out["swapped"]) == 1 and "'1'" in out["swapped"][0]
        else:
            assert out["swapped"] == []
        assert out["async_synced"]
    assert not os.path.exists(tmp_path / "ema" / "step_0000000001")
    kind, message = run_ranks(_bn_alone_worker, 2, args=(str(tmp_path),), timeout=60)[0]
    assert kind == "BarrierTimeoutError" and "did not reach 'ddpstate.save'" in message, message


def _reuse_worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    manager = ddpstate.CheckpointManager(folder, timeout=30)
    refused = _outcome(lambda: manager.save(1, {"x": 1}))
    steps = manager.steps()
    manager.save(1, {"x": 1}, rollback=True)
    return {"refused": refused, "steps": steps, "after": manager.steps()}


@pytest.mark.slow
def test_a_reused_folder_is_not_rolled_back_on_any_rank(tmp_path: Path) -> None:
    with ddpstate.CheckpointManager(tmp_path) as earlier:  # an earlier run's checkpoint
        earlier.save(10, {"x": 10})
    results = run_ranks(_reuse_worker, 2, args=(str(tmp_path),), timeout=120)
    for out in results:
        kind, message = out["refused"]
        assert kind == "InvalidArgumentError" and "[10]" in message and "rollback=True" in message
    assert results[0]["steps"] == [10] and results[0]["after"] == [1]
