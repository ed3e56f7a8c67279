"""``ddpstate inspect``/``verify``/``convert`` on torch.distributed.checkpoint folders.

DCP needs torch, so the other commands of :mod:`ddpstate._convert` import this module
only when a folder (or ``format="dcp"``) is involved; the streaming paths for files stay torch-free.
``inspect`` and ``verify`` work from the ``.metadata`` alone (read with the
safe unpickler) and the files' sizes; ``convert`` consolidates a folder into
one ``.pt``/``.safetensors`` file, or writes a file's state as a DCP folder.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ddpstate import _fs, formats, keys, storage
from ddpstate._convert.common import (
    StateEdit,
    apply_edit,
    counted,
    describe,
    destination,
    dotted,
    dtype_name,
    find_or_note,
    format_from_name,
    structure,
)
from ddpstate._convert.results import ConvertResult, InspectResult, TensorInfo, VerifyResult
from ddpstate._dcp import read as _dcp_read
from ddpstate._io import savecheck as _savecheck
from ddpstate._io import torch_io as _torch_io
from ddpstate._io.durable_dcp import DurableWriter
from ddpstate._io.safetensors_io import write_safetensors
from ddpstate._manifest import MANIFEST_NAME, verify_checkpoint
from ddpstate._storage.temps import cleanup_after
from ddpstate.checkpoint import load
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointFormatError,
    DDPStateError,
    InvalidArgumentError,
    concerning,
)
from ddpstate.formats import PT, SAFETENSORS

__all__ = ["convert_from_dcp", "convert_to_dcp", "inspect_dcp", "verify_dcp"]


def _nbytes(entry: Any) -> int:
    return math.prod(int(n) for n in entry.size) * int(entry.properties.dtype.itemsize)


def _file_sizes(path: str, storage_options: Optional[dict[str, Any]]) -> dict[str, int]:
    """Each file directly in the folder -> its size in bytes."""
    if _fs.is_remote(path):
        fs, root = _fs.url_to_fs(path, storage_options)
        return {
            os.path.basename(str(info["name"]).rstrip("/")): int(info.get("size") or 0)
            for info in fs.ls(root, detail=True)
            if info.get("type") == "file"
        }
    local = _fs.local_path(path)
    with os.scandir(local) as entries:
        return {e.name: e.stat().st_size for e in entries if e.is_file()}


# --------------------------------------------------------------------------- inspect


def _describe(value: Any, role: Optional[str]) -> str:
    count, size = _tensor_stats(value)
    if role is None and isinstance(value, torch.Tensor):
        return describe(value)
    if role is None and isinstance(value, _dcp_read.BytesEntry):
        return "a pickled value"
    return counted(f"{type(value).__name__} of {len(value)} entries", role, count, size)


def _children(value: Any) -> Optional[Iterable[tuple[Any, Any]]]:
    """``(key, value)`` of a mapping, ``(index, item)`` of a list or tuple; None for a leaf."""
    if isinstance(value, Mapping):
        return value.items()
    return enumerate(value) if isinstance(value, (list, tuple)) else None


def _flat(value: Any, name: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted name, leaf)`` for every leaf of a nested state."""
    children = _children(value)
    if children is None:
        yield name, value
        return
    for k, v in children:
        yield from _flat(v, f"{name}.{k}" if name else str(k))


def inspect_dcp(path: str, *, storage_options: Optional[dict[str, Any]] = None) -> InspectResult:
    """Describe a DCP folder from its ``.metadata``: keys, shapes, dtypes, sizes; no data read.

    Args:
        path: The folder.
        storage_options: fsspec options for a URL.

    Returns:
        An :class:`~ddpstate.convert.InspectResult` (format ``"dcp"``); tensor
        shapes are the whole (consolidated) shapes, whatever the sharding.

    Raises:
        CheckpointCorruptError: The metadata is damaged.
        UnsafeCheckpointError: The metadata names a class DCP never uses.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _dcp_read.read_metadata(path, name=path, storage_options=storage_options)
    tree = _dcp_read.skeleton(metadata)
    notes: list[str] = []
    sd_path, sd = find_or_note(tree, notes)
    dtype_bytes: dict[str, int] = collections.Counter()
    tensor_count = chunks = 0
    for entry in metadata.state_dict_metadata.values():
        if isinstance(entry, TensorStorageMetadata):
            tensor_count += 1
            chunks += len(entry.chunks)
            dtype_bytes[dtype_name(entry.properties.dtype)] += _nbytes(entry)
    sizes = _file_sizes(path, storage_options)
    files = {info.relative_path for info in (metadata.storage_data or {}).values()}
    notes.append(
        f"{tensor_count} tensors stored as {chunks} chunk(s) in {len(files)} file(s); "
        f"shapes are those of the whole (consolidated) tensors"
    )
    items = list(sd.items()) if sd is not None else list(_flat(tree))
    rows = [
        TensorInfo(str(k), dtype_name(v.dtype), tuple(v.shape), v.nbytes, "cpu")
        if isinstance(v, torch.Tensor)
        else TensorInfo(str(k), _describe(v, None), (), 0, "")
        for k, v in items
    ]
    return InspectResult(
        path=path,
        format=formats.DCP,
        file_size=sum(sizes.values()),
        tensor_count=tensor_count,
        tensor_bytes=sum(dtype_bytes.values()),
        dtype_bytes=dict(dtype_bytes),
        devices={},
        prefixes=tuple(keys.detect_prefixes(sd)) if sd is not None else (),
        state_dict_path=dotted(sd_path),
        structure=structure(tree, sd_path, _describe),
        tensors=tuple(rows),
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------- verify


def verify_dcp(path: str, *, storage_options: Optional[dict[str, Any]] = None) -> VerifyResult:
    """Check a DCP folder: metadata parses, every file it names is there and long enough.

    DCP records no checksums, so the data's bytes are not read; when a
    ddpstate ``manifest.json`` sits in the folder, its sizes and CRC-32s are
    checked too (:func:`ddpstate.manager.verify_checkpoint`).

    Args:
        path: The folder.
        storage_options: fsspec options for a URL.

    Returns:
        A :class:`~ddpstate.convert.VerifyResult` (format ``"dcp"``); each
        problem names the file.

    Raises:
        UnsafeCheckpointError: The metadata names a class DCP never uses.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = _dcp_read.read_metadata(path, name=path, storage_options=storage_options)
    except CheckpointCorruptError as exc:
        return VerifyResult(path=path, format=formats.DCP, problems=(str(exc),))
    notes: list[str] = []
    sizes = _file_sizes(path, storage_options)
    problems, placed = _item_problems(path, metadata, sizes, storage_options)
    stored = {index.fqn for index in (metadata.storage_data or {})}
    unplaced = [fqn for fqn in metadata.state_dict_metadata if fqn not in stored]
    if unplaced:
        problems.append(
            f"{storage.join(path, _dcp_read.METADATA_FILE)}: {len(unplaced)} item(s) with no "
            f"storage location, e.g. "
            f"{unplaced[0]!r}; the metadata is damaged"
        )
    tensors = sum(
        isinstance(e, TensorStorageMetadata) for e in metadata.state_dict_metadata.values()
    )
    read = sizes.get(_dcp_read.METADATA_FILE, 0)
    if MANIFEST_NAME in sizes:
        found = verify_checkpoint(path, storage_options=storage_options)
        problems.extend(found.problems)
        notes.extend(found.notes)
        read += found.bytes_read
        notes.append(f"{found.files} file(s) checked against {MANIFEST_NAME} (sizes and CRC-32)")
    else:
        notes.append(
            f"{placed} data file(s) present and long enough; DCP records no checksums, "
            f"so their bytes were not checked"
        )
    return VerifyResult(
        path=path,
        format=formats.DCP,
        problems=tuple(problems),
        tensors=tensors,
        bytes_read=read,
        notes=tuple(notes),
    )


def _chunk_bytes(metadata: Any, fqn: str) -> dict[tuple[int, ...], int]:
    """A tensor's chunks (by offsets) -> their data bytes; empty for a non-tensor value."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entry = metadata.state_dict_metadata.get(fqn)
    if not isinstance(entry, TensorStorageMetadata):
        return {}
    itemsize = int(entry.properties.dtype.itemsize)
    return {tuple(c.offsets): math.prod(int(n) for n in c.sizes) * itemsize for c in entry.chunks}


def _item_problems(
    path: str, metadata: Any, sizes: Mapping[str, int], storage_options: Optional[dict[str, Any]]
) -> tuple[list[str], int]:
    """Each item's file, offset and length against the folder, the files and the item's size.

    Returns the problems and the number of data files the items use. A file
    outside the folder (or a FIFO, a device) is named and never opened; an
    offset or length that is not a byte count, a range past the file's end or
    shorter than the item's tensor data, and two items sharing bytes are damage.
    """
    problems: list[str] = []
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    refused: set[str] = set()
    chunks: dict[str, dict[tuple[int, ...], int]] = {}  # built once per tensor: many items each
    for index, info in (metadata.storage_data or {}).items():
        name, fqn = info.relative_path, index.fqn
        key = name if isinstance(name, str) else repr(name)
        if key in refused:
            continue
        if key not in ranges:
            try:
                _fs.confined_file(path, name, checkpoint=path, entry=f".metadata item {fqn!r}")
            except CheckpointCorruptError as exc:
                problems.append(str(exc))
                refused.add(key)
                continue
        offset, length = info.offset, info.length
        where = storage.join(path, key)
        if not isinstance(offset, int) or not isinstance(length, int) or min(offset, length) < 0:
            problems.append(
                f"{where}: .metadata places item {fqn!r} at offset {offset!r}, length "
                f"{length!r}, which are not byte counts; the metadata is damaged"
            )
            continue
        if fqn not in chunks:
            chunks[fqn] = _chunk_bytes(metadata, fqn)
        # A transformed (compressed) record may hold fewer bytes than its data: no bound then.
        transformed = bool(getattr(info, "transform_descriptors", None))
        least = 0 if transformed else chunks[fqn].get(tuple(index.offset or ()), 0)
        if length < least:
            problems.append(
                f"{where}: .metadata gives item {fqn!r} {length} bytes, fewer than its "
                f"{least} bytes of tensor data; the metadata is damaged"
            )
        ranges.setdefault(key, []).append((offset, length, fqn))
    for name, items in sorted(ranges.items()):
        items.sort()
        size, end = sizes.get(name), max(o + n for o, n, _ in items)
        if size is None:
            problems.append(
                f"{storage.join(path, name)}: missing (.metadata places {items[0][2]!r} "
                f"and maybe more there)"
            )
        elif size < end:
            problems.append(
                f"{storage.join(path, name)}: {size} bytes, but .metadata places data up to "
                f"byte {end}; the file is truncated"
            )
        for (o1, n1, a), (o2, _, b) in itertools.pairwise(items):
            if o2 < o1 + n1:
                problems.append(
                    f"{storage.join(path, name)}: .metadata places items {a!r} and {b!r} on "
                    f"the same bytes ({o2}..{o1 + n1}); each item has bytes of its own, so "
                    f"the metadata is damaged"
                )
    return problems, len(ranges)


# --------------------------------------------------------------------------- convert


def _tensor_stats(value: Any) -> tuple[int, int]:
    tensors = [v for _, v in _flat(value) if isinstance(v, torch.Tensor)]
    return len(tensors), sum(t.nbytes for t in tensors)


def convert_from_dcp(
    src: str,
    dst: Optional[str],
    edit: StateEdit,
    *,
    format: Optional[formats.FormatName],
    overwrite: bool,
    weights_only: bool,
    fsync: bool,
    storage_options: Optional[dict[str, Any]],
) -> ConvertResult:
    """Consolidate a DCP folder into one ``.pt`` or ``.safetensors`` file, atomically.

    See :func:`ddpstate.convert.convert_file` for the arguments; ``format`` is
    ``"pt"`` or ``"safetensors"`` (a folder cannot become another folder here).
    The whole checkpoint is read into memory (DCP has no streaming reader);
    the output holds plain CPU tensors that ``torch.load(weights_only=True)``
    or ``safetensors.torch.load_file`` read.
    """
    if format == formats.DCP:
        raise InvalidArgumentError(
            f"{src} is already a torch.distributed.checkpoint folder; convert it to 'pt' or "
            f"'safetensors'"
        )
    dst_format = format or format_from_name(dst) or PT
    if dst is None:
        # Next to the folder, named after it: ckpt_dcp/ -> ckpt_dcp.pt (never inside it).
        folder = src.rstrip("/\\") or src
        dst = folder + (".safetensors" if dst_format == SAFETENSORS else ".pt")
    dst_text = destination(src, dst, dst_format, overwrite, storage_options)
    state = _torch_io.load_dcp(
        src if _fs.is_remote(src) else _fs.local_path(src),
        name=src,
        weights_only=weights_only,
        storage_options=storage_options,
    )
    whole = dst_format != SAFETENSORS
    done = apply_edit(state, edit, whole=whole)
    written = done.root if whole else done.sd
    count, nbytes = _tensor_stats(written)
    with storage.atomic_write(dst_text, storage_options=storage_options, fsync=fsync) as out:
        if not whole:
            write_safetensors(out, written, {"format": "pt"}, name=dst_text)
        elif not weights_only:
            # The folder's own objects (already trusted by the caller) go back as they are.
            torch.save(written, out)
        else:
            _savecheck.save_torch(written, out, what="state", where=dst_text, extra=())
    return done.result(src, dst_text, formats.DCP, dst_format, count, nbytes)


def _dcp_target(
    dst: Optional[str], src: str, overwrite: bool, storage_options: Optional[dict[str, Any]]
) -> str:
    """The folder ``--to dcp`` writes, or the error for one it must not replace."""
    if dst is None:
        raise InvalidArgumentError(
            f"name the folder to write: ddpstate convert {src} OUT_FOLDER --to dcp"
        )
    target = dst if _fs.is_remote(dst) else os.path.abspath(_fs.local_path(dst))
    opts: dict[str, Any] = {"storage_options": storage_options}
    if storage.exists(target, **opts):
        names = storage.listdir(target, **opts) if storage.isdir(target, **opts) else None
        if names is None or (names and _dcp_read.METADATA_FILE not in names):
            raise CheckpointExistsError(
                f"{dst} already exists and is not a torch.distributed.checkpoint folder; "
                f"name a new folder (only a DCP folder or an empty one is ever replaced)"
            )
        if names and not overwrite:
            raise concerning("overwrite", CheckpointExistsError(
                f"{dst} already exists; pass --force (overwrite=True) to replace it, or name "
                f"another destination"
            ))  # fmt: skip
    return target


def convert_to_dcp(
    src: str,
    dst: Optional[str],
    edit: StateEdit,
    *,
    format: Optional[formats.FormatName],
    overwrite: bool,
    weights_only: bool,
    fsync: bool,
    storage_options: Optional[dict[str, Any]],
) -> ConvertResult:
    """Write a checkpoint file's state (``.pt``, legacy or ``.safetensors``) as a DCP folder.

    Through :class:`ddpstate.dcp.DurableWriter`: every item CRC-32'd as it is
    written, a manifest last, and locally the staged folder fsynced and swapped
    into place, so ``dst`` (a local folder or an fsspec URL) is never
    half-written and an existing DCP folder there (with ``overwrite``) stays
    whole until the new one commits. ``format`` is ``"dcp"``.
    """
    target = _dcp_target(dst, src, overwrite, storage_options)
    state = load(
        src, map_location="cpu", weights_only=weights_only, barrier=False,
        storage_options=storage_options,
    )  # fmt: skip
    done = apply_edit(state, edit, whole=True)
    root = done.root
    if not isinstance(root, Mapping):
        raise CheckpointFormatError(
            f"{src} holds a {type(root).__name__}, not a dict; a torch.distributed.checkpoint "
            f"folder stores a dict of named values"
        )
    odd = _non_str_key(root, ())
    if odd is not None:
        where, k = odd
        raise CheckpointFormatError(
            f"{src}: {repr(where) if where else 'the top level'} has the non-string key {k!r}; a "
            f"torch.distributed.checkpoint folder stores every key as a string, so it would "
            f"come back as {str(k)!r} (an optimizer's state would then silently not load); "
            f"pass drop_optimizer=True (--drop-optimizer) if that is the optimizer state, or "
            f"save the optimizer with torch.distributed.checkpoint.state_dict."
            f"get_optimizer_state_dict, which keys it by parameter name"
        )
    if any(getattr(v, "_metadata", None) is not None for v in (root, done.sd) if v is not None):
        done.notes.append(
            "the state dict's _metadata (module versions) is not kept: DCP stores no "
            "attributes of dicts; models load without it"
        )
    count, nbytes = _tensor_stats(root)
    writer = DurableWriter(target, sync_files=fsync, storage_options=storage_options)
    try:
        with warnings.catch_warnings():
            # Without a process group DCP warns that it runs single-process: the intent.
            warnings.simplefilter("ignore", UserWarning)
            dcp_save(dict(root), storage_writer=writer, no_dist=True)
    except Exception as exc:
        # Its staging folder; the target is untouched until the commit.
        cleanup_after(exc, f"the staging folder {writer.path}", writer.discard)
        if isinstance(exc, DDPStateError):
            raise
        raise CheckpointFormatError(
            f"{src}: writing it as a torch.distributed.checkpoint folder failed "
            f"({type(exc).__name__}: {exc}); {dst} was left as it was"
        ) from exc
    src_format = formats.detect_format(src, storage_options=storage_options)
    return done.result(src, target if dst is None else dst, src_format, formats.DCP, count, nbytes)


def _non_str_key(value: Any, path: tuple[str, ...]) -> Optional[tuple[str, Any]]:
    """(dotted path of the dict, key) of the first dict key that is not a string."""
    for k, v in _children(value) or ():
        if isinstance(value, Mapping) and not isinstance(k, str):
            return ".".join(path), k
        found = _non_str_key(v, (*path, str(k)))
        if found is not None:
            return found
    return None
