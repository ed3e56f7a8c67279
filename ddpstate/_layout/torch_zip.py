"""torch.save's zip container checked with the standard library's ``zipfile`` before torch reads it.

torch's own reader (miniz) does not check what an attacker arranges in the container:
a second ``data.pkl`` (which copy wins depends on the entry count), two directory
entries sharing one local header, names outside the archive folder, deflated records
(a zip bomb). This module refuses all of them on the same bytes torch then reads, so
what ddpstate shows, checks and copies is exactly what ``torch.load`` acts on.
Torch-free.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import struct
import zipfile
from collections.abc import Callable
from typing import IO, NamedTuple, Optional, cast

from ddpstate._crc import crc32_alongside
from ddpstate.errors import CheckpointCorruptError

__all__ = ["ZIP_ERRORS", "Record", "TorchZip", "check_crcs", "read_torch_zip"]

# The local file header: signature, versions and flags, sizes, name and extra lengths.
_LOCAL = struct.Struct("<4s2B4HL2L2H")
_LOCAL_SIGNATURE = b"PK\x03\x04"
# The end of central directory record, the zip64 locator and the zip64 end record.
_END = struct.Struct("<4s4H2LH")
_END_SIGNATURE = b"PK\x05\x06"
_LOCATOR = struct.Struct("<4sLQL")
_LOCATOR_SIGNATURE = b"PK\x06\x07"
_END64 = struct.Struct("<4sQ2H2L4Q")
# The records every torch.save archive holds; torch.load refuses a file without them.
_REQUIRED = ("data.pkl", "version")
# torch.save writes records at most one folder below the archive folder.
_SUBFOLDERS = ("data", ".data")
# Path parts that name no record (an empty part is a doubled or leading slash).
_NOT_NAMES = frozenset(("", ".", ".."))
#: What ``zipfile`` raises for a zip directory it cannot read (damaged, truncated, crafted).
ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    OSError,
    ValueError,
    EOFError,
    NotImplementedError,
)
# Records are CRC-32'd in reads of this size (one buffer, reused).
_CRC_BUFFER = 16 << 20


class Record(NamedTuple):
    """One record of the archive: its name and where its bytes lie.

    A named tuple, not a dataclass: an archive of 25,000 tensors makes 25,000 of
    them on every load, and a frozen dataclass costs several times as much to build.

    Attributes:
        name: The name inside the archive folder (``data.pkl``, ``data/0``).
        offset: Where its data starts in the file.
        size: Its length (stored, never compressed).
        crc32: The CRC-32 the central directory records.
    """

    name: str
    offset: int
    size: int
    crc32: int


@dataclasses.dataclass(frozen=True)
class TorchZip:
    """A torch.save archive whose container passed :func:`read_torch_zip`.

    Attributes:
        folder: The archive folder, without its ``/``.
        records: Every record by its name inside the folder, in file order.
    """

    folder: str
    records: dict[str, Record]


def _refuse(path: str, record: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{path}: zip record {record!r} {what}; torch.save never writes such an archive, so "
        f"the file is damaged or was crafted: re-save it from the original, or re-download it"
    )


def _split(path: str, name: str) -> tuple[str, str]:
    """``(archive folder, name inside it)``, refusing any name torch.save would not write."""
    if "\\" in name or name.startswith("/") or "/" not in name:
        raise _refuse(path, name, "is not inside one archive folder")
    folder, _, rest = name.partition("/")
    # `rest` is a name, or one of _SUBFOLDERS, a slash and a name (partitions, not a
    # generator: this runs once per record).
    sub, slash, leaf = rest.rpartition("/")
    if folder in _NOT_NAMES or leaf in _NOT_NAMES or (slash and sub not in _SUBFOLDERS):
        raise _refuse(path, name, "has a path torch.save does not write")
    return folder, rest


def _local_offset(file: IO[bytes], path: str, info: zipfile.ZipInfo) -> int:
    """Where a record's data starts, from its local header, checked against the directory."""
    file.seek(info.header_offset)
    # One read for the header and the name (at most 4 bytes a character in UTF-8): a
    # read per record is what an archive of 25,000 tensors pays on every load.
    head = file.read(_LOCAL.size + 4 * len(info.orig_filename))
    if len(head) < _LOCAL.size or not head.startswith(_LOCAL_SIGNATURE):
        raise _refuse(path, info.filename, "has no local header where the directory says")
    name_len, extra_len = (int(n) for n in _LOCAL.unpack_from(head)[-2:])
    raw = head[_LOCAL.size : _LOCAL.size + name_len]
    if len(raw) < name_len:  # a longer name than the directory's: read the rest
        raw += file.read(name_len - len(raw))
    # zipfile decodes a name as UTF-8 when flag bit 11 says so, else as code page 437.
    name = raw.decode("utf-8" if info.flag_bits & 0x800 else "cp437", errors="replace")
    if name != info.orig_filename:
        raise _refuse(path, info.filename, f"is named {name[:80]!r} in its local header")
    return info.header_offset + _LOCAL.size + name_len + extra_len


def _check_end(file: IO[bytes], size: int, path: str, entries: int) -> None:
    """Refuse a central directory that does not end where the end record starts.

    ``zipfile`` reads the directory just before the end record (taking any gap for
    data prepended to the archive) and the zip64 end record just before its locator;
    torch's reader takes both at the offsets the records state. When the two differ,
    each reader sees a different archive in the same bytes.
    """
    tail_start = max(0, size - _END.size - 0xFFFF)
    file.seek(tail_start)
    tail = file.read()
    # zipfile's own choice: an end record with no comment at the very end, else the last
    # signature (whose bytes may also occur inside a no-comment record's offsets).
    last = tail[-_END.size :]
    plain = last.startswith(_END_SIGNATURE) and last.endswith(b"\0\0")
    at = size - _END.size if plain else tail_start + tail.rfind(_END_SIGNATURE)
    fields = _END.unpack(tail[at - tail_start : at - tail_start + _END.size])
    count, dir_size, dir_offset, end = fields[4], fields[5], fields[6], at
    file.seek(max(0, at - _LOCATOR.size))
    locator = file.read(_LOCATOR.size)
    if at >= _LOCATOR.size and locator.startswith(_LOCATOR_SIGNATURE):
        end = at - _LOCATOR.size - _END64.size
        file.seek(end)
        record = file.read(_END64.size)
        if _LOCATOR.unpack(locator)[2] != end or not record.startswith(b"PK\x06\x06"):
            raise _refuse(path, "zip64 end record", "is not where its locator says")
        count, dir_size, dir_offset = _END64.unpack(record)[-3:]
    if dir_offset + dir_size != end or count != entries:
        raise _refuse(
            path,
            "central directory",
            f"of {count} entries at offset {dir_offset} does not end at the end record "
            f"(offset {end}, {entries} entries read): a second archive or prepended data",
        )


def read_torch_zip(file: IO[bytes], size: int, path: str) -> TorchZip:
    """Check a torch.save zip's container and list its records, before torch reads it.

    Refused: a name twice in the central directory (ignoring ASCII case, as torch
    does), two entries sharing a local header, a local header naming another record,
    more than one archive folder,
    names outside it or deeper than torch.save writes, a missing ``version`` or
    ``data.pkl``, a compressed or encrypted record, a record reaching past the end
    of the file or into another, a central directory that does not end where the
    end record starts (a second archive, or data before the archive).

    Args:
        file: The file, readable and seekable.
        size: Its size in bytes.
        path: The file, for messages.

    Returns:
        The :class:`TorchZip`.

    Raises:
        CheckpointCorruptError: Any of the above, naming the file and the record.

    Example:
        >>> import io, torch
        >>> buf = io.BytesIO()
        >>> torch.save({"w": torch.ones(2)}, buf)
        >>> sorted(read_torch_zip(buf, len(buf.getvalue()), "m.pt").records)[:2]
        ['.data/serialization_id', '.format_version']
    """
    try:
        infos = zipfile.ZipFile(file).infolist()
    except ZIP_ERRORS as exc:
        raise CheckpointCorruptError(
            f"{path}: its zip directory cannot be read ({type(exc).__name__}: {exc}); the file "
            f"is truncated or damaged: re-save or re-download it"
        ) from exc
    _check_end(file, size, path, len(infos))
    folders: set[str] = set()
    records: dict[str, Record] = {}
    headers: set[int] = set()
    seen: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    for info in infos:
        folder, name = _split(path, info.filename)
        folders.add(folder)
        if len(folders) > 1:
            raise _refuse(path, info.filename, f"lies outside the archive folder {folder!r}")
        # torch's reader finds records ignoring ASCII case: DATA.PKL is data.pkl to it.
        if name.lower() in seen:
            raise _refuse(path, info.filename, "appears twice in the central directory")
        seen.add(name.lower())
        if info.header_offset in headers:
            raise _refuse(path, info.filename, "shares its local header with another record")
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
            raise _refuse(path, info.filename, "is compressed or encrypted")
        headers.add(info.header_offset)
        start = _local_offset(file, path, info)
        if start + info.compress_size > size:
            raise _refuse(path, info.filename, f"reaches past the end of the {size}-byte file")
        spans.append((info.header_offset, start + info.compress_size, info.filename))
        records[name] = Record(name, start, info.file_size, info.CRC)
    spans.sort()
    for (_, end, name), (nxt, _, other) in itertools.pairwise(spans):
        if end > nxt:
            raise _refuse(path, name, f"overlaps record {other!r}")
    missing = [r for r in _REQUIRED if r not in records]
    if missing:
        raise _refuse(path, f"{next(iter(folders), 'archive')}/{missing[0]}", "is missing")
    return TorchZip(folders.pop(), dict(sorted(records.items(), key=lambda r: r[1].offset)))


def check_crcs(
    file: IO[bytes], archive: TorchZip, progress: Optional[Callable[[int], object]] = None
) -> tuple[list[str], int]:
    """Read every record and compare its CRC-32 with the central directory's.

    Args:
        file: The file, readable and seekable.
        archive: What :func:`read_torch_zip` found in it.
        progress: Called with each read's length.

    Returns:
        ``(a line per record whose bytes differ, records written with no CRC)``:
        torch can save with its CRC computation turned off (CRC 0).

    Example:
        >>> import io, torch
        >>> buf = io.BytesIO()
        >>> torch.save({"w": torch.ones(2)}, buf)
        >>> check_crcs(buf, read_torch_zip(buf, len(buf.getvalue()), "m.pt"))
        ([], 0)
    """
    problems: list[str] = []
    unchecked = 0
    buffer = memoryview(
        bytearray(min(_CRC_BUFFER, max((r.size for r in archive.records.values()), default=0)))
    )
    reader = cast(io.BufferedIOBase, file)  # every binary file object has readinto
    for record in archive.records.values():
        file.seek(record.offset)
        crc = done = 0
        while done < record.size:
            view = buffer[: min(buffer.nbytes, record.size - done)]
            moved, crc = crc32_alongside(view, lambda at, piece: reader.readinto(piece) or 0, crc)
            done += moved
            if progress is not None:
                progress(moved)
            if moved < view.nbytes:
                break
        if record.crc32 == 0 and record.size and crc != 0:
            unchecked += 1
        elif done < record.size or crc != record.crc32:
            problems.append(
                f"zip record {archive.folder}/{record.name}: CRC-32 {crc:08x} does not match the "
                f"recorded {record.crc32:08x}; its bytes are damaged"
            )
    return problems, unchecked
