"""Reading a Hugging Face sharded folder: ``ddpstate.load`` against ``load_file`` per shard.

For each size, ``SIZE_TENSORS`` float32 tensors are split into ``SHARDS``
consecutive safetensors shards written by ``safetensors.torch.save_file`` (as
``transformers`` writes them) with a ``model.safetensors.index.json``. Then,
round-robin, median of ``--repeats``:

* ``ddpstate.load(folder)`` (finds and checks the index, checks every shard's
  keys against it, reads the shards into one state dict);
* the baseline: ``safetensors.torch.load_file`` on each shard in a loop,
  merged into one dict (what a script that already knows the shard names does);
* both again with every page of every tensor touched afterwards: both readers
  return memory-mapped tensors (``load_file`` of safetensors 0.8 maps the file;
  ddpstate maps local safetensors files by default), so the plain rows time the
  opening and the touched rows the data actually reaching memory;
* for information, ``ddpstate.load`` on each shard in a loop: the ratio to it
  is what the sharded layer (index, key checks) adds to ddpstate's
  single-file safetensors reader.

On disk, every run reads cold (the folder is evicted from the page cache
first); on tmpfs (``/dev/shm``, when there is one) there is no disk at all, so
the ratio is software overhead alone. Target: <= 1.1x (issue 18).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import MIB, Results, Settings, timing

SIZE_TENSORS = 600
SHARDS = 4
TARGET = 1.10
OURS = "ddpstate.load (HF folder)"
BASELINE = f"load_file x {SHARDS} shards"
TOUCHED = ", every page touched"
_PAGE = 4096


def _touch(state: dict[str, Any]) -> dict[str, Any]:
    """Read one element of every page of every tensor, so mapped data reaches memory."""
    for tensor in state.values():
        flat = tensor.reshape(-1)
        if flat.numel():
            flat[:: max(1, _PAGE // tensor.element_size())].sum()
    return state


def write_folder(folder: Path, state: dict[str, Any], shards: int = SHARDS) -> list[Path]:
    """``state`` as ``shards`` safetensors files plus the index; returns the shard paths."""
    import safetensors.torch as st

    folder.mkdir(parents=True, exist_ok=True)
    keys = list(state)
    per = -(-len(keys) // shards)
    weight_map: dict[str, str] = {}
    paths = []
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i * per : (i + 1) * per]}
        st.save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update((k, name) for k in part)
        paths.append(folder / name)
    index = {"metadata": {"total_size": harness.nbytes(state)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return paths


def _shm(size_mib: int) -> Path | None:
    """``/dev/shm`` when it is writable and has room for the folder twice over (it is RAM)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        return None
    return shm if shutil.disk_usage(shm).free > 2 * size_mib * MIB else None


def run_point(results: Results, settings: Settings, size_mib: int, where: str, root: Path) -> None:
    """Time both readers on one folder (``where``: "disk" or "tmpfs")."""
    import safetensors.torch as st

    import ddpstate

    folder = Path(tempfile.mkdtemp(prefix="ddpstate-hf-", dir=root))
    try:
        state = harness.make_state(size_mib * MIB, SIZE_TENSORS)
        shards = write_folder(folder, state)
        del state

        def loop() -> dict[str, Any]:
            merged: dict[str, Any] = {}
            for shard in shards:
                merged.update(st.load_file(str(shard)))
            return merged

        def ddpstate_loop() -> dict[str, Any]:
            merged: dict[str, Any] = {}
            for shard in shards:
                merged.update(ddpstate.load(shard, map_location="cpu", barrier=False))
            return merged

        def ours() -> Any:
            return ddpstate.load(folder, map_location="cpu", barrier=False)

        fns = {
            OURS: ours,
            BASELINE: loop,
            OURS + TOUCHED: lambda: _touch(ours()),
            BASELINE + TOUCHED: lambda: _touch(loop()),
            # The same reads without the index: what the sharded layer itself adds.
            f"ddpstate.load x {SHARDS} shards": ddpstate_loop,
        }
        cold = where == "disk"
        prepare = {
            name: (lambda: harness.evict(folder, drop_all=settings.drop_caches))
            for name in fns
            if cold
        }
        measured = harness.interleave(fns, settings.repeats_at(size_mib, SIZE_TENSORS), prepare)
        case = f"load HF {SHARDS} shards ({where})"
        t = {
            name: results.add(timing(case, "size_mib", size_mib, name, m, name.startswith(OURS)))
            for name, m in measured.items()
        }
        results.compare(t[OURS], t[BASELINE], TARGET)
        results.compare(t[OURS + TOUCHED], t[BASELINE + TOUCHED], TARGET)
        results.compare(t[OURS], t[f"ddpstate.load x {SHARDS} shards"])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run(results: Results, settings: Settings) -> None:
    """Every size on the benchmark's disk folder, then on tmpfs where it has room."""
    for size in settings.sizes_mib:
        run_point(results, settings, size, "disk", settings.work)
        shm = _shm(size)
        if shm is not None:
            run_point(results, settings, size, "tmpfs", shm)
        else:
            results.notes.append(f"hf_sharded: no room in /dev/shm for {size} MiB; tmpfs skipped")
