"""A step folder's checksum pass in one process: one thread against byte-range pieces on threads.

``verify_checkpoint``, ``ddpstate verify`` and a one-rank ``restore`` read every
byte of a step folder for its CRC-32 (``_manifest.check_folder``). The pass is
cut into byte-range pieces read by a thread per CPU (``_checksum.check_files``);
this times it against one thread reading each file whole (what it did before),
interleaved in the same run, on tmpfs (software cost) and on ``--work`` (disk,
evicted from the page cache before each pass where the kernel allows). The
folder is a real ``CheckpointManager`` step: ``--files`` tensors of equal size.

    python -m benchmarks.checksum --size 1G --files 1 --repeats 5
    python -m benchmarks.checksum --size 1G --files 3 --repeats 5 --work /tmp
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.local_tier import _evict, _size_mib


def _folder(root: str, size_mib: int, files: int) -> str:
    """A committed step folder holding ``files`` float32 tensors, ``size_mib`` MiB in all."""
    import torch

    from ddpstate.manager import CheckpointManager

    per = max(1, size_mib // files) << 18  # float32 elements per file
    state: dict[str, Any] = {f"part{i}": torch.full((per,), float(i)) for i in range(files)}
    with CheckpointManager(os.path.join(root, "run")) as manager:
        manager.save(1, state)
    return os.path.join(root, "run", "step_0000000001")


def _time(folder: str, workers: int | None, evict: bool) -> float:
    from ddpstate import _manifest

    if evict:
        _evict(Path(folder))
    start = time.perf_counter()
    check = _manifest.check_folder(folder, 1, None, workers)
    seconds = time.perf_counter() - start
    assert check.manifest is not None, check.problems
    return seconds


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=_size_mib, default=1024, help="folder size (MiB)")
    parser.add_argument("--files", type=int, default=1, help="tensor files in the folder")
    parser.add_argument("--repeats", type=int, default=5, help="passes per variant")
    parser.add_argument("--work", default=None, help="disk folder (default: no disk run)")
    args = parser.parse_args(argv)
    places = {"tmpfs (/dev/shm)": "/dev/shm"}
    if args.work:
        places[f"disk ({args.work}, evicted)"] = args.work
    variants = {"one thread, whole files": 1, f"pieces on threads ({os.cpu_count()} CPUs)": None}
    result: dict[str, dict[str, float]] = {}
    print(
        f"check_folder on one step folder: {args.size} MiB in {args.files} file(s), "
        f"median of {args.repeats}, variants interleaved"
    )
    print("| where | variant | time | GB/s | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for place, parent in places.items():
        root = tempfile.mkdtemp(prefix="ddpstate-checksum-", dir=parent)
        try:
            folder = _folder(root, args.size, args.files)
            evict = parent != "/dev/shm"
            times: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(args.repeats):
                for variant, workers in variants.items():
                    times[variant].append(_time(folder, workers, evict))
            medians = {v: statistics.median(t) for v, t in times.items()}
        finally:
            shutil.rmtree(root, ignore_errors=True)
        base = next(iter(medians.values()))
        for variant, seconds in medians.items():
            rate = args.size * (1 << 20) / seconds / 1e9
            print(f"| {place} | {variant} | {seconds:.3f} s | {rate:.2f} | {seconds / base:.2f} |")
        result[place] = medians
    return result


if __name__ == "__main__":
    main()
