"""ddpstate's safetensors save/load against the safetensors library's own calls.

Local safetensors files go through the library (``safe_open``/``save_file``),
so what is measured here is ddpstate's own cost on top: the collective and
format checks, tie detection, the atomic temp file, fsync and rename, the
``_metadata``/alias header entries. For 600, 10,000 and 100,000 tensors
(``--counts`` caps the ladder; at ``min(--count-size, 64)`` MiB in all), on
tmpfs (``/dev/shm``: no disk, so the ratio is software overhead alone) and on
the disk of ``--work``, implementations interleaved round-robin, median of
``--repeats`` after one untimed warm-up call each:

* ``ddpstate.save(sd, "x.safetensors")`` against ``safetensors.torch.save_file``
  + fsync of the file (target <= 1.05x; ddpstate also fsyncs the folder);
* ``ddpstate.load(path)`` (memory-mapped) against ``load_file(path)`` (its
  default mmap backend), target <= 1.05x;
* ``ddpstate.load(path, mmap=False)`` against ``load_file(path,
  backend="pread")`` (both read into fresh memory), target <= 1.05x.

Both sides load the same file; on disk it is evicted from the page cache
before each load (see :func:`harness.evict`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from benchmarks import harness
from benchmarks.harness import MIB, Results, Settings, timing

COUNTS = (600, 10_000, 100_000)
SIZE_MIB = 64
TARGET = 1.05


def _places(settings: Settings) -> list[tuple[str, Path]]:
    places = []
    shm = Path("/dev/shm")
    if shm.is_dir():
        places.append(("tmpfs", shm))
    places.append(("disk", settings.work))
    return places


def run_point(results: Results, settings: Settings, where: str, root: Path, count: int) -> None:
    """Save and load one state of ``count`` tensors in ``root`` (``where`` names it)."""
    import tempfile

    import safetensors.torch as st

    import ddpstate

    size_mib = min(settings.count_size_mib, SIZE_MIB)
    folder = Path(tempfile.mkdtemp(prefix="st-lib-", dir=root))
    try:
        state = harness.make_state(size_mib * MIB, count)
        ours, ref = folder / "ours.safetensors", folder / "ref.safetensors"
        repeats = settings.repeats_at(size_mib, count)

        def save_file() -> None:
            st.save_file(state, ref)
            harness.fsync_path(ref)

        saves: dict[str, Callable[[], Any]] = {
            "ddpstate.save (.safetensors)": lambda: ddpstate.save(state, ours),
            "safetensors save_file + fsync": save_file,
        }
        prepare = {
            "ddpstate.save (.safetensors)": lambda: harness.remove(ours),
            "safetensors save_file + fsync": lambda: harness.remove(ref),
        }
        for name, fn in saves.items():  # warm up: first calls pay for imports and caches
            prepare[name]()
            fn()
        measured = harness.interleave(saves, repeats, prepare, rss=False)
        t = {
            name: results.add(
                timing(f"st save ({where})", "tensors", count, name, m, name.startswith("ddp"))
            )
            for name, m in measured.items()
        }
        results.compare(
            t["ddpstate.save (.safetensors)"], t["safetensors save_file + fsync"], TARGET
        )

        evict: Optional[Callable[[], None]] = None
        if where == "disk":
            evict = lambda: harness.evict(ours, drop_all=settings.drop_caches)  # noqa: E731
        loads: dict[str, tuple[str, Callable[[], Any]]] = {
            "ddpstate.load": (
                f"st load mmap ({where})",
                lambda: ddpstate.load(ours, map_location="cpu"),
            ),
            "safetensors load_file": (f"st load mmap ({where})", lambda: st.load_file(ours)),
            "ddpstate.load (mmap=False)": (
                f"st load read ({where})",
                lambda: ddpstate.load(ours, map_location="cpu", mmap=False),
            ),
            "safetensors load_file (pread)": (
                f"st load read ({where})",
                lambda: st.load_file(ours, backend="pread"),
            ),
        }
        for _, fn in loads.values():
            fn()
        measured = harness.interleave(
            {name: fn for name, (_, fn) in loads.items()},
            repeats,
            {name: evict for name in loads} if evict is not None else None,
            rss=False,
        )
        lt = {
            name: results.add(timing(loads[name][0], "tensors", count, name, m, "ddp" in name))
            for name, m in measured.items()
        }
        results.compare(lt["ddpstate.load"], lt["safetensors load_file"], TARGET)
        results.compare(
            lt["ddpstate.load (mmap=False)"], lt["safetensors load_file (pread)"], TARGET
        )
    finally:
        harness.remove(folder)


def run(results: Results, settings: Settings) -> None:
    """Every tensor count of the ladder (up to the largest of ``--counts``), tmpfs then disk."""
    cap = max(settings.counts, default=COUNTS[0])
    counts = [c for c in COUNTS if c <= max(cap, COUNTS[0])]
    for count in counts:
        for where, root in _places(settings):
            run_point(results, settings, where, root, count)
