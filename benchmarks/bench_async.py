"""How long a training loop is blocked per checkpoint: async_save=True against a synchronous save.

The state is ``--gib`` GiB of float32 tensors (1 GiB by default) in a dict, on
``--device`` (cpu by default). Each mode saves ``--saves`` checkpoints with a
fresh CheckpointManager (keep_last=1) into a temporary folder under ``--dir``;
between saves the "training loop" changes every tensor in place and then keeps
busy until the previous write is done, so the async numbers measure the
snapshot alone, not a wait for the previous write. The first async save also
allocates the snapshot buffers (page faults); later saves reuse them, so both
are reported.

Run:
    python benchmarks/bench_async.py                 # 1 GiB on the CPU
    python benchmarks/bench_async.py --device cuda   # pinned-memory snapshot of GPU tensors
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from ddpstate.manager import CheckpointManager

_TENSOR_MIB = 64


def _state(gib: float, device: str) -> dict[str, torch.Tensor]:
    count = max(1, round(gib * 1024 / _TENSOR_MIB))
    numel = _TENSOR_MIB * (1 << 20) // 4
    return {f"w{i:03d}": torch.randn(numel, device=device) for i in range(count)}


def _train_a_little(state: dict[str, torch.Tensor]) -> None:
    for tensor in state.values():
        tensor.add_(1.0)
    if any(t.is_cuda for t in state.values()):
        torch.cuda.synchronize()


def _run(mode: str, state: dict[str, torch.Tensor], saves: int, root: str) -> list[float]:
    folder = tempfile.mkdtemp(prefix=f"bench-{mode}-", dir=root)
    blocked = []
    try:
        manager = CheckpointManager(folder, keep_last=1, async_save=mode == "async")
        for step in range(saves):
            _train_a_little(state)
            start = time.perf_counter()
            manager.save(step, {"weights": state})
            blocked.append(time.perf_counter() - start)
            _train_a_little(state)  # the snapshot must not see this
            thread = manager._thread
            while thread is not None and thread.is_alive():  # keep "training" meanwhile
                time.sleep(0.01)
        manager.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return blocked


def main() -> None:
    """Measure and print blocked time per checkpoint for both modes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--saves", type=int, default=4, help="checkpoints per mode (default 4)")
    parser.add_argument("--dir", default=".", help="where the temporary folders go (default .)")
    args = parser.parse_args()

    state = _state(args.gib, args.device)
    size = sum(t.numel() * t.element_size() for t in state.values()) / (1 << 30)
    print(f"state: {len(state)} tensors, {size:.2f} GiB on {args.device}; {args.saves} saves each")
    print(f"folder: {os.path.abspath(args.dir)}; torch {torch.__version__}")
    sync = _run("sync", state, args.saves, args.dir)
    async_ = _run("async", state, args.saves, args.dir)
    sync_median = statistics.median(sync)
    steady = statistics.median(async_[1:]) if len(async_) > 1 else async_[0]
    print(f"sync save, blocked per checkpoint:    median {sync_median:7.3f} s  {_fmt(sync)}")
    print(f"async save, blocked per checkpoint:   median {steady:7.3f} s  {_fmt(async_)}")
    print(f"  first async save (allocates buffers): {async_[0]:.3f} s")
    mean_ratio = 100 * statistics.mean(async_) / statistics.mean(sync)
    print(f"blocked async / sync (mean over all saves, first included): {mean_ratio:5.1f} %")
    ratio = 100 * steady / sync_median
    print(f"blocked async / sync (steady state): {ratio:5.1f} %  (target <= 20 %)")


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


if __name__ == "__main__":
    main()
