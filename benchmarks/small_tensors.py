"""Many small tensors (issue 42): a ``CheckpointManager`` on 2 gloo ranks against torch.

The state is MoE-shaped: 40 layers, each a router (64 x 16) and 64 experts of
10 tensors (three 512-element matrices, biases and two norms), 25,640
float32 tensors, about 16.4 MiB, held as one ``nn.Module`` (no optimizer:
an Adam state would triple the tensor count, the same per-tensor costs).
Two real processes on 127.0.0.1 (gloo) build the same model (same seed), as
DDP replicas do, and per repeat, alternating which side goes first, time:

* save: ``CheckpointManager.save`` (sync) against rank 0's
  ``torch.save(model.state_dict())`` + fsync and a barrier;
* async: the ``save()`` call of a ``CheckpointManager(async_save=True)`` (the
  time the training loop is blocked; the write is waited for untimed; the
  first save, which allocates the snapshot buffers, is left out) against the
  sync save of the same repeat;
* restore: ``CheckpointManager.restore`` against ``torch.load(path,
  weights_only=True)`` (the target) and against
  ``model.load_state_dict(torch.load(...))`` (what a user's restore does; for
  information) on every rank, each read evicted from the page cache first.

Each run's time is the maximum over the ranks, then the median over repeats.
Targets (issue 42): save <= 1.3x, async call <= 0.10x of a sync save,
restore <= 1.2x torch.load.
The CRC-32 implementation in use is printed and recorded in the notes.

    python -m benchmarks --only small_tensors --repeats 5
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import Results, Settings, Timing

WORLD = 2
LAYERS, EXPERTS = 40, 64
#: One expert's 10 tensors: name -> shape (1,680 float32 elements).
EXPERT_SHAPES = {
    "w1": (32, 16), "w2": (16, 32), "w3": (32, 16), "b1": (32,), "b2": (16,), "b3": (32,),
    "norm1.weight": (16,), "norm1.bias": (16,), "norm2.weight": (16,), "norm2.bias": (16,),
}  # fmt: skip
TENSORS = LAYERS * (EXPERTS * len(EXPERT_SHAPES) + 1)


def make_model() -> Any:
    """The MoE-shaped module (seeded: every rank builds the same one)."""
    import torch
    from torch import nn

    torch.manual_seed(0)

    def expert() -> nn.Module:
        module = nn.Module()
        for name, shape in EXPERT_SHAPES.items():
            owner = module
            if "." in name:
                sub, name = name.split(".")
                if not hasattr(module, sub):
                    module.add_module(sub, nn.Module())
                owner = getattr(module, sub)
            owner.register_parameter(name, nn.Parameter(torch.randn(shape)))
        return module

    layers = nn.ModuleList()
    for _ in range(LAYERS):
        layer = nn.Module()
        layer.router = nn.Parameter(torch.randn(EXPERTS, 16))
        layer.experts = nn.ModuleList(expert() for _ in range(EXPERTS))
        layers.append(layer)
    model = nn.Module()
    model.layers = layers
    return model


def _worker(rank: int, repeats: int, folder: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from ddpstate.manager import CheckpointManager

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = make_model()
    torch_path = folder / "torch.pt"
    sync = CheckpointManager(folder / "sync", keep_last=1)
    async_ = CheckpointManager(folder / "async", keep_last=1, async_save=True)
    names = ("save", "torch save", "async", "restore", "torch load", "torch load + load_state_dict")
    times: dict[str, list[float]] = {k: [] for k in names}

    def timed(name: str, fn: Any) -> None:
        harness.settle()
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, elapsed)
        times[name].append(max(gathered))

    def torch_save() -> None:
        if rank == 0:
            torch.save(model.state_dict(), torch_path)
            harness.fsync_path(torch_path)
        dist.barrier()

    def evict(path: Path) -> None:
        if rank == 0:
            harness.evict(path)

    async_.save(0, {"model": model})  # untimed: allocates the snapshot buffers
    async_.wait()
    state = {"model": model}
    for i in range(1, repeats + 1):
        timed("async", functools.partial(async_.save, i, state))
        async_.wait()
        pairs = [("save", functools.partial(sync.save, i, state)), ("torch save", torch_save)]
        for name, fn in pairs if i % 2 else pairs[::-1]:
            timed(name, fn)
        loads = [
            ("restore", folder / "sync", lambda: sync.restore(state)),
            ("torch load", torch_path, lambda: torch.load(torch_path, weights_only=True)),
            ("torch load + load_state_dict", torch_path,
             lambda: model.load_state_dict(torch.load(torch_path, weights_only=True))),
        ]  # fmt: skip
        for name, path, fn in loads[i % 3 :] + loads[: i % 3]:
            evict(path)
            timed(name, fn)
    async_.close()
    sync.close()
    if rank == 0:
        out.write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def measure(repeats: int, folder: Path) -> dict[str, list[float]]:
    """Run the two ranks; return each measurement's per-repeat times (max over ranks)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "times.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(harness.free_port()),
           "WORLD_SIZE": str(WORLD)}  # fmt: skip
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.small_tensors",
                *map(str, (rank, repeats, folder, out)),
            ],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in range(WORLD)
    ]
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise RuntimeError(f"small-tensors benchmark ranks exited with {codes}")
    times: dict[str, list[float]] = json.loads(out.read_text())
    return times


def run(results: Results, settings: Settings) -> None:
    """Measure the three comparisons and record them with the CRC implementation."""
    crc = harness.crc32_in_use()
    print(f"[small_tensors] {crc}", flush=True)
    results.notes.append(f"small_tensors: {crc}")
    folder = settings.work / "small_tensors"
    times = measure(settings.repeats, folder)
    x = float(TENSORS)

    def row(case: str, key: str, impl: str, ours: bool) -> Timing:
        runs = times[key]
        return results.add(
            Timing(case, "tensors", x, impl, statistics.median(runs), None, runs, ours)
        )

    sync = row("MoE save (2 ranks)", "save", "CheckpointManager.save", True)
    base = row("MoE save (2 ranks)", "torch save", "rank 0 torch.save + fsync, barrier", False)
    results.compare(sync, base, 1.3)
    blocked = row("MoE async save() call", "async", "save() call, async_save=True", True)
    results.compare(blocked, sync, 0.10)
    restore = row("MoE restore (2 ranks)", "restore", "CheckpointManager.restore", True)
    load = row("MoE restore (2 ranks)", "torch load", "torch.load(weights_only=True)", False)
    results.compare(restore, load, 1.2)
    both = row("MoE restore (2 ranks)", "torch load + load_state_dict",
               "model.load_state_dict(torch.load(weights_only=True))", False)  # fmt: skip
    results.compare(restore, both)
    harness.remove(folder)


if __name__ == "__main__":
    rank, repeats, folder, out = sys.argv[1:5]
    _worker(int(rank), int(repeats), Path(folder), Path(out))
