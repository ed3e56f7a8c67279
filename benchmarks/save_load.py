"""``ddpstate.save``/``ddpstate.load`` against torch, safetensors, the peers and the disk.

For each checkpoint size (``--sizes``, 600 mixed-size float32 tensors) and
each tensor count at a fixed size (``--counts`` at ``--count-size``), in one
process, implementations interleaved round-robin (median of ``--repeats``):

Saves (the state already in memory; every output removed before each run,
untimed, so no side pays for freeing an old file; ``os.sync`` before each run):

* ``ddpstate.save`` (temp file, fsync, rename, folder fsync) against
  ``torch.save`` + fsync (target <= 1.10x), and against the disk's own limit:
  the same number of bytes written with one large buffered write + fsync
  (target <= 1.3x);
* ``ddpstate.save(..., "x.safetensors")`` against ``safetensors.torch.save_file``
  + fsync (target <= 1.10x);
* for information, the peers on one process: ``torch.distributed.checkpoint.save``
  (its writer fsyncs), Lightning ``Fabric.save`` + fsync and ``Accelerator.save``
  + fsync.

Loads, each from a cold page cache (see :func:`harness.evict`):

* ``ddpstate.load(map_location="auto")`` (memory-mapped) against
  ``torch.load(mmap=True)`` (target <= 1.10x; both are lazy: the tensor bytes
  are read on first touch, so this is the pickle and bookkeeping cost);
* ``ddpstate.load(mmap=False)`` against ``torch.load(mmap=False)`` (target
  <= 1.10x, peak RSS <= 1.10x the file) and, for information, the disk's read
  limit (one ``readinto`` of the whole file) and ``dcp.load`` (in place into
  the existing state dict, as on a resume);
* ``ddpstate.load(mmap=False)`` of the safetensors file against
  ``safetensors.torch.load_file`` (target <= 1.10x).

Peak RSS is each call's own high-water mark above what was resident before it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from benchmarks import harness
from benchmarks.harness import MIB, Results, Settings, timing

SIZE_TENSORS = 600


def _peers(enabled: bool, notes: list[str]) -> dict[str, Callable[[dict[str, Any], Path], None]]:
    """The peers' save calls that import on this machine, each made as durable as ddpstate's."""
    if not enabled:
        return {}
    peers: dict[str, Callable[[dict[str, Any], Path], None]] = {}

    import torch.distributed.checkpoint as dcp

    def dcp_save(state: dict[str, Any], path: Path) -> None:
        # No process group: dcp warns that it assumes one process; that is the point.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, checkpoint_id=str(path))  # FileSystemWriter fsyncs (sync_files=True)

    peers["dcp.save (1 process)"] = dcp_save
    try:
        from lightning_fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=1)

        def fabric_save(state: dict[str, Any], path: Path) -> None:
            fabric.save(path, state)
            harness.fsync_path(path)

        peers["Fabric.save + fsync"] = fabric_save
    except ImportError as exc:
        notes.append(f"Lightning Fabric not benchmarked: {exc} (pip install -e .[bench])")
    try:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)

        def accelerate_save(state: dict[str, Any], path: Path) -> None:
            accelerator.save(state, path)
            harness.fsync_path(path)

        peers["Accelerator.save + fsync"] = accelerate_save
    except ImportError as exc:
        notes.append(f"Accelerate not benchmarked: {exc} (pip install -e .[bench])")
    return peers


def _disk_write(nbytes: int) -> tuple[Callable[[Path], None], Any]:
    import torch

    # Touched memory (fill_), so the write copies real pages, not the shared zero page.
    buffer = torch.empty(nbytes, dtype=torch.uint8).fill_(7).numpy()

    def write(path: Path) -> None:
        view = memoryview(buffer)
        with open(path, "wb", buffering=0) as f:
            while view:  # one write() moves at most ~2 GiB on Linux
                view = view[f.write(view) :]
            os.fsync(f.fileno())

    return write, buffer


def _disk_read(path: Path) -> Any:
    import torch

    size = path.stat().st_size
    buffer = torch.empty(size, dtype=torch.uint8).numpy()  # fresh memory, as a load allocates
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buffer)
        while view:
            got = f.readinto(view)
            if not got:
                break
            view = view[got:]
    return buffer


def run_point(
    results: Results,
    settings: Settings,
    axis: str,
    x: int,
    size_mib: int,
    count: int,
    peers: dict[str, Callable[[dict[str, Any], Path], None]],
) -> None:
    """Measure every save and load case for one state (``size_mib`` MiB in ``count`` tensors)."""
    import safetensors.torch as st
    import torch
    import torch.distributed.checkpoint as dcp

    import ddpstate

    folder = settings.work / f"saveload-{axis}-{x}"
    folder.mkdir(parents=True, exist_ok=True)
    state = harness.make_state(size_mib * MIB, count)
    p = {
        name: folder / name
        for name in ("ours.pt", "torch.pt", "disk.bin", "ours.safetensors", "ref.safetensors")
    }
    repeats = settings.repeats_at(size_mib, count)
    ours_pt = p["ours.pt"]
    ddpstate.save(state, ours_pt)  # to know the byte count of the disk baseline
    disk_write, _buffer = _disk_write(ours_pt.stat().st_size)

    saves: dict[str, Callable[[], Any]] = {
        "ddpstate.save": lambda: ddpstate.save(state, ours_pt),
        "torch.save + fsync": lambda: (
            torch.save(state, p["torch.pt"]),
            harness.fsync_path(p["torch.pt"]),
        ),
        "disk write limit (1 write + fsync)": lambda: disk_write(p["disk.bin"]),
        "ddpstate.save (.safetensors)": lambda: ddpstate.save(state, p["ours.safetensors"]),
        "safetensors save_file + fsync": lambda: (
            st.save_file(state, p["ref.safetensors"]),
            harness.fsync_path(p["ref.safetensors"]),
        ),
    }
    outputs = {
        "ddpstate.save": ours_pt,
        "torch.save + fsync": p["torch.pt"],
        "disk write limit (1 write + fsync)": p["disk.bin"],
        "ddpstate.save (.safetensors)": p["ours.safetensors"],
        "safetensors save_file + fsync": p["ref.safetensors"],
    }
    for name, save in peers.items():
        out = folder / name.split()[0].lower()
        outputs[name] = out
        saves[name] = lambda save=save, out=out: save(state, out)  # type: ignore[misc]
    prepare = {name: (lambda out=out: harness.remove(out)) for name, out in outputs.items()}
    measured = harness.interleave(saves, repeats, prepare)
    t = {
        name: results.add(timing("save", axis, x, name, m, name.startswith("ddpstate")))
        for name, m in measured.items()
    }
    results.compare(t["ddpstate.save"], t["torch.save + fsync"], 1.10)
    results.compare(t["ddpstate.save"], t["disk write limit (1 write + fsync)"], 1.30)
    for name in peers:
        results.compare(t["ddpstate.save"], t[name])
    st_ours = t.pop("ddpstate.save (.safetensors)")
    st_ref = t.pop("safetensors save_file + fsync")
    st_ours.case = st_ref.case = "save safetensors"
    results.compare(st_ours, st_ref, 1.10)

    # Every output exists again now (the last run of each left it): load them cold.
    del _buffer
    ours_st, dcp_dir = p["ours.safetensors"], outputs.get("dcp.save (1 process)")
    drop = settings.drop_caches

    def cold(path: Optional[Path]) -> Callable[[], None]:
        return lambda: harness.evict(path, drop_all=drop) if path is not None else None

    loads: dict[str, tuple[str, Callable[[], Any], Optional[Path]]] = {
        "ddpstate.load (mmap, auto)": (
            "load mmap",
            lambda: ddpstate.load(ours_pt, map_location="auto"),
            ours_pt,
        ),
        "torch.load (mmap)": (
            "load mmap",
            lambda: torch.load(ours_pt, mmap=True, weights_only=True),
            ours_pt,
        ),
        "ddpstate.load (mmap=False)": (
            "load",
            lambda: ddpstate.load(ours_pt, map_location="cpu", mmap=False),
            ours_pt,
        ),
        "torch.load": (
            "load",
            lambda: torch.load(ours_pt, map_location="cpu", weights_only=True),
            ours_pt,
        ),
        "disk read limit (1 read)": ("load", lambda: _disk_read(ours_pt), ours_pt),
        "ddpstate.load (.safetensors)": (
            "load safetensors",
            # mmap=False: load_file copies every tensor into memory too.
            lambda: ddpstate.load(ours_st, map_location="cpu", mmap=False),
            ours_st,
        ),
        "safetensors load_file": ("load safetensors", lambda: st.load_file(ours_st), ours_st),
    }
    if dcp_dir is not None:

        def dcp_load() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, checkpoint_id=str(dcp_dir))

        loads["dcp.load (1 process, in place)"] = ("load", dcp_load, dcp_dir)
    measured = harness.interleave(
        {name: fn for name, (_, fn, _) in loads.items()},
        repeats,
        {name: cold(path) for name, (_, _, path) in loads.items()},
    )
    lt = {
        name: results.add(timing(loads[name][0], axis, x, name, m, name.startswith("ddpstate")))
        for name, m in measured.items()
    }
    file_mib = ours_pt.stat().st_size / MIB
    results.compare(lt["ddpstate.load (mmap, auto)"], lt["torch.load (mmap)"], 1.10)
    results.compare(lt["ddpstate.load (mmap=False)"], lt["torch.load"], 1.10, 1.10 * file_mib)
    results.compare(lt["ddpstate.load (mmap=False)"], lt["disk read limit (1 read)"])
    results.compare(lt["ddpstate.load (mmap=False)"], lt.get("dcp.load (1 process, in place)"))
    results.compare(lt["ddpstate.load (.safetensors)"], lt["safetensors load_file"], 1.10)
    harness.remove(folder)


def run(results: Results, settings: Settings) -> None:
    """Every size with the peers, then every tensor count at the fixed size without them."""
    peers = _peers(settings.peers, results.notes)
    for size in settings.sizes_mib:
        run_point(results, settings, "size_mib", size, size, SIZE_TENSORS, peers)
    for count in settings.counts:
        run_point(results, settings, "tensors", count, settings.count_size_mib, count, {})
