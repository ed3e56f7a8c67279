"""``inspect_file``: describe a checkpoint as torch loads it (tensor data stays mapped, unread)."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Optional

import torch

from ddpstate import formats, keys
from ddpstate import storage as _storage
from ddpstate._convert import folders
from ddpstate._convert.common import (
    counted,
    describe,
    dotted,
    dtype_name,
    find_or_note,
    is_dcp_folder,
    is_optimizer_state,
    old_arguments,
    structure,
)
from ddpstate._convert.results import InspectResult, TensorInfo
from ddpstate._convert.source import failures_named, iter_tensors, model_unit, read_checkpoint
from ddpstate._fs import PathLike
from ddpstate._progress import human_bytes
from ddpstate.errors import StateDictNotFoundError


def _summary(value: Any, role: Optional[str]) -> str:
    tensors = [t for _, t in iter_tensors(value)]
    size = sum(t.nbytes for t in tensors)
    if role is None and is_optimizer_state(value):
        if isinstance(value, Mapping) and "param_groups" in value:
            groups = value.get("param_groups")
            state = value.get("state")
            n_groups = len(groups) if isinstance(groups, (list, tuple)) else "?"
            n_state = len(state) if isinstance(state, Mapping) else "?"
            return (
                f"optimizer state: {n_state} parameter states, {n_groups} param group(s), "
                f"{len(tensors)} tensors, {human_bytes(size)}"
            )
        return f"optimizer states: {len(tensors)} tensors, {human_bytes(size)}"
    whole = isinstance(value, torch.Tensor)  # a tensor's own description says its size
    return counted(describe(value), role, 0 if whole else len(tensors), size)


def inspect_file(
    src: PathLike,
    *,
    weights_only: bool = True,
    storage_options: Optional[dict[str, Any]] = None,
    **legacy: Any,
) -> InspectResult:
    """Describe a checkpoint as ``torch.load(weights_only=True, mmap=True)`` reads it.

    The tensors are memory-mapped, never read: only the pickle is unpickled.

    A ``torch.distributed.checkpoint`` folder is described from its ``.metadata``
    (read with an unpickler that allows only DCP's metadata classes): keys, whole
    shapes, dtypes and sizes, whatever the sharding. A training folder (a
    CheckpointManager step, an Accelerate ``save_state`` folder, a Hugging Face
    Trainer ``checkpoint-N``) is described by its model weights, with notes
    listing its files and their roles, and the manifest's step, metrics and entries.

    Args:
        src: The checkpoint file, DCP folder or training folder.
        weights_only: ``False`` reads with torch's full unpickler, which runs
            whatever code the file names: only for files you trust.
        storage_options: fsspec options for URLs.
        **legacy: ``unsafe=`` (now ``weights_only=``, inverted), with a
            ``DeprecationWarning``.

    Returns:
        An :class:`InspectResult`: format, sizes, dtypes, devices, wrapper
        prefixes, the top-level structure and the model's keys.

    Raises:
        CheckpointNotFoundError, CheckpointFormatError, CheckpointCorruptError,
        UnsafeCheckpointError: as for :func:`convert_file`.

    Example:
        >>> import torch, tempfile, os
        >>> from ddpstate.convert import inspect_file
        >>> p = os.path.join(tempfile.mkdtemp(), "m.pt")
        >>> torch.save({"epoch": 1, "state_dict": {"module.w": torch.ones(2)}}, p)
        >>> info = inspect_file(p)
        >>> info.state_dict_path, info.prefixes, info.tensors[0].name
        ('state_dict', ('module.',), 'module.w')
    """
    weights_only = old_arguments("inspect_file", legacy, weights_only=weights_only)[0]
    if is_dcp_folder(os.fspath(src), storage_options):
        # DCP needs torch: imported only for a folder, so files stay torch-free.
        from ddpstate._convert.dcp import inspect_dcp

        return inspect_dcp(os.fspath(src), storage_options=storage_options)
    text = os.fspath(src)
    if _storage.isdir(text, storage_options=storage_options):
        kind = formats.detect_format(text, storage_options=storage_options)
        if kind in formats.TRAINING_FOLDERS:
            try:
                unit, _ = model_unit(text, kind, None, storage_options)
            except StateDictNotFoundError as exc:  # no model, or several: the folder alone
                about = folders.describe(text, kind, None, storage_options)
                return InspectResult(
                    text, kind, 0, 0, 0, {}, {}, (), None, (), (), notes=(*about, str(exc))
                )
            found = inspect_file(unit, weights_only=weights_only, storage_options=storage_options)
            about = folders.describe(text, kind, unit, storage_options)
            return dataclasses.replace(found, notes=(*about, *found.notes))
    with failures_named(text):
        return _inspect(text, not weights_only, storage_options)


def _inspect(text: str, unsafe: bool, storage_options: Optional[dict[str, Any]]) -> InspectResult:
    ckpt = read_checkpoint(text, unsafe=unsafe, storage_options=storage_options)
    root = ckpt.obj
    notes: list[str] = []
    path: Optional[tuple[Any, ...]] = None
    sd: Any = None
    if isinstance(root, torch.nn.Module):
        sd = root.state_dict()
        notes.append(
            f"a pickled whole nn.Module ({type(root).__name__}), not a state dict; "
            f"the table lists its parameters and buffers"
        )
    else:
        path, sd = find_or_note(root, notes)
    all_tensors = [t for _, t in iter_tensors(root)]
    # A storage is counted once, under the dtype of the first tensor viewing it.
    storages: dict[int, tuple[str, int, str]] = {}
    for t in all_tensors:
        storages.setdefault(
            t.untyped_storage().data_ptr() or id(t),
            (dtype_name(t.dtype), t.untyped_storage().nbytes(), ckpt.location(t)),
        )
    dtype_bytes: dict[str, int] = collections.Counter()
    for dtype, nbytes, _ in storages.values():
        dtype_bytes[dtype] += nbytes
    devices = collections.Counter(location for _, _, location in storages.values())
    every = ((dotted(p) or "", t) for p, t in iter_tensors(root))  # no state dict
    rows = tuple(
        TensorInfo(str(name), dtype_name(v.dtype), tuple(v.shape), v.nbytes, ckpt.location(v))
        if isinstance(v, torch.Tensor)
        else TensorInfo(str(name), describe(v), (), 0, "")
        for name, v in (sd.items() if sd is not None else every)
    )
    return InspectResult(
        path=ckpt.path,
        format=ckpt.format,
        file_size=ckpt.size,
        tensor_count=len(all_tensors),
        tensor_bytes=sum(nbytes for _, nbytes, _ in storages.values()),
        dtype_bytes=dict(dtype_bytes),
        devices=dict(devices),
        prefixes=tuple(keys.detect_prefixes(sd)) if sd is not None else (),
        state_dict_path=dotted(path),
        structure=structure(root, path, _summary),
        tensors=rows,
        unsafe_globals=ckpt.unsafe_globals,
        problems=(),
        notes=tuple(notes),
    )
