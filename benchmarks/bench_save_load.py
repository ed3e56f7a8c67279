"""Benchmark: ddpstate.save/load against plain torch and safetensors doing the same work.

Measures, in one run and on the same state dict (~600 mixed-size float32
tensors, 1 GiB by default):

* ``ddpstate.save`` (temp file, fsync, rename, folder fsync) vs
  ``torch.save`` + fsync of the file;
* ``ddpstate.save(..., "x.safetensors")`` vs ``safetensors.torch.save_file`` + fsync;
* ``ddpstate.load(map_location="auto")`` vs ``torch.load(mmap=True, weights_only=True)``;
* peak memory of a non-mmap ``ddpstate.load`` in a fresh subprocess, as
  (peak RSS - RSS before the load) / file size, next to ``torch.load``'s.

Timings are medians over ``--repeats`` runs, the two sides interleaved so
that drift on a shared machine hits both alike. The page cache is not
dropped: loads read warm files, saves end with a real fsync to disk. Both
sides overwrite their previous file: torch.save frees the old blocks when it
truncates the file, ddpstate.save frees them after the new file is durable,
in a background thread (the time save returns is what is measured; the
benchmark waits for that thread between runs).

Run:
    python benchmarks/bench_save_load.py                  # 1 GiB
    python benchmarks/bench_save_load.py --size-mb 256 --repeats 3

Saves end in a real fsync, so on a disk shared with other work the timings
vary from run to run; compare figures from the same run only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch


def make_state(size_mb: int, count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """About ``size_mb`` MiB of float32 in ``count`` tensors of log-uniformly mixed sizes."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.exp(torch.rand(count, generator=gen) * 9.0)  # sizes span ~4 decades
    total = size_mb * (1 << 20) // 4
    numels = (weights / weights.sum() * total).long().clamp(min=1)
    state = {}
    for i, n in enumerate(numels.tolist()):
        cols = 256 if n >= 4096 else 1
        state[f"layers.{i}.weight"] = torch.randn(max(n // cols, 1), cols, generator=gen)
    return state


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _time(fn: Callable[[], Any]) -> float:
    from ddpstate import storage

    # Start every run with no disk work queued by the previous one (dirty pages,
    # or ddpstate freeing a replaced file in the background), so it is billed to
    # neither side.
    storage._wait_for_freed()
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _pair(ours: Callable[[], Any], theirs: Callable[[], Any], repeats: int) -> tuple[float, float]:
    ours_t, theirs_t = [], []
    for i in range(repeats):
        # Alternate which side goes first, so neither always gets the warmer cache.
        if i % 2:
            ours_t.append(_time(ours))
            theirs_t.append(_time(theirs))
        else:
            theirs_t.append(_time(theirs))
            ours_t.append(_time(ours))
    return statistics.median(ours_t), statistics.median(theirs_t)


_RSS_PROBE = r"""
import json, sys
import torch
import ddpstate.checkpoint as ck

def status(field):
    # VmHWM is this process's peak RSS; unlike getrusage's ru_maxrss it is not
    # inherited from the parent that forked us before exec.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no " + field + " in /proc/self/status (Linux only)")

which, path = sys.argv[1], sys.argv[2]
torch.ones(1).numpy()  # load numpy now, so its import is not counted as the load's
before = status("VmRSS")
if which == "ddpstate":
    obj = ck.load(path, map_location="cpu", mmap=False)
else:
    obj = torch.load(path, map_location="cpu", mmap=False, weights_only=True)
peak = status("VmHWM")
total = sum(t.numel() * t.element_size() for t in obj.values())
print(json.dumps({"before": before, "peak": peak, "tensor_bytes": total}))
"""


def _peak_rss(which: str, path: str) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, which, path],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print a table, and return the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size-mb",
        "--size_mb",
        type=int,
        default=1024,
        help="total state size in MiB (default: 1024)",
    )
    parser.add_argument("--tensors", type=int, default=600, help="number of tensors (default: 600)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed runs per measurement; the median is reported (default: 5)",
    )
    parser.add_argument(
        "--dir", default=None, help="folder for the files (default: a new temporary folder)"
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)

    import safetensors.torch as st

    import ddpstate.checkpoint as ck

    folder = args.dir or tempfile.mkdtemp(prefix="ddpstate-bench-")
    os.makedirs(folder, exist_ok=True)
    try:
        state = make_state(args.size_mb, args.tensors)
        nbytes = sum(t.numel() * 4 for t in state.values())
        paths = {
            k: os.path.join(folder, k)
            for k in ("ours.pt", "torch.pt", "ours.safetensors", "ref.safetensors")
        }

        def torch_save() -> None:
            torch.save(state, paths["torch.pt"])
            _fsync(paths["torch.pt"])

        def ref_save_file() -> None:
            st.save_file(state, paths["ref.safetensors"])
            _fsync(paths["ref.safetensors"])

        save_pt = _pair(lambda: ck.save(state, paths["ours.pt"]), torch_save, args.repeats)
        save_st = _pair(
            lambda: ck.save(state, paths["ours.safetensors"]), ref_save_file, args.repeats
        )
        load_pt = _pair(
            lambda: ck.load(paths["ours.pt"], map_location="auto"),
            lambda: torch.load(paths["ours.pt"], mmap=True, weights_only=True),
            max(args.repeats, 5),
        )
        load_st = _pair(
            lambda: ck.load(paths["ours.safetensors"], map_location="auto"),
            lambda: st.load_file(paths["ours.safetensors"]),
            max(args.repeats, 5),
        )
        size_pt = os.path.getsize(paths["ours.pt"])
        size_st = os.path.getsize(paths["ours.safetensors"])
        rss = {
            "ddpstate torch file": (_peak_rss("ddpstate", paths["ours.pt"]), size_pt),
            "torch.load": (_peak_rss("torch", paths["ours.pt"]), size_pt),
            "ddpstate safetensors": (_peak_rss("ddpstate", paths["ours.safetensors"]), size_st),
        }
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)

    figures: dict[str, Any] = {
        "state_mib": nbytes / (1 << 20),
        "tensors": len(state),
        "torch": torch.__version__,
        "save_torch": {
            "ddpstate_s": save_pt[0],
            "torch_save_fsync_s": save_pt[1],
            "ratio": save_pt[0] / save_pt[1],
        },
        "save_safetensors": {
            "ddpstate_s": save_st[0],
            "save_file_fsync_s": save_st[1],
            "ratio": save_st[0] / save_st[1],
        },
        "load_torch": {
            "ddpstate_auto_s": load_pt[0],
            "torch_load_mmap_s": load_pt[1],
            "ratio": load_pt[0] / load_pt[1],
        },
        "load_safetensors": {
            "ddpstate_auto_s": load_st[0],
            "load_file_s": load_st[1],
            "ratio": load_st[0] / load_st[1],
        },
        "peak_rss_non_mmap_load": {
            name: {
                "file_bytes": size,
                "rss_before": probe["before"],
                "peak_rss": probe["peak"],
                "increase_over_file": (probe["peak"] - probe["before"]) / size,
                "peak_over_file": probe["peak"] / size,
            }
            for name, (probe, size) in rss.items()
        },
    }
    print(
        f"state: {figures['state_mib']:.0f} MiB in {len(state)} float32 tensors, "
        f"torch {torch.__version__}, median of {args.repeats} (loads: {max(args.repeats, 5)})"
    )
    rows = [
        ("ddpstate.save vs torch.save + fsync", save_pt),
        ("ddpstate.save safetensors vs save_file + fsync", save_st),
        ("ddpstate.load(auto) vs torch.load(mmap=True)", load_pt),
        ("ddpstate.load(auto) vs safetensors load_file", load_st),
    ]
    for label, (ours, theirs) in rows:
        print(
            f"  {label:<50} {ours * 1000:9.1f} ms  {theirs * 1000:9.1f} ms  "
            f"ratio {ours / theirs:5.2f}"
        )
    print("  peak RSS of a non-mmap load (fresh process), increase / file size:")
    for name, entry in figures["peak_rss_non_mmap_load"].items():
        print(
            f"    {name:<22} {entry['increase_over_file']:5.2f}  "
            f"(peak {entry['peak_rss'] / (1 << 20):.0f} MiB, before load "
            f"{entry['rss_before'] / (1 << 20):.0f} MiB, file "
            f"{entry['file_bytes'] / (1 << 20):.0f} MiB)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return figures


if __name__ == "__main__":
    main()
