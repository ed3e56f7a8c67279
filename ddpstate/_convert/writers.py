"""The output writers of ``convert``: torch.save, a safetensors file, a sharded folder, casts."""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Mapping
from typing import IO, Any, Optional

import torch

from ddpstate._convert.source import Checkpoint, check_materializable, iter_tensors
from ddpstate._io.safetensors_io import save_sharded, tied_keys, write_safetensors
from ddpstate._progress import Progress
from ddpstate.location import map_nested

# Cast tensors this large are made in mapped files (``cast_floating(spill=)``).
_SPILL_BYTES = 1 << 20

__all__ = ["cast_floating", "write_pt", "write_safetensors_file", "write_sharded"]


class _Counted:
    """A file ``torch.save`` writes into, reporting each write to the progress bar."""

    def __init__(self, file: IO[bytes], bar: Progress) -> None:
        self._file = file
        self._bar = bar

    def write(self, data: Any) -> int:
        written = self._file.write(data)
        self._bar.update(memoryview(data).nbytes)
        return written

    def flush(self) -> None:
        self._file.flush()


def _stored(tree: Any) -> tuple[int, int]:
    """``(storages, bytes)`` of the tensors in ``tree``, each storage once."""
    sizes = {
        t.untyped_storage().data_ptr() or id(t): t.untyped_storage().nbytes()
        for _, t in iter_tensors(tree)
    }
    return len(sizes), sum(sizes.values())


def write_pt(file: IO[bytes], root: Any, bar: Progress) -> tuple[int, int]:
    """``torch.save`` of ``root`` into ``file``; ``(storages, bytes)``.

    Mapped tensors are written from the page cache by torch's own zip writer, one
    record at a time: nothing is held twice.
    """
    torch.save(root, _Counted(file, bar))  # type: ignore[arg-type]
    return _stored(root)


def _checked(ckpt: Checkpoint, sd: Mapping[Any, Any]) -> None:
    for key, value in sd.items():
        if isinstance(value, torch.Tensor):
            check_materializable(ckpt, str(key), value)


def write_safetensors_file(
    file: IO[bytes],
    ckpt: Checkpoint,
    sd: Mapping[Any, Any],
    metadata: dict[str, str],
    bar: Progress,
) -> tuple[int, int, list[str]]:
    """``sd`` as one safetensors file; ``(tensors, bytes, notes)``: ties and overlaps told."""
    _checked(ckpt, sd)
    # The writer warns of ties and overlaps in memory; convert tells them in its notes.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aliases = write_safetensors(_Counted(file, bar), sd, metadata, name=ckpt.path)  # type: ignore[arg-type]
    notes = _tie_notes(aliases, caught, "recorded as aliases")
    nbytes = _stored({k: v for k, v in sd.items() if k not in aliases})[1]
    return len(sd) - len(aliases), nbytes, notes


def _tie_notes(
    aliases: Mapping[str, str], caught: list[warnings.WarningMessage], how: str
) -> list[str]:
    """Convert's notes for tied tensors (``how`` they were recorded) and overlapping ones."""
    notes = [str(w.message) for w in caught if "overlap" in str(w.message)]
    if aliases:
        shown = ", ".join(f"{a} -> {c}" for a, c in list(aliases.items())[:3])
        notes.insert(0, f"{len(aliases)} tied tensor(s) written once and {how} ({shown})")
    return notes


def write_sharded(
    ckpt: Checkpoint,
    sd: Mapping[Any, Any],
    metadata: dict[str, str],
    dst: str,
    limit: int,
    *,
    fsync: bool,
    overwrite: bool,
) -> tuple[int, int, list[str]]:
    """``sd`` as a Hugging Face sharded folder; ``(tensors, bytes, notes)``: ties told."""
    _checked(ckpt, sd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        weight_map = save_sharded(sd, dst, limit, metadata, overwrite=overwrite, fsync=fsync)
    # The keys left out of the index; tied_keys names the key whose tensor each shares.
    aliases = tied_keys(sd)[0] if len(weight_map) < len(sd) else {}
    notes = _tie_notes(aliases, caught, "left out of the index, as transformers does")
    return len(weight_map), _stored(sd)[1], notes


def _spilled(value: torch.Tensor, dtype: torch.dtype, folder: str) -> torch.Tensor:
    """``value.to(dtype)`` written into a file mapped from ``folder``, not into anonymous memory.

    The file is unlinked at once: its pages are page cache the kernel can write back and
    reclaim, and they go with the mapping once the output is written.
    """
    fd, name = tempfile.mkstemp(prefix=".ddpstate-cast-", dir=folder)
    try:
        os.close(fd)
        out = torch.from_file(name, shared=True, size=value.numel(), dtype=dtype)
    finally:
        os.unlink(name)
    return out.view(value.shape).copy_(value.detach())


def cast_floating(
    ckpt: Checkpoint, tree: Any, dtype: torch.dtype, spill: Optional[str] = None
) -> tuple[Any, int]:
    """``tree`` with every floating tensor as ``tensor.to(dtype)``; ``(tree, tensors cast)``.

    Integer and bool tensors, and those already of ``dtype``, are kept. Views that are
    the very same tensor (tied weights) stay one tensor. With ``spill`` (a local folder),
    cast tensors of :data:`_SPILL_BYTES` or more are made in files mapped from it, so
    anonymous memory does not grow with what is cast.
    """
    cast: dict[tuple[Any, ...], torch.Tensor] = {}

    def leaf(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return value
        if value.dtype == dtype:
            return value
        key = (
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            value.shape,
            value.stride(),
            value.dtype,
        )
        if key not in cast:
            check_materializable(ckpt, "(cast)", value)
            big = value.numel() * dtype.itemsize >= _SPILL_BYTES
            new = _spilled(value, dtype, spill) if spill and big else value.detach().to(dtype)
            # A Parameter stays a Parameter (as torch.load gives it), with its requires_grad.
            kind = torch.nn.Parameter if isinstance(value, torch.nn.Parameter) else None
            cast[key] = (
                kind(new, value.requires_grad) if kind else new.requires_grad_(value.requires_grad)
            )
        return cast[key]

    return map_nested(tree, leaf), len(cast)
