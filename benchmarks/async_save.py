"""How long a training loop is blocked per checkpoint: ``async_save=True`` against a sync save.

For each size, a state of float32 tensors (64 MiB each, fewer for small
sizes) is saved ``--async-saves`` times by a fresh ``CheckpointManager``
(keep_last=1) per mode. Between saves the "training loop" changes every
tensor in place and then keeps busy until the previous write is done, so the
async figure is the snapshot alone, not a wait for the previous write. The
first async save also allocates the snapshot buffers (page faults); later
saves reuse them, so the stall compared is the median of the steady-state
saves, and the first is kept as its own row. Target: steady stall <= 20 % of
a synchronous save. Peak RSS: the largest increase during a save call
(the snapshot buffers are the async mode's cost).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import MIB, PeakRss, Results, Settings, Timing

_TENSOR_MIB = 64


def _state(size_mib: int) -> dict[str, Any]:
    import torch

    per = min(_TENSOR_MIB, max(1, size_mib // 4))
    count = max(1, size_mib // per)
    return {f"w{i:03d}": torch.empty(per * MIB // 4).uniform_() for i in range(count)}


def _blocked(mode: str, state: dict[str, Any], saves: int, root: str) -> tuple[list[float], float]:
    import torch

    from ddpstate.manager import CheckpointManager

    folder = tempfile.mkdtemp(prefix=f"async-{mode}-", dir=root)
    blocked: list[float] = []
    peak = 0.0
    manager = CheckpointManager(folder, keep_last=1, async_save=mode == "async")
    try:
        for step in range(saves):
            with torch.no_grad():
                for tensor in state.values():
                    tensor.add_(1.0)
            harness.settle()
            with PeakRss() as probe:
                start = time.perf_counter()
                manager.save(step, {"weights": state})
                blocked.append(time.perf_counter() - start)
            peak = max(peak, probe.peak_mib or 0.0)
            with torch.no_grad():
                for tensor in state.values():  # the snapshot must not see this
                    tensor.add_(1.0)
            manager.wait()  # "training" goes on meanwhile; not timed
    finally:
        manager.close()
        harness.remove(Path(folder))
    return blocked, peak


def run(results: Results, settings: Settings) -> None:
    """Sync and async stall at every size."""
    for size in settings.sizes_mib:
        # 2 saves is the least that has a steady-state one; 4 GiB saves take ~6 s each.
        saves = max(2, settings.async_saves if size < 4096 else settings.async_saves - 1)
        state = _state(size)
        sync, sync_peak = _blocked("sync", state, saves, str(settings.work))
        async_, async_peak = _blocked("async", state, saves, str(settings.work))
        x = float(size)
        sync_t = results.add(
            Timing("async stall", "size_mib", x, "sync CheckpointManager.save",
                   statistics.median(sync), sync_peak, sync, True)
        )  # fmt: skip
        steady = results.add(
            Timing("async stall", "size_mib", x, "async_save=True (steady)",
                   statistics.median(async_[1:]), async_peak, async_, True)
        )  # fmt: skip
        first = results.add(
            Timing("async stall", "size_mib", x, "async_save=True (first save)",
                   async_[0], async_peak, async_[:1], True)
        )  # fmt: skip
        results.compare(steady, sync_t, 0.20)
        results.compare(first, sync_t)
        del state
