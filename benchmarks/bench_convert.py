"""Streaming `ddpstate convert` against `cp` and the naive load/rename/save, side by side.

Builds a DataParallel-style checkpoint (``{"epoch", "state_dict"}``, every key
``module.``-prefixed) of ``--size-gib`` GiB in ``--tensors`` tensors, as a
torch.save file and as safetensors, then times in one run, each command in its
own process (median of ``--repeat`` round-robin runs, warm page cache, ``sync``
before each run):

* ``cp`` of the torch.save file (the yardstick);
* ``ddpstate convert --strip-module`` on the torch.save file and on the safetensors file;
* ``ddpstate convert --to safetensors --strip-module`` from the torch.save file;
* the naive script: ``torch.load``, rename the keys, ``torch.save``.

ddpstate writes its output durably (fsync of the file and its folder before
the rename); ``cp`` does not, so the table also shows ``cp`` followed by
``sync`` of the copy, the same durability, and gives both ratios.

Peak RSS is each command's own maximum resident set size
(``getrusage(RUSAGE_CHILDREN)`` in a wrapper process that runs only that
command). Finally every streaming output is loaded and compared, tensor for
tensor, with the naive output.

Run (not a test)::

    python benchmarks/bench_convert.py                  # 1 GiB, 600 tensors
    python benchmarks/bench_convert.py --size-gib 0.25 --repeat 1
    python benchmarks/bench_convert.py --ddpstate "python -m ddpstate"

Targets (issue: the ddpstate command): ``--strip-module`` <= 1.5x cp with peak
RSS <= 128 MiB; ``--to safetensors`` <= 2x cp with peak RSS <= 128 MiB plus the
largest tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Runs one command and reports its wall time and its own peak RSS: the wrapper
# has no other children, so RUSAGE_CHILDREN's maximum is that command's.
_WRAPPER = """
import json, resource, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL)
elapsed = time.perf_counter() - start
peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"rc": proc.returncode, "seconds": elapsed, "peak_mib": peak_kib / 1024}))
"""

_NAIVE = """
import sys, torch
ckpt = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
ckpt["state_dict"] = {k[len("module."):] if k.startswith("module.") else k: v
                      for k, v in ckpt["state_dict"].items()}
torch.save(ckpt, sys.argv[2])
"""

MIB = 1 << 20


def _run_once(command: list[str], cleanup: Path | None) -> dict[str, float]:
    if cleanup is not None and cleanup.exists():
        cleanup.unlink()
    # Start every command with no dirty pages waiting for the disk, so one
    # command's write-back does not land in the next one's time.
    os.sync()
    out = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *command], capture_output=True, text=True, check=True
    )
    result: dict[str, float] = json.loads(out.stdout)
    if result["rc"] != 0:
        raise SystemExit(f"command failed ({result['rc']}): {shlex.join(command)}")
    return result


def _measure_all(
    commands: dict[str, tuple[list[str], Path | None]], repeat: int
) -> dict[str, dict[str, float]]:
    """Run the commands round-robin ``repeat`` times; median time, largest peak RSS."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, (command, cleanup) in commands.items():
            runs[name].append(_run_once(command, cleanup))
    return {
        name: {
            "seconds": statistics.median(r["seconds"] for r in results),
            "peak_mib": max(r["peak_mib"] for r in results),
        }
        for name, results in runs.items()
    }


def _make_checkpoint(folder: Path, size_gib: float, count: int) -> tuple[Path, Path, int]:
    import safetensors.torch
    import torch

    total = int(size_gib * (1 << 30))
    # One embedding-like tensor of 1/16 of the file, a third of the rest in
    # small bias/norm vectors, the remainder in equal weight matrices.
    embedding = total // 16
    small_count = count // 3
    small = 4096
    big_count = count - 1 - small_count
    big = (total - embedding - small_count * small) // max(big_count, 1)
    generator = torch.Generator().manual_seed(0)
    state = {"module.embed.weight": torch.randn(embedding // 4 // 256, 256, generator=generator)}
    for i in range(big_count):
        state[f"module.layers.{i}.weight"] = torch.randn(big // 4 // 128, 128, generator=generator)
        if i < small_count:
            state[f"module.layers.{i}.bias"] = torch.randn(small // 4, generator=generator)
    pt = folder / "src.pt"
    torch.save({"epoch": 12, "state_dict": state}, pt)
    st = folder / "src.safetensors"
    safetensors.torch.save_file(state, st)
    largest = max(t.numel() * t.element_size() for t in state.values())
    return pt, st, largest


def _check_equal(naive: Path, pt_out: Path, st_plain_out: Path, st_out: Path) -> None:
    import torch
    from safetensors import safe_open

    reference = torch.load(naive, mmap=True, weights_only=True)
    streamed = torch.load(pt_out, mmap=True, weights_only=True)
    assert reference["epoch"] == streamed["epoch"]
    ref_sd, pt_sd = reference["state_dict"], streamed["state_dict"]
    assert list(ref_sd) == list(pt_sd), "key order differs"
    with safe_open(st_out, "pt") as from_zip, safe_open(st_plain_out, "pt") as from_st:
        assert set(from_zip.keys()) == set(ref_sd) == set(from_st.keys())
        for key, value in ref_sd.items():
            assert torch.equal(value, pt_sd[key]), key
            assert torch.equal(value, from_zip.get_tensor(key)), key
            assert torch.equal(value, from_st.get_tensor(key)), key


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="checkpoint size (default 1)")
    parser.add_argument("--tensors", type=int, default=600, help="number of tensors (default 600)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per command; median time")
    parser.add_argument("--dir", type=Path, default=None, help="work folder (default: a temp one)")
    parser.add_argument(
        "--ddpstate", default=shutil.which("ddpstate") or "ddpstate",
        help="how to run the command (default: the installed console script)",
    )  # fmt: skip
    args = parser.parse_args()
    ddpstate = shlex.split(args.ddpstate)

    folder = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.dir))
    try:
        pt, st, largest = _make_checkpoint(folder, args.size_gib, args.tensors)
        names = ("cp.pt", "strip.pt", "strip.safetensors", "to_st.safetensors", "naive.pt")
        out = {name: folder / name for name in names}
        subprocess.run(["cp", pt, out["cp.pt"]], check=True)  # warm the page cache
        subprocess.run(["cat", st], stdout=subprocess.DEVNULL, check=True)
        durable_cp = 'cp "$0" "$1" && sync "$1"'
        commands: dict[str, tuple[list[str], Path | None]] = {
            "cp": (["cp", str(pt), str(out["cp.pt"])], out["cp.pt"]),
            "cp + sync (durable, like ddpstate's fsync)": (
                ["sh", "-c", durable_cp, str(pt), str(out["cp.pt"])], out["cp.pt"]
            ),
            "convert --strip-module (torch zip)": (
                [*ddpstate, "convert", str(pt), str(out["strip.pt"]), "--strip-module", "-q"],
                out["strip.pt"],
            ),
            "convert --strip-module (safetensors)": (
                [*ddpstate, "convert", str(st), str(out["strip.safetensors"]), "--strip-module",
                 "-q"],
                out["strip.safetensors"],
            ),
            "convert --to safetensors --strip-module": (
                [*ddpstate, "convert", str(pt), str(out["to_st.safetensors"]), "--to",
                 "safetensors", "--strip-module", "-q"],
                out["to_st.safetensors"],
            ),
            "naive torch.load/rename/torch.save": (
                [sys.executable, "-c", _NAIVE, str(pt), str(out["naive.pt"])], out["naive.pt"]
            ),
            "python -c 'import torch' (for scale)": (
                [sys.executable, "-c", "import torch"], None
            ),
        }  # fmt: skip
        rows = _measure_all(commands, args.repeat)
        _check_equal(out["naive.pt"], out["strip.pt"], out["strip.safetensors"],
                     out["to_st.safetensors"])  # fmt: skip
        cp_time = rows["cp"]["seconds"]
        durable_cp_time = rows["cp + sync (durable, like ddpstate's fsync)"]["seconds"]
        targets = {
            "convert --strip-module (torch zip)": (1.5, 128.0),
            "convert --strip-module (safetensors)": (1.5, 128.0),
            "convert --to safetensors --strip-module": (2.0, 128.0 + largest / MIB),
        }
        size = pt.stat().st_size
        print(
            f"checkpoint: {size / MIB:.0f} MiB, {args.tensors} tensors, largest "
            f"{largest / MIB:.1f} MiB; median of {args.repeat} runs; "
            f"command: {shlex.join(ddpstate)}"
        )
        print(
            f"{'':44} {'seconds':>8} {'x cp':>6} {'x cp+sync':>9} {'peak RSS':>10}  "
            f"target (time vs cp / vs cp+sync; RSS)"
        )
        for name, row in rows.items():
            ratio = row["seconds"] / cp_time
            durable_ratio = row["seconds"] / durable_cp_time
            target = ""
            if name in targets:
                max_ratio, max_rss = targets[name]
                rss_ok = row["peak_mib"] <= max_rss
                target = (
                    f"<= {max_ratio}x: {'met' if ratio <= max_ratio else 'NOT met'} / "
                    f"{'met' if durable_ratio <= max_ratio else 'NOT met'}; "
                    f"<= {max_rss:.0f} MiB: {'met' if rss_ok else 'NOT met'}"
                )
            print(
                f"{name:44} {row['seconds']:8.2f} {ratio:6.2f} {durable_ratio:9.2f} "
                f"{row['peak_mib']:7.0f} MiB  {target}"
            )
        print("streaming outputs load equal, tensor for tensor, to the naive output")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
