"""One checkpoint file (or folder) read into memory by its bytes, in any format ddpstate reads.

``ddpstate.load`` (and ``load_model_state`` through it) reads here on the
ranks that read: the format comes from the bytes (``formats.detect_format``),
never from the name, and each format's reader places the tensors where
``map_location`` resolved. A Hugging Face sharded checkpoint is read shard by
shard through the same single-file reader.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

from ddpstate import _fs, storage
from ddpstate._io import torch_io
from ddpstate._io.safetensors_io import read_safetensors
from ddpstate._layout.hf_index import check_keys, open_index
from ddpstate.errors import CheckpointAccessError, CheckpointFormatError, CheckpointNotFoundError
from ddpstate.formats import (
    DCP,
    HF_SHARDED,
    LEGACY,
    SAFETENSORS,
    TABLE,
    TORCH_ZIP,
    TORCHSCRIPT,
    TRAINING_FOLDERS,
    FormatName,
    detect_format,
)
from ddpstate.location import ResolvedMapLocation, place_all, require_reachable, target_device

__all__ = ["Reading", "detect", "load_sharded", "read"]

# torch.load goes by this suffix: a torch file so named cannot be mapped by it.
_SAFETENSORS_SUFFIXES = TABLE[SAFETENSORS].suffixes


def detect(text: str, storage_options: Optional[dict[str, Any]]) -> FormatName:
    try:
        return detect_format(text, storage_options=storage_options)
    except PermissionError as exc:
        raise CheckpointAccessError(
            f"{text}: permission denied ({exc}); check the file's permissions"
        ) from exc


def _mmap_refused(text: str, why: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{text}: mmap=True is not possible here ({why}); pass mmap=None")


@dataclasses.dataclass(frozen=True)
class Reading:
    """How one load reads: the same for a single file and for each shard of a folder.

    Attributes:
        resolved: The resolved ``map_location``.
        weights_only: As for :func:`ddpstate.load` (torch files and ``.bin`` shards).
        mmap: As for :func:`ddpstate.load`.
        storage_options: fsspec options for URLs.
        safe_globals: As for :func:`ddpstate.load`.
    """

    resolved: ResolvedMapLocation
    weights_only: bool
    mmap: Optional[bool]
    storage_options: Optional[dict[str, Any]]
    safe_globals: Sequence[Any]


def read(
    text: str,
    resolved: ResolvedMapLocation,
    weights_only: bool,
    mmap: Optional[bool],
    storage_options: Optional[dict[str, Any]],
    safe_globals: Sequence[Any] = (),
) -> Any:
    require_reachable(resolved, text)
    kind = detect(text, storage_options)
    how = Reading(resolved, weights_only, mmap, storage_options, safe_globals)
    if kind == TORCHSCRIPT:
        raise CheckpointFormatError(
            f"{text}: this is a TorchScript archive, not a checkpoint: use torch.jit.load"
        )
    if kind == HF_SHARDED:
        return load_sharded(text, how)
    if kind in TRAINING_FOLDERS:
        raise CheckpointFormatError(
            f"{text}: {TABLE[kind].description}, not a checkpoint file; load one of its files "
            f"(`ddpstate inspect {text}` shows its model weights), or resume with the "
            f"framework's own load"
        )
    if kind == DCP:
        if mmap:
            raise _mmap_refused(text, "a torch.distributed.checkpoint folder")
        remote = _fs.is_remote(text)
        state = torch_io.load_dcp(
            text if remote else _fs.local_path(text),
            name=text,
            weights_only=weights_only,
            storage_options=storage_options,
            safe_globals=safe_globals,
        )
        return place_all(state, "cpu", resolved)
    return _read_file(text, kind, how)


def _read_file(text: str, kind: FormatName, how: Reading) -> Any:
    """One safetensors, torch.save zip or legacy torch file, its tensors placed."""
    remote = _fs.is_remote(text)
    local = _fs.local_path(text)
    mmap = how.mmap
    if mmap and (remote or not TABLE[kind].mappable):
        raise _mmap_refused(text, "the file is remote" if remote else "legacy files cannot be")
    # torch.load (2.13+) picks its safetensors reader from this suffix, whatever the bytes
    # say; a file object makes it read the bytes ddpstate detected (and cannot be mapped).
    misnamed = kind != SAFETENSORS and local.endswith(_SAFETENSORS_SUFFIXES)
    if mmap and misnamed:
        raise CheckpointFormatError(
            f"{text}: named .safetensors but holds a {torch_io.DESCRIPTIONS[kind]}; it cannot be "
            f"memory-mapped under this name: load it with mmap=False, or rename it to .pt"
        )
    with contextlib.ExitStack() as stack:
        # A remote file is read through a file object, never mapped.
        src = (
            stack.enter_context(storage.open_read(text, storage_options=how.storage_options))
            if remote or misnamed
            else local
        )
        use_mmap = TABLE[kind].mappable and isinstance(src, str) if mmap is None else bool(mmap)
        if kind == SAFETENSORS:
            # Read straight onto a CUDA target: reading to the CPU and then moving would
            # hold every byte in host memory at once (mmap=False) or copy from pageable
            # memory (mmap=True).
            target = target_device("cpu", how.resolved)
            device = target if target is not None and target.type == "cuda" else "cpu"
            tensors = read_safetensors(src, device=device, mmap=use_mmap)
            return place_all(tensors, "cpu", how.resolved)
        return torch_io.load_torch_file(
            src,
            kind=kind,
            name=text,
            map_location=how.resolved,
            weights_only=how.weights_only,
            mmap=use_mmap,
            safe_globals=how.safe_globals,
        )


def load_sharded(path: str, how: Reading) -> collections.OrderedDict[str, Any]:
    """Load a Hugging Face sharded checkpoint into one state dict, shard by shard.

    Each shard is read as a single file is (safetensors through ddpstate's
    safetensors reader, torch shards through its safe ``torch.load``); its
    keys are checked against the index before the next shard is read.

    Args:
        path: The index file or its folder.
        how: The resolved ``map_location`` and :func:`ddpstate.load`'s ``weights_only``
            (``.bin`` shards), ``mmap``, ``storage_options`` and ``safe_globals``.

    Returns:
        An ``OrderedDict`` of every tensor, in the index's order; the tied keys
        ddpstate recorded in the index come last, sharing their tensor.

    Raises:
        CheckpointNotFoundError, CheckpointCorruptError, CheckpointFormatError,
        UnsafeCheckpointError: As for :func:`ddpstate.load`; a missing shard,
            or one the index disagrees with, is named with the index.
    """
    index = open_index(path, how.storage_options)
    if how.mmap and _fs.is_remote(index.path):
        raise _mmap_refused(path, "the shards are remote")
    merged: collections.OrderedDict[str, Any] = collections.OrderedDict()
    for shard in index.shards:
        where = index.shard_path(shard)
        try:
            kind = detect_format(where, storage_options=how.storage_options)
        except CheckpointNotFoundError as exc:
            raise index.missing(shard) from exc
        if kind not in (SAFETENSORS, TORCH_ZIP, LEGACY):
            raise CheckpointFormatError(
                f"{where}: a shard of {index.path} in format {kind!r}; shards must be "
                f"safetensors or torch.save files"
            )
        part = _read_file(where, kind, how)
        if not isinstance(part, dict) or not all(isinstance(k, str) for k in part):
            raise CheckpointFormatError(
                f"{where}: a shard of {index.path} that is not a state dict; a sharded "
                f"checkpoint's shards hold state-dict entries only"
            )
        check_keys(index, shard, part)
        merged.update(part)
    # The index's order (tied keys it records last): a state dict's own for files
    # ddpstate writes, unless a tied key stood before others (then nothing moves).
    order = index.order
    if list(merged) == order:
        return merged
    return collections.OrderedDict((k, merged[k]) for k in order)
