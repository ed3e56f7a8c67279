"""File-to-file checkpoint conversion, inspection, comparison and verification, streaming."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import os
import struct
import zipfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, Final, Optional, Union

from ddpstate import _fs, formats
from ddpstate._fs import PathLike
from ddpstate._layout.safetensors import (
    CODES,
    STATE_DICT_METADATA_KEY,
    View,
    build_header,
    find_aliases,
    state_dict_metadata_json,
)
from ddpstate._streaming.cast import Casts, target_dtype
from ddpstate._streaming.pickle_rewrite import rename_keys
from ddpstate._streaming.pickle_scan import (
    GlobalRef,
    Opaque,
    StorageRecord,
    TensorRecord,
    is_pickled_module,
    iter_tensors,
    module_state_dict,
    opaque_name,
)
from ddpstate._streaming.progress import Progress, human_bytes
from ddpstate._streaming.reader import Checkpoint, read_checkpoint, zip_entry_bytes
from ddpstate._streaming.stream import Sink
from ddpstate._streaming.zipwriter import CopyCandidate, ZipWriter
from ddpstate.errors import (
    AmbiguousStateDictError,
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointFormatError,
    InvalidArgumentError,
    StateDictNotFoundError,
)
from ddpstate.formats import HF_SHARDED, FormatName, parse_format

if TYPE_CHECKING:
    import torch

__all__ = [
    "ConvertResult",
    "DiffResult",
    "InspectResult",
    "TensorInfo",
    "VerifyResult",
    "convert_file",
    "default_destination",
    "diff_files",
    "inspect_file",
    "verify_file",
]


#: Output formats of :func:`convert_file` (:mod:`ddpstate.formats`' names).
PT: Final = formats.PT
SAFETENSORS: Final = formats.SAFETENSORS

# Entries drop_optimizer removes besides those whose value looks like optimizer
# state (see _is_optimizer_state). Short names such as "opt" are left out on
# purpose: YOLO-style checkpoints keep their command-line options under "opt".
_OPTIMIZER_NAMES = frozenset(
    {"optimizer", "optimizers", "optimizer_state", "optimizer_states", "optimizer_state_dict"}
)
# torch.save's archive folder name when it cannot use the file's own name.
_ARCHIVE = "archive/"
# The zip format version torch 2.x writes in the "version" record.
_ZIP_VERSION = b"3\n"
_DIFF_CHUNK = 1 << 22


# --------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert_file` did.

    Attributes:
        src: The source file.
        dst: The file written (``src`` itself for ``in_place``).
        src_format: ``"pt"``, ``"pt_legacy"``, ``"safetensors"``, ``"hf_sharded"`` or
            ``"dcp"`` (:mod:`ddpstate.formats`).
        dst_format: ``"pt"``, ``"safetensors"``, ``"hf_sharded"`` (``max_shard_size``)
            or ``"dcp"``.
        state_dict_path: Where the model state dict was found (dotted; ``""``
            for a bare state dict), or None when no key rule was needed.
        renamed: How many state-dict keys changed.
        tensors: Tensors written.
        bytes_copied: Tensor bytes copied from the source.
        dropped: Top-level entries removed by ``drop_optimizer``.
        left_out: Entries not written to a safetensors file (only the model
            state dict goes there).
        notes: Other things worth telling the user, one line each.
        written: False when ``in_place`` found nothing to change and left the file alone.
        cast: Tensors cast to ``dtype`` (``convert --dtype``).
    """

    src: str
    dst: str
    src_format: FormatName
    dst_format: FormatName
    state_dict_path: Optional[str]
    renamed: int
    tensors: int
    bytes_copied: int
    dropped: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    written: bool = True
    cast: int = 0


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One row of :class:`InspectResult`'s key table."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    device: str


@dataclasses.dataclass(frozen=True)
class InspectResult:
    """What :func:`inspect_file` found, read from headers and the pickle only.

    Attributes:
        path: The file.
        format: Its format.
        file_size: Bytes on disk.
        tensor_count: Tensors anywhere in the checkpoint (optimizer state included).
        tensor_bytes: Bytes of tensor data stored (shared storages counted once).
        dtype_bytes: Stored bytes per dtype.
        devices: Number of storages per device tag recorded in the file.
        prefixes: Wrapper prefixes leading every model key (``module.``...).
        state_dict_path: Dotted path of the model state dict (``""``: the file
            is one), or None when there is none.
        structure: ``(top-level key, description)`` for nested checkpoints.
        tensors: The model state dict's keys (or every tensor's path when
            there is no state dict).
        unsafe_globals: Globals only ``unsafe=True`` reads.
        problems: Structural damage found (``ddpstate verify`` checks more).
        notes: Other remarks (a pickled whole module, ...).
    """

    path: str
    format: FormatName
    file_size: int
    tensor_count: int
    tensor_bytes: int
    dtype_bytes: dict[str, int]
    devices: dict[str, int]
    prefixes: tuple[str, ...]
    state_dict_path: Optional[str]
    structure: tuple[tuple[str, str], ...]
    tensors: tuple[TensorInfo, ...]
    unsafe_globals: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``ddpstate inspect --json`` prints)."""
        out = dataclasses.asdict(self)
        out["structure"] = [{"key": k, "value": v} for k, v in self.structure]
        out["tensors"] = [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
             "device": t.device}
            for t in self.tensors
        ]  # fmt: skip
        return out


@dataclasses.dataclass(frozen=True)
class DiffResult:
    """How two checkpoints' model state dicts differ.

    Attributes:
        a: First file.
        b: Second file.
        only_a: Keys only in ``a`` (after normalizing wrapper prefixes unless raw).
        only_b: Keys only in ``b``.
        mismatched: ``(key, what a has, what b has)`` for shape, dtype or type differences.
        max_abs_diff: Largest absolute difference per shared tensor of equal shape and dtype.
        atol: The tolerance used.
        different_values: Keys whose difference exceeds ``atol``.
        notes: Remarks (which state dicts were compared...).
    """

    a: str
    b: str
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    mismatched: tuple[tuple[str, str, str], ...]
    max_abs_diff: dict[str, float]
    atol: float
    different_values: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def equal(self) -> bool:
        """True when the keys match and every tensor agrees within ``atol``."""
        return not (self.only_a or self.only_b or self.mismatched or self.different_values)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``ddpstate diff --json`` prints)."""
        out = dataclasses.asdict(self)
        out["equal"] = self.equal
        out["mismatched"] = [{"key": k, "a": a, "b": b} for k, a, b in self.mismatched]
        out["max_abs_diff"] = {k: _json_float(v) for k, v in self.max_abs_diff.items()}
        return out


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """Whether a checkpoint file is intact.

    Attributes:
        path: The file.
        format: Its format (None when it could not be read at all).
        problems: What is wrong; empty when the file is good.
        tensors: Tensors checked.
        bytes_read: Bytes read to check the data.
        notes: Remarks that are not problems (no CRC recorded...).
    """

    path: str
    format: Optional[FormatName]
    problems: tuple[str, ...]
    tensors: int = 0
    bytes_read: int = 0
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        return out


def _json_float(value: float) -> Any:
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    return value


# --------------------------------------------------------------------------- helpers


def _dotted(path: Optional[Sequence[Any]]) -> Optional[str]:
    return None if path is None else ".".join(str(p) for p in path)


def _find_state_dict(root: Any, key: Optional[str]) -> tuple[tuple[Any, ...], Any]:
    # keys.find_state_dict counts TensorRecord placeholders as tensors (they
    # are marked `_ddpstate_tensor_like`), so the scanned tree goes in as is
    # and the streaming path never needs torch.
    from ddpstate import keys

    return keys.find_state_dict(root, key)


def _rename(sd: Any, strip: Optional[str], add: Optional[str], normalize: bool) -> Any:
    from ddpstate import keys

    if strip is not None:
        return keys.strip_prefix(sd, strip)
    if add is not None:
        return keys.add_prefix(sd, add)
    if normalize:
        return keys.normalize_keys(sd)
    return sd


def _check_rules(strip: Optional[str], add: Optional[str], normalize: bool) -> None:
    if sum([strip is not None, add is not None, bool(normalize)]) > 1:
        raise InvalidArgumentError("pass at most one of strip_prefix, add_prefix and normalize")


def _is_optimizer_state(value: Any) -> bool:
    if isinstance(value, Mapping):
        if "state" in value and "param_groups" in value:
            return True
        return bool(value) and all(_is_optimizer_state(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_is_optimizer_state(v) for v in value)
    return False


def _drop_optimizer(root: Any, keep: Optional[tuple[Any, ...]]) -> tuple[Any, tuple[str, ...]]:
    if not isinstance(root, Mapping):
        return root, ()
    head = keep[0] if keep else None
    dropped = [
        k
        for k, v in root.items()
        if k != head
        and (
            _is_optimizer_state(v)
            or (isinstance(k, str) and k.lower() in _OPTIMIZER_NAMES and v is not None)
        )
    ]
    if not dropped:
        return root, ()
    import copy

    new = copy.copy(root) if isinstance(root, dict) else dict(root)
    for k in dropped:
        del new[k]
    return new, tuple(str(k) for k in dropped)


def default_destination(src: PathLike, dst_format: str) -> str:
    """The output name :func:`convert_file` uses when none is given.

    ``--to safetensors`` on ``model.pt`` gives ``model.safetensors``; a
    conversion that keeps the format gives ``model.converted.pt``.

    Args:
        src: The source path or URL.
        dst_format: ``"pt"`` or ``"safetensors"``.

    Returns:
        The derived path, next to ``src``.

    Example:
        >>> default_destination("runs/ckpt.pt", "pt")
        'runs/ckpt.converted.pt'
        >>> default_destination("runs/ckpt.pt", "safetensors")
        'runs/ckpt.safetensors'
    """
    text = os.fspath(src)
    if _fs.is_remote(text):
        head, tail = text.rsplit("/", 1) if "/" in text else ("", text)
    else:
        head, tail = os.path.split(text)
    stem, dot, ext = tail.rpartition(".")
    if not dot or not stem:
        stem, ext = tail, ""
    ext = f".{ext}" if ext else ""
    if dst_format == SAFETENSORS:
        name = f"{stem}.safetensors" if ext != ".safetensors" else f"{stem}.converted.safetensors"
    elif ext == ".safetensors" or not ext:
        name = f"{stem}.pt" if ext else f"{stem}.converted.pt"
    else:
        name = f"{stem}.converted{ext}"
    if not head:
        return name
    return f"{head}/{name}" if _fs.is_remote(text) else os.path.join(head, name)


def _exists(path: str, storage_options: Optional[dict[str, Any]]) -> bool:
    from ddpstate import storage

    return storage.exists(path, storage_options=storage_options)


def _isdir(path: str, storage_options: Optional[dict[str, Any]]) -> bool:
    from ddpstate import storage

    return storage.isdir(path, storage_options=storage_options)


def _join(folder: str, name: str) -> str:
    from ddpstate import storage

    return storage.join(folder, name)


def _is_dcp_folder(path: str, storage_options: Optional[dict[str, Any]]) -> bool:
    # A stat first: files (the common case) are not sniffed twice.
    return _isdir(path, storage_options) and (
        formats.detect_format(path, storage_options=storage_options) == formats.DCP
    )


def _same_file(a: str, b: str) -> bool:
    if _fs.is_remote(a) or _fs.is_remote(b):
        return a.rstrip("/") == b.rstrip("/")
    try:
        return os.path.samefile(_fs.local_path(a), _fs.local_path(b))
    except OSError:
        return os.path.abspath(_fs.local_path(a)) == os.path.abspath(_fs.local_path(b))


def _extent_problems(ckpt: Checkpoint) -> list[str]:
    # A damaged shape, stride or offset can make a view reach past its storage;
    # torch.load refuses such a file, so copying it through would hide the damage.
    return [
        f"tensor {_dotted(path)} reaches byte {rec.extent() * rec.itemsize} of a "
        f"{rec.storage.nbytes}-byte storage"
        for path, rec in iter_tensors(ckpt.obj)
        if isinstance(rec, TensorRecord) and rec.extent() * rec.itemsize > rec.storage.nbytes
    ]


def _raise_problems(ckpt: Checkpoint) -> None:
    problems = [*ckpt.problems, *_extent_problems(ckpt)]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointCorruptError(
            f"{ckpt.path}: {problems[0]}{more}; the file is damaged or truncated "
            f"(`ddpstate verify` lists everything): re-save or re-download it"
        )


# --------------------------------------------------------------------------- tensor data


def _storage_bytes(ckpt: Checkpoint, storage: StorageRecord, start: int, length: int) -> bytes:
    if length <= 0:
        return b""
    if storage.compressed and storage.record_name:
        record = ckpt.zip_records[storage.record_name]
        data = zip_entry_bytes(ckpt.source, record, ckpt.path)
        return data[start : start + length]
    return ckpt.source.read_at(storage.data_offset + start, length)


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"dtype {name!r} is not available in this torch")
    return dtype


def _load_tensor(ckpt: Checkpoint, rec: TensorRecord) -> torch.Tensor:
    """Read one tensor's data from the file (just the span of storage it views)."""
    import torch

    dtype = _torch_dtype(rec.dtype)
    if rec.numel == 0:
        return torch.empty(rec.shape, dtype=dtype)
    first, last = rec.offset, rec.extent()
    raw = bytearray(
        _storage_bytes(ckpt, rec.storage, first * rec.itemsize, (last - first) * rec.itemsize)
    )
    flat = torch.frombuffer(raw, dtype=torch.uint8)
    if ckpt.byteorder != _native_byteorder() and rec.itemsize > 1:
        flat = flat.view(-1, rec.itemsize).flip(-1).reshape(-1).clone()
    return flat.view(dtype).as_strided(rec.shape, rec.stride)


def _native_byteorder() -> str:
    import sys

    return sys.byteorder


# --------------------------------------------------------------------------- writers


def _serialization_id(pickle_bytes: bytes, records: list[tuple[int, int]]) -> bytes:
    # torch.save stores a unique id per save; a digest of the content keeps the
    # output deterministic, so converting an already converted file is a no-op.
    digest = hashlib.sha1(pickle_bytes)
    for crc, size in records:
        digest.update(struct.pack("<IQ", crc, size))
    return str(int(digest.hexdigest(), 16) % 10**40).zfill(40).encode("ascii")


def _copied_pickle(
    ckpt: Checkpoint, path: Optional[tuple[Any, ...]], sd: Any, new_sd: Any
) -> Optional[bytes]:
    """``data.pkl`` for the output by copying the source's through, or None.

    Only where the result is, to the byte, what re-emitting the renamed tree
    gives (:mod:`ddpstate._streaming.pickle_rewrite` says why): a torch.save-shaped pickle,
    storages already numbered in first-use order and tagged ``cpu``, and a rename
    that changes the keys and at most the ``_metadata`` attribute (spliced in
    re-emitted), every value kept, dicts all the way down to the state dict.
    """
    layout = ckpt.pickle_layout
    if layout is None or ckpt.format != formats.TORCH_ZIP:
        return None
    if any(s.location != "cpu" or s.key != str(i) for i, s in enumerate(ckpt.storages)):
        return None
    if sd is None:
        return rename_keys(ckpt.pickle_bytes, layout, [])
    if path is None or type(new_sd) is not type(sd) or len(new_sd) != len(sd):
        return None
    state = None
    old_attrs = getattr(sd, "__dict__", None) or {}
    new_attrs = getattr(new_sd, "__dict__", None) or {}
    if old_attrs or new_attrs:
        if set(old_attrs) != {"_metadata"} or set(new_attrs) != {"_metadata"}:
            return None
        state = (old_attrs, new_attrs)  # what the pickler writes as BUILD state
    node = ckpt.obj
    for step in path:
        if not isinstance(node, dict):
            return None
        node = node[step]
    if node is not sd or not isinstance(sd, dict):
        return None
    renames = []
    for (old, value), (new, kept) in zip(sd.items(), new_sd.items(), strict=True):
        if value is not kept or type(old) is not type(new):
            return None
        if old != new:
            if not isinstance(old, str):
                return None
            renames.append((old, new))
    return rename_keys(ckpt.pickle_bytes, layout, renames, state)


def _write_pt(
    sink: Sink,
    ckpt: Checkpoint,
    root: Any,
    pickle_bytes: Optional[bytes] = None,
    casts: Optional[Casts] = None,
) -> tuple[int, int]:
    if pickle_bytes is not None:
        data_pkl, storages = pickle_bytes, ckpt.storages
    else:
        # Imported here: the copy-through (the common case) never needs the pickler.
        from ddpstate._streaming.pickle_emit import dump_checkpoint_pickle

        data_pkl, storages = dump_checkpoint_pickle(root, casts.replace if casts else None)
    writer = ZipWriter(sink)
    writer.add_bytes(_ARCHIVE + "data.pkl", data_pkl)
    writer.add_bytes(_ARCHIVE + ".format_version", b"1")
    writer.add_bytes(_ARCHIVE + ".storage_alignment", b"64")
    writer.add_bytes(_ARCHIVE + "byteorder", ckpt.byteorder.encode("ascii"))
    sizes = [storage.nbytes for storage in storages]
    crcs = list(
        zip(
            writer.add_copies(ckpt.source, _copy_candidates(ckpt, storages, casts)),
            sizes,
            strict=True,
        )
    )
    copied = sum(sizes)
    version = _ZIP_VERSION
    if ckpt.zip_prefix + "version" in ckpt.zip_records:
        record = ckpt.zip_records[ckpt.zip_prefix + "version"]
        version = ckpt.source.read_at(record.data_offset, record.size)
        if zlib.crc32(version) != record.crc32 or not version.strip().isdigit():
            raise CheckpointCorruptError(
                f"{ckpt.path}: zip entry {record.name} holds {version[:16]!r}, not the format "
                f"version number its CRC-32 records; the file is damaged: re-save or "
                f"re-download it (`ddpstate verify` lists every damaged record)"
            )
    writer.add_bytes(_ARCHIVE + "version", version)
    writer.add_bytes(_ARCHIVE + ".data/serialization_id", _serialization_id(data_pkl, crcs))
    writer.close()
    return len(storages), copied


def _copy_candidates(
    ckpt: Checkpoint, storages: list[StorageRecord], casts: Optional[Casts]
) -> Iterator[CopyCandidate]:
    """The output's storage records for :meth:`ZipWriter.add_copies`, made one at a time.

    A storage that ``casts`` makes anew has no offset in the source (``data_offset``
    -1), so it always goes through its ``write`` callback, which casts it.
    """
    for index, storage in enumerate(storages):
        size = storage.nbytes

        def write(out: Sink, storage: StorageRecord = storage, size: int = size) -> int:
            crc = casts.write(out, storage) if casts is not None else None
            return _copy_storage(out, ckpt, storage, size) if crc is None else crc

        # What _copy_storage copies as it is, with the CRC-32 the source records.
        whole = (
            storage.data_offset >= 0
            and not storage.compressed
            and storage.crc32 is not None
            and storage.stored_size == size
        )
        yield CopyCandidate(
            f"{_ARCHIVE}data/{index}",
            size,
            storage.crc32 or 0,
            storage.data_offset if whole else -1,
            write,
        )


def _copy_storage(out: Sink, ckpt: Checkpoint, storage: StorageRecord, size: int) -> int:
    if storage.data_offset < 0:
        raise CheckpointCorruptError(f"{ckpt.path}: storage {storage.key} has no data in the file")
    if storage.compressed:
        data = _storage_bytes(ckpt, storage, 0, size)
        out.write(data)
        if out.progress is not None:
            out.progress.update(len(data))
        return zlib.crc32(data)
    if storage.crc32 is not None and storage.stored_size == size:
        # A zip record copied whole keeps its CRC: no need to read it in user space.
        out.copy_from(ckpt.source, storage.data_offset, size, crc=False)
        return storage.crc32
    return out.copy_from(ckpt.source, storage.data_offset, size, crc=True)


def _safetensors_plan(
    sd: Mapping[Any, Any], name: str
) -> tuple[list[tuple[str, TensorRecord]], dict[str, str], list[str]]:
    problems = []
    for key, value in sd.items():
        if not isinstance(key, str):
            problems.append(f"key {key!r} is not a string")
        elif not isinstance(value, TensorRecord):
            problems.append(f"{key!r} is {_describe(value)}, not a tensor")
        elif value.dtype not in CODES:
            problems.append(f"{key!r} has dtype {value.dtype}, which safetensors cannot store")
        elif value.metadata:
            problems.append(f"{key!r} has its conjugate/negative bit set; resolve it first")
    if problems:
        shown = "; ".join(problems[:8])
        raise CheckpointFormatError(
            f"{name}: cannot write safetensors: {shown}. safetensors stores only a flat map of "
            f"names to plain tensors; keep the pt format for this one"
        )
    aliases, overlaps = find_aliases(_view(key, rec) for key, rec in sd.items())
    return [(k, rec) for k, rec in sd.items() if k not in aliases], aliases, overlaps


def _view(key: str, rec: TensorRecord) -> Optional[View]:
    if not rec.numel:
        return None
    start = rec.offset * rec.itemsize
    identity = (id(rec.storage), rec.offset, rec.shape, rec.stride, rec.dtype)
    return View(key, identity, id(rec.storage), start, start + rec.extent() * rec.itemsize)


def _write_safetensors(
    sink: Sink,
    ckpt: Checkpoint,
    sd: Mapping[Any, Any],
    metadata: dict[str, str],
    casts: Optional[Casts] = None,
) -> tuple[int, int, dict[str, str], list[str]]:
    if ckpt.byteorder != "little":
        raise CheckpointFormatError(
            f"{ckpt.path}: its tensors are stored big-endian; safetensors is little-endian. "
            f"Convert to pt first, load it and save again on a little-endian machine"
        )
    if casts is not None:
        sd = casts.state_dict(sd)
    canonical, aliases, overlaps = _safetensors_plan(sd, ckpt.path)
    meta = dict(metadata)
    sd_meta = getattr(sd, "_metadata", None)
    if sd_meta is not None:
        meta[STATE_DICT_METADATA_KEY] = state_dict_metadata_json(sd_meta)
    header, order, size = build_header(
        [(key, CODES[rec.dtype], rec.shape, rec.nbytes) for key, rec in canonical], meta, aliases
    )
    sink.write(header)
    records = dict(canonical)
    for key in order:
        if casts is None or casts.write(sink, records[key].storage) is None:
            _copy_tensor(sink, ckpt, records[key])
    return len(canonical), size, aliases, overlaps


def _copy_tensor(sink: Sink, ckpt: Checkpoint, rec: TensorRecord) -> None:
    if rec.numel == 0:
        return
    storage = rec.storage
    if storage.data_offset < 0:
        raise CheckpointCorruptError(f"{ckpt.path}: storage {storage.key} has no data in the file")
    if rec.is_contiguous() and not storage.compressed:
        start, length = rec.byte_range()
        sink.copy_from(ckpt.source, storage.data_offset + start, length, crc=False)
        return
    # A non-contiguous view (or a compressed record): gather this one tensor in memory.
    tensor = _load_tensor(ckpt, rec).contiguous()
    data = tensor.reshape(-1).view(_torch_dtype("uint8")).numpy().tobytes()
    sink.write(data)
    if sink.progress is not None:
        sink.progress.update(len(data))


# --------------------------------------------------------------------------- convert


def convert_file(
    src: PathLike,
    dst: Optional[PathLike] = None,
    *,
    strip_prefix: Optional[str] = None,
    add_prefix: Optional[str] = None,
    normalize: bool = False,
    key: Optional[str] = None,
    to: Optional[str] = None,
    drop_optimizer: bool = False,
    in_place: bool = False,
    overwrite: bool = False,
    unsafe: bool = False,
    progress: bool = False,
    fsync: bool = True,
    storage_options: Optional[dict[str, Any]] = None,
    dtype: Optional[str] = None,
    max_shard_size: Optional[Union[int, str]] = None,
) -> ConvertResult:
    """Rewrite a checkpoint file's keys or format without loading it into memory.

    torch.save files: only the pickled structure is rewritten; every tensor
    record is copied byte for byte (in the kernel where the OS allows).
    safetensors: the header is rewritten and the data copied. Across formats,
    one tensor at a time. Legacy (pre-1.6) files are streamed the same way.
    Key rules are :mod:`ddpstate.keys`' own, applied to the model state dict
    :func:`ddpstate.keys.find_state_dict` locates (or ``key``); everything else
    in the checkpoint comes through unchanged. The output is written atomically
    and every storage is tagged ``cpu``, so it loads without ``map_location``
    on a machine without a GPU. No code from the file runs.

    A ``torch.distributed.checkpoint`` folder as ``src`` is consolidated into
    one ``.pt`` or ``.safetensors`` file (read whole, with torch: DCP has no
    streaming reader); ``to="dcp"`` writes a file's state as a DCP folder,
    under a temporary name first and renamed into place when complete.

    Args:
        src: The checkpoint file or DCP folder (local path or fsspec URL).
        dst: Where to write; default :func:`default_destination`.
        strip_prefix: Remove this prefix (e.g. ``"module."``) from the model's keys.
        add_prefix: Add this prefix to every model key.
        normalize: Remove every wrapper prefix (``module.``, ``_orig_mod.``).
        key: Dotted path of the model state dict inside the checkpoint.
        to: ``"pt"``, ``"safetensors"`` or ``"dcp"``; default: from ``dst``'s suffix
            (``.safetensors``; ``.pt``, ``.pth``, ``.bin``, ``.ckpt``), else the source's kind.
            safetensors output holds the model state dict only; ``"dcp"`` writes
            ``dst`` as a ``torch.distributed.checkpoint`` folder (local, required).
        drop_optimizer: Leave optimizer state out of the output.
        in_place: Replace ``src`` itself (atomically).
        overwrite: Replace an existing ``dst``.
        unsafe: Accept pickles naming globals ``torch.load(weights_only=True)``
            refuses; they are copied through as they are, never run.
        progress: Draw a progress bar on stderr (only when it is a terminal).
        fsync: ``False`` skips the fsyncs of a local output: as fast as ``cp``
            and still atomic against a crashed process, but a power loss or OS
            crash can leave the new file empty. Refused with ``in_place``,
            where the output replaces the only copy.
        storage_options: fsspec options for URLs.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (or torch's names): cast
            every floating tensor written to it, one tensor in memory at a
            time, exactly as ``tensor.to(dtype)``; integer and bool tensors
            (``num_batches_tracked``...) are kept as they are.
        max_shard_size: Write ``dst`` as a folder in the Hugging Face sharded
            layout (``model-00001-of-0000N.safetensors`` shards of at most this
            size, ``"2GB"``, ``"500MB"``, ``"1.5GiB"`` or bytes, and
            ``model.safetensors.index.json``), atomically as a whole; safetensors only.

    Returns:
        A :class:`ConvertResult`.

    Raises:
        CheckpointNotFoundError: ``src`` does not exist.
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is False.
        CheckpointFormatError: ``src`` is not a checkpoint ddpstate reads, or
            the state dict cannot go to safetensors.
        CheckpointCorruptError: ``src`` is truncated or damaged.
        UnsafeCheckpointError: ``src`` needs unsafe globals and ``unsafe`` is False.
        StateDictNotFoundError: No model state dict to apply the key rule to.
        KeyCollisionError: Renaming would make two keys equal.
        InvalidArgumentError: Conflicting arguments (also a ``ValueError``).

    Example:
        >>> import torch, tempfile, os
        >>> from ddpstate.convert import convert_file
        >>> folder = tempfile.mkdtemp()
        >>> src = os.path.join(folder, "dp.pt")
        >>> torch.save({"epoch": 3, "state_dict": {"module.w": torch.ones(2)}}, src)
        >>> result = convert_file(src, strip_prefix="module.")
        >>> os.path.basename(result.dst), result.renamed
        ('dp.converted.pt', 1)
        >>> list(torch.load(result.dst)["state_dict"])
        ['w']
    """
    _check_rules(strip_prefix, add_prefix, normalize)
    cast_to = None if dtype is None else target_dtype(dtype)
    if to is not None:
        to = parse_format(to, allowed=(PT, SAFETENSORS, formats.DCP), what="to")
    shard_limit = shard_dst = None
    if max_shard_size is not None:
        shard_limit, shard_dst = _check_sharded_output(dst, to, in_place, max_shard_size)
    if in_place and dst is not None:
        raise InvalidArgumentError("pass either dst or in_place=True, not both")
    if in_place and not fsync:
        raise InvalidArgumentError(
            "in_place=True needs fsync: the output replaces the only copy of the source "
            "(drop --no-fsync, or write to a new DST)"
        )
    src_text = os.fspath(src)
    from_dcp = _is_dcp_folder(src_text, storage_options)
    if from_dcp or to == formats.DCP:
        if in_place:
            raise InvalidArgumentError(
                "in_place=True cannot turn a file into a folder or a folder into a file; name DST"
            )
        # DCP needs torch; imported only here so the streaming paths stay torch-free.
        from ddpstate._dcp import convert as _dcp_convert

        dst_text = None if dst is None else os.fspath(dst)
        options: dict[str, Any] = dict(
            strip=strip_prefix, add=add_prefix, normalize=normalize, key=key,
            drop_optimizer=drop_optimizer, overwrite=overwrite, unsafe=unsafe, fsync=fsync,
            storage_options=storage_options,
        )  # fmt: skip
        if dtype is not None or max_shard_size is not None:
            raise InvalidArgumentError(
                f"{src_text}: dtype and max_shard_size do not apply when converting from or to a "
                f"torch.distributed.checkpoint folder; convert to a .pt file first, then cast "
                f"or shard that"
            )
        if from_dcp:
            return _dcp_convert.convert_from_dcp(src_text, dst_text, to=to, **options)
        return _dcp_convert.convert_to_dcp(src_text, dst_text, **options)
    with read_checkpoint(src_text, unsafe=unsafe, storage_options=storage_options) as ckpt:
        _raise_problems(ckpt)
        dst_format = (
            to or _format_from_name(dst) or (SAFETENSORS if ckpt.format == SAFETENSORS else PT)
        )
        if shard_dst is not None:
            dst_format = SAFETENSORS
            dst_text = shard_dst
            if _same_file(src_text, dst_text) or _same_file(ckpt.path, dst_text):
                raise CheckpointExistsError(
                    f"{dst_text} is the source; write the sharded copy to a new folder"
                )
        elif in_place and ckpt.format == HF_SHARDED:
            raise InvalidArgumentError(
                f"{ckpt.path}: in_place=True cannot replace a sharded checkpoint; name a new DST "
                f"(a folder with max_shard_size for a sharded copy)"
            )
        elif in_place:
            dst_text = src_text
        else:
            # A sharded source is named after its folder, not its index file.
            dst_text = _destination(
                src_text, dst, dst_format, overwrite, storage_options, base=_sharded_base(ckpt)
            )
        return _convert(
            ckpt,
            dst_text,
            dst_format,
            strip=strip_prefix,
            add=add_prefix,
            normalize=normalize,
            key=key,
            drop_optimizer=drop_optimizer,
            in_place=in_place,
            progress=progress,
            fsync=fsync,
            storage_options=storage_options,
            dtype=cast_to,
            shard_limit=shard_limit,
            overwrite=overwrite,
        )


def _sharded_base(ckpt: Checkpoint) -> Optional[str]:
    if ckpt.format != HF_SHARDED:
        return None
    from ddpstate._hf.read import folder_of

    return folder_of(ckpt.path)


def _check_sharded_output(
    dst: Optional[PathLike], to: Optional[str], in_place: bool, max_shard_size: Union[int, str]
) -> tuple[int, str]:
    """``(shard size limit, output folder)``, or the error for a combination that cannot be."""
    from ddpstate._hf.write import parse_size

    limit = parse_size(max_shard_size)
    if to not in (None, SAFETENSORS):
        raise InvalidArgumentError(
            "max_shard_size writes safetensors shards; drop --to pt (to='pt') or max_shard_size"
        )
    if in_place or dst is None:
        raise InvalidArgumentError(
            "max_shard_size writes a folder of shards: name the output folder as DST "
            "(not --in-place)"
        )
    return limit, os.fspath(dst)


def _destination(
    src: str,
    dst: Optional[PathLike],
    dst_format: str,
    overwrite: bool,
    storage_options: Optional[dict[str, Any]],
    base: Optional[str] = None,
) -> str:
    """The output file: ``dst``, inside ``dst`` when it is a folder, or the default name.

    The default name derives from ``base`` (a sharded source's folder) or ``src``.
    Refuses the source itself and an existing file unless ``overwrite``.
    """
    base = base or src
    dst_text = os.fspath(dst) if dst is not None else default_destination(base, dst_format)
    if dst is not None and _isdir(dst_text, storage_options):
        name = default_destination(base, dst_format).replace("\\", "/")
        dst_text = _join(dst_text, name.rsplit("/", 1)[-1])
    if _exists(dst_text, storage_options):
        if _same_file(src, dst_text):
            raise CheckpointExistsError(
                f"{dst_text} is the source file; pass --in-place (in_place=True) to replace it"
            )
        if not overwrite:
            raise CheckpointExistsError(
                f"{dst_text} already exists; pass --force (overwrite=True) to replace "
                f"it, or name another destination"
            )
    return dst_text


def _format_from_name(dst: Optional[PathLike]) -> Optional[FormatName]:
    """The format a destination's suffix names, as ``ddpstate.save`` reads it (None: no say)."""
    if dst is None:
        return None
    name = os.fspath(dst).lower()
    if name.endswith(".safetensors"):
        return SAFETENSORS
    if name.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return PT
    return None


def _convert(
    ckpt: Checkpoint,
    dst: str,
    dst_format: FormatName,
    *,
    strip: Optional[str],
    add: Optional[str],
    normalize: bool,
    key: Optional[str],
    drop_optimizer: bool,
    in_place: bool,
    progress: bool,
    fsync: bool,
    storage_options: Optional[dict[str, Any]],
    dtype: Optional[str] = None,
    shard_limit: Optional[int] = None,
    overwrite: bool = False,
) -> ConvertResult:
    root = ckpt.obj
    notes: list[str] = []
    renaming = strip is not None or add is not None or normalize
    need_sd = renaming or key is not None or dst_format == SAFETENSORS
    path: Optional[tuple[Any, ...]] = None
    sd: Any = None
    if is_pickled_module(root) and need_sd:
        sd = module_state_dict(root)
        notes.append(
            f"the source is a pickled whole nn.Module ({opaque_name(root)}); its parameters "
            f"and buffers were written as a plain state dict"
        )
    elif need_sd:
        path, sd = _find_state_dict(root, key)
    renamed = 0
    metadata_changed = False
    new_root = root
    source_sd = sd
    if sd is not None:
        new_sd = _rename(sd, strip, add, normalize)
        renamed = sum(1 for a, b in zip(sd, new_sd, strict=False) if a != b)
        renamed += abs(len(sd) - len(new_sd))
        metadata_changed = getattr(sd, "_metadata", None) != getattr(new_sd, "_metadata", None)
        if path is None:
            new_root = new_sd
        elif new_sd is not sd:
            from ddpstate import keys

            new_root = keys.replace_state_dict(root, path, new_sd)
        sd = new_sd
    dropped: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()
    if dst_format == SAFETENSORS:
        if isinstance(new_root, Mapping) and path:
            left_out = tuple(str(k) for k in new_root if k != path[0])
            if len(path) > 1:
                left_out = (f"the rest of {path[0]!s}", *left_out)
    elif drop_optimizer:
        new_root, dropped = _drop_optimizer(new_root, path)
        if not dropped:
            notes.append("no optimizer state found to drop")
    casts = _plan_casts(ckpt, new_root if dst_format == PT else sd, dtype)
    if casts is not None and casts.count:
        notes.append(
            f"cast {casts.count} floating tensor(s) to {dtype}; integer and bool tensors kept"
        )
    changed = (
        (casts is not None and casts.count)
        or renamed
        or metadata_changed
        or dropped
        or dst_format != (SAFETENSORS if ckpt.format == SAFETENSORS else PT)
        or ckpt.format == formats.LEGACY
        or any(s.location != "cpu" for s in ckpt.storages)
        or (sd is not None and path is None)
    )
    if in_place and not changed:
        return ConvertResult(
            src=ckpt.path,
            dst=dst,
            src_format=ckpt.format,
            dst_format=dst_format,
            state_dict_path=_dotted(path) if sd is not None else None,
            renamed=0,
            tensors=0,
            bytes_copied=0,
            notes=(*notes, "nothing to change; the file was left as it is"),
            written=False,
        )
    total = sum(s.nbytes for s in ckpt.storages)
    bar = Progress(total, "convert", enabled=None if progress else False)
    from ddpstate import storage

    try:
        if shard_limit is not None:
            meta = dict(ckpt.st_metadata)
            meta.setdefault("format", "pt")
            count, copied, aliases, overlaps = _write_sharded_safetensors(
                ckpt, sd, meta, casts, dst, shard_limit, bar, fsync=fsync, overwrite=overwrite
            )
            notes += _alias_notes(aliases, overlaps)
            dst_format = HF_SHARDED
        else:
            with storage.atomic_write(dst, storage_options=storage_options, fsync=fsync) as out:
                sink = Sink(out, bar, write_back=fsync)
                if dst_format == SAFETENSORS:
                    meta = dict(ckpt.st_metadata)
                    if ckpt.format != SAFETENSORS:
                        # Hugging Face loaders ask for this entry in torch-made files.
                        meta.setdefault("format", "pt")
                    count, copied, aliases, overlaps = _write_safetensors(
                        sink, ckpt, sd, meta, casts
                    )
                    notes += _alias_notes(aliases, overlaps)
                else:
                    pickle_bytes = None
                    # A cast rewrites tensor records: the tree is re-emitted, never copied.
                    if not dropped and not is_pickled_module(root) and casts is None:
                        pickle_bytes = _copied_pickle(ckpt, path, source_sd, sd)
                    count, copied = _write_pt(sink, ckpt, new_root, pickle_bytes, casts)
    finally:
        bar.close()
    return ConvertResult(
        src=ckpt.path,
        dst=dst,
        src_format=ckpt.format,
        dst_format=dst_format,
        state_dict_path=_dotted(path) if sd is not None else None,
        renamed=renamed,
        tensors=count,
        bytes_copied=copied,
        dropped=dropped,
        left_out=left_out,
        notes=tuple(notes),
        cast=casts.count if casts is not None else 0,
    )


def _alias_notes(aliases: dict[str, str], overlaps: list[str]) -> list[str]:
    notes = []
    if aliases:
        notes.append(
            f"{len(aliases)} tied tensor(s) written once and recorded as aliases "
            f"({', '.join(f'{a} -> {c}' for a, c in list(aliases.items())[:3])})"
        )
    if overlaps:
        notes.append(
            f"tensors overlapping in memory were written as separate copies: "
            f"{'; '.join(overlaps[:3])}"
        )
    return notes


def _write_sharded_safetensors(
    ckpt: Checkpoint,
    sd: Mapping[Any, Any],
    metadata: dict[str, str],
    casts: Optional[Casts],
    dst: str,
    limit: int,
    bar: Progress,
    *,
    fsync: bool,
    overwrite: bool,
) -> tuple[int, int, dict[str, str], list[str]]:
    """The state dict as a Hugging Face sharded folder, each shard by ``_write_safetensors``."""
    from ddpstate._hf import write as _hf_write

    if casts is not None:
        sd = casts.state_dict(sd)
    canonical, aliases, overlaps = _safetensors_plan(sd, ckpt.path)
    nbytes = {key: rec.nbytes for key, rec in canonical}
    shards = _hf_write.plan_shards(list(sd), nbytes, aliases, limit)

    def write_shard(f: IO[bytes], keys: list[str], name: str) -> int:
        part = collections.OrderedDict((k, sd[k]) for k in keys)
        _write_safetensors(Sink(f, bar, write_back=fsync), ckpt, part, metadata, casts)
        return sum(nbytes.get(k, 0) for k in keys)

    _hf_write.write_sharded(
        dst, shards, write_shard, order=list(sd), overwrite=overwrite, fsync=fsync
    )
    return len(canonical), sum(nbytes.values()), aliases, overlaps


def _plan_casts(ckpt: Checkpoint, tree: Any, dtype: Optional[str]) -> Optional[Casts]:
    if dtype is None:
        return None
    if ckpt.byteorder != _native_byteorder():
        raise CheckpointFormatError(
            f"{ckpt.path}: its tensors are stored {ckpt.byteorder}-endian; convert it without "
            f"--dtype first, load it and save it again on this machine, then cast"
        )
    records = (r for _, r in iter_tensors(tree))
    return Casts(records, dtype, lambda rec: _load_tensor(ckpt, rec), ckpt.path)


# --------------------------------------------------------------------------- inspect


def _describe(value: Any) -> str:
    if isinstance(value, TensorRecord):
        return f"tensor {value.dtype} {list(value.shape)}"
    if isinstance(value, StorageRecord):
        return f"storage {value.dtype} x{value.numel}"
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (int, float)):
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, str):
        return f"str {value[:40]!r}" + ("..." if len(value) > 40 else "")
    if isinstance(value, (bytes, bytearray)):
        return f"{type(value).__name__} of {len(value)} bytes"
    if is_pickled_module(value):
        return f"pickled nn.Module {opaque_name(value)}"
    if isinstance(value, (Opaque, GlobalRef)) or (
        isinstance(value, type) and issubclass(value, Opaque)
    ):
        return f"{opaque_name(value)} object"
    if isinstance(value, Mapping):
        return f"{type(value).__name__} of {len(value)} entries"
    if isinstance(value, (list, tuple, set, frozenset)):
        return f"{type(value).__name__} of {len(value)} items"
    return type(value).__name__


def _summary(value: Any, role: Optional[str]) -> str:
    tensors = [r for _, r in iter_tensors(value) if isinstance(r, TensorRecord)]
    size = sum(r.nbytes for r in tensors)
    if role is not None:
        return f"{role}: {len(tensors)} tensors, {human_bytes(size)}"
    if _is_optimizer_state(value):
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
    text = _describe(value)
    if tensors and not isinstance(value, TensorRecord):
        text += f" ({len(tensors)} tensors, {human_bytes(size)})"
    return text


def inspect_file(
    src: PathLike,
    *,
    unsafe: bool = False,
    storage_options: Optional[dict[str, Any]] = None,
) -> InspectResult:
    """Describe a checkpoint from its headers and pickle structure, never its tensor data.

    A ``torch.distributed.checkpoint`` folder is described from its ``.metadata``
    (read with an unpickler that allows only DCP's metadata classes): keys, whole
    shapes, dtypes and sizes, whatever the sharding.

    Args:
        src: The checkpoint file or DCP folder.
        unsafe: Also read pickles that name unsafe globals (still never run).
        storage_options: fsspec options for URLs.

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
    from ddpstate import keys

    if _is_dcp_folder(os.fspath(src), storage_options):
        from ddpstate._dcp.convert import inspect_dcp

        return inspect_dcp(os.fspath(src), storage_options=storage_options)
    with read_checkpoint(os.fspath(src), unsafe=unsafe, storage_options=storage_options) as ckpt:
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
            try:
                path, sd = _find_state_dict(root, None)
            except StateDictNotFoundError as exc:
                notes.append(f"no model state dict found: {exc}")
        all_tensors = [r for _, r in iter_tensors(root) if isinstance(r, TensorRecord)]
        dtype_of: dict[int, str] = {}
        for rec in all_tensors:
            dtype_of.setdefault(id(rec.storage), rec.dtype)
        dtype_bytes: dict[str, int] = collections.Counter()
        devices: dict[str, int] = collections.Counter()
        for storage in ckpt.storages:
            dtype_bytes[dtype_of.get(id(storage), storage.dtype)] += storage.nbytes
            devices[storage.location] += 1
        rows: list[TensorInfo] = []
        if sd is not None:
            items = list(sd.items())
        else:
            items = [(_dotted(p) or "", r) for p, r in iter_tensors(root)]
        for name, value in items:
            if isinstance(value, TensorRecord):
                rows.append(
                    TensorInfo(str(name), value.dtype, value.shape, value.nbytes,
                               value.storage.location)
                )  # fmt: skip
            else:
                rows.append(TensorInfo(str(name), _describe(value), (), 0, ""))
        structure: list[tuple[str, str]] = []
        if isinstance(root, Mapping) and path:
            for k, v in root.items():
                role = None
                if k == path[0]:
                    role = (
                        "model state dict"
                        if len(path) == 1
                        else f"holds the model at {_dotted(path)}"
                    )
                structure.append((str(k), _summary(v, role)))
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
            state_dict_path=_dotted(path),
            structure=tuple(structure),
            tensors=tuple(rows),
            unsafe_globals=ckpt.unsafe_globals,
            problems=tuple(ckpt.problems),
            notes=tuple(notes),
        )


# --------------------------------------------------------------------------- diff


def _model_tensors(
    ckpt: Checkpoint, key: Optional[str] = None
) -> tuple[str, Mapping[Any, Any], Optional[str]]:
    """``(where, state dict, note)``: the model tensors diff compares in one file.

    ``key`` picks the state dict where the file has that entry; a file that is
    a bare state dict itself is taken whole (so ``--key state_dict`` compares a
    Lightning checkpoint with a plain one). Several state dicts and no ``key``
    is refused, as :func:`ddpstate.load_model_state` refuses it.
    """
    from ddpstate._collectives import with_message

    root = ckpt.obj
    if is_pickled_module(root):
        return f"the parameters of the pickled {opaque_name(root)}", module_state_dict(root), None
    if key is not None:
        try:
            path, sd = _find_state_dict(root, key)
        except StateDictNotFoundError as exc:
            try:
                bare, sd = _find_state_dict(root, None)
            except StateDictNotFoundError:
                bare = None
            if bare != ():
                raise with_message(exc, f"{ckpt.path}: {exc}") from exc
            note = f"{ckpt.path} is a bare state dict without {key!r}; compared whole"
            return "the whole file", sd, note
        return (f"'{_dotted(path)}'" if path else "the whole file"), sd, None
    try:
        path, sd = _find_state_dict(root, None)
    except AmbiguousStateDictError as exc:
        raise with_message(exc, f"{ckpt.path}: {exc}") from exc
    except StateDictNotFoundError:
        every = collections.OrderedDict(
            (_dotted(p) or "", r) for p, r in iter_tensors(root) if isinstance(r, TensorRecord)
        )
        return "every tensor (no model state dict found)", every, None
    return (f"'{_dotted(path)}'" if path else "the whole file"), sd, None


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    import torch

    flat_a = a.reshape(-1)
    flat_b = b.reshape(-1)
    worst = 0.0
    for start in range(0, flat_a.numel(), _DIFF_CHUNK):
        x = flat_a[start : start + _DIFF_CHUNK]
        y = flat_b[start : start + _DIFF_CHUNK]
        if x.is_complex():
            delta = (x.to(torch.complex128) - y.to(torch.complex128)).abs()
        elif x.is_floating_point():
            x64, y64 = x.to(torch.float64), y.to(torch.float64)
            delta = (x64 - y64).abs()
            both_nan = torch.isnan(x64) & torch.isnan(y64)
            delta = torch.where(both_nan, torch.zeros_like(delta), delta)
            delta = torch.where(torch.isnan(delta), torch.full_like(delta, float("inf")), delta)
        elif x.dtype == torch.bool:
            delta = (x != y).to(torch.float64)
        else:
            try:
                delta = (x.to(torch.float64) - y.to(torch.float64)).abs()
            except (RuntimeError, TypeError):
                delta = (x.view(torch.uint8) != y.view(torch.uint8)).to(torch.float64)
        if delta.numel():
            worst = max(worst, float(delta.max()))
    return worst


def diff_files(
    a: PathLike,
    b: PathLike,
    *,
    raw_keys: bool = False,
    key: Optional[str] = None,
    strip_prefix: Optional[str] = None,
    add_prefix: Optional[str] = None,
    normalize: bool = False,
    atol: float = 0.0,
    unsafe: bool = False,
    progress: bool = False,
    storage_options: Optional[dict[str, Any]] = None,
) -> DiffResult:
    """Compare the model state dicts of two checkpoint files, tensor by tensor.

    The state dicts are located as :func:`convert_file` locates them (``key``
    names one; a file holding several is refused without it), the key rule
    (``strip_prefix``, ``add_prefix`` or ``normalize``, as for
    :func:`convert_file`) is applied to both, and keys are then compared after
    removing wrapper prefixes (``module.``, ``_orig_mod.``) unless
    ``raw_keys``; shapes and dtypes must match; the largest absolute
    difference of each shared tensor is reported. Tensors are read one pair at
    a time (a sharded checkpoint: one tensor of one shard at a time).

    Args:
        a: First checkpoint (any format ddpstate reads, a sharded one included).
        b: Second checkpoint.
        raw_keys: Compare keys exactly as stored (after the key rule, if any).
        key: Dotted path of the model state dict in each file that has it; a
            file that is a bare state dict is compared whole.
        strip_prefix: Remove this prefix from both files' model keys.
        add_prefix: Add this prefix to both files' model keys.
        normalize: Remove every wrapper prefix from both (the default unless
            ``raw_keys``; with ``raw_keys`` it still applies).
        atol: Differences up to this count as equal.
        unsafe: Also read pickles naming unsafe globals (never run).
        progress: Draw a progress bar on stderr (only on a terminal).
        storage_options: fsspec options for URLs.

    Returns:
        A :class:`DiffResult`; ``.equal`` tells the verdict.

    Raises:
        CheckpointNotFoundError, CheckpointFormatError, CheckpointCorruptError,
        UnsafeCheckpointError: as for :func:`convert_file`.
        KeyCollisionError: Normalizing a file's keys makes two of them equal
            (compare with ``raw_keys=True``).
        AmbiguousStateDictError: A file holds several state dicts and no
            ``key`` names one (the message names them).
        StateDictNotFoundError: ``key`` is in neither place it could be.
        InvalidArgumentError: More than one key rule.

    Example:
        >>> import torch, tempfile, os
        >>> from ddpstate.convert import diff_files
        >>> d = tempfile.mkdtemp()
        >>> torch.save({"module.w": torch.ones(2)}, os.path.join(d, "a.pt"))
        >>> torch.save({"w": torch.ones(2) + 1e-7}, os.path.join(d, "b.pt"))
        >>> diff_files(os.path.join(d, "a.pt"), os.path.join(d, "b.pt"), atol=1e-6).equal
        True
    """
    from ddpstate import keys

    _check_rules(strip_prefix, add_prefix, normalize)
    with contextlib.ExitStack() as stack:
        ca = stack.enter_context(
            read_checkpoint(os.fspath(a), unsafe=unsafe, storage_options=storage_options)
        )
        cb = stack.enter_context(
            read_checkpoint(os.fspath(b), unsafe=unsafe, storage_options=storage_options)
        )
        _raise_problems(ca)
        _raise_problems(cb)
        where_a, sd_a, note_a = _model_tensors(ca, key)
        where_b, sd_b, note_b = _model_tensors(cb, key)
        sd_a = _rename(sd_a, strip_prefix, add_prefix, normalize)
        sd_b = _rename(sd_b, strip_prefix, add_prefix, normalize)
        if not raw_keys:
            sd_a = keys.normalize_keys(sd_a)
            sd_b = keys.normalize_keys(sd_b)
        only_a = tuple(str(k) for k in sd_a if k not in sd_b)
        only_b = tuple(str(k) for k in sd_b if k not in sd_a)
        mismatched: list[tuple[str, str, str]] = []
        diffs: dict[str, float] = {}
        shared = [k for k in sd_a if k in sd_b]
        total = sum(
            v.nbytes for k in shared for v in (sd_a[k], sd_b[k]) if isinstance(v, TensorRecord)
        )
        bar = Progress(total, "diff", enabled=None if progress else False)
        try:
            for k in shared:
                va, vb = sd_a[k], sd_b[k]
                if not (isinstance(va, TensorRecord) and isinstance(vb, TensorRecord)):
                    if (
                        isinstance(va, TensorRecord)
                        or isinstance(vb, TensorRecord)
                        or (_describe(va) != _describe(vb))
                    ):
                        mismatched.append((str(k), _describe(va), _describe(vb)))
                    continue
                if va.shape != vb.shape or va.dtype != vb.dtype:
                    mismatched.append((str(k), _describe(va), _describe(vb)))
                    continue
                diffs[str(k)] = _max_abs_diff(_load_tensor(ca, va), _load_tensor(cb, vb))
                bar.update(va.nbytes + vb.nbytes)
        finally:
            bar.close()
        notes = [f"compared {where_a} of {ca.path} with {where_b} of {cb.path}"]
        notes += [n for n in (note_a, note_b) if n]
        if not raw_keys:
            notes.append(
                "keys compared without wrapper prefixes (--raw-keys compares them as stored)"
            )
        return DiffResult(
            a=ca.path,
            b=cb.path,
            only_a=only_a,
            only_b=only_b,
            mismatched=tuple(mismatched),
            max_abs_diff=diffs,
            atol=atol,
            different_values=tuple(k for k, v in diffs.items() if not v <= atol),
            notes=tuple(notes),
        )


# --------------------------------------------------------------------------- verify


def verify_file(
    src: PathLike,
    *,
    unsafe: bool = False,
    progress: bool = False,
    storage_options: Optional[dict[str, Any]] = None,
) -> VerifyResult:
    """Check that a checkpoint file is readable end to end and every tensor record is whole.

    torch.save files: every zip record is read and its CRC-32 compared with
    the directory's; every storage the pickle refers to must have a record of
    the right size, and every tensor must lie inside its storage. Legacy and
    safetensors files: every tensor's data must be present (and is read).

    A folder is checked as a CheckpointManager step folder or directory by
    :func:`ddpstate.manager.verify_checkpoint` (manifest, sizes, CRC-32s,
    commit marker, ``latest`` pointer); the result's format is ``"manager"``.
    A ``torch.distributed.checkpoint`` folder: its ``.metadata`` must parse, and
    every file it names must exist and reach its largest offset + length (DCP
    records no checksums); a ddpstate ``manifest.json`` in it adds its CRC-32s.

    Args:
        src: The checkpoint file, or a CheckpointManager folder.
        unsafe: Also read pickles naming unsafe globals (never run).
        progress: Draw a progress bar on stderr (only on a terminal).
        storage_options: fsspec options for URLs.

    Returns:
        A :class:`VerifyResult`; ``.ok`` is the verdict, ``.problems`` says what is wrong.

    Raises:
        CheckpointNotFoundError: No such file.
        CheckpointFormatError: Not a checkpoint file at all, or a folder that
            is not a CheckpointManager folder.
        UnsafeCheckpointError: Unsafe globals and ``unsafe`` is False.

    Example:
        >>> import torch, tempfile, os
        >>> from ddpstate.convert import verify_file
        >>> p = os.path.join(tempfile.mkdtemp(), "m.pt")
        >>> torch.save({"w": torch.ones(2)}, p)
        >>> verify_file(p).ok
        True
    """
    text = os.fspath(src)
    from ddpstate import storage
    from ddpstate._hf import read as _hf_sharded

    if _hf_sharded.find_index(text, storage_options) is not None:
        return _hf_sharded.verify_sharded(
            text, unsafe=unsafe, progress=progress, storage_options=storage_options
        )
    if storage.isdir(text, storage_options=storage_options):
        if storage.exists(storage.join(text, ".metadata"), storage_options=storage_options):
            from ddpstate._dcp.convert import verify_dcp

            return verify_dcp(text, storage_options=storage_options)
        return _verify_folder(text, storage_options)
    try:
        ckpt = read_checkpoint(text, unsafe=unsafe, storage_options=storage_options)
    except CheckpointCorruptError as exc:
        return VerifyResult(path=text, format=None, problems=(str(exc),))
    with ckpt:
        problems = [*ckpt.problems, *_extent_problems(ckpt)]
        notes: list[str] = []
        tensors = [r for _, r in iter_tensors(ckpt.obj) if isinstance(r, TensorRecord)]
        if ckpt.format == formats.TORCH_ZIP:
            total = sum(r.compressed_size for r in ckpt.zip_records.values())
        else:
            total = sum(s.stored_size for s in ckpt.storages if s.data_offset >= 0)
        bar = Progress(total, "verify", enabled=None if progress else False)
        read = 0
        try:
            if ckpt.format == formats.TORCH_ZIP:
                read = _verify_zip_records(ckpt, problems, notes, bar)
            else:
                for s in ckpt.storages:
                    if s.data_offset >= 0 and s.data_offset + s.stored_size <= ckpt.size:
                        ckpt.source.crc32(s.data_offset, s.stored_size, bar)
                        read += s.stored_size
        finally:
            bar.close()
        return VerifyResult(
            path=ckpt.path,
            format=ckpt.format,
            problems=tuple(problems),
            tensors=len(tensors),
            bytes_read=read,
            notes=tuple(notes),
        )


def _verify_zip_records(
    ckpt: Checkpoint, problems: list[str], notes: list[str], bar: Progress
) -> int:
    read = 0
    unchecked = 0
    for record in ckpt.zip_records.values():
        end = record.data_offset + record.compressed_size
        if end > ckpt.size:
            continue  # already reported by the reader
        if record.method != zipfile.ZIP_STORED:
            try:
                zip_entry_bytes(ckpt.source, record, ckpt.path)  # inflating checks the CRC
            except CheckpointCorruptError as exc:
                problems.append(f"zip entry {record.name}: {exc.__cause__ or exc}")
            read += record.compressed_size
            bar.update(record.compressed_size)
            continue
        crc = ckpt.source.crc32(record.data_offset, record.size, bar)
        read += record.size
        if record.crc32 == 0 and record.size and crc != 0:
            unchecked += 1  # written with torch's CRC computation turned off
        elif crc != record.crc32:
            problems.append(
                f"zip entry {record.name}: CRC-32 {crc:08x} does not match the recorded "
                f"{record.crc32:08x}; its bytes are damaged"
            )
    if unchecked:
        notes.append(
            f"{unchecked} record(s) carry no CRC (saved with CRC turned off): read, not checked"
        )
    return read


def _verify_folder(path: str, storage_options: Optional[dict[str, Any]]) -> VerifyResult:
    # One implementation: the manager's restore() accepts exactly what this passes.
    from ddpstate._manifest import verify_checkpoint

    found = verify_checkpoint(path, storage_options=storage_options)
    steps = ", ".join(str(s) for s in found.steps) or "none"
    return VerifyResult(
        path=found.path,
        format=formats.MANAGER,
        problems=found.problems,
        bytes_read=found.bytes_read,
        notes=(
            f"{found.files} file(s) of committed step(s) {steps} checked against their manifest",
            *found.notes,
        ),
    )
