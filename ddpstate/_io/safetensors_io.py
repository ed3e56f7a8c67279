"""safetensors files with ddpstate's tied tensors and ``_metadata``: the library, or a stream.

Local files are read by the ``safetensors`` package itself (the reference
implementation). Every write, and reads from file objects (fsspec downloads,
buffers) and headers read without the data, are done here on top of the
torch-free layout in :mod:`ddpstate._layout.safetensors`: the header it builds
and each tensor's bytes, streamed into whatever file object the caller has
(the temp file of :func:`ddpstate.storage.atomic_write`, an fsspec upload), so
no second copy of the state dict and no second file is made. Also the Hugging
Face sharded layout's torch side: :func:`save_sharded`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import json
import os
import threading
import weakref
from collections.abc import Mapping
from typing import IO, Any, Optional, Union

import safetensors
import torch

from ddpstate._gc import gc_paused
from ddpstate._io.device_copy import read_into, read_into_tensors
from ddpstate._layout.hf_write import parse_size, plan_shards, write_sharded
from ddpstate._layout.safetensors import (
    ALIASES_KEY,
    DTYPES,
    KEY_ORDER_KEY,
    RESERVED_PREFIX,
    STATE_DICT_METADATA_KEY,
    View,
    build_header,
    find_aliases,
    parse_header,
    restore_extras,
    state_dict_metadata_json,
)
from ddpstate._warn import warn
from ddpstate.errors import CheckpointCorruptError, CheckpointFormatError

__all__ = [
    "ALIASES_KEY",
    "DTYPE_NAMES",
    "RESERVED_PREFIX",
    "STATE_DICT_METADATA_KEY",
    "SafetensorsHeader",
    "TensorEntry",
    "read_safetensors",
    "read_safetensors_header",
    "safetensors_header_for",
    "save_sharded",
    "tied_keys",
    "write_safetensors",
]

#: torch dtype -> safetensors dtype code, for every dtype both know (on this torch).
DTYPE_NAMES: dict[torch.dtype, str] = {
    getattr(torch, name): code for code, (name, _) in DTYPES.items() if hasattr(torch, name)
}

_SHOW = 8  # how many offending keys an error message lists

Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, IO[bytes]]


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor in a safetensors header.

    Attributes:
        dtype: The torch dtype.
        shape: The tensor's shape.
        begin: Offset of its first byte, counted from the start of the data section.
        end: Offset one past its last byte.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed, validated safetensors header.

    Attributes:
        tensors: Key -> :class:`TensorEntry`, in header order.
        metadata: The ``__metadata__`` string map (ddpstate's own keys included).
        data_start: File offset of the data section (8 + header length).
    """

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int


def _refuse(name: str, problems: list[str], what: str) -> CheckpointFormatError:
    shown = "; ".join(problems[:_SHOW])
    more = f" (and {len(problems) - _SHOW} more)" if len(problems) > _SHOW else ""
    return CheckpointFormatError(f"{name}: cannot write safetensors: {shown}{more}. {what}")


def _validate(state_dict: Any, name: str) -> None:
    if not isinstance(state_dict, Mapping):
        raise CheckpointFormatError(
            f"{name}: safetensors stores a flat mapping of str -> tensor, got "
            f"{type(state_dict).__name__}; save a state dict, or use format='torch' for "
            f"other objects"
        )
    problems = []
    for key, value in state_dict.items():
        if not isinstance(key, str):
            problems.append(f"key {key!r} is not a string")
        elif key == "__metadata__":
            problems.append("key '__metadata__' is reserved by the format; rename that entry")
        elif not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is a {type(value).__name__}, not a tensor")
        elif value.layout != torch.strided:
            problems.append(f"{key!r} is a {value.layout} tensor; call .to_dense() first")
        elif value.is_quantized:
            problems.append(f"{key!r} is quantized; dequantize it first")
        elif value.dtype not in DTYPE_NAMES:
            problems.append(f"{key!r} has dtype {value.dtype}, which safetensors cannot store")
        elif value.device.type == "meta":
            problems.append(f"{key!r} is on the meta device and has no data")
    if problems:
        raise _refuse(
            name,
            problems,
            "Store only tensors (format='torch' keeps any object, e.g. optimizer state)",
        )


def _metadata_entries(
    state_dict: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]], name: str
) -> dict[str, str]:
    out: dict[str, str] = {}
    if metadata:
        problems = []
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                problems.append(f"metadata entry {key!r}: {value!r} is not str -> str")
            elif key.startswith(RESERVED_PREFIX) or key == "__metadata__":
                problems.append(f"metadata key {key!r} is reserved for ddpstate")
            else:
                out[key] = value
        if problems:
            raise _refuse(name, problems, "Pass metadata as a dict of str -> str")
    if len(state_dict) > 1:
        out[KEY_ORDER_KEY] = json.dumps(list(state_dict), separators=(",", ":"))
    sd_meta = getattr(state_dict, "_metadata", None)
    if sd_meta is not None:
        try:
            out[STATE_DICT_METADATA_KEY] = state_dict_metadata_json(sd_meta)
        except (TypeError, ValueError) as exc:
            raise CheckpointFormatError(
                f"{name}: the state dict's _metadata cannot be stored as JSON ({exc}); "
                f"use format='torch' to keep it"
            ) from exc
    return out


def _view(key: str, t: torch.Tensor) -> Optional[View]:
    if t.numel() == 0:
        return None  # empty tensors all share data pointer 0; there is nothing to tie
    storage = (t.device, t.untyped_storage().data_ptr())
    size = t.element_size()
    extent = 1 + sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    start = int(t.storage_offset()) * size
    # The conjugate/negative bits are part of what a view means: x.conj() is no tie of x.
    identity = (
        *storage,
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
        t.is_conj(),
        t.is_neg(),
    )
    return View(key, identity, storage, start, start + extent * size)


def tied_keys(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, str], list[str]]:
    """``({alias: canonical}, overlaps)``: keys that are the very same view of another's tensor.

    Tied tensors (the same view of the same memory) are written once, under
    their first key. Overlaps are tensors sharing memory without being the same
    view (written as copies), as :func:`~ddpstate._layout.safetensors.find_aliases` tells them.

    Example:
        >>> import torch
        >>> w = torch.ones(2)
        >>> tied_keys({"embed": w, "head": w, "b": torch.zeros(1)})
        ({'head': 'embed'}, [])
    """
    # Only tensors that share a storage with another can be tied or overlap; a
    # storage's start is data_ptr - offset, which costs no storage object.
    by_storage: dict[tuple[int, int], list[str]] = {}
    for k, t in state_dict.items():
        base = t.data_ptr() - int(t.storage_offset()) * t.element_size()
        by_storage.setdefault((t.get_device(), base), []).append(k)
    shared = {k for keys in by_storage.values() if len(keys) > 1 for k in keys}
    return find_aliases(_view(k, t) for k, t in state_dict.items() if k in shared)


def _find_ties(state_dict: Mapping[str, torch.Tensor], name: str) -> dict[str, str]:
    """``{alias: canonical}`` of tied tensors; warns about overlaps that are not ties."""
    aliases, overlaps = tied_keys(state_dict)
    if overlaps:
        warn(
            f"{name}: tensors overlap in memory without being identical "
            f"({'; '.join(overlaps[:_SHOW])}); each is written as its own copy and loads as "
            f"an independent tensor",
        )
    return aliases


# The storages whose ties were reported. Ties are harmless and the same at every save
# of a model, so they are said once per process, not every epoch. Weakly held: torch
# keeps one Python object per live storage, and a freed model's entry goes with it (a
# new model at the same address is reported again, which a data_ptr key would miss).
_TIES_REPORTED: weakref.WeakSet[Any] = weakref.WeakSet()
_TIES_LOCK = threading.Lock()


def _first_report_of_ties(state_dict: Mapping[str, torch.Tensor], aliases: dict[str, str]) -> bool:
    """True the first time this process writes these tied storages (then remembered)."""
    storages = [state_dict[canonical].untyped_storage() for canonical in set(aliases.values())]
    with _TIES_LOCK:
        if all(s in _TIES_REPORTED for s in storages):
            return False
        _TIES_REPORTED.update(storages)
    return True


def safetensors_header_for(
    state_dict: Mapping[str, torch.Tensor],
    metadata: Optional[Mapping[str, str]] = None,
    *,
    name: str = "<state dict>",
) -> tuple[bytes, list[tuple[str, torch.Tensor]], dict[str, str]]:
    """Validate a state dict and build the safetensors header that describes it.

    Tensors that are the same view of the same memory (tied weights) are laid
    out once; the later keys are recorded as aliases under :data:`ALIASES_KEY`.
    Data is ordered by decreasing element size so that every tensor starts
    aligned (as the reference writer does); header keys keep the dict's order.

    Args:
        state_dict: A mapping of str -> tensor (``_metadata`` attribute kept).
        metadata: Extra str -> str entries for ``__metadata__``.
        name: How to name the destination in error messages.

    Returns:
        ``(header_bytes, tensors_in_data_order, aliases)``: the 8-byte length
        plus the space-padded JSON header; the ``(key, tensor)`` pairs whose
        bytes follow, in order; and ``{alias: canonical}``.

    Raises:
        CheckpointFormatError: A value is not a storable tensor (the message
            names the keys), or a metadata key is reserved or not a string.

    Example:
        >>> import torch
        >>> from ddpstate._io.safetensors_io import safetensors_header_for
        >>> header, order, aliases = safetensors_header_for({"w": torch.ones(2)})
        >>> [key for key, _ in order], aliases
        (['w'], {})
    """
    _validate(state_dict, name)
    meta = _metadata_entries(state_dict, metadata, name)
    aliases = _find_ties(state_dict, name)
    written = {k: t for k, t in state_dict.items() if k not in aliases}
    entries = [
        (k, DTYPE_NAMES[t.dtype], t.shape, t.numel() * t.element_size()) for k, t in written.items()
    ]
    header, order, _ = build_header(entries, meta, aliases)
    return header, [(k, written[k]) for k in order], aliases


def _write_all(fileobj: IO[bytes], data: memoryview) -> None:
    while data:
        written = fileobj.write(data)
        if written is None or written >= len(data):
            return
        data = data[written:]


def write_safetensors(
    fileobj: IO[bytes],
    state_dict: Mapping[str, torch.Tensor],
    metadata: Optional[Mapping[str, str]] = None,
    *,
    name: str = "<file>",
) -> dict[str, str]:
    """Write a state dict to a binary file in safetensors format.

    The header and then each tensor's bytes are streamed one tensor at a time
    straight from memory into ``fileobj`` (a local temp file of
    :func:`ddpstate.storage.atomic_write`, an fsspec upload, a buffer), so no
    second copy of the state dict is built; the bytes are those
    ``safetensors.torch.save_file`` writes, plus ddpstate's header entries.
    Tied tensors are written once and recorded as aliases, with a warning;
    ``_metadata`` and ``metadata`` go into the header. Any safetensors reader can read the file.

    Args:
        fileobj: A writable binary file (e.g. from :func:`ddpstate.storage.atomic_write`).
        state_dict: A mapping of str -> tensor.
        metadata: Extra str -> str header metadata (keys may not start with ``ddpstate.``).
        name: How to name the destination in messages.

    Returns:
        ``{alias: canonical}`` for the tensors that were written once.

    Raises:
        CheckpointFormatError: The state dict or metadata cannot be stored
            (nothing has been written then).

    Example:
        >>> import io, torch
        >>> from ddpstate._io.safetensors_io import read_safetensors, write_safetensors
        >>> buf = io.BytesIO()
        >>> write_safetensors(buf, {"w": torch.arange(3.0)})
        {}
        >>> read_safetensors(buf.getvalue())["w"]
        tensor([0., 1., 2.])
    """
    header, order, aliases = safetensors_header_for(state_dict, metadata, name=name)
    if aliases and _first_report_of_ties(state_dict, aliases):
        shown = ", ".join(f"{a} -> {c}" for a, c in list(aliases.items())[:_SHOW])
        warn(
            f"{name}: {len(aliases)} tensor(s) share memory with another entry and are written "
            f"once ({shown}); the aliases are kept in the header metadata {ALIASES_KEY!r} and "
            f"ddpstate.load restores them as shared, while other safetensors readers see only "
            f"the canonical keys",
        )
    _write_all(fileobj, memoryview(header))
    for _, tensor in order:
        if tensor.numel() == 0:
            continue
        t = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
        _write_all(fileobj, t.reshape(-1).view(torch.uint8).numpy().data.cast("B"))
    return aliases


def save_sharded(
    state: Any,
    target: str,
    max_shard_size: Union[int, str],
    metadata: Optional[Mapping[str, str]] = None,
    *,
    overwrite: bool = True,
    fsync: bool = True,
) -> dict[str, str]:
    """Save a state dict in the Hugging Face sharded layout (what ``save(max_shard_size=)`` does).

    Tied entries (the same tensor under two keys) share a shard and are
    stored once there, as :func:`write_safetensors` records them; as
    ``transformers`` does, the index leaves the tied key out (so every key it
    names is in its shard) and records it in its ``metadata``, from which
    :func:`ddpstate.load` gives it back, shared.

    Args:
        state: Names to tensors.
        target: The folder.
        max_shard_size: See :func:`ddpstate._layout.hf_write.parse_size`.
        metadata: str -> str entries for every shard's header.
        overwrite: Replace a sharded checkpoint already at ``target``.
        fsync: Fsync every shard (the folder swap is fsynced either way).

    Returns:
        The weight map written (tied keys left out).

    Raises:
        CheckpointFormatError: ``state`` is not a flat map of names to tensors.
        CheckpointExistsError: ``target`` holds other files.
    """
    if not isinstance(state, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointFormatError(
            f"{target}: max_shard_size writes safetensors shards, which hold a flat map of "
            f"names to tensors only; save a state dict (or use save_model_state)"
        )
    limit = parse_size(max_shard_size)
    keys = list(state)
    # Tied keys go with the key whose tensor they share; write_safetensors warns of overlaps.
    owner, _ = tied_keys(state)
    nbytes = {k: t.numel() * t.element_size() for k, t in state.items() if k not in owner}
    entries = dict(metadata or {})
    entries.setdefault("format", "pt")

    def write_shard(f: IO[bytes], shard_keys: list[str], name: str) -> int:
        part = {k: state[k] for k in shard_keys}
        write_safetensors(f, part, entries, name=os.path.join(target, name))
        return sum(nbytes.get(k, 0) for k in shard_keys)

    shards = plan_shards(keys, nbytes, owner, limit)
    return write_sharded(
        target, shards, write_shard, order=keys, overwrite=overwrite, aliases=owner, fsync=fsync
    )


# ------------------------------------------------------------------------------------- reading


def _corrupt(name: str, detail: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{name}: damaged safetensors file ({detail}); re-save or re-download it"
    )


def _source_name(source: Source) -> str:
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    return str(getattr(source, "name", "<safetensors bytes>"))


def read_safetensors_header(source: Source) -> SafetensorsHeader:
    """Read and validate the header of a safetensors file without touching the data.

    Args:
        source: A local path, the file's bytes, or a readable, seekable binary file.

    Returns:
        The parsed :class:`SafetensorsHeader`.

    Raises:
        CheckpointCorruptError: The header is malformed or does not match the file size.

    Example:
        >>> import io, torch
        >>> from ddpstate._io.safetensors_io import read_safetensors_header, write_safetensors
        >>> buf = io.BytesIO()
        >>> _ = write_safetensors(buf, {"w": torch.ones(2, 3)}, {"step": "7"})
        >>> header = read_safetensors_header(buf.getvalue())
        >>> header.tensors["w"].shape, header.metadata
        ((2, 3), {'step': '7'})
    """
    name = _source_name(source)
    with contextlib.ExitStack() as stack:
        if isinstance(source, (str, os.PathLike)):
            source = stack.enter_context(open(source, "rb"))
        elif isinstance(source, (bytes, bytearray, memoryview)):
            source = io.BytesIO(source)
        start = source.tell()
        stack.callback(source.seek, start)
        parsed = parse_header(_reader_of(source), source.seek(0, os.SEEK_END), name)
    if parsed.problems:
        raise _corrupt(name, parsed.problems[0])
    tensors = {}
    for key, entry in parsed.entries.items():
        dtype = getattr(torch, entry.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointFormatError(
                f"{name}: tensor {key!r} has dtype {entry.dtype}, which this torch "
                f"({torch.__version__}) does not have; load it with a newer torch"
            )
        tensors[key] = TensorEntry(dtype, entry.shape, entry.begin, entry.end)
    return SafetensorsHeader(tensors, parsed.metadata, parsed.data_start)


def _reader_of(f: IO[bytes]) -> Any:
    def read_at(offset: int, length: int) -> bytes:
        f.seek(offset)
        return f.read(length)

    return read_at


def _finish(tensors: dict[str, torch.Tensor], metadata: Mapping[str, str], name: str) -> Any:
    out: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict(tensors)
    problems = restore_extras(out, metadata)
    if problems:
        raise _corrupt(name, problems[0])
    return out


def _damage(path: str, name: str, exc: BaseException) -> BaseException:
    """The error for a file the safetensors library refused: ours, naming the file."""
    try:
        # The layout parser says precisely what is wrong (and tells an unknown
        # dtype, a newer format, from damage); only then is the file read twice.
        read_safetensors_header(path)
    except (CheckpointCorruptError, CheckpointFormatError) as precise:
        return precise
    except OSError:
        pass
    return _corrupt(name, f"{type(exc).__name__}: {exc}")


def _load_local(path: str, device: str, mmap: bool, name: str) -> Any:
    """Read a local file with the safetensors library: mapped, or read into fresh memory."""
    options = {} if mmap else {"backend": "pread"}
    try:
        try:
            opened = safetensors.safe_open(path, framework="pt", device=device, **options)
        except TypeError:
            if not options:
                raise
            opened, options = safetensors.safe_open(path, framework="pt", device=device), {}
        with opened as f, gc_paused():
            metadata = f.metadata() or {}
            get_all = getattr(f, "get_tensors", None)  # safetensors >= 0.7: one call
            tensors = (
                get_all() if get_all is not None else {k: f.get_tensor(k) for k in f.offset_keys()}
            )
    except (safetensors.SafetensorError, ValueError, RuntimeError) as exc:
        raise _damage(path, name, exc) from exc
    if not mmap and not options:  # a library without the pread backend: copy out of the map
        tensors = {k: t.clone() for k, t in tensors.items()}
    return _finish(tensors, metadata, name)


def _library_keys(path: str, name: str) -> set[str]:
    """The tensors the safetensors library finds in a local file; its errors, ours."""
    try:
        with safetensors.safe_open(path, framework="pt") as f:  # the header only
            return set(f.keys())
    except (safetensors.SafetensorError, ValueError, RuntimeError) as exc:
        raise _damage(path, name, exc) from exc


def _read_in_pieces(source: Source, device: torch.device, name: str) -> Any:
    """Every tensor straight onto ``device`` (CUDA) through two pinned pieces (``device_copy``).

    The library reads a local file's tensors into host memory first (every byte at
    once, with ``pread``); here host memory stays at two pieces. The library still
    gives its verdict on a local file's header, and ddpstate's parser (the one file
    objects are read with) must find the same tensors before their bytes are read.
    """
    with contextlib.ExitStack() as stack:
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            keys: Optional[set[str]] = _library_keys(path, name)
            stream: Any = stack.enter_context(open(path, "rb", buffering=0))
        else:
            keys = None
            raw = isinstance(source, (bytes, bytearray, memoryview))
            stream = io.BytesIO(source) if raw else source  # type: ignore[arg-type]
        header = read_safetensors_header(stream)
        if keys is not None and keys != set(header.tensors):
            raise _corrupt(name, "the safetensors library and ddpstate read different tensors")
        tensors = {
            key: torch.empty(entry.shape, dtype=entry.dtype, device=device)
            for key, entry in header.tensors.items()
        }
        order = sorted(header.tensors, key=lambda key: header.tensors[key].begin)
        spans = [(header.data_start + header.tensors[k].begin, tensors[k]) for k in order]
        filled = read_into_tensors(stream, spans)
    if filled < len(order):
        raise _corrupt(name, f"tensor {order[filled]!r} is cut short")
    return _finish(tensors, header.metadata, name)


def read_safetensors(
    source: Source,
    *,
    device: Union[str, torch.device] = "cpu",
    mmap: Optional[bool] = None,
) -> collections.OrderedDict[str, torch.Tensor]:
    """Read a safetensors file, restoring ddpstate's tied tensors and ``_metadata``.

    A local path is read by the safetensors library (``safe_open``); bytes
    and file objects (fsspec streams) are read tensor by tensor into fresh
    memory. Onto a CUDA device every source is read through two pinned host
    pieces straight into the tensors there (never every byte in host memory at
    once, ``mmap`` or not: the tensors live on the device either way). Keys
    come in the order ddpstate recorded when it wrote the file, else in the
    file's order (as ``safetensors.torch.load_file`` gives them).

    Args:
        source: A local path, the file's bytes, or a readable, seekable binary
            file (e.g. from :func:`ddpstate.storage.open_read`).
        device: Where the tensors go.
        mmap: Map a local file into memory instead of reading it, so only the
            pages actually used cost memory (private mapping: changes to the
            tensors never reach the file). Default: True for local paths.

    Returns:
        An ``OrderedDict`` of tensors; aliased keys hold the very same tensor
        as their canonical key; ``_metadata`` is set when the file carries it.

    Raises:
        CheckpointCorruptError: The file is truncated or its header is damaged.
        CheckpointFormatError: ``mmap=True`` for a source that is not a local
            path, or a dtype code ddpstate does not know.

    Example:
        >>> import io, torch
        >>> from ddpstate._io.safetensors_io import read_safetensors, write_safetensors
        >>> buf = io.BytesIO()
        >>> _ = write_safetensors(buf, {"b": torch.tensor(True)})
        >>> read_safetensors(buf.getvalue())["b"]
        tensor(True)
    """
    name = _source_name(source)
    if mmap and not isinstance(source, (str, os.PathLike)):
        raise CheckpointFormatError(
            f"{name}: mmap=True needs a local file path; pass mmap=None or False"
        )
    if torch.device(device).type == "cuda":
        return _read_in_pieces(source, torch.device(device), name)  # type: ignore[no-any-return]
    if isinstance(source, (str, os.PathLike)):
        return _load_local(os.fspath(source), str(device), mmap is None or mmap, name)  # type: ignore[no-any-return]
    stream = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
    header = read_safetensors_header(stream)
    tensors: dict[str, torch.Tensor] = {}
    for key, entry in sorted(header.tensors.items(), key=lambda kv: kv[1].begin):
        t = torch.empty(entry.shape, dtype=entry.dtype)
        if t.numel():
            stream.seek(header.data_start + entry.begin)
            target = t.reshape(-1).view(torch.uint8).numpy().data.cast("B")
            if read_into(stream, target) != len(target):
                raise _corrupt(name, f"tensor {key!r} is cut short")
        tensors[key] = t
    # Header order; .to() returns a tensor already on the device as it is.
    tensors = {key: tensors[key].to(device) for key in header.tensors}
    return _finish(tensors, header.metadata, name)  # type: ignore[no-any-return]
