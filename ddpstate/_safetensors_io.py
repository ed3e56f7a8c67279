"""Streaming safetensors writer and reader that keep tied tensors and ``_metadata``."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import struct
import warnings
from collections.abc import Mapping
from typing import IO, Any, Optional, Union, cast

import torch

from ddpstate.errors import CheckpointCorruptError, CheckpointFormatError
from ddpstate.formats import SAFETENSORS_MAX_HEADER

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
    "write_safetensors",
]

#: Header metadata key: JSON object ``{alias_key: canonical_key}`` for tensors
#: that shared memory with an earlier entry and were written once.
ALIASES_KEY = "ddpstate.aliases"
#: Header metadata key: JSON of the state dict's ``_metadata`` (module path ->
#: ``{"version": ...}``), which ``nn.Module.load_state_dict`` consults.
STATE_DICT_METADATA_KEY = "ddpstate.state_dict_metadata"
#: Caller metadata keys may not start with this; ddpstate owns that namespace.
RESERVED_PREFIX = "ddpstate."

#: The safetensors dtype names of every dtype torch and safetensors share.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _attr, _name in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _attr):
        DTYPE_NAMES[getattr(torch, _attr)] = _name
_DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}

# safetensors refuses headers above 100 MB; so does this reader.
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


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
    sd_meta = getattr(state_dict, "_metadata", None)
    if sd_meta is not None:
        try:
            out[STATE_DICT_METADATA_KEY] = json.dumps(
                {str(k): dict(v) for k, v in sd_meta.items()}, separators=(",", ":")
            )
        except (TypeError, ValueError) as exc:
            raise CheckpointFormatError(
                f"{name}: the state dict's _metadata cannot be stored as JSON ({exc}); "
                f"use format='torch' to keep it"
            ) from exc
    return out


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (
        t.device,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
    )


def _find_aliases(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, str], list[str]]:
    """Identical views become aliases; other overlaps are reported, then copied."""
    canonical_of: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    spans: dict[tuple[Any, int], list[tuple[int, int, str]]] = {}
    for key, t in state_dict.items():
        if t.numel() == 0:
            continue  # empty tensors all share data pointer 0; there is nothing to tie
        view = _view_key(t)
        if view in canonical_of:
            aliases[key] = canonical_of[view]
            continue
        canonical_of[view] = key
        size = t.element_size()
        extent = 1 + sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        start = int(t.storage_offset()) * size
        spans.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(
            (start, start + extent * size, key)
        )
    overlaps = []
    for entries in spans.values():
        entries.sort()
        for (_, end_a, key_a), (start_b, _, key_b) in itertools.pairwise(entries):
            if start_b < end_a:
                overlaps.append(f"{key_b!r} overlaps {key_a!r}")
    return aliases, overlaps


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
        >>> from ddpstate.formats import safetensors_header_for
        >>> header, order, aliases = safetensors_header_for({"w": torch.ones(2)})
        >>> [key for key, _ in order], aliases
        (['w'], {})
    """
    _validate(state_dict, name)
    meta = _metadata_entries(state_dict, metadata, name)
    aliases, overlaps = _find_aliases(state_dict)
    if overlaps:
        warnings.warn(
            f"{name}: tensors overlap in memory without being identical "
            f"({'; '.join(overlaps[:_SHOW])}); each is written as its own copy and loads as "
            f"an independent tensor",
            UserWarning,
            stacklevel=3,
        )
    if aliases:
        meta[ALIASES_KEY] = json.dumps(aliases, separators=(",", ":"))
    written = [(k, t) for k, t in state_dict.items() if k not in aliases]
    order = sorted(written, key=lambda kv: -kv[1].element_size())
    offsets: dict[str, tuple[int, int]] = {}
    cursor = 0
    for key, t in order:
        nbytes = t.numel() * t.element_size()
        offsets[key] = (cursor, cursor + nbytes)
        cursor += nbytes
    entries: dict[str, Any] = {}
    if meta:
        entries["__metadata__"] = meta
    for key, t in written:
        entries[key] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": list(offsets[key]),
        }
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text, order, aliases


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
    """Stream a state dict to a binary file in safetensors format.

    Tensors are written one at a time straight from their memory (a
    non-contiguous or GPU tensor is copied alone first), so no second copy of
    the state dict is ever built. Tied tensors are written once and recorded
    as aliases, with a warning; ``_metadata`` and ``metadata`` go into the
    header. Any safetensors reader can read the file.

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
        >>> from ddpstate.formats import read_safetensors, write_safetensors
        >>> buf = io.BytesIO()
        >>> write_safetensors(buf, {"w": torch.arange(3.0)})
        {}
        >>> read_safetensors(buf.getvalue())["w"]
        tensor([0., 1., 2.])
    """
    header, order, aliases = safetensors_header_for(state_dict, metadata, name=name)
    if aliases:
        shown = ", ".join(f"{a} -> {c}" for a, c in list(aliases.items())[:_SHOW])
        warnings.warn(
            f"{name}: {len(aliases)} tensor(s) share memory with another entry and are written "
            f"once ({shown}); the aliases are kept in the header metadata {ALIASES_KEY!r} and "
            f"ddpstate.load restores them as shared, while other safetensors readers see only "
            f"the canonical keys",
            UserWarning,
            stacklevel=2,
        )
    _write_all(fileobj, memoryview(header))
    for _, tensor in order:
        if tensor.numel() == 0:
            continue
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        _write_all(fileobj, t.reshape(-1).view(torch.uint8).numpy().data.cast("B"))
    return aliases


# ------------------------------------------------------------------------------------- reading


def _corrupt(name: str, detail: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{name}: damaged safetensors file ({detail}); re-save or re-download it"
    )


def _parse_header(head8: bytes, read_json: Any, size: int, name: str) -> SafetensorsHeader:
    if len(head8) < 8:
        raise _corrupt(name, f"only {len(head8)} bytes long")
    (length,) = struct.unpack("<Q", head8)
    if length > SAFETENSORS_MAX_HEADER or 8 + length > size:
        raise _corrupt(name, f"header length {length} does not fit in {size} bytes")
    raw = read_json(length)
    try:
        parsed = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _corrupt(name, f"header is not valid JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise _corrupt(name, "header is not a JSON object")
    meta = parsed.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise _corrupt(name, "__metadata__ is not a map of str -> str")
    tensors: dict[str, TensorEntry] = {}
    for key, info in parsed.items():
        try:
            dtype = _DTYPES_BY_NAME[info["dtype"]]
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise _corrupt(name, f"entry {key!r} is malformed or has an unknown dtype") from exc
        numel = 1
        for n in shape:
            numel *= n
        if min(shape, default=0) < 0 or begin < 0 or end - begin != numel * _itemsize(dtype):
            raise _corrupt(name, f"entry {key!r} has offsets that do not match its shape")
        tensors[key] = TensorEntry(dtype, shape, begin, end)
    data_len = size - 8 - length
    cursor = 0
    for key, entry in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if entry.begin != cursor:
            raise _corrupt(name, f"tensor data is not contiguous at {key!r}")
        cursor = entry.end
    if cursor != data_len:
        raise _corrupt(name, f"data section is {data_len} bytes but the header describes {cursor}")
    return SafetensorsHeader(tensors, dict(meta), 8 + length)


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
        >>> from ddpstate.formats import read_safetensors_header, write_safetensors
        >>> buf = io.BytesIO()
        >>> _ = write_safetensors(buf, {"w": torch.ones(2, 3)}, {"step": "7"})
        >>> header = read_safetensors_header(buf.getvalue())
        >>> header.tensors["w"].shape, header.metadata
        ((2, 3), {'step': '7'})
    """
    name = _source_name(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        view = memoryview(source)
        return _parse_header(bytes(view[:8]), lambda n: view[8 : 8 + n], len(view), name)
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return _parse_header(f.read(8), f.read, size, name)
    start = source.tell()
    source.seek(0, os.SEEK_END)
    size = source.tell()
    source.seek(0)
    try:
        return _parse_header(source.read(8), source.read, size, name)
    finally:
        source.seek(start)


def _bytes_as(chunk: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    if chunk.numel() == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    if chunk.storage_offset() % _itemsize(entry.dtype):
        chunk = chunk.clone()  # a foreign file with a misaligned tensor: copy that one
    return chunk.view(entry.dtype).reshape(entry.shape)


def _finish(tensors: dict[str, torch.Tensor], header: SafetensorsHeader, name: str) -> Any:
    out: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict(tensors)
    meta = header.metadata
    if ALIASES_KEY in meta:
        try:
            aliases = json.loads(meta[ALIASES_KEY])
            for alias, canonical in aliases.items():
                out[alias] = out[canonical]
        except (ValueError, KeyError, AttributeError, TypeError) as exc:
            raise _corrupt(name, f"{ALIASES_KEY} names a tensor that is not in the file") from exc
    if STATE_DICT_METADATA_KEY in meta:
        try:
            sd_meta = json.loads(meta[STATE_DICT_METADATA_KEY])
            out._metadata = collections.OrderedDict(  # type: ignore[attr-defined]
                (k, dict(v)) for k, v in sd_meta.items()
            )
        except (ValueError, AttributeError, TypeError) as exc:
            raise _corrupt(name, f"{STATE_DICT_METADATA_KEY} is not valid JSON") from exc
    return out


def read_safetensors(
    source: Source,
    *,
    device: Union[str, torch.device] = "cpu",
    mmap: Optional[bool] = None,
) -> collections.OrderedDict[str, torch.Tensor]:
    """Read a safetensors file, restoring ddpstate's tied tensors and ``_metadata``.

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
        CheckpointFormatError: ``mmap=True`` for a source that is not a local path.

    Example:
        >>> import io, torch
        >>> from ddpstate.formats import read_safetensors, write_safetensors
        >>> buf = io.BytesIO()
        >>> _ = write_safetensors(buf, {"b": torch.tensor(True)})
        >>> read_safetensors(buf.getvalue())["b"]
        tensor(True)
    """
    name = _source_name(source)
    is_path = isinstance(source, (str, os.PathLike))
    if mmap and not is_path:
        raise CheckpointFormatError(
            f"{name}: mmap=True needs a local file path; pass mmap=None or False"
        )
    header = read_safetensors_header(source)
    base = header.data_start
    tensors: dict[str, torch.Tensor] = {}
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = torch.frombuffer(bytearray(source), dtype=torch.uint8)
        for key, entry in header.tensors.items():
            tensors[key] = _bytes_as(data[base + entry.begin : base + entry.end], entry)
    elif is_path and (mmap is None or mmap):
        path = os.fspath(source)  # type: ignore[arg-type]
        size = os.path.getsize(path)
        # shared=False is a private (copy-on-write) mapping: pages load on first use.
        storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(path, False, size))
        data = torch.empty(0, dtype=torch.uint8).set_(storage)
        for key, entry in header.tensors.items():
            tensors[key] = _bytes_as(data[base + entry.begin : base + entry.end], entry)
    else:
        with open(source, "rb") if is_path else _NoClose(source) as f:  # type: ignore[arg-type]
            for key, entry in sorted(header.tensors.items(), key=lambda kv: kv[1].begin):
                t = torch.empty(entry.shape, dtype=entry.dtype)
                if t.numel():
                    f.seek(base + entry.begin)
                    target = t.reshape(-1).view(torch.uint8).numpy().data.cast("B")
                    got = _read_into(f, target)
                    if got != len(target):
                        raise _corrupt(name, f"tensor {key!r} is cut short")
                tensors[key] = t
            tensors = {key: tensors[key] for key in header.tensors}
    target_device = torch.device(device)
    if target_device.type != "cpu":
        tensors = {k: t.to(target_device) for k, t in tensors.items()}
    return _finish(tensors, header, name)  # type: ignore[no-any-return]


def _read_into(f: Any, target: memoryview) -> int:
    done = 0
    readinto = getattr(f, "readinto", None)
    while done < len(target):
        if readinto is not None:
            got = readinto(target[done:])
        else:
            chunk = f.read(len(target) - done)
            got = len(chunk)
            target[done : done + got] = chunk
        if not got:
            break
        done += got
    return done


class _NoClose:
    """Use a caller's file object in a ``with`` block without closing it."""

    def __init__(self, fileobj: IO[bytes]) -> None:
        self._fileobj = fileobj

    def __enter__(self) -> IO[bytes]:
        return self._fileobj

    def __exit__(self, *exc: object) -> None:
        return None
