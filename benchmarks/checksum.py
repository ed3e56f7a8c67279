"""CRC-32 throughput side by side, and a step folder's checksum pass: one thread against pieces.

First a buffer of ``--crc-size`` MiB in memory is CRC-32'd by each library ddpstate
may pick (``zlib``, ``zlib-ng``, ``isal``; a missing one is noted), by the one it
picked (``_crc.crc32``) and by ``_crc.crc32_parallel`` (pieces on threads), as
ratios to ``zlib.crc32`` (issue 42's target: >= 3x), interleaved in one run.

``verify_checkpoint``, ``ddpstate verify`` and a one-rank ``restore`` read every
byte of a step folder for its CRC-32 (``_manifest.check_folder``). The pass is
cut into byte-range pieces read by a thread per CPU (``_checksum.check_files``);
this times it against one thread reading each file whole (what it did before),
interleaved in the same run, on tmpfs (software cost) and on ``--work`` (disk,
evicted from the page cache before each pass where the kernel allows). The
folder is a real ``CheckpointManager`` step: ``--files`` tensors of equal size.

    python -m benchmarks.checksum --crc-only --crc-size 256 --repeats 5
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
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import harness
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


def _crc_functions() -> dict[str, Callable[[Any], int]]:
    """Each CRC-32 to time, by the name the table gives it; zlib.crc32 first (the base)."""
    from ddpstate import _crc

    found: dict[str, Callable[[Any], int]] = {"zlib.crc32": zlib.crc32}
    try:
        from zlib_ng import zlib_ng

        found["zlib_ng.crc32"] = zlib_ng.crc32
    except ImportError:
        print("note: zlib-ng is not installed")
    try:
        from isal import isal_zlib

        found["isal_zlib.crc32"] = isal_zlib.crc32
    except ImportError:
        print("note: isal is not installed")
    found[f"ddpstate _crc.crc32 ({_crc.IMPLEMENTATION})"] = _crc.crc32
    threads = min(_crc.cpus(), _crc.MAX_THREADS)
    found[f"ddpstate _crc.crc32_parallel ({threads} threads)"] = _crc.crc32_parallel
    return found


def crc_table(size_mib: int, repeats: int) -> dict[str, float]:
    """Print and return each CRC-32's median GB/s on ``size_mib`` MiB of random bytes."""
    data = memoryview(os.urandom(size_mib << 20))
    functions = _crc_functions()
    measured = harness.interleave(
        {name: lambda f=f: f(data) for name, f in functions.items()}, repeats, rss=False
    )
    rates = {n: data.nbytes / statistics.median(t) / 1e9 for n, (t, _) in measured.items()}
    base = rates["zlib.crc32"]
    print(f"CRC-32 of {size_mib} MiB in memory, median of {repeats}, interleaved; {_cpus_line()}")
    print("| implementation | GB/s | vs zlib.crc32 |")
    print("| --- | --- | --- |")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.2f} | {rate / base:.2f}x |")
    return rates


def _cpus_line() -> str:
    from ddpstate import _crc

    return f"{_crc.cpus()} CPUs usable, load {os.getloadavg()[0]:.1f}"


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=_size_mib, default=1024, help="folder size (MiB)")
    parser.add_argument("--files", type=int, default=1, help="tensor files in the folder")
    parser.add_argument("--repeats", type=int, default=5, help="passes per variant")
    parser.add_argument("--work", default=None, help="disk folder (default: no disk run)")
    parser.add_argument("--crc-size", type=int, default=256, help="CRC table buffer (MiB)")
    parser.add_argument("--crc-only", action="store_true", help="the CRC table alone")
    args = parser.parse_args(argv)
    print(harness.crc32_in_use())
    result: dict[str, dict[str, float]] = {"crc32": crc_table(args.crc_size, args.repeats)}
    if args.crc_only:
        return result
    places = {"tmpfs (/dev/shm)": "/dev/shm"}
    if args.work:
        places[f"disk ({args.work}, evicted)"] = args.work
    variants = {"one thread, whole files": 1, f"pieces on threads ({os.cpu_count()} CPUs)": None}
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
