"""``python -m benchmarks.pickle_emit``: the pickle writer of ``convert``, before and after.

``ddpstate._streaming.pickle_emit.dump_checkpoint_pickle`` writes the ``data.pkl`` of
every torch file ``ddpstate convert`` streams. It once subclassed CPython's private
pure-Python pickler; it now writes protocol 2 itself. This times both, in one process,
on the same scanned tree: a torch.save'd ``{"epoch", "state_dict"}`` checkpoint of
``--tensors`` small tensors (30,000 by default), every key ``module.``-prefixed, read
back with ``scan_pickle``. The old writer is the frozen copy in
``tests/streaming/emit_reference.py``. Runs alternate (old, new, old, new...), median of
``--repeats``; the peak of Python allocations during one write (``tracemalloc``) is
measured in separate runs. The two outputs are checked to be byte for byte equal.
"""

from __future__ import annotations

import argparse
import gc
import io
import statistics
import time
import tracemalloc
import zipfile
from collections.abc import Callable
from typing import Any

from ddpstate._streaming.pickle_emit import dump_checkpoint_pickle
from ddpstate._streaming.pickle_scan import StorageRecord, scan_pickle
from tests.streaming.emit_reference import reference_dump_checkpoint_pickle


def _scanned_tree(tensors: int) -> Any:
    import torch

    state = {f"module.layer{i}.weight": torch.zeros(4) for i in range(tensors)}
    buffer = io.BytesIO()
    torch.save({"epoch": 3, "state_dict": state}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        data = archive.read(name)

    def storage(pid: Any) -> StorageRecord:
        _, cls, key, location, numel = pid
        return StorageRecord(key, cls.name, "float32", location, numel)

    return scan_pickle(io.BytesIO(data), storage).obj


def _seconds(write: Callable[[Any], Any], tree: Any) -> float:
    gc.collect()
    start = time.perf_counter()
    write(tree)
    return time.perf_counter() - start


def _peak_bytes(write: Callable[[Any], Any], tree: Any) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        write(tree)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Time the old and the new writer on one tree; print a table, return the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=30_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    tree = _scanned_tree(args.tensors)
    old = reference_dump_checkpoint_pickle(tree)[0]
    if dump_checkpoint_pickle(tree)[0] != old:
        raise SystemExit("the new writer's bytes differ from the old writer's")
    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(args.repeats):
        times["old"].append(_seconds(reference_dump_checkpoint_pickle, tree))
        times["new"].append(_seconds(dump_checkpoint_pickle, tree))
    old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
    old_peak = _peak_bytes(reference_dump_checkpoint_pickle, tree)
    new_peak = _peak_bytes(dump_checkpoint_pickle, tree)
    mib = 1024 * 1024
    print(f"dump_checkpoint_pickle, {args.tensors:,} tensors, {len(old):,} bytes of pickle")
    print(f"{'writer':<8}{'median s':>10}{'peak MiB':>10}")
    print(f"{'old':<8}{old_s:>10.3f}{old_peak / mib:>10.1f}")
    print(f"{'new':<8}{new_s:>10.3f}{new_peak / mib:>10.1f}")
    print(f"new/old: time {new_s / old_s:.2f}x, peak {new_peak / old_peak:.2f}x")
    return {
        "old_s": old_s,
        "new_s": new_s,
        "old_peak": float(old_peak),
        "new_peak": float(new_peak),
    }


if __name__ == "__main__":
    main()
