"""A 2-rank gloo save + load where every rank loads: ddpstate against the usual hand-written code.

Two real processes on 127.0.0.1 (gloo), each holding the same state (600
mixed float32 tensors of ``--dist-size`` MiB in all). Per repeat, alternating
which side goes first:

* ddpstate: ``ddpstate.save(state, path)`` on every rank (rank 0 writes, the
  outcome is shared), then ``ddpstate.load(path, mmap=False)`` on every rank;
* baseline: ``if rank == 0: torch.save(state, path)`` + fsync, ``dist.barrier()``,
  then ``torch.load(path, weights_only=True)`` on every rank.

A collective takes as long as its slowest rank, so each run's time is the
maximum over the ranks (gathered with ``all_gather_object``), then the median
over repeats. Before each load, rank 0 evicts the file from the page cache;
both ranks then read it at once (one from the disk, one mostly from the
cache it fills), as on a single node. Targets: <= 1.10x for both.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import MIB, Results, Settings, Timing

WORLD = 2


def _worker(rank: int, size_mib: int, repeats: int, folder: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist

    import ddpstate

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    state = harness.make_state(size_mib * MIB, 600)  # same seed: same state on every rank
    ours_path, torch_path = folder / "ours.pt", folder / "torch.pt"

    def ddpstate_save() -> None:
        ddpstate.save(state, ours_path)

    def torch_save() -> None:
        if rank == 0:
            torch.save(state, torch_path)
            harness.fsync_path(torch_path)
        dist.barrier()

    sides = {
        "ddpstate": (ddpstate_save, lambda: ddpstate.load(ours_path, mmap=False), ours_path),
        "torch": (
            torch_save,
            lambda: torch.load(torch_path, map_location="cpu", weights_only=True),
            torch_path,
        ),
    }
    times: dict[str, dict[str, list[float]]] = {s: {"save": [], "load": []} for s in sides}
    for i in range(repeats):
        for side in list(sides) if i % 2 == 0 else list(sides)[::-1]:
            save, load, path = sides[side]
            if rank == 0:
                harness.remove(path)
            harness.settle()
            dist.barrier()
            start = time.perf_counter()
            save()
            saved = time.perf_counter() - start
            if rank == 0:
                harness.evict(path)
            dist.barrier()
            start = time.perf_counter()
            obj = load()
            loaded = time.perf_counter() - start
            del obj
            gathered: list[Any] = [None] * WORLD
            dist.all_gather_object(gathered, (saved, loaded))
            times[side]["save"].append(max(g[0] for g in gathered))
            times[side]["load"].append(max(g[1] for g in gathered))
    if rank == 0:
        out.write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def run(results: Results, settings: Settings) -> None:
    """Start two ranks, collect their times, record save and load comparisons."""
    folder = settings.work / "dist"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "times.json"
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(harness.free_port()),
        "WORLD_SIZE": str(WORLD),
    }
    args = [str(settings.dist_size_mib), str(settings.repeats), str(folder), str(out)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.distributed", str(rank), *args],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in range(WORLD)
    ]
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise RuntimeError(f"distributed benchmark ranks exited with {codes}")
    times = json.loads(out.read_text())
    x = float(settings.dist_size_mib)
    for op in ("save", "load"):
        case = f"2-rank gloo {op}"
        ours = results.add(
            Timing(case, "size_mib", x, f"ddpstate.{op} (every rank)",
                   statistics.median(times["ddpstate"][op]), None, times["ddpstate"][op], True)
        )  # fmt: skip
        label = "rank 0 torch.save + fsync, barrier" if op == "save" else "torch.load (every rank)"
        base = results.add(
            Timing(case, "size_mib", x, label, statistics.median(times["torch"][op]), None,
                   times["torch"][op])
        )  # fmt: skip
        results.compare(ours, base, 1.10)
    harness.remove(folder)


if __name__ == "__main__":
    rank, size, repeats, folder, out = sys.argv[1:6]
    _worker(int(rank), int(size), int(repeats), Path(folder), Path(out))
