"""Opening a checkpoint file down to its structure: headers and pickle only, never tensor data."""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import pickle
import struct
import zipfile
import zlib
from typing import IO, Any, NamedTuple, Optional

from ddpstate import formats
from ddpstate._layout.safetensors import parse_header, restore_extras
from ddpstate._layout.zip import (
    LOCAL,
    LOCAL_SIGNATURE,
    CentralEntry,
    ZipEnd,
    directory_span,
    parse_directory,
)
from ddpstate._streaming.pickle_rewrite import PickleLayout, walk
from ddpstate._streaming.pickle_scan import (
    DTYPE_ITEMSIZE,
    DTYPE_STORAGE,
    STORAGE_DTYPE,
    StorageRecord,
    StorageTypeRef,
    StorageView,
    TensorRecord,
    UnknownTorchTypeError,
    is_pickled_module,
    not_a_torch_type,
    opaque_name,
    scan_pickle,
)
from ddpstate._streaming.stream import Source
from ddpstate._streaming.torch_tables import TORCH_VERSION
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    UnsafeCheckpointError,
)
from ddpstate.formats import FormatName

_LEGACY_PROTOCOL = 1001


class ZipRecord(NamedTuple):
    """One zip entry: where its data starts and what the central directory says of it."""

    name: str
    header_offset: int
    data_offset: int
    size: int
    compressed_size: int
    crc32: int
    method: int


@dataclasses.dataclass(eq=False)
class Checkpoint:
    """A checkpoint read down to its structure; tensor data stays in the file.

    Attributes:
        path: The file.
        format: ``"pt"``, ``"pt_legacy"`` or ``"safetensors"`` (:mod:`ddpstate.formats`).
        size: File size in bytes.
        obj: The object tree with :class:`~ddpstate._streaming.pickle_scan.TensorRecord`
            placeholders (for safetensors: an OrderedDict of them).
        storages: Every storage the tree refers to, in first-use order.
        globals_used: Globals the pickle names.
        unsafe_globals: Those ``torch.load(weights_only=True)`` refuses.
        byteorder: Byte order of the tensor data (``"little"`` or ``"big"``).
        problems: What is wrong with the file's structure (missing records...).
        zip_records: The zip's entries by name (zip format only).
        zip_prefix: The archive's top folder, with its ``/``.
        st_metadata: The safetensors ``__metadata__`` minus ddpstate's own keys.
        pickle_bytes: ``data.pkl`` as stored (zip format only).
        pickle_layout: Where its strings lie, when it has torch.save's own shape
            (see :mod:`ddpstate._streaming.pickle_rewrite`); None otherwise.
        source: The open file; closed by :meth:`close`.
    """

    path: str
    format: FormatName
    size: int
    obj: Any
    storages: list[StorageRecord]
    globals_used: tuple[str, ...]
    unsafe_globals: tuple[str, ...]
    byteorder: str
    problems: list[str]
    source: Source
    zip_records: dict[str, ZipRecord] = dataclasses.field(default_factory=dict)
    zip_prefix: str = ""
    st_metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    pickle_bytes: bytes = b""
    pickle_layout: Optional[PickleLayout] = None

    def close(self) -> None:
        """Close the file."""
        self.source.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _corrupt(path: str, what: str, exc: Optional[BaseException] = None) -> CheckpointCorruptError:
    detail = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
    return CheckpointCorruptError(
        f"{path}: {what}{detail}; the file is damaged or truncated: re-save or re-download it"
    )


def _scan(
    file: IO[bytes], persistent: Any, path: str, what: str, *, memo_checked: bool = False
) -> Any:
    try:
        return scan_pickle(file, persistent, memo_checked=memo_checked)
    except CheckpointCorruptError:
        raise
    except UnknownTorchTypeError as exc:
        raise CheckpointFormatError(
            f"{path}: {exc}, which torch {TORCH_VERSION} (the torch ddpstate's tables come "
            f"from) does not have: it was written by a newer torch; upgrade ddpstate, or read "
            f"it with that torch's torch.load"
        ) from exc
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:  # fmt: skip
        raise _corrupt(path, f"{what} cannot be read", exc) from exc
    except MemoryError as exc:  # a structure claiming absurd sizes, not a real shortage
        raise _corrupt(path, f"{what} claims more memory than there is", exc) from exc


def _no_persistent(pid: Any) -> Any:
    raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("ascii")
    raise pickle.UnpicklingError(f"expected a string in a storage id, got {value!r}")


def _count(value: Any) -> int:
    if type(value) is int and value >= 0:
        return value
    raise pickle.UnpicklingError(f"expected a size >= 0 in a storage id, got {value!r}")


def _storage_type(value: Any, path: str) -> StorageTypeRef:
    if not isinstance(value, StorageTypeRef):
        error = not_a_torch_type(value, "storage class")
        if isinstance(error, UnknownTorchTypeError):
            raise error  # _scan names the newer torch
        raise _corrupt(path, f"a storage has type {value!r}, not a torch storage class")
    return value


def read_file(
    path: str,
    *,
    unsafe: bool = False,
    storage_options: Optional[dict[str, Any]] = None,
) -> Checkpoint:
    """Read a checkpoint file's structure: the zip directory and pickle, or the safetensors header.

    No tensor data is read and no code from the file runs: globals become
    placeholders. Structural problems (a missing tensor record, a size that
    does not match) are collected in ``Checkpoint.problems``. The file is
    opened once and its zip directory read once, by format detection.
    :func:`ddpstate._streaming.opener.read_checkpoint` also takes folders.

    Args:
        path: Local path or fsspec URL of a single checkpoint file.
        unsafe: Read pickles that name globals ``torch.load(weights_only=True)``
            refuses (they stay placeholders; nothing runs either way).
        storage_options: fsspec options for URLs.

    Returns:
        The open :class:`Checkpoint`; close it when done (or use ``with``).

    Raises:
        CheckpointNotFoundError: No such file.
        CheckpointFormatError: Not a checkpoint file, or a TorchScript archive.
        CheckpointCorruptError: The file is truncated or its structure damaged.
        UnsafeCheckpointError: The pickle names unsafe globals and ``unsafe`` is False.

    Example:
        >>> import torch, tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "m.pt")
        >>> torch.save({"module.w": torch.ones(2)}, p)
        >>> with read_file(p) as ckpt:
        ...     ckpt.format, list(ckpt.obj)
        ('pt', ['module.w'])
    """
    source = Source(path, storage_options)
    try:
        detected = formats.classify_file(source.file, source.size, path)
        kind = detected.format
        if kind == formats.TORCHSCRIPT:
            raise CheckpointFormatError(
                f"{path}: a TorchScript archive (torch.jit.save), not a torch.save checkpoint; "
                f"load it with torch.jit.load() and torch.save its .state_dict() to use "
                f"ddpstate on it"
            )
        if kind == formats.TORCH_ZIP:
            ckpt = _read_zip(source, path, detected)
        elif kind == formats.LEGACY:
            ckpt = _read_legacy(source, path)
        else:
            ckpt = _read_safetensors(source, path)
        if ckpt.unsafe_globals and not unsafe:
            raise UnsafeCheckpointError(_unsafe_message(ckpt), ckpt.unsafe_globals)
        return ckpt
    except BaseException:
        source.close()
        raise


def _unsafe_message(ckpt: Checkpoint) -> str:
    names = ", ".join(ckpt.unsafe_globals[:8])
    more = f" and {len(ckpt.unsafe_globals) - 8} more" if len(ckpt.unsafe_globals) > 8 else ""
    what = ""
    if is_pickled_module(ckpt.obj):
        what = f" (it is a pickled whole nn.Module, class {opaque_name(ckpt.obj)})"
    return (
        f"{ckpt.path}: its pickle names globals that torch.load(weights_only=True) refuses: "
        f"{names}{more}{what}; ddpstate never runs them, but reads such a file only when "
        f"told to: pass --unsafe (unsafe=True) if you trust where it came from"
    )


# --------------------------------------------------------------------------- torch zip


def _read_zip(source: Source, path: str, detected: formats.Detected) -> Checkpoint:
    records, problems, prefix = _zip_records(source, path, detected)
    pkl_bytes = zip_entry_bytes(source, records[prefix + "data.pkl"], path)
    byteorder = "little"
    if prefix + "byteorder" in records:
        byteorder = zip_entry_bytes(source, records[prefix + "byteorder"], path).decode(
            "ascii", "replace"
        )
        if byteorder not in ("little", "big"):
            raise _corrupt(path, f"its byteorder record says {byteorder!r}")
    storages = _ZipStorages(records, prefix, path, problems)
    # One walk over the opcodes: it checks the memo indexes (so the scan skips its
    # own walk) and, when the pickle has torch.save's shape, lets convert copy it
    # through instead of re-emitting it.
    layout = walk(pkl_bytes)
    result = _scan(
        io.BytesIO(pkl_bytes), storages, path, "data.pkl", memo_checked=layout is not None
    )
    return Checkpoint(
        path=path,
        format=formats.TORCH_ZIP,
        size=source.size,
        obj=result.obj,
        storages=list(storages.found.values()),
        globals_used=result.globals_used,
        unsafe_globals=result.unsafe_globals,
        byteorder=byteorder,
        problems=problems,
        source=source,
        zip_records=records,
        zip_prefix=prefix,
        pickle_bytes=pkl_bytes,
        pickle_layout=layout,
    )


def _zip_records(
    source: Source, path: str, detected: formats.Detected
) -> tuple[dict[str, ZipRecord], list[str], str]:
    """The zip's entries by name, checked against their local headers: ``(records, problems,
    archive folder)``."""
    end = detected.zip_end
    assert end is not None  # classify_file read it, as it does for every zip
    try:
        # The directory format detection read, parsed once (as zipfile would parse it).
        entries = parse_directory(detected.zip_directory, end, source.read_upto)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as exc:
        raise _corrupt(path, "the zip directory cannot be read", exc) from exc
    records: dict[str, ZipRecord] = {}
    problems: list[str] = []
    for entry, header in zip(entries, _local_headers(source, entries), strict=True):
        # The local header and, right after it, the name.
        fields = LOCAL.unpack(header[: LOCAL.size])
        if fields[0] != LOCAL_SIGNATURE:
            problems.append(f"zip entry {entry.name}: local header is damaged")
            continue
        if fields[9] != len(entry.raw_name) or header[LOCAL.size :] != entry.raw_name:
            problems.append(
                f"zip entry {entry.name} has another name in its local header; the names differ"
            )
        data_offset = entry.header_offset + LOCAL.size + fields[9] + fields[10]
        # Positional: this runs once per tensor.
        records[entry.name] = ZipRecord(
            entry.name,
            entry.header_offset,
            data_offset,
            entry.size,
            entry.compressed_size,
            entry.crc32,
            entry.method,
        )
        if data_offset + entry.compressed_size > source.size:
            problems.append(
                f"zip entry {entry.name} runs to byte {data_offset + entry.compressed_size} "
                f"but the file ends at {source.size}"
            )
    pickles = sorted((n for n in records if n.endswith("data.pkl")), key=len)
    if not pickles:
        raise CheckpointFormatError(f"{path}: a zip archive without data.pkl")
    prefix = pickles[0][: -len("data.pkl")]
    problems.extend(_zip_header_problems(end, detected.zip_directory, entries, prefix))
    return records, problems, prefix


# Local headers closer together than this are read in one piece.
_HEADER_GAP = 1 << 20


def _local_headers(source: Source, entries: list[CentralEntry]) -> list[bytes]:
    """Each entry's local header and name; neighbours within 1 MiB read in one piece.

    A checkpoint with 100,000 small tensors has 100,000 local headers a few KiB
    apart: one read per MiB instead of one per header (and, unlike a read-ahead
    window, nothing read across the data of large records). A header the piece
    does not hold whole (a truncated file) is read on its own, failing as before.
    """
    spans = sorted(
        (e.header_offset, LOCAL.size + len(e.raw_name), i) for i, e in enumerate(entries)
    )
    headers = [b""] * len(entries)
    start = 0
    while start < len(spans):
        first, stop = spans[start][0], start
        while stop < len(spans) and spans[stop][0] - first <= _HEADER_GAP:
            stop += 1
        end = max(offset + length for offset, length, _ in spans[start:stop])
        piece = source.read_upto(first, end - first) if first >= 0 else b""
        for offset, length, i in spans[start:stop]:
            header = piece[offset - first : offset - first + length]
            whole = first >= 0 and len(header) == length
            headers[i] = header if whole else source.read_at(offset, length)
        start = stop
    return headers


@dataclasses.dataclass
class _ZipStorages:
    """The ``persistent_load`` of a zip's ``data.pkl``: one storage record per key.

    Attributes:
        records: The zip's entries by name.
        prefix: The archive folder.
        path: The file, for messages.
        problems: Where a missing or mis-sized data record is noted.
        found: The storages, by key, in first-use order.
    """

    records: dict[str, ZipRecord]
    prefix: str
    path: str
    problems: list[str]
    found: dict[str, StorageRecord] = dataclasses.field(default_factory=dict)

    def __call__(self, pid: Any) -> StorageRecord:
        # Once per storage (100,000 calls for as many tensors): the checks of _text,
        # _count and _storage_type inlined for the types torch.save writes, those
        # helpers called (to convert or refuse) for any other.
        if not isinstance(pid, tuple) or len(pid) != 5:
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        tag, storage_type, key, location, numel = pid
        if tag != "storage" and _text(tag) != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        if type(storage_type) is not StorageTypeRef:
            storage_type = _storage_type(storage_type, self.path)
        if type(key) is not str:
            key = _text(key)
        found = self.found.get(key)
        if found is not None:
            return found
        if type(location) is not str:
            location = _text(location)
        if type(numel) is not int or numel < 0:
            numel = _count(numel)
        name = f"{self.prefix}data/{key}"
        entry = self.records.get(name)
        if entry is None:
            record = StorageRecord(
                key, storage_type.name, storage_type.dtype, location, numel, record_name=name
            )
            self.problems.append(f"tensor data record data/{key} is missing")
        else:
            # Positional, in field order; the zip entry's own name object: one string,
            # not two, per storage.
            record = StorageRecord(
                key,
                storage_type.name,
                storage_type.dtype,
                location,
                numel,
                entry.data_offset,
                entry.size,
                entry.crc32,
                entry.method != zipfile.ZIP_STORED,
                entry.name,
            )
            if entry.size != record.nbytes:
                self.problems.append(
                    f"tensor data record data/{key} holds {entry.size} bytes, "
                    f"its storage needs {record.nbytes}"
                )
        self.found[key] = record
        return record


def _zip_header_problems(
    end: ZipEnd, directory: bytes, entries: list[CentralEntry], prefix: str
) -> list[str]:
    """Damage in zip metadata that Python's zipfile tolerates but torch.load refuses.

    No CRC covers these fields, so without this check ``verify`` would pass a file
    torch cannot open: an entry marked encrypted or on another disk, a stored entry
    whose two sizes differ, a directory name that differs from its local header or
    lies outside the archive folder, and inconsistent end-of-directory records.
    """
    problems: list[str] = []
    for entry in entries:
        name = entry.name
        if entry.flags & ~0x80E:  # only data descriptor, deflate options and UTF-8
            problems.append(
                f"zip entry {name} asks for zip features torch cannot read (encryption, "
                f"patched data: flags {entry.flags:#06x})"
            )
        if entry.disk != 0:
            problems.append(f"zip entry {name} claims to start on disk {entry.disk}")
        if entry.method == zipfile.ZIP_STORED and entry.compressed_size != entry.size:
            problems.append(
                f"zip entry {name} is stored with {entry.compressed_size} bytes but claims "
                f"{entry.size}"
            )
        if not name.startswith(prefix):
            problems.append(f"zip entry {name} lies outside the archive folder {prefix}")
    problems.extend(end.problems)
    if (end.disk, end.cd_disk) != (0, 0):
        problems.append(f"the end-of-directory record names disks {end.disk}/{end.cd_disk}, not 0")
    if not end.on_disk == end.total == len(entries):
        problems.append(
            f"the end-of-directory record counts {end.on_disk}/{end.total} entries; there are "
            f"{len(entries)}"
        )
    cd_size, cd_offset, cd_end = end.cd_size, end.cd_offset, end.cd_end
    # The directory as its own length fields lay it out (zipfile silently
    # truncates a name or extra field whose length runs past the directory).
    listed, count = directory_span(directory)
    if cd_offset + cd_size != cd_end or listed != cd_size or count != len(entries):
        problems.append(
            f"the directory's recorded place and size ({cd_size} bytes at {cd_offset}) do not "
            f"match its {count} entries ({listed} bytes) ending at byte {cd_end}"
        )
    return problems


def zip_entry_bytes(source: Source, record: ZipRecord, path: str) -> bytes:
    """The bytes of one zip entry; a compressed one is inflated (and its CRC-32 checked).

    Raises:
        CheckpointCorruptError: The entry cannot be read or inflated.
    """
    if record.method == zipfile.ZIP_STORED:
        return source.read_at(record.data_offset, record.size)
    try:
        if record.method != zipfile.ZIP_DEFLATED:
            with zipfile.ZipFile(source.file) as archive:
                return archive.read(record.name)
        # Inflated from the offset the directory walk found: no second ZipFile
        # (and its directory parse) per entry.
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        data = inflater.decompress(source.read_at(record.data_offset, record.compressed_size))
        data += inflater.flush()
        # The messages zipfile gives for the same damage.
        if not inflater.eof:
            raise EOFError("Compressed file ended before the end-of-stream marker was reached")
        if len(data) != record.size or zlib.crc32(data) != record.crc32:
            raise zipfile.BadZipFile(f"Bad CRC-32 for file {record.name!r}")
        return data
    except (
        zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, zlib.error
    ) as exc:  # fmt: skip
        raise _corrupt(path, f"zip entry {record.name} cannot be read", exc) from exc


# --------------------------------------------------------------------------- legacy


def _read_legacy(source: Source, path: str) -> Checkpoint:
    file = source.file
    little = _legacy_header(file, path)
    storages = _LegacyStorages(path)
    result = _scan(file, storages, path, "the pickled object")
    keys = _scan(file, _no_persistent, path, "the storage list").obj
    if not isinstance(keys, list):
        raise _corrupt(path, "the storage list is not a list")
    ordered, problems = _legacy_data(source, file.tell(), keys, storages.found, little)
    return Checkpoint(
        path=path,
        format=formats.LEGACY,
        size=source.size,
        obj=result.obj,
        storages=ordered,
        globals_used=result.globals_used,
        unsafe_globals=result.unsafe_globals,
        byteorder="little" if little else "big",
        problems=problems,
        source=source,
    )


def _legacy_header(file: IO[bytes], path: str) -> bool:
    """Read the magic number, protocol version and system info; True for little-endian data."""
    file.seek(0)
    magic = _scan(file, _no_persistent, path, "the magic number").obj
    version = _scan(file, _no_persistent, path, "the protocol version").obj
    if magic != formats.LEGACY_MAGIC or version != _LEGACY_PROTOCOL:
        raise CheckpointFormatError(
            f"{path}: starts like a legacy torch file but has magic {magic!r} / protocol "
            f"{version!r}; it is not a format ddpstate reads"
        )
    sys_info = _scan(file, _no_persistent, path, "the system info").obj
    return not isinstance(sys_info, dict) or bool(sys_info.get("little_endian", True))


@dataclasses.dataclass
class _LegacyStorages:
    """The ``persistent_load`` of a legacy pickle: storages (or views of them) and modules."""

    path: str  # the file, for messages
    found: dict[str, StorageRecord] = dataclasses.field(default_factory=dict)

    def __call__(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or not pid:
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        kind = _text(pid[0])
        if kind == "module" and len(pid) >= 2:
            return pid[1]  # the pickled module's class placeholder
        if kind != "storage" or len(pid) != 6:
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        storage_type = _storage_type(pid[1], self.path)
        key = _text(pid[2])
        record = self.found.get(key)
        if record is None:
            record = StorageRecord(
                key=key,
                type_name=storage_type.name,
                dtype=storage_type.dtype,
                location=_text(pid[3]),
                numel=_count(pid[4]),
            )
            self.found[key] = record
        view = pid[5]
        if view is not None:
            if not isinstance(view, tuple) or len(view) != 3:
                raise pickle.UnpicklingError(f"unexpected storage view {view!r}")
            return StorageView(record, _count(view[1]), _count(view[2]))
        return record


def _legacy_data(
    source: Source, offset: int, keys: list[Any], storages: dict[str, StorageRecord], little: bool
) -> tuple[list[StorageRecord], list[str]]:
    """Place each storage's data, which follows the pickles as (element count, bytes) in
    ``keys`` order: ``(storages in file order, problems)``."""
    problems: list[str] = []
    ordered: list[StorageRecord] = []
    for raw_key in keys:
        key = _text(raw_key)
        record = storages.get(key)
        if record is None:
            problems.append(f"storage {key} has data but nothing refers to it")
            break
        if offset + 8 > source.size:
            problems.append(f"storage {key} is missing: the file ends at byte {source.size}")
            break
        (numel,) = struct.unpack("<q" if little else ">q", source.read_at(offset, 8))
        if numel < 0:
            problems.append(f"storage {key} claims {numel} elements")
            break
        record.data_offset = offset + 8
        record.stored_size = numel * record.itemsize
        if numel != record.numel:
            problems.append(f"storage {key} holds {numel} elements, the pickle says {record.numel}")
        offset = record.data_offset + record.stored_size
        if offset > source.size:
            problems.append(
                f"storage {key} runs to byte {offset} but the file ends at {source.size}"
            )
        ordered.append(record)
    missing = [k for k, r in storages.items() if r.data_offset < 0]
    if missing and not problems:
        problems.append(f"storages {', '.join(missing[:5])} have no data in the file")
    if not problems and offset < source.size:
        problems.append(f"{source.size - offset} unexpected bytes after the last storage")
    ordered.extend(r for r in storages.values() if r.data_offset < 0)
    return ordered, problems


# --------------------------------------------------------------------------- safetensors


def _read_safetensors(source: Source, path: str) -> Checkpoint:
    header = parse_header(source.read_at, source.size, path)
    problems = list(header.problems)
    state_dict: collections.OrderedDict[str, Any] = collections.OrderedDict()
    storages: list[StorageRecord] = []
    for key, entry in header.entries.items():
        start, stored = header.data_start + entry.begin, max(entry.end - entry.begin, 0)
        state_dict[key] = contiguous_tensor(key, entry.dtype, entry.shape, start, stored)
        storages.append(state_dict[key].storage)
    problems += restore_extras(state_dict, header.metadata)
    return Checkpoint(
        path=path,
        format=formats.SAFETENSORS,
        size=source.size,
        obj=state_dict,
        storages=storages,
        globals_used=(),
        unsafe_globals=(),
        byteorder="little",
        problems=problems,
        source=source,
        st_metadata={k: v for k, v in header.metadata.items() if not k.startswith("ddpstate.")},
    )


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a C-contiguous tensor of ``shape`` (as ``torch.empty(shape).stride()``)."""
    return tuple(math.prod(max(n, 1) for n in shape[i + 1 :]) for i in range(len(shape)))


def contiguous_tensor(
    key: str, dtype: str, shape: tuple[int, ...], data_offset: int = -1, stored_size: int = -1
) -> TensorRecord:
    """A C-contiguous tensor filling a storage of its own (``key``), as torch.save writes one.

    Example:
        >>> tensor = contiguous_tensor("0", "bfloat16", (2, 3))
        >>> tensor.stride, tensor.storage.type_name
        ((3, 1), 'BFloat16Storage')
    """
    typed = dtype in DTYPE_STORAGE  # else an untyped storage, counting bytes
    type_name = DTYPE_STORAGE[dtype] if typed else "UntypedStorage"
    storage_dtype = dtype if typed else STORAGE_DTYPE["UntypedStorage"]
    numel = math.prod(shape) * (1 if typed else DTYPE_ITEMSIZE[dtype])
    storage = StorageRecord(key, type_name, storage_dtype, "cpu", numel, data_offset, stored_size)
    strides = contiguous_strides(shape)
    return TensorRecord(storage, 0, shape, strides, dtype, rebuild="v2" if typed else "v3")


__all__ = [
    "Checkpoint",
    "ZipRecord",
    "contiguous_tensor",
    "read_file",
    "zip_entry_bytes",
]
