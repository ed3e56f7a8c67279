"""``inspect_file``: describe a checkpoint from its headers and pickle, never its tensor data."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Optional

from ddpstate import formats, keys
from ddpstate import storage as _storage
from ddpstate._convert import folders
from ddpstate._convert.common import (
    counted,
    describe,
    dotted,
    find_or_note,
    is_dcp_folder,
    is_optimizer_state,
    old_arguments,
    structure,
)
from ddpstate._convert.results import InspectResult, TensorInfo
from ddpstate._fs import PathLike
from ddpstate._streaming.opener import model_unit, read_checkpoint
from ddpstate._streaming.pickle_scan import (
    TensorRecord,
    is_pickled_module,
    iter_tensors,
    module_state_dict,
    opaque_name,
)
from ddpstate._streaming.progress import human_bytes
from ddpstate.errors import StateDictNotFoundError


def _summary(value: Any, role: Optional[str]) -> str:
    tensors = [r for _, r in iter_tensors(value) if isinstance(r, TensorRecord)]
    size = sum(r.nbytes for r in tensors)
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
    whole = isinstance(value, TensorRecord)  # a tensor's own description says its size
    return counted(describe(value), role, 0 if whole else len(tensors), size)


def inspect_file(
    src: PathLike,
    *,
    weights_only: bool = True,
    storage_options: Optional[dict[str, Any]] = None,
    **legacy: Any,
) -> InspectResult:
    """Describe a checkpoint from its headers and pickle structure, never its tensor data.

    A ``torch.distributed.checkpoint`` folder is described from its ``.metadata``
    (read with an unpickler that allows only DCP's metadata classes): keys, whole
    shapes, dtypes and sizes, whatever the sharding. A training folder (a
    CheckpointManager step, an Accelerate ``save_state`` folder, a Hugging Face
    Trainer ``checkpoint-N``) is described by its model weights, with notes
    listing its files and their roles, and the manifest's step, metrics and entries.

    Args:
        src: The checkpoint file, DCP folder or training folder.
        weights_only: ``False`` also reads pickles that name unsafe globals (still
            never run).
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
    unsafe = not weights_only
    with read_checkpoint(text, unsafe=unsafe, storage_options=storage_options) as ckpt:
        root = ckpt.obj
        notes: list[str] = []
        path: Optional[tuple[Any, ...]] = None
        sd: Any = None
        if is_pickled_module(root):
            sd = module_state_dict(root)
            notes.append(
                f"a pickled whole nn.Module ({opaque_name(root)}), not a state dict; "
                f"the table lists its parameters and buffers"
            )
        else:
            path, sd = find_or_note(root, notes)
        all_tensors = [r for _, r in iter_tensors(root) if isinstance(r, TensorRecord)]
        # A storage is counted under the dtype of the first tensor viewing it.
        dtype_of = {id(rec.storage): rec.dtype for rec in reversed(all_tensors)}
        dtype_bytes: dict[str, int] = collections.Counter()
        for storage in ckpt.storages:
            dtype_bytes[dtype_of.get(id(storage), storage.dtype)] += storage.nbytes
        devices = collections.Counter(storage.location for storage in ckpt.storages)
        every = ((dotted(p) or "", r) for p, r in iter_tensors(root))  # no state dict
        rows = tuple(
            TensorInfo(str(name), value.dtype, value.shape, value.nbytes, value.storage.location)
            if isinstance(value, TensorRecord)
            else TensorInfo(str(name), describe(value), (), 0, "")
            for name, value in (sd.items() if sd is not None else every)
        )
        prefixes = tuple(keys.detect_prefixes(sd)) if sd is not None else ()
        return InspectResult(
            path=ckpt.path,
            format=ckpt.format,
            file_size=ckpt.size,
            tensor_count=len(all_tensors),
            tensor_bytes=sum(s.nbytes for s in ckpt.storages),
            dtype_bytes=dict(dtype_bytes),
            devices=dict(devices),
            prefixes=prefixes,
            state_dict_path=dotted(path),
            structure=structure(root, path, _summary),
            tensors=rows,
            unsafe_globals=ckpt.unsafe_globals,
            problems=tuple(ckpt.problems),
            notes=tuple(notes),
        )
