"""The local tier's restore with its CRC-32 check split across a node's ranks, or not.

Two gloo ranks on one node restore the same local step again and again,
interleaved: with ``LOCAL_WORLD_SIZE=2`` (as torchrun sets it) each rank checks
a share of the step's bytes; without it the node's local rank 0 checks them
all while the other waits (what every restore did before the split). The
shares are byte ranges (``verify_split.assign``), so one large file is split
too. The state is ``--files`` entries of equal size: 1 (a model: the restart
benchmark's shape) or 3 (Adam-like: ``model``, ``exp_avg``, ``exp_avg_sq``).

    python -m benchmarks.local_check --size 1G --files 1 --repeats 5
    python -m benchmarks.local_check --size 768M --files 3 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from benchmarks.local_tier import _join, _size_mib, _spawn, _state

_VARIANTS = {"one checker (no LOCAL_WORLD_SIZE)": None, "split (LOCAL_WORLD_SIZE=2)": "2"}


def _child(rank: int, port: int, opts: dict[str, Any], out: Any) -> None:
    from ddpstate.dist import barrier
    from ddpstate.manager import CheckpointManager, NodeLocal

    _join(rank, port)
    names = ("model", "exp_avg", "exp_avg_sq")[: opts["files"]]
    part = max(1, opts["size_mib"] // len(names))
    state = {n: _state(part, 1.0) for n in names}
    times: dict[str, list[float]] = {v: [] for v in _VARIANTS}
    with CheckpointManager(opts["durable"], local=NodeLocal(opts["shm"], every=1)) as manager:
        manager.save_local(1, state)
        manager.wait()
        for _ in range(opts["repeats"]):
            for variant, lws in _VARIANTS.items():
                if lws is None:
                    os.environ.pop("LOCAL_WORLD_SIZE", None)
                else:
                    os.environ["LOCAL_WORLD_SIZE"] = lws
                barrier()
                start = time.perf_counter()
                assert manager.restore(state) == 1
                times[variant].append(time.perf_counter() - start)
                assert manager.restored_from is not None
                assert manager.restored_from.tier == "local"
    out.put((rank, times))


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=_size_mib, default=768, help="state per rank (MiB)")
    parser.add_argument("--files", type=int, choices=(1, 2, 3), default=1, help="state files")
    parser.add_argument("--repeats", type=int, default=5, help="restores per variant")
    parser.add_argument("--work", default=None, help="folder for the durable tier")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="ddpstate-local-check-", dir=args.work)
    shm = tempfile.mkdtemp(prefix="ddpstate-local-check-", dir="/dev/shm")
    try:
        opts = {
            "size_mib": args.size,
            "repeats": args.repeats,
            "files": args.files,
            "durable": os.path.join(work, "run"),
            "shm": os.path.join(shm, "tier"),
        }
        _, results = _spawn(_child, opts)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    # Each restore on the slower rank, then the median over the repeats.
    medians = {
        v: statistics.median(max(r[v][i] for r in results) for i in range(args.repeats))
        for v in _VARIANTS
    }
    base, split = medians.values()
    print(
        f"2 gloo ranks on one node, {args.size} MiB state per rank in {args.files} file(s), "
        f"restore() from /dev/shm, median of {args.repeats} (slower rank), interleaved"
    )
    print("| variant | restore() | ratio |")
    print("| --- | --- | --- |")
    for variant, seconds in medians.items():
        print(f"| {variant} | {seconds:.3f} s | {seconds / base:.2f} |")
    return {"one": base, "split": split}


if __name__ == "__main__":
    main()
