"""Accelerate checkpoints: ``ddpstate.integrations.accelerate.save_state`` against Accelerate's own.

``python -m benchmarks.integrations_accelerate [--sizes 64 256] [--repeats 5] [--work DIR]``

For each size, a model of float32 ``Linear`` layers holding SIZE MiB of weights and
its AdamW optimizer (after one step: two more copies of the weights' size) is saved,
round-robin, median of ``--repeats``, on disk under ``--work``:

* Accelerate's own ``Accelerator.save_state(folder)`` (written in place, no fsync);
* the same followed by an fsync of every file and the folder (for information:
  Accelerate's files made as durable as ddpstate's);
* ``ddpstate.integrations.accelerate.save_state(accelerator, folder)``: the same files
  staged beside the folder, read back for the manifest's CRC-32s, fsynced, swapped in.

Ratio: ddpstate / Accelerate's own, the fsync included on ddpstate's side only.
Target: <= 1.10x (issue 31).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness

TARGET = 1.10
LAYER = 1024  # a 1024 x 1024 float32 weight: 4 MiB


def _accelerator(size_mib: int) -> tuple[Any, ...]:
    from accelerate import Accelerator

    layers = [torch.nn.Linear(LAYER, LAYER, bias=False) for _ in range(max(1, size_mib // 4))]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, LAYER)).sum().backward()
    opt.step()  # the optimizer state exists: exp_avg and exp_avg_sq
    acc = Accelerator(cpu=True)
    return (acc, *acc.prepare(model, opt))


def run(sizes: list[int], repeats: int, work: Path) -> list[str]:
    from ddpstate.integrations.accelerate import save_state

    rows = []
    for size in sizes:
        acc, *_ = _accelerator(size)
        own, durable, ours = work / "own", work / "own_fsync", work / "ours"

        def accelerate_own(acc: Any = acc, own: Path = own) -> None:
            acc.save_state(str(own))

        def accelerate_fsync(acc: Any = acc, durable: Path = durable) -> None:
            acc.save_state(str(durable))
            harness.fsync_path(durable)

        def ddpstate_save(acc: Any = acc, ours: Path = ours) -> None:
            save_state(acc, str(ours))

        def clear(path: Path) -> Callable[[], None]:
            return lambda: shutil.rmtree(path, ignore_errors=True)

        measured = harness.interleave(
            {"accelerate": accelerate_own, "accelerate+fsync": accelerate_fsync,
             "ddpstate": ddpstate_save},
            repeats,
            prepare={"accelerate": clear(own), "accelerate+fsync": clear(durable),
                     "ddpstate": clear(ours)},
            rss=False,
        )  # fmt: skip
        med = {name: statistics.median(times) for name, (times, _) in measured.items()}
        on_disk = sum(f.stat().st_size for f in ours.iterdir()) / harness.MIB
        ratio = med["ddpstate"] / med["accelerate"]
        verdict = "met" if ratio <= TARGET else "NOT met"
        rows.append(
            f"| {size} MiB weights ({on_disk:.0f} MiB on disk) | {med['accelerate']:.3f} s | "
            f"{med['accelerate+fsync']:.3f} s | {med['ddpstate']:.3f} s | {ratio:.2f}x "
            f"({verdict}, target <= {TARGET:.2f}x) | "
            f"{med['ddpstate'] / med['accelerate+fsync']:.2f}x |"
        )
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True)
    return [
        "| state | Accelerate save_state | + fsync | ddpstate save_state | ratio | vs +fsync |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256], help="MiB of weights")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", type=Path, default=None, help="a folder on the disk to test")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="ddpstate-bench-", dir=Path.home()))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print("\n".join(run(args.sizes, args.repeats, work)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
