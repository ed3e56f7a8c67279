"""CheckpointManager on real 2-rank gloo jobs: resume bitwise, agree on the step, fail together."""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from ddpstate.errors import CheckpointWriteError
from ddpstate.keys import unwrap_model
from ddpstate.manager import MANIFEST_NAME, CheckpointManager, KeepBest
from ddpstate.sampler import ResumableDistributedSampler
from ddpstate.storage import is_temp_name
from tests.manager.test_manager import _assert_bitwise
from tests.multiproc import run_ranks

# --------------------------------------------------------------------------- a small DDP trainer


def _build(seed: int) -> tuple[dict[str, Any], DataLoader[Any]]:
    torch.manual_seed(seed)
    model = DDP(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)))
    head = nn.Linear(2, 1)
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    sgd = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)  # the data set is the same in every run
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 1, generator=g))
    sampler = ResumableDistributedSampler(data, seed=3)  # world size and rank from the group
    state = {
        "model": model,
        "head": head,
        "adam": adam,
        "sgd": sgd,
        "scheduler": torch.optim.lr_scheduler.StepLR(adam, step_size=2, gamma=0.5),
        "scaler": torch.amp.GradScaler("cpu", growth_interval=1),
        "sampler": sampler,
        "epoch": 0,
    }
    return state, DataLoader(data, batch_size=4, sampler=sampler)


def _step(state: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> None:
    noise = torch.randn_like(x) * 0.01  # draws from the RNG, like dropout or augmentation
    out = state["head"](state["model"](x + noise))
    loss = (out - y).square().mean()
    state["adam"].zero_grad()
    state["sgd"].zero_grad()
    scaler = state["scaler"]
    scaler.scale(loss).backward()
    scaler.step(state["adam"])
    scaler.step(state["sgd"])
    scaler.update()
    state["scheduler"].step()


def _contents(state: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in state.items():
        if isinstance(value, nn.Module):
            out[name] = dict(unwrap_model(value).state_dict())
        elif hasattr(value, "state_dict"):
            out[name] = value.state_dict()
        else:
            out[name] = value
    return out


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def _train_and_save(rank: int, world: int, directory: str, refs: str) -> dict[str, Any]:
    state, loader = _build(seed=0)
    state["sampler"].set_epoch(1)
    batches = iter(loader)
    for _ in range(5):
        _step(state, *next(batches))
    state["epoch"] = 1
    with CheckpointManager(directory) as manager:
        manager.save(5, state, metrics={"loss": 0.25})
    draws = _draws()
    torch.save(_contents(state), os.path.join(refs, f"rank{rank}.pt"))
    rest = [x.tolist() for x, _ in batches]
    return {"draws": draws, "rest": rest}


def _restore_and_report(rank: int, world: int, directory: str, refs: str) -> dict[str, Any]:
    state, loader = _build(seed=1)  # different weights: everything must come from the file
    with CheckpointManager(directory) as manager:
        step = manager.restore(state)
    draws = _draws()
    # Rank 0's state is the checkpoint's state, on every rank (DDP keeps them equal,
    # except BatchNorm statistics, which DDP broadcasts from rank 0 at each forward).
    reference = torch.load(os.path.join(refs, "rank0.pt"), weights_only=True)
    _assert_bitwise(_contents(state), reference)
    state["sampler"].set_epoch(state["sampler"].epoch)  # what a training loop does
    rest = [x.tolist() for x, _ in loader]
    return {"step": step, "draws": draws, "rest": rest}


@pytest.mark.slow
def test_save_then_restore_in_new_processes_is_bitwise(tmp_path: Path) -> None:
    directory, refs = str(tmp_path / "run"), str(tmp_path)
    before = run_ranks(_train_and_save, 2, args=(directory, refs))
    after = run_ranks(_restore_and_report, 2, args=(directory, refs))
    for rank in range(2):
        assert after[rank]["step"] == 5
        assert after[rank]["draws"] == before[rank]["draws"]  # each rank's own RNG
        assert after[rank]["rest"] == before[rank]["rest"]  # the rest of the epoch, exactly
        assert len(after[rank]["rest"]) == 3  # 32 samples per rank, 4 per batch, 5 done
    assert before[0]["rest"] != before[1]["rest"]


# --------------------------------------------------------------------------- rotation + fallback


def _save_series(rank: int, world: int, directory: str) -> list[int]:
    model = DDP(nn.Linear(8, 8))
    losses = {1: 0.1, 2: 0.9, 3: 0.8, 4: 0.7, 5: 0.6, 6: 0.5}
    with CheckpointManager(directory, keep_last=3, best=KeepBest(1, "loss")) as manager:
        for step, loss in losses.items():
            with torch.no_grad():
                model.module.weight.fill_(float(step))
            manager.save(step, {"model": model}, metrics={"loss": loss})
        return manager.steps()


def _restore_with_warnings(rank: int, world: int, directory: str, grown: str) -> dict[str, Any]:
    model = DDP(nn.Linear(8, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = CheckpointManager(directory).restore({"model": model})
        grown_step = CheckpointManager(grown).restore({"w": None})
    return {
        "step": step,
        "weight": float(model.module.weight[0, 0]),
        "warnings": [str(w.message) for w in caught],
        "grown_step": grown_step,
        "draw": torch.rand(3).tolist(),
    }


@pytest.mark.slow
def test_rotation_then_corrupted_checkpoints_fall_back_on_every_rank(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    kept = run_ranks(_save_series, 2, args=(str(directory),))
    assert kept == [[1, 4, 5, 6], [1, 4, 5, 6]]  # keep_last=3 plus the best loss (step 1)

    def folder(step: int) -> Path:
        return directory / f"step_{step:010d}"

    (folder(6) / MANIFEST_NAME).unlink()  # killed before the commit
    model_file = folder(5) / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:-64])  # truncated
    model_file = folder(4) / "model.pt"
    data = bytearray(model_file.read_bytes())
    data[-300] ^= 0x10  # one flipped bit
    model_file.write_bytes(bytes(data))

    # A one-process checkpoint, restored below by two ranks (the world grows).
    grown = tmp_path / "grown"
    with CheckpointManager(grown) as single:
        single.save(9, {"w": torch.ones(2)})
    parent_draw = torch.rand(3).tolist()

    results = run_ranks(_restore_with_warnings, 2, args=(str(directory), str(grown)))
    assert [r["step"] for r in results] == [1, 1]  # both ranks agree on the fallback
    assert [r["weight"] for r in results] == [1.0, 1.0]
    text = "\n".join(results[0]["warnings"])
    assert "step_0000000006: it has no manifest.json" in text
    assert "step_0000000005: model.pt is truncated" in text
    assert "step_0000000004: model.pt fails its checksum" in text
    assert "saved by 1 ranks and is restored by 2" in text
    assert results[1]["warnings"] == []  # rank 0 speaks for the job
    assert [r["grown_step"] for r in results] == [9, 9]
    assert results[0]["draw"] == parent_draw  # rank 0 takes the saved state
    assert results[1]["draw"] != parent_draw  # rank 1 derives its own


# --------------------------------------------------------------------------- async


def _async_snapshot(rank: int, world: int, directory: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(nn.Linear(1024, 1024))  # 4 MiB: the write outlasts the next optimizer step
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    with CheckpointManager(directory, async_save=True) as manager:
        model(torch.randn(4, 1024)).square().sum().backward()
        opt.step()
        expected = {k: v.clone() for k, v in model.module.state_dict().items()}
        manager.save(1, {"model": model, "optimizer": opt})
        returned_after = time.perf_counter()
        draw = torch.rand(3).tolist()
        for _ in range(3):  # training goes on while rank 0 writes
            opt.zero_grad()
            model(torch.randn(4, 1024)).square().sum().backward()
            opt.step()
        mutated_at = time.perf_counter()
        manager.wait()
    saved = torch.load(Path(manager.checkpoint_path(1)) / "model.pt", weights_only=True)
    _assert_bitwise(dict(saved), expected)
    assert not torch.equal(saved["weight"], model.module.weight.detach())
    return {"draw": draw, "mutated_after_return": mutated_at > returned_after}


@pytest.mark.slow
def test_async_checkpoint_is_the_state_at_save_time_on_2_ranks(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    results = run_ranks(_async_snapshot, 2, args=(str(directory),))
    assert all(r["mutated_after_return"] for r in results)
    # The world shrinks to this single process: warned, and rank 0's RNG comes back.
    with pytest.warns(UserWarning, match="saved by 2 ranks and is restored by 1"):
        step = CheckpointManager(directory).restore({"model": nn.Linear(1024, 1024)}, strict=False)
    assert step == 1
    assert torch.rand(3).tolist() == results[0]["draw"]


def _async_failure(rank: int, world: int, directory: str) -> dict[str, Any]:
    model = DDP(nn.Linear(1024, 1024))
    manager = CheckpointManager(directory, async_save=True)
    manager.save(1, {"small": torch.zeros(4)})
    manager.wait()
    if rank == 0:
        # A disk that fills up under the writer: the kernel refuses writes past 64 KiB.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    manager.save(2, {"small": torch.zeros(4), "model": model})  # returns before the failure
    try:
        manager.wait()
        message = None
    except CheckpointWriteError as exc:
        message = str(exc)
    if rank == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    steps = manager.steps()
    manager.save(3, {"small": torch.ones(4)})  # the job goes on after handling the error
    manager.close()
    return {"message": message, "steps_after_failure": steps, "steps": manager.steps()}


@pytest.mark.slow
def test_async_write_error_is_raised_on_every_rank(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    results = run_ranks(_async_failure, 2, args=(str(directory),))
    for result in results:
        assert result["message"] is not None
        assert "saving step 2" in result["message"]
        assert "rank 0: OSError: [Errno 27] File too large" in result["message"]
        assert result["steps_after_failure"] == [1]
        assert result["steps"] == [1, 3]
    assert not any(is_temp_name(p.name) for p in directory.rglob("*"))


# --------------------------------------------------------------------------- preemption

_TRAINER = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from ddpstate.manager import CheckpointManager

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    directory, ready = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": opt}
    manager = CheckpointManager(directory, keep_last=2, async_save=True, handle_signals=True,
                                timeout=60)
    step = 0
    while True:
        step += 1
        opt.zero_grad()
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()
        if step % 5 == 0:
            manager.save(step, state)  # async: often still writing when the signal comes
        if step == 3 and rank == 1:
            open(ready, "w").close()
        if manager.should_stop():
            manager.save(step, state)
            break
        if step > 20000:
            sys.exit(3)
        time.sleep(0.005)
    manager.close()
    print(f"STOPPED step={step} weight={float(model.module.weight[0, 0])!r}", flush=True)
    dist.destroy_process_group()
    """
)


def _restore_preempted(rank: int, world: int, directory: str) -> tuple[int | None, float]:
    model = DDP(nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = CheckpointManager(directory).restore({"model": model, "optimizer": opt})
    return step, float(model.module.weight[0, 0])


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_TRAINER)
    directory, ready = tmp_path / "run", tmp_path / "ready"
    store = dist.TCPStore(
        "127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_PORT": str(store.port)}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(directory), str(ready)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline, "rank 1 never reached step 3"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.05)
        time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGTERM)  # rank 1 only, as a scheduler might
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    lines = [
        next(line for line in out.splitlines() if line.startswith("STOPPED")) for out, _ in outputs
    ]
    assert lines[0] == lines[1]  # same step, same weights on both ranks
    stopped_step = int(lines[0].split()[1].split("=")[1])
    assert CheckpointManager(directory).latest_step() == stopped_step
    restored = run_ranks(_restore_preempted, 2, args=(str(directory),))
    weight = float(lines[0].split("weight=")[1])
    assert restored == [(stopped_step, weight), (stopped_step, weight)]
