"""``python -m benchmarks [--quick | --full]``: every ddpstate benchmark, one table, one plot.

Runs the families in ``benchmarks/`` (save/load, safetensors vs its library, convert,
``convert --strip-module`` against ``cp`` + ``sync`` and the load-rename-save script, async
stall, 2-rank gloo, Hugging Face sharded folders, DCP saves, CUDA state where a GPU is
present) at every checkpoint size and tensor count, and writes
``results.md``, ``results.json`` and ``results.png`` to ``--out``
(``benchmarks/results/`` by default). Ratios are ddpstate / baseline, measured
side by side in the same run; see each module's docstring for what it
measures and how.

Presets: ``--quick`` (16 and 64 MiB, one repeat: a check that everything
runs, < 3 minutes on 2 cores); default (64 MiB, 256 MiB, 1 GiB; tensor counts
10 to 100,000 at 256 MiB); ``--full`` (adds 4 GiB). ``--sizes``, ``--counts``,
``--repeats`` and ``--only`` override a preset.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import (
    async_save,
    convert,
    dcp,
    distributed,
    gpu,
    harness,
    hf_sharded,
    report,
    safetensors_lib,
    save_load,
    small_tensors,
    strip_module,
)

FAMILIES: dict[str, Callable[[harness.Results, harness.Settings], None]] = {
    "save_load": save_load.run,
    "safetensors": safetensors_lib.run,
    "convert": convert.run,
    "strip_module": strip_module.run,
    "async": async_save.run,
    "dist": distributed.run,
    "hf_sharded": hf_sharded.run,
    "dcp": dcp.run,
    "gpu": gpu.run,
    "small_tensors": small_tensors.run,
}

PRESETS = {
    # quick: 100,000 tensors alone would take ~2 minutes (torch.load of them takes
    # ~11 s here), so the quick ladder stops at 10,000.
    "quick": {"sizes": [16, 64], "counts": [10, 1000, 10_000], "count_size": 16,
              "repeats": 1, "heavy_repeats": 1, "dist_size": 16, "async_saves": 3},
    "default": {"sizes": [64, 256, 1024], "counts": [10, 100, 1000, 10_000, 100_000],
                "count_size": 256, "repeats": 3, "heavy_repeats": 2, "dist_size": 256,
                "async_saves": 4},
    "full": {"sizes": [64, 256, 1024, 4096], "counts": [10, 100, 1000, 10_000, 100_000],
             "count_size": 256, "repeats": 3, "heavy_repeats": 2, "dist_size": 256,
             "async_saves": 4},
}  # fmt: skip


def _ints(text: str) -> list[int]:
    return [int(v.replace("_", "")) for v in text.split(",") if v.strip()]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=(__doc__ or "").split("\n\n")[0]
    )
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    preset.add_argument("--full", action="store_true", help="add the 4 GiB checkpoint")
    parser.add_argument("--sizes", type=_ints, help="checkpoint sizes in MiB, e.g. 64,256,1024")
    parser.add_argument(
        "--counts", type=_ints, help="tensor counts at --count-size, e.g. 10,1000 ('' for none)"
    )
    parser.add_argument("--count-size", type=int, help="total MiB for the tensor-count scaling")
    parser.add_argument("--repeats", type=int, help="timed runs per measurement (median)")
    parser.add_argument("--dist-size", type=int, help="MiB for the 2-rank gloo case")
    parser.add_argument(
        "--only",
        type=lambda s: s.split(","),
        default=list(FAMILIES),
        help=f"families to run, comma-separated: {','.join(FAMILIES)} (default: all)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--work", type=Path, default=None, help="folder for the checkpoints (default: a temp one)"
    )
    parser.add_argument("--no-peers", action="store_true", help="skip dcp, Fabric, Accelerate")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the whole page cache before cold reads (needs root) instead of "
        "evicting only the benchmark's files",
    )
    parser.add_argument(
        "--ddpstate", default=None, help="how to run the ddpstate command (default: installed)"
    )
    args = parser.parse_args(argv)
    unknown = set(args.only) - set(FAMILIES)
    if unknown:
        parser.error(f"unknown --only {sorted(unknown)}; choose from {list(FAMILIES)}")
    return args


def _machine(work: Path) -> dict[str, str]:
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    fs = "?"
    best = ""
    for part in psutil.disk_partitions(all=True):
        if str(work.resolve()).startswith(part.mountpoint) and len(part.mountpoint) > len(best):
            best, fs = part.mountpoint, f"{part.fstype} ({part.device} at {part.mountpoint})"
    versions = {"torch": torch.__version__}
    for name in ("safetensors", "lightning_fabric", "accelerate", "ddpstate"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = "not installed"
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu}; {os.cpu_count()} cores; "
        f"{psutil.virtual_memory().total / (1 << 30):.0f} GiB RAM; {platform.platform()}",
        "filesystem": fs,
        "python": platform.python_version(),
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items()),
        "checksum": harness.crc32_in_use(),
    }


def main(argv: list[str] | None = None) -> harness.Results:
    """Run the selected families, print the table, write the files; return the results."""
    args = parse(argv)
    preset = PRESETS["quick" if args.quick else "full" if args.full else "default"]
    work = Path(tempfile.mkdtemp(prefix="ddpstate-bench-", dir=args.work))
    settings = harness.Settings(
        sizes_mib=args.sizes if args.sizes is not None else preset["sizes"],
        counts=args.counts if args.counts is not None else preset["counts"],
        count_size_mib=args.count_size or preset["count_size"],
        repeats=args.repeats or preset["repeats"],
        heavy_repeats=args.repeats or preset["heavy_repeats"],
        work=work,
        peers=not args.no_peers,
        drop_caches=args.drop_caches,
        ddpstate_cmd=shlex.split(args.ddpstate) if args.ddpstate else convert.ddpstate_command(),
        dist_size_mib=args.dist_size or preset["dist_size"],
        async_saves=preset["async_saves"],
    )
    if args.drop_caches and not harness.can_drop_caches():
        raise SystemExit("--drop-caches: /proc/sys/vm/drop_caches is not writable here")
    results = harness.Results()
    results.meta = {
        "command": shlex.join(["python", "-m", "benchmarks", *(argv or sys.argv[1:])]),
        **_machine(work),
        "repeats": str(settings.repeats),
    }
    results.notes.append(harness.check_eviction(work, args.drop_caches))
    if not args.drop_caches:
        results.notes.append(
            "drop_caches is "
            + ("writable here (--drop-caches uses it)" if harness.can_drop_caches() else
               "not writable here")
            + "; per-file eviction keeps the interpreter's and torch's own pages cached, "
            "so cold figures are the checkpoint's I/O, not library loading"
        )  # fmt: skip
    started = time.perf_counter()
    print(results.meta["checksum"], flush=True)
    try:
        for name in args.only:
            begun = time.perf_counter()
            print(f"[{name}] ...", flush=True)
            FAMILIES[name](results, settings)
            print(f"[{name}] done in {time.perf_counter() - begun:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results.meta["wall_seconds"] = f"{time.perf_counter() - started:.0f}"
    paths = report.write(results, args.out, with_plot=not args.no_plot)
    print(report.markdown(results))
    for note in results.notes:
        print("note:", note)
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return results


if __name__ == "__main__":
    main()
