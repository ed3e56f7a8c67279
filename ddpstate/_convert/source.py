"""Opening what a file command is given, through the reference readers: torch, safetensors.

One checkpoint file, a Hugging Face sharded checkpoint, or a training folder's model
weights, read into a :class:`Checkpoint` whose objects are torch's own load of the
bytes: ``torch.load(weights_only=True)`` (memory-mapped for a local zip, so tensor
bytes stay in the page cache and are read once), after the container check of
:mod:`ddpstate._layout.torch_zip`; safetensors through the ``safetensors`` library. So
what ``inspect`` shows, ``verify`` passes, ``diff`` compares and ``convert`` copies is
exactly what torch acts on.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any, Optional

import torch

from ddpstate import _fs, _manifest, formats, storage
from ddpstate._io import torch_io
from ddpstate._io.safetensors_io import read_safetensors, read_safetensors_header
from ddpstate._layout.folders import model_files
from ddpstate._layout.hf_index import check_keys, find_index, is_index_name, open_index
from ddpstate._layout.safetensors import RESERVED_PREFIX
from ddpstate.errors import (
    AmbiguousStateDictError,
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    StateDictNotFoundError,
    concerning,
)
from ddpstate.formats import FormatName

__all__ = [
    "Checkpoint",
    "check_materializable",
    "failures_named",
    "iter_tensors",
    "model_unit",
    "read_checkpoint",
]

# A remote torch file is copied to local disk in pieces of this size.
_COPY_PIECE = 16 << 20

# Among several models, the one so named is the model (a manager's "model" beside "ema";
# Accelerate's model.safetensors beside model_1.safetensors).
_MODEL = "model"


def _pick(path: str, choices: dict[str, str], key: Optional[str], what: str) -> tuple[str, str]:
    """``(choice, key left)``: the one choice, or the one ``key`` names (whole or first part)."""
    if key is not None:
        for name in (key, key.split(".", 1)[0]):
            if name in choices:
                return name, key[len(name) + 1 :]
    if key is None and (len(choices) == 1 or _MODEL in choices):
        return (_MODEL if _MODEL in choices else next(iter(choices))), ""
    listed = ", ".join(choices) or "none"
    error = AmbiguousStateDictError if len(choices) > 1 else StateDictNotFoundError
    named = f"key={key!r} names none of them" if key is not None else "which one is meant?"
    raise concerning("key", error(
        f"{path} holds {len(choices)} {what} ({listed}): {named} Pass key='<one of them>'"
    ))  # fmt: skip


def model_unit(
    path: str, kind: str, key: Optional[str], storage_options: Optional[dict[str, Any]]
) -> tuple[str, Optional[str]]:
    """The model weights of a training folder, and what is left of ``key`` inside them.

    A CheckpointManager step folder: its manifest's module entry, the one named
    ``model`` among several, or the entry ``key`` names (a manager directory:
    its newest committed step). An Accelerate or Hugging Face Trainer folder:
    its sharded index, or its model weights file (``model.*`` among several, or
    the one ``key`` names).

    Args:
        path: The folder.
        kind: Its kind (:func:`ddpstate.formats.detect_format`), one of
            :data:`ddpstate.formats.TRAINING_FOLDERS`.
        key: The user's key: an entry or file to pick, then a key inside it.
        storage_options: fsspec options for URLs.

    Returns:
        ``(file or folder to read, key inside it or None)``.

    Raises:
        StateDictNotFoundError: No model weights, or ``key`` names none of the choices.
        AmbiguousStateDictError: Several, and ``key`` picks none.
        CheckpointFormatError: A manager folder with no readable manifest.
    """
    opts = storage_options
    if kind != formats.MANAGER:
        index = find_index(path, opts)
        if index is not None:
            return index, key
        names = model_files(storage.listdir(path, storage_options=opts))
        if key in names:
            return storage.join(path, key), None
        stems = {n.split(".", 1)[0]: n for n in names}
        picked, rest = _pick(path, stems, key, "model weights files")
        return storage.join(path, stems[picked]), rest or None
    manifest, problem = _manifest.read_manifest(path, opts)
    if manifest is None:
        steps = _manifest.StepFolders(path, opts).committed_steps()
        if not steps:
            raise CheckpointFormatError(f"{path}: a CheckpointManager folder, but {problem}")
        return model_unit(storage.join(path, _manifest.step_name(steps[-1])), kind, key, opts)
    path = storage.committed_folder(path, storage_options=opts)  # a URL's version folder
    entries = manifest.get("entries") or {}
    # "module", or "dcp_module" for a model saved sharded into the step's DCP folder
    modules = {n: e for n, e in entries.items() if str(e.get("kind")).endswith("module")}
    choices = modules if key is None and modules else entries
    picked, rest = _pick(path, choices, key, "model entries" if choices is modules else "entries")
    file = str(entries[picked]["file"])
    if file.startswith(_manifest.DCP_SUBDIR + "/"):  # sharded entries share one DCP folder
        return storage.join(path, _manifest.DCP_SUBDIR), ".".join(filter(None, (picked, rest)))
    where = _fs.confined_file(
        path, file, checkpoint=path, entry=f"its {_manifest.MANIFEST_NAME} entry {picked!r}"
    )
    return where, rest or None


@dataclasses.dataclass(eq=False)
class Checkpoint:
    """A checkpoint as torch (or the safetensors library) reads it.

    Attributes:
        path: The file (a sharded checkpoint: its index).
        format: ``"pt"``, ``"pt_legacy"``, ``"safetensors"`` or ``"hf_sharded"``.
        size: Its size in bytes (a sharded checkpoint: all shards').
        obj: What torch loaded; tensors on the CPU (memory-mapped where possible).
        locations: The device each storage was saved on, by its data pointer.
        unsafe_globals: Globals beyond torch's weights_only list (read with ``unsafe``).
        st_metadata: The safetensors ``__metadata__`` minus ddpstate's own keys.
    """

    path: str
    format: FormatName
    size: int
    obj: Any
    locations: dict[int, str] = dataclasses.field(default_factory=dict)
    unsafe_globals: tuple[str, ...] = ()
    st_metadata: dict[str, str] = dataclasses.field(default_factory=dict)

    def location(self, tensor: torch.Tensor) -> str:
        """The device ``tensor``'s storage was saved on."""
        return self.locations.get(tensor.untyped_storage().data_ptr(), "cpu")


def iter_tensors(obj: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """``(path, tensor)`` for every tensor in nested dicts, lists, tuples and sets, in order.

    A loop over an explicit stack: torch loads 100,000-deep nesting, so may this. Each
    entry keeps its path as a link to its parent's (``(parent link, key)``), so a level
    costs one small tuple, not a copy of the whole path; a path is spelled out only for a
    tensor.
    """
    Link = Optional[tuple[Any, Any]]  # (parent link, key), None at the root
    stack: list[tuple[Link, Any]] = [(None, obj)]
    while stack:
        link, value = stack.pop()
        if isinstance(value, torch.Tensor):
            keys: list[Any] = []
            while link is not None:
                link, key = link
                keys.append(key)
            yield tuple(reversed(keys)), value
        elif isinstance(value, dict):
            stack.extend(((link, k), v) for k, v in reversed(value.items()))
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(((link, i), v) for i, v in reversed(list(enumerate(value))))


def check_materializable(ckpt: Checkpoint, name: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor whose elements would take more memory than its file could back.

    A view's shape and strides are claims of the file: a stride-0 view of four floats
    "shaped" 100000x100000 takes 40 GB once made contiguous (a copy, a cast, safetensors).

    Raises:
        CheckpointCorruptError: ``numel * itemsize`` exceeds its storage and the file.
    """
    needed = tensor.numel() * tensor.element_size()
    if needed > max(tensor.untyped_storage().nbytes(), ckpt.size):
        raise CheckpointCorruptError(
            f"{ckpt.path}: tensor {name} claims {needed} bytes of elements from a "
            f"{tensor.untyped_storage().nbytes()}-byte storage in a {ckpt.size}-byte file; "
            f"ddpstate refuses to make it (the file is damaged or crafted)"
        )


@contextlib.contextmanager
def failures_named(path: str) -> Iterator[None]:
    """Turn running out of memory or of recursion depth inside the block into a named error."""
    try:
        yield
    except (MemoryError, RecursionError) as exc:
        raise torch_io.too_large(path, exc) from exc


def _load(path: str, kind: FormatName, unsafe: bool, opts: Optional[dict[str, Any]]) -> Checkpoint:
    """One file through torch's reader (or the safetensors library's)."""
    if kind == formats.TORCHSCRIPT:
        raise CheckpointFormatError(
            f"{path}: a TorchScript archive (torch.jit.save), not a torch.save checkpoint; "
            f"load it with torch.jit.load() and torch.save its .state_dict() to use ddpstate on it"
        )
    local = _fs.local_path(path)
    # torch.load (2.13+) picks its safetensors reader from this suffix, whatever the bytes say.
    misnamed = kind != formats.SAFETENSORS and local.endswith(
        formats.TABLE[formats.SAFETENSORS].suffixes
    )
    with contextlib.ExitStack() as stack:
        src: Any = local
        if _fs.is_remote(path) and kind == formats.TORCH_ZIP:
            # Copied to local disk once and mapped from there: torch.load reads a file object
            # whole into memory. The mapping outlives the copy's name (removed on exit).
            src = os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "src.pt")
            with storage.open_read(path, storage_options=opts) as remote, open(src, "wb") as f:
                shutil.copyfileobj(remote, f, _COPY_PIECE)
        elif _fs.is_remote(path) or misnamed:
            src = stack.enter_context(storage.open_read(path, storage_options=opts))
        size = os.path.getsize(src) if isinstance(src, str) else src.seek(0, os.SEEK_END)
        mapped = isinstance(src, str)
        if kind == formats.SAFETENSORS:
            meta = read_safetensors_header(src).metadata
            obj = read_safetensors(src, mmap=mapped)
            user = {k: v for k, v in meta.items() if not k.startswith(RESERVED_PREFIX)}
            return Checkpoint(path, kind, size, obj, st_metadata=user)
        locations: dict[int, str] = {}

        def place(stored: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
            torch.device(location)  # a tag no device has is damage, as torch.load finds it
            locations[stored.data_ptr()] = location
            return stored  # read to the CPU; every output is tagged cpu

        obj = torch_io.load_torch_file(
            src, kind=kind, name=path, map_location=place, weights_only=not unsafe,
            mmap=mapped and kind == formats.TORCH_ZIP,
        )  # fmt: skip
        unsafe_globals = tuple(torch_io.unsafe_globals(src, kind)) if unsafe else ()
        return Checkpoint(path, kind, size, obj, locations, unsafe_globals)


def _load_sharded(path: str, unsafe: bool, opts: Optional[dict[str, Any]]) -> Checkpoint:
    """Every shard of a Hugging Face sharded checkpoint, checked against its index, as one."""
    index = open_index(path, opts)
    merged: dict[str, Any] = {}
    size = 0
    shards = []
    for shard in index.shards:
        where = index.shard_path(shard)
        try:
            part = _load(where, formats.detect_format(where, storage_options=opts), unsafe, opts)
        except CheckpointNotFoundError as exc:
            raise index.missing(shard) from exc
        if not isinstance(part.obj, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in part.obj.items()
        ):
            raise CheckpointFormatError(
                f"{where}: a shard of {index.path} that is not a flat map of names to tensors; "
                f"a sharded checkpoint's shards hold state-dict entries only"
            )
        check_keys(index, shard, part.obj)
        merged.update(part.obj)
        size += part.size
        shards.append(part)
    obj = collections.OrderedDict((k, merged[k]) for k in index.order)
    meta = next((c.st_metadata for c in shards if c.format == formats.SAFETENSORS), {})
    locations = {p: loc for c in shards for p, loc in c.locations.items()}
    unsafe_globals = tuple(sorted({g for c in shards for g in c.unsafe_globals}))
    return Checkpoint(index.path, formats.HF_SHARDED, size, obj, locations, unsafe_globals, meta)


def read_checkpoint(
    path: str,
    *,
    unsafe: bool = False,
    storage_options: Optional[dict[str, Any]] = None,
) -> Checkpoint:
    """Read a checkpoint with torch's own reader, after checking its zip container.

    Args:
        path: Local path or fsspec URL of a single checkpoint file, of a
            Hugging Face sharded checkpoint (its shards merged into one view), or of
            a training folder (its model weights, see :func:`model_unit`).
        unsafe: Read with ``torch.load(weights_only=False)``: torch's full
            unpickler, which runs whatever code the file names.
        storage_options: fsspec options for URLs.

    Returns:
        The :class:`Checkpoint`.

    Raises:
        CheckpointNotFoundError: No such file.
        CheckpointFormatError: Not a checkpoint file, a TorchScript archive or a
            torch.distributed.checkpoint folder; or more memory or nesting than
            this process allows.
        CheckpointCorruptError: The file is truncated, damaged or crafted.
        UnsafeCheckpointError: torch's weights_only refuses it and ``unsafe`` is False.

    Example:
        >>> import torch, tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "m.pt")
        >>> torch.save({"module.w": torch.ones(2)}, p)
        >>> ckpt = read_checkpoint(p)
        >>> ckpt.format, list(ckpt.obj)
        ('pt', ['module.w'])
    """
    opts = storage_options
    with failures_named(path):
        if is_index_name(path) or storage.isdir(path, storage_options=opts):
            kind = formats.detect_format(path, storage_options=opts)
            if kind == formats.HF_SHARDED:
                return _load_sharded(path, unsafe, opts)
            if kind in formats.TRAINING_FOLDERS:
                unit, _ = model_unit(path, kind, None, opts)
                return read_checkpoint(unit, unsafe=unsafe, storage_options=opts)
            if kind == formats.DCP:
                raise CheckpointFormatError(
                    f"{path}: a torch.distributed.checkpoint folder; this command reads single "
                    f"checkpoint files (torch.save, legacy torch or safetensors)"
                )
        return _load(path, formats.detect_format(path, storage_options=opts), unsafe, opts)
