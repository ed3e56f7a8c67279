"""FSDP2 (DTensor) and writers="all" state through CheckpointManager and save(), on real gloo ranks.

Every restore is compared bitwise with the full (gathered) state the saving job had,
including resharding between world sizes 4 and 2.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ddpstate
from ddpstate._dcp import write as _dcp
from ddpstate._manifest import DCP_SUBDIR
from ddpstate.errors import DDPStateError
from tests.multiproc import run_ranks


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _fsdp(world: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = _net()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=gen)).pow(2).sum().backward()
        opt.step()


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole (gathered) model and optimizer state on rank 0 (CPU); a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    # Copies: on CPU the gathered tensors may be the live ones, which training changes later.
    return copy.deepcopy({"model": model_sd, "optim": optim_sd})


def _assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert sorted(map(str, a)) == sorted(map(str, b)), where
        for k in a:
            _assert_bitwise(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


# --------------------------------------------------------------------------- FSDP2 manager


def _fsdp_save(rank: int, world: int, folder: str) -> dict[str, Any]:
    model, opt = _fsdp(world)
    manager = ddpstate.CheckpointManager(folder, keep_last=2)
    _train(model, opt, rank)
    manager.save(1, {"model": model, "optimizer": opt, "epoch": 3})
    _train(model, opt, rank)
    manager.save(2, {"model": model, "optimizer": opt, "epoch": 4})
    steps = manager.steps()
    manager.close()
    return {"full": _full(model, opt), "steps": steps}


def _fsdp_restore(rank: int, world: int, folder: str, step: Any) -> dict[str, Any]:
    model, opt = _fsdp(world, seed=1)  # other initial weights, no optimizer state yet
    state: dict[str, Any] = {"model": model, "optimizer": opt, "epoch": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager = ddpstate.CheckpointManager(folder)
        got = manager.restore(state, step=step)
        manager.close()
    full = _full(model, opt)
    # Training goes on from the restored state (FSDP2 still works after set_state_dict).
    _train(model, opt, rank, steps=1)
    return {
        "step": got,
        "epoch": state["epoch"],
        "full": full,
        "warnings": [str(w.message) for w in caught],
    }


@pytest.mark.slow
@pytest.mark.parametrize(("saved_on", "restored_on"), [(2, 2), (4, 4), (4, 2), (2, 4)])
def test_fsdp2_model_and_optimizer_restore_bitwise_and_reshard(
    tmp_path: Path, saved_on: int, restored_on: int
) -> None:
    folder = str(tmp_path / "run")
    saved = run_ranks(_fsdp_save, saved_on, args=(folder,), timeout=150)
    assert saved[0]["steps"] == [1, 2]
    step_folder = tmp_path / "run" / "step_0000000002"
    listed = sorted(p.name for p in (step_folder / DCP_SUBDIR).iterdir())
    shards = [f"__{r}_0.distcp" for r in range(saved_on)]
    assert listed == sorted([".metadata", *shards, "manifest.json"])  # DurableWriter's commit
    assert ddpstate.verify_checkpoint(str(step_folder)).ok
    restored = run_ranks(_fsdp_restore, restored_on, args=(folder, None), timeout=150)
    for out in restored:
        assert out["step"] == 2 and out["epoch"] == 4
    # The gathered full state lives on rank 0 (cpu_offload gives the others nothing).
    _assert_bitwise(saved[0]["full"], restored[0]["full"])
    resharded = saved_on != restored_on
    assert any("saved by" in w for w in restored[0]["warnings"]) == resharded  # RNG note


def _fsdp_async_save(rank: int, world: int, folder: str) -> dict[str, Any]:
    model, opt = _fsdp(world)
    with ddpstate.CheckpointManager(folder, async_save=True) as manager:
        _train(model, opt, rank)
        manager.save(1, {"model": model, "optimizer": opt, "epoch": 3})
        _train(model, opt, rank)
        manager.save(2, {"model": model, "optimizer": opt, "epoch": 4})
        manager.wait()
        steps = manager.steps()
    return {"full": _full(model, opt), "steps": steps}


@pytest.mark.slow
def test_async_manager_saves_fsdp2_state_and_restores_it_bitwise(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    saved = run_ranks(_fsdp_async_save, 2, args=(folder,), timeout=150)
    assert saved[0]["steps"] == [1, 2]
    restored = run_ranks(_fsdp_restore, 2, args=(folder, None), timeout=150)
    assert [(out["step"], out["epoch"]) for out in restored] == [(2, 4), (2, 4)]
    _assert_bitwise(saved[0]["full"], restored[0]["full"])


def _gate_dcp_writes() -> threading.Event:
    """Hold this rank's background DCP write until the returned event is set (real write after)."""
    gate = threading.Event()
    real = _dcp.write_shards

    def gated(state_dict: Any, folder: str, *args: Any, **kwargs: Any) -> Any:
        gate.wait()
        return real(state_dict, folder, *args, **kwargs)

    _dcp.write_shards = gated  # type: ignore[assignment]
    return gate


def _async_save_gated(rank: int, world: int, folder: str) -> dict[str, Any]:
    model, opt = _fsdp(world)
    _train(model, opt, rank)
    gate = _gate_dcp_writes()
    with ddpstate.CheckpointManager(folder, async_save=True) as manager:
        manager.save(1, {"model": model, "optimizer": opt, "epoch": 3})
        # save() returned while no rank has written a shard: nothing is committed yet.
        step_folder = Path(manager.checkpoint_path(1))
        in_flight = {
            "steps": manager.steps(),
            "manifest": (step_folder / "manifest.json").exists(),
            "shards": sorted(p.name for p in step_folder.rglob("*.distcp")),
        }
        saved = _full(model, opt)
        # Training goes on (collectives on the default group) while the write waits...
        _train(model, opt, rank)
        after = _full(model, opt)
        gate.set()  # ...then the write runs from the snapshot taken in save()
        manager.wait()
        steps = manager.steps()
    return {"in_flight": in_flight, "saved": saved, "after": after, "steps": steps}


@pytest.mark.slow
def test_async_dcp_save_returns_before_the_shards_are_written_and_restores_the_snapshot(
    tmp_path: Path,
) -> None:
    folder = str(tmp_path / "run")
    out = run_ranks(_async_save_gated, 2, args=(folder,), timeout=150)
    for rank_out in out:
        assert rank_out["in_flight"] == {"steps": [], "manifest": False, "shards": []}
        assert rank_out["steps"] == [1]
    assert ddpstate.verify_checkpoint(str(tmp_path / "run" / "step_0000000001")).ok
    restored = run_ranks(_fsdp_restore, 2, args=(folder, None), timeout=150)
    assert [(r["step"], r["epoch"]) for r in restored] == [(1, 3), (1, 3)]
    # The values of save() time, not the ones training made while the write waited.
    _assert_bitwise(out[0]["saved"], restored[0]["full"])
    with pytest.raises(AssertionError):
        _assert_bitwise(out[0]["after"], restored[0]["full"])


def _async_save_fails(rank: int, world: int, folder: str) -> dict[str, Any]:
    model, opt = _fsdp(world)
    _train(model, opt, rank)
    gate = _gate_dcp_writes()
    state = {"model": model, "optimizer": opt, "epoch": 3}
    with ddpstate.CheckpointManager(folder, async_save=True, timeout=60) as manager:
        manager.save(1, state)
        if rank == 0:
            # A file where DCP's folder goes: every rank's write fails for real.
            (Path(manager.checkpoint_path(1)) / DCP_SUBDIR).write_bytes(b"in the way")
        ddpstate.barrier()
        gate.set()
        try:
            manager.save(2, state)
        except DDPStateError as exc:
            error = (type(exc).__name__, str(exc))
        else:
            error = None
        steps_after_failure = manager.steps()
        manager.save(2, state)  # the manager goes on working
        manager.wait()
        steps = manager.steps()
    return {"error": error, "steps_after_failure": steps_after_failure, "steps": steps}


@pytest.mark.slow
def test_a_failed_background_dcp_write_raises_on_every_rank_at_the_next_call(
    tmp_path: Path,
) -> None:
    folder = str(tmp_path / "run")
    out = run_ranks(_async_save_fails, 2, args=(folder,), timeout=150)
    assert out[0]["error"] is not None and out[0]["error"] == out[1]["error"]
    name, message = out[0]["error"]
    assert name == "CheckpointWriteError"
    assert "step 1" in message and "rank 0" in message and "rank 1" in message
    assert [o["steps_after_failure"] for o in out] == [[], []]
    assert [o["steps"] for o in out] == [[2], [2]]
    assert not (tmp_path / "run" / "step_0000000001").exists()  # the failed step's folder


def _kill_rank_one_mid_save(rank: int, world: int, folder: str) -> str:
    model, opt = _fsdp(world)
    manager = ddpstate.CheckpointManager(folder, timeout=6)
    _train(model, opt, rank)
    manager.save(1, {"model": model, "optimizer": opt, "epoch": 3})
    _train(model, opt, rank)
    if rank == 1:
        real = _dcp.write_shards

        def die_after_writing(state_dict: Any, folder: str, *args: Any, **kwargs: Any) -> Any:
            # Rank 1's shard is on disk (DCP's save returned); die before reporting it.
            real(state_dict, folder, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
            raise AssertionError("unreachable")

        _dcp.write_shards = die_after_writing  # type: ignore[assignment]
    try:
        manager.save(2, {"model": model, "optimizer": opt, "epoch": 4})
    except DDPStateError as exc:
        return type(exc).__name__
    return "saved"


@pytest.mark.slow
def test_a_rank_killed_mid_save_leaves_the_previous_step_restorable(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    saved = run_ranks(_fsdp_save, 2, args=(str(tmp_path / "ref"),), timeout=150)
    outcomes = run_ranks(
        _kill_rank_one_mid_save, 2, args=(folder,), timeout=150, expect_failure=True
    )
    assert outcomes[1] is None  # killed
    assert outcomes[0] == "BarrierTimeoutError"
    partial = tmp_path / "run" / "step_0000000002"
    assert (partial / DCP_SUBDIR / "__1_0.distcp").exists()  # its shard was written...
    assert not (partial / "manifest.json").exists()  # ...but the step was never committed
    assert ddpstate.CheckpointManager(folder).steps() == [1]
    restored = run_ranks(_fsdp_restore, 2, args=(folder, None), timeout=150)
    assert [out["step"] for out in restored] == [1, 1]
    # Step 1 of this run is the reference run's step 1 (same seeds, same data).
    reference = run_ranks(_fsdp_restore, 2, args=(str(tmp_path / "ref"), 1), timeout=150)
    _assert_bitwise(reference[0]["full"], restored[0]["full"])
    assert saved[0]["steps"] == [1, 2]


@pytest.mark.slow
def test_a_corrupted_shard_makes_restore_fall_back_with_a_warning_naming_it(
    tmp_path: Path,
) -> None:
    folder = str(tmp_path / "run")
    run_ranks(_fsdp_save, 2, args=(folder,), timeout=150)
    reference = run_ranks(_fsdp_restore, 2, args=(folder, 1), timeout=150)
    shard = tmp_path / "run" / "step_0000000002" / DCP_SUBDIR / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    check = ddpstate.verify_checkpoint(str(tmp_path / "run" / "step_0000000002"))
    assert not check.ok and any("dcp/__1_0.distcp fails its checksum" in p for p in check.problems)
    restored = run_ranks(_fsdp_restore, 2, args=(folder, None), timeout=150)
    assert [out["step"] for out in restored] == [1, 1]
    assert any("step_0000000002" in w and "dcp/__1_0.distcp" in w for w in restored[0]["warnings"])
    _assert_bitwise(reference[0]["full"], restored[0]["full"])


def _restore_named_step(rank: int, world: int, folder: str, step: int) -> str:
    model, opt = _fsdp(world, seed=1)
    manager = ddpstate.CheckpointManager(folder)
    try:
        manager.restore({"model": model, "optimizer": opt, "epoch": 0}, step=step)
    except ddpstate.CheckpointCorruptError as exc:
        return str(exc)
    finally:
        manager.close()
    return "restored"


@pytest.mark.slow
def test_a_named_step_with_a_corrupted_shard_is_refused_on_every_rank(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    run_ranks(_fsdp_save, 2, args=(folder,), timeout=150)
    shard = tmp_path / "run" / "step_0000000002" / DCP_SUBDIR / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0x01
    shard.write_bytes(bytes(data))
    outcomes = run_ranks(_restore_named_step, 2, args=(folder, 2), timeout=150)
    for text in outcomes:  # found while rank 0 read its shard; every rank is told
        assert "__0_0.distcp" in text and "step 2" in text, text


@pytest.mark.slow
def test_a_truncated_shard_or_missing_shard_manifest_is_found_before_loading(
    tmp_path: Path,
) -> None:
    folder = str(tmp_path / "run")
    run_ranks(_fsdp_save, 2, args=(folder,), timeout=150)
    step2 = tmp_path / "run" / "step_0000000002" / DCP_SUBDIR
    shard = step2 / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-3])
    restored = run_ranks(_fsdp_restore, 2, args=(folder, None), timeout=150)
    assert [out["step"] for out in restored] == [1, 1]
    assert any("dcp/__1_0.distcp is truncated" in w for w in restored[0]["warnings"])
    (tmp_path / "run" / "step_0000000001" / DCP_SUBDIR / "manifest.json").unlink()
    outcomes = run_ranks(_restore_named_step, 2, args=(folder, 1), timeout=150)
    assert all("dcp/manifest.json is missing" in text for text in outcomes), outcomes


def _rchar() -> int:
    """Bytes this process has read through read() calls so far (page cache or not)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _big_fsdp(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # 2 MiB of float32
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _read_once(rank: int, world: int, folder: str) -> int:
    model, opt = _big_fsdp(world, 0)
    opt.zero_grad()
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    manager = ddpstate.CheckpointManager(folder)
    manager.save(1, {"model": model, "optimizer": opt})
    manager.save(2, {"model": model, "optimizer": opt})
    manager.restore({"model": model, "optimizer": opt}, step=1)  # imports and warms up
    before = _rchar()
    manager.restore({"model": model, "optimizer": opt}, step=2)
    read = _rchar() - before
    manager.close()
    return read


@pytest.mark.slow
def test_restore_reads_each_shard_byte_once_to_check_and_once_to_load(tmp_path: Path) -> None:
    """The CRC pass before loading is split across the ranks (each byte read by one rank),
    then each rank reads its own shards into the live state: twice the shards in all."""
    folder = tmp_path / "run"
    read = run_ranks(_read_once, 2, args=(str(folder),), timeout=150)
    shards = sum(p.stat().st_size for p in (folder / "step_0000000002" / DCP_SUBDIR).iterdir())
    assert shards > 6 << 20  # weights and Adam's two moments
    # Every rank checking every byte would make this at least 3x the shards on 2 ranks.
    assert sum(read) < 2.3 * shards, (read, shards)


@pytest.mark.slow
def test_an_unlisted_shard_fails_verification(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    run_ranks(_fsdp_save, 2, args=(folder,), timeout=150)
    step = tmp_path / "run" / "step_0000000002"
    (step / DCP_SUBDIR / "__7_0.distcp").write_bytes(b"stray")
    check = ddpstate.verify_checkpoint(str(step))
    assert not check.ok and any("dcp/__7_0.distcp is not listed" in p for p in check.problems)


# --------------------------------------------------------------------------- writers="all" (DDP)


def _ddp_save_all(rank: int, world: int, folder: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(_net())
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt, rank)
    with ddpstate.CheckpointManager(folder, writers="all") as manager:
        manager.save(5, {"model": model, "optimizer": opt, "epoch": 7})
    return {"model": model.module.state_dict(), "optim": opt.state_dict()}


def _restore_ddp(rank: int, world: int, folder: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(1)
    model = DistributedDataParallel(_net())
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "epoch": 0}
    with ddpstate.CheckpointManager(folder, writers="all") as manager:
        step = manager.restore(state)
    return {
        "step": step,
        "epoch": state["epoch"],
        "model": model.module.state_dict(),
        "optim": opt.state_dict(),
    }


def _restore_fsdp_from_ddp(rank: int, world: int, folder: str) -> dict[str, Any]:
    model, opt = _fsdp(world, seed=1)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "epoch": 0}
    with ddpstate.CheckpointManager(folder) as manager:
        step = manager.restore(state)
    return {"step": step, "full": _full(model, opt)}


@pytest.mark.slow
def test_ddp_writers_all_splits_the_write_and_restores_into_ddp_fsdp2_and_plain(
    tmp_path: Path,
) -> None:
    folder = str(tmp_path / "run")
    saved = run_ranks(_ddp_save_all, 2, args=(folder,), timeout=150)
    _assert_bitwise(saved[0], saved[1])  # replicated
    step = tmp_path / "run" / "step_0000000005"
    shards = sorted((step / DCP_SUBDIR).glob("*.distcp"))
    # The dedup planner gave each rank a part of the replicated state to write.
    assert [p.name for p in shards] == ["__0_0.distcp", "__1_0.distcp"]
    assert all(p.stat().st_size > 200 for p in shards)
    assert sorted(p.name for p in step.iterdir() if p.suffix == ".pt") == ["_rng.pt", "epoch.pt"]
    assert ddpstate.verify_checkpoint(str(step)).ok

    for out in run_ranks(_restore_ddp, 2, args=(folder,), timeout=150):
        assert out["step"] == 5 and out["epoch"] == 7
        _assert_bitwise(saved[0]["model"], out["model"])
        _assert_bitwise(saved[0]["optim"], out["optim"])

    fsdp = run_ranks(_restore_fsdp_from_ddp, 2, args=(folder,), timeout=150)
    assert fsdp[0]["step"] == 5
    _assert_bitwise(saved[0]["model"], fsdp[0]["full"]["model"])

    # A plain model in this (non-distributed) process, through the manager.
    torch.manual_seed(1)
    plain = _net()
    opt = torch.optim.Adam(plain.parameters(), lr=0.1)
    state: dict[str, Any] = {"model": plain, "optimizer": opt, "epoch": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the RNG note: saved by 2 ranks, restored by 1
        assert ddpstate.CheckpointManager(folder).restore(state) == 5
    _assert_bitwise(saved[0]["model"], plain.state_dict())
    _assert_bitwise(saved[0]["optim"], opt.state_dict())
    assert state["epoch"] == 7


def test_writers_must_be_rank0_or_all(tmp_path: Path) -> None:
    with pytest.raises(ddpstate.InvalidArgumentError, match="writers='some'"):
        ddpstate.CheckpointManager(str(tmp_path), writers="some")


# ------------------------------------------------------------------------ save() on DTensor state


def _save_sharded(rank: int, world: int, folder: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    model, opt = _fsdp(world)
    _train(model, opt, rank)
    target = os.path.join(folder, "model_dcp")
    if rank == 0:
        os.makedirs(target)
        (Path(target) / "old.txt").write_text("the previous folder")
    ddpstate.save(model.state_dict(), target)
    ddpstate.save_model_state(model, os.path.join(folder, "weights_dcp"))
    # torch's own reader takes the folder as it is (into fresh shards of another model).
    other, _ = _fsdp(world, seed=1)
    loaded = other.state_dict()
    dcp.load(loaded, checkpoint_id=target)
    other.load_state_dict(loaded)
    refused = ""
    try:
        ddpstate.save(model.state_dict(), os.path.join(folder, "model.pt"))
    except ddpstate.ShardedStateError as exc:
        refused = str(exc)
    return {
        "full": _full(model, opt)["model"],
        "loaded": _full(other, torch.optim.Adam(other.parameters()))["model"],
        "refused": refused,
    }


@pytest.mark.slow
def test_save_writes_sharded_state_as_a_committed_dcp_folder(tmp_path: Path) -> None:
    results = run_ranks(_save_sharded, 2, args=(str(tmp_path),), timeout=150)
    target = tmp_path / "model_dcp"
    assert sorted(p.name for p in target.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "manifest.json",
    ]  # the old folder was replaced whole, atomically
    check = ddpstate.verify_checkpoint(str(target))
    assert check.ok and check.files == 3, check.problems
    assert ddpstate.verify_checkpoint(str(tmp_path / "weights_dcp")).ok
    # Read back whole in one plain process (no process group), as ddpstate.load does today.
    _assert_bitwise(results[0]["full"], ddpstate.load(str(target), map_location="cpu"))
    _assert_bitwise(results[0]["full"], ddpstate.load(str(tmp_path / "weights_dcp")))
    _assert_bitwise(results[0]["full"], results[0]["loaded"])
    for out in results:
        assert "give a folder path" in out["refused"].lower()
        assert "obj['0.weight']" in out["refused"]
    assert not (tmp_path / "model.pt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_async_writers_all_without_a_process_group_saves_in_the_background(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = _net()
    saved = copy.deepcopy(model.state_dict())
    with ddpstate.CheckpointManager(tmp_path, async_save=True, writers="all") as manager:
        manager.save(1, {"model": model})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # after save() returned: not in the checkpoint
        manager.wait()
        assert manager.steps() == [1]
        assert (tmp_path / "step_0000000001" / DCP_SUBDIR / ".metadata").exists()
        assert manager.restore({"model": model}) == 1
    _assert_bitwise(saved, model.state_dict())
