"""GPU state: ``ddpstate.save`` from CUDA tensors and ``ddpstate.load`` onto this rank's GPU.

The case a DDP user has on every rank: the model's state lives on ``cuda:N``, the
checkpoint is written from there, and a resume reads it back onto ``cuda:N``. For each
size (``--sizes``, 600 mixed-size float32 tensors on ``cuda:0``), implementations
interleaved round-robin in one process (median of ``--repeats``):

* save: ``ddpstate.save`` (device-to-host copy, temp file, fsync, rename, folder fsync)
  against ``torch.save`` + fsync of the same CUDA state (target <= 1.10x), and
  ``ddpstate.save(.safetensors)`` against ``safetensors.torch.save_file`` + fsync
  (target <= 1.10x);
* DCP from CUDA state, one process: ``dcp.save`` with ``ddpstate.dcp.DurableWriter``
  against torch's ``FileSystemWriter(sync_files=True)`` (target <= 1.10x), and ``dcp.load``
  into the CUDA state with ``VerifiedReader`` against ``FileSystemReader`` (target <= 1.10x);
* load onto the GPU from a cold page cache, ``torch.cuda.synchronize()`` included:
  ``ddpstate.load(map_location="auto")`` (``auto`` is ``cuda:LOCAL_RANK``) against
  ``torch.load(map_location="cuda:0", weights_only=True)`` with ``mmap=False`` on both
  (target <= 1.10x), and ``ddpstate.load(.safetensors, map_location="auto")`` against
  ``safetensors.torch.load_file(device="cuda:0")`` (target <= 1.10x).

Run where a CUDA device is present: ``python -m benchmarks --only gpu --sizes 256,1024``
(``--work /dev/shm`` for tmpfs). Without CUDA the family adds a note and measures nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks import harness
from benchmarks.harness import MIB, Results, Settings, timing

SIZE_TENSORS = 600


def run_point(results: Results, settings: Settings, size_mib: int) -> None:
    """Measure the CUDA save and load cases for one state of ``size_mib`` MiB."""
    import safetensors.torch as st
    import torch

    import ddpstate

    folder = settings.work / f"gpu-{size_mib}"
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.to("cuda:0") for k, v in harness.make_state(size_mib * MIB, SIZE_TENSORS).items()}
    torch.cuda.synchronize()
    paths = {n: folder / n for n in ("ours.pt", "torch.pt", "ours.safetensors", "ref.safetensors")}
    saves: dict[str, Callable[[], Any]] = {
        "ddpstate.save (cuda)": lambda: ddpstate.save(state, paths["ours.pt"]),
        "torch.save + fsync (cuda)": lambda: (
            torch.save(state, paths["torch.pt"]),
            harness.fsync_path(paths["torch.pt"]),
        ),
        "ddpstate.save (.safetensors, cuda)": lambda: ddpstate.save(
            state, paths["ours.safetensors"]
        ),
        "safetensors save_file + fsync (cuda)": lambda: (
            st.save_file(state, paths["ref.safetensors"]),
            harness.fsync_path(paths["ref.safetensors"]),
        ),
    }
    outputs = dict(zip(saves, paths.values(), strict=True))
    measured = harness.interleave(
        saves, settings.repeats, {n: (lambda p=p: harness.remove(p)) for n, p in outputs.items()}
    )
    t = {
        n: results.add(timing("gpu save", "size_mib", size_mib, n, m)) for n, m in measured.items()
    }
    results.compare(t["ddpstate.save (cuda)"], t["torch.save + fsync (cuda)"], 1.10)
    results.compare(
        t["ddpstate.save (.safetensors, cuda)"], t["safetensors save_file + fsync (cuda)"], 1.10
    )

    def synced(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            out = fn()
            torch.cuda.synchronize()
            return out

        return call

    loads: dict[str, tuple[Callable[[], Any], Any]] = {
        "ddpstate.load (auto -> cuda)": (
            lambda: ddpstate.load(paths["ours.pt"], map_location="auto", mmap=False),
            paths["ours.pt"],
        ),
        "torch.load (cuda:0)": (
            lambda: torch.load(paths["ours.pt"], map_location="cuda:0", weights_only=True),
            paths["ours.pt"],
        ),
        "ddpstate.load (.safetensors, auto -> cuda)": (
            lambda: ddpstate.load(paths["ours.safetensors"], map_location="auto", mmap=False),
            paths["ours.safetensors"],
        ),
        "safetensors load_file (cuda:0)": (
            lambda: st.load_file(paths["ours.safetensors"], device="cuda:0"),
            paths["ours.safetensors"],
        ),
    }
    loaded = ddpstate.load(paths["ours.pt"], map_location="auto")
    assert all(v.device == torch.device("cuda:0") for v in loaded.values()), "auto is not cuda:0"
    assert all(torch.equal(loaded[k], v) for k, v in state.items()), "GPU round trip differs"
    del loaded
    _dcp_point(results, settings, size_mib, state, folder)
    measured = harness.interleave(
        {n: synced(fn) for n, (fn, _) in loads.items()},
        settings.repeats,
        {
            n: (lambda p=p: harness.evict(p, drop_all=settings.drop_caches))
            for n, (_, p) in loads.items()
        },
    )
    lt = {
        n: results.add(timing("gpu load", "size_mib", size_mib, n, m)) for n, m in measured.items()
    }
    results.compare(lt["ddpstate.load (auto -> cuda)"], lt["torch.load (cuda:0)"], 1.10)
    results.compare(
        lt["ddpstate.load (.safetensors, auto -> cuda)"], lt["safetensors load_file (cuda:0)"], 1.10
    )
    saves.clear()  # the closures hold the CUDA state
    torch.cuda.empty_cache()
    harness.remove(folder)


def _dcp_point(
    results: Results, settings: Settings, size_mib: int, state: dict[str, Any], folder: Any
) -> None:
    """DurableWriter/VerifiedReader against torch's writer/reader, the state on ``cuda:0``."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ddpstate.dcp import DurableWriter, VerifiedReader

    ours, theirs = folder / "dcp-ours", folder / "dcp-torch"
    writers = {
        "dcp.save DurableWriter (cuda)": lambda: dcp.save(
            state, storage_writer=DurableWriter(ours), no_dist=True
        ),
        "dcp.save FileSystemWriter (cuda)": lambda: dcp.save(
            state, storage_writer=dcp.FileSystemWriter(theirs, sync_files=True), no_dist=True
        ),
    }
    out = {"dcp.save DurableWriter (cuda)": ours, "dcp.save FileSystemWriter (cuda)": theirs}
    measured = harness.interleave(
        writers, settings.repeats, {n: (lambda p=p: harness.remove(p)) for n, p in out.items()}
    )
    t = {
        n: results.add(timing("gpu dcp save", "size_mib", size_mib, n, m))
        for n, m in measured.items()
    }
    results.compare(t["dcp.save DurableWriter (cuda)"], t["dcp.save FileSystemWriter (cuda)"], 1.10)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=VerifiedReader(ours), no_dist=True)
    assert all(torch.equal(target[k], v) for k, v in state.items()), "DCP GPU round trip differs"

    def load(reader: Any) -> None:
        dcp.load(target, storage_reader=reader, no_dist=True)
        torch.cuda.synchronize()

    readers = {
        "dcp.load VerifiedReader (cuda)": lambda: load(VerifiedReader(ours)),
        "dcp.load FileSystemReader (cuda)": lambda: load(dcp.FileSystemReader(theirs)),
    }
    measured = harness.interleave(
        readers,
        settings.repeats,
        {
            "dcp.load VerifiedReader (cuda)": lambda: harness.evict(ours),
            "dcp.load FileSystemReader (cuda)": lambda: harness.evict(theirs),
        },
    )
    lt = {
        n: results.add(timing("gpu dcp load", "size_mib", size_mib, n, m))
        for n, m in measured.items()
    }
    results.compare(
        lt["dcp.load VerifiedReader (cuda)"], lt["dcp.load FileSystemReader (cuda)"], 1.10
    )


def run(results: Results, settings: Settings) -> None:
    """Every size on ``cuda:0``; a note and nothing measured where CUDA is absent."""
    import torch

    if not torch.cuda.is_available():
        results.notes.append("gpu: no CUDA device here, nothing measured")
        return
    results.notes.append(f"gpu: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for size in settings.sizes_mib:
        run_point(results, settings, size)
