"""The zip byte layout torch.save archives use: record signatures, structs, sizes, end records.

Format detection (``ddpstate.formats``), the streaming reader and the streaming
zip writer all speak zip; this module says once what the bytes look like
(APPNOTE.TXT, the PKWARE zip specification), torch-free, so the three agree.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import zipfile
from collections.abc import Callable
from typing import NamedTuple, Optional

from ddpstate.errors import CheckpointCorruptError

#: Record signatures, as the little-endian integers the structs below pack.
LOCAL_SIGNATURE = 0x04034B50
CENTRAL_SIGNATURE = 0x02014B50
EOCD_SIGNATURE = 0x06054B50
EOCD64_SIGNATURE = 0x06064B50
EOCD64_LOCATOR_SIGNATURE = 0x07064B50
DESCRIPTOR_SIGNATURE = 0x08074B50
#: The same signatures as the bytes a file holds (``b"PK\x03\x04"``...), for searches.
LOCAL_MAGIC = LOCAL_SIGNATURE.to_bytes(4, "little")
CENTRAL_MAGIC = CENTRAL_SIGNATURE.to_bytes(4, "little")
EOCD_MAGIC = EOCD_SIGNATURE.to_bytes(4, "little")
EOCD64_MAGIC = EOCD64_SIGNATURE.to_bytes(4, "little")
EOCD64_LOCATOR_MAGIC = EOCD64_LOCATOR_SIGNATURE.to_bytes(4, "little")

#: Local file header (30 bytes): signature, version needed, flags, method, time,
#: date, CRC-32, compressed size, size, name length, extra length.
LOCAL = struct.Struct("<IHHHHHIIIHH")
#: Central directory entry (46 bytes): signature, version made by, version needed,
#: flags, method, time, date, CRC-32, compressed size, size, name length, extra
#: length, comment length, disk, internal attributes, external attributes, offset.
CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
#: End of central directory (22 bytes): signature, disk, directory's disk, entries
#: on this disk, entries, directory size, directory offset, comment length.
EOCD = struct.Struct("<IHHHHIIH")
#: Zip64 end of central directory (56 bytes): signature, record size, version made
#: by, version needed, disk, directory's disk, entries on this disk, entries,
#: directory size, directory offset.
EOCD64 = struct.Struct("<IQHHIIQQQQ")
#: Zip64 end locator (20 bytes): signature, disk of the zip64 record, its offset, disks.
EOCD64_LOCATOR = struct.Struct("<IIQI")
#: Data descriptor after a record's data: signature, CRC-32, compressed size, size.
DESCRIPTOR = struct.Struct("<IIII")
#: The zip64 data descriptor (64-bit sizes).
DESCRIPTOR64 = struct.Struct("<IIQQ")
#: Header ID of the zip64 extended information extra field.
ZIP64_EXTRA_ID = 0x0001
#: A 16-bit or 32-bit field at this value means "see the zip64 record".
U16_MAX = 0xFFFF
U32_MAX = 0xFFFFFFFF
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
#: The longest archive comment, so the end record lies within the last
#: ``EOCD.size + MAX_COMMENT`` bytes.
MAX_COMMENT = 0xFFFF


def truncated_zip(name: str, detail: str) -> CheckpointCorruptError:
    """The error for a file that starts like a zip but whose directory cannot be read."""
    return CheckpointCorruptError(
        f"{name}: starts like a torch.save zip archive but its directory cannot be read "
        f"({detail}), so the file is truncated or damaged: re-save or re-download it"
    )


@dataclasses.dataclass(frozen=True)
class ZipfileView:
    """Where Python's zipfile looks for the central directory (torch's reader differs).

    zipfile takes the directory's size and offset from the classic end record,
    or from a zip64 record right before a locator right before it (not where
    the locator points), and shifts every entry by how far the directory's
    actual place is from the recorded one (an archive appended to other data).

    Attributes:
        start: Where zipfile reads the directory.
        size: How many bytes it reads.
        concat: The shift it adds to every entry's header offset.
        error: The message zipfile refuses the archive with; empty when it reads it.
    """

    start: int
    size: int
    concat: int
    error: str = ""


@dataclasses.dataclass(frozen=True)
class ZipEnd:
    """What a zip archive's end records say about its central directory.

    Attributes:
        disk: Number of this disk (0 in a single-file archive).
        cd_disk: Disk where the directory starts (0).
        on_disk: Entries on this disk.
        total: Entries in all.
        cd_size: Bytes of the directory.
        cd_offset: Where the directory starts.
        cd_end: Where it must end: the zip64 end record, or the classic one.
        problems: Damage to the zip64 locator that still leaves the classic
            record usable.
        zipfile_view: Where Python's zipfile would read the directory (see
            :func:`parse_directory`); by default, where these records say.
    """

    disk: int
    cd_disk: int
    on_disk: int
    total: int
    cd_size: int
    cd_offset: int
    cd_end: int
    problems: tuple[str, ...]
    zipfile_view: Optional[ZipfileView] = None


def _zipfile_view(
    read_at: Callable[[int, int], bytes], eocd_at: int, cd_size: int, cd_offset: int
) -> ZipfileView:
    # As zipfile's _EndRecData64 and _RealGetContents do, from the classic
    # record's figures (cd_size, cd_offset) and its place (eocd_at).
    shift = 0
    if eocd_at >= EOCD64_LOCATOR.size:
        locator = read_at(eocd_at - EOCD64_LOCATOR.size, EOCD64_LOCATOR.size)
        if len(locator) == EOCD64_LOCATOR.size and locator[:4] == EOCD64_LOCATOR_MAGIC:
            _, disk, _, disks = EOCD64_LOCATOR.unpack(locator)
            if disk != 0 or disks > 1:
                return ZipfileView(0, 0, 0, "zipfiles that span multiple disks are not supported")
            record_at = eocd_at - EOCD64_LOCATOR.size - EOCD64.size
            if record_at < 0:
                return ZipfileView(0, 0, 0, "File is not a zip file")
            record = read_at(record_at, EOCD64.size)
            if len(record) == EOCD64.size and record[:4] == EOCD64_MAGIC:
                cd_size, cd_offset = EOCD64.unpack(record)[8:10]
                shift = EOCD64.size + EOCD64_LOCATOR.size
    concat = eocd_at - cd_size - cd_offset - shift
    if cd_offset + concat < 0:
        return ZipfileView(0, 0, 0, "Bad offset for central directory")
    return ZipfileView(cd_offset + concat, cd_size, concat)


def read_zip_end(read_at: Callable[[int, int], bytes], size: int, name: str) -> ZipEnd:
    """Find and parse a zip archive's end-of-directory records (zip64 included).

    Args:
        read_at: ``read_at(offset, length)`` returns up to ``length`` bytes of the file.
        size: The file's size.
        name: The file, for messages.

    Returns:
        The :class:`ZipEnd`.

    Raises:
        CheckpointCorruptError: No end record, or a zip64 one that the classic
            record needs but that is missing or damaged.

    Example:
        >>> raw = EOCD.pack(EOCD_SIGNATURE, 0, 0, 0, 0, 0, 0, 0)
        >>> read_zip_end(lambda o, n: raw[o : o + n], len(raw), "empty.zip").total
        0
    """
    tail_len = min(size, EOCD.size + MAX_COMMENT + EOCD64_LOCATOR.size)
    tail_at = size - tail_len
    tail = read_at(tail_at, tail_len)
    at = tail.rfind(EOCD_MAGIC)
    if at < 0 or at + EOCD.size > len(tail):
        raise truncated_zip(name, "no end-of-directory record")
    fields: tuple[int, ...] = EOCD.unpack_from(tail, at)[1:7]
    cd_end = tail_at + at
    view = _zipfile_view(read_at, cd_end, fields[4], fields[5])
    problems: list[str] = []
    needs_zip64 = U32_MAX in fields[4:] or U16_MAX in fields[:4]
    locator = at - EOCD64_LOCATOR.size
    if locator >= 0 and tail[locator : locator + 4] == EOCD64_LOCATOR_MAGIC:
        _, cd_disk64, record_at, disks = EOCD64_LOCATOR.unpack_from(tail, locator)
        if cd_disk64 != 0 or disks != 1:
            problems.append(f"the zip64 locator names disk {cd_disk64} of {disks}, not 0 of 1")
        record = read_at(record_at, EOCD64.size) if 0 <= record_at <= size - EOCD64.size else b""
        if record[:4] == EOCD64_MAGIC:
            fields = EOCD64.unpack_from(record)[4:10]
            cd_end = record_at
        elif needs_zip64:
            raise truncated_zip(name, "no zip64 end-of-directory record")
        else:
            problems.append(f"the zip64 locator points to byte {record_at}, not its record")
    elif needs_zip64:
        raise truncated_zip(name, "no zip64 end-of-directory locator")
    disk, cd_disk, on_disk, total, cd_size, cd_offset = (int(v) for v in fields)
    return ZipEnd(disk, cd_disk, on_disk, total, cd_size, cd_offset, cd_end, tuple(problems), view)


def read_directory(
    read_at: Callable[[int, int], bytes], size: int, name: str
) -> tuple[ZipEnd, bytes]:
    """The end records and the raw central directory of a zip archive, in two reads.

    No per-entry objects: ``zipfile.ZipFile`` builds a ZipInfo per entry, ~10 us
    each, 1 % of loading a checkpoint of 100,000 tensors, for questions a
    substring search answers.

    Args:
        read_at: ``read_at(offset, length)`` returns up to ``length`` bytes of the file.
        size: The file's size.
        name: The file, for messages.

    Returns:
        ``(end, directory)``: the :class:`ZipEnd` and the directory's bytes.

    Raises:
        CheckpointCorruptError: The end records or the directory cannot be read
            (see :func:`truncated_zip`).

    Example:
        >>> raw = EOCD.pack(EOCD_SIGNATURE, 0, 0, 0, 0, 0, 0, 0)
        >>> read_directory(lambda o, n: raw[o : o + n], len(raw), "empty.zip")[1]
        b''
    """
    end = read_zip_end(read_at, size, name)
    if end.cd_offset + end.cd_size > size:
        raise truncated_zip(
            name, f"the directory claims bytes {end.cd_offset}..{end.cd_offset + end.cd_size}"
        )
    directory = read_at(end.cd_offset, end.cd_size)
    if len(directory) != end.cd_size or (end.cd_size and not directory.startswith(CENTRAL_MAGIC)):
        raise truncated_zip(name, "the directory is not where the end record says")
    return end, directory


def directory_span(directory: bytes) -> tuple[int, int]:
    """Walk a raw central directory by its own length fields.

    ``zipfile`` silently truncates a name or extra field whose length runs past
    the directory; this walk does not, so a caller can compare what the records
    add up to with what the end record claims.

    Args:
        directory: The directory's bytes (see :func:`read_directory`).

    Returns:
        ``(length, count)``: the bytes the well-formed entries at the start
        cover, and how many there are.

    Example:
        >>> entry = CENTRAL.pack(CENTRAL_SIGNATURE, *[0] * 9, 1, 0, 0, 0, 0, 0, 0) + b"x"
        >>> directory_span(entry + entry + b"junk")
        (94, 2)
    """
    listed, count = 0, 0
    while (
        listed + CENTRAL.size <= len(directory) and directory[listed : listed + 4] == CENTRAL_MAGIC
    ):
        # Name, extra field and comment lengths, in that order from byte 28.
        listed += CENTRAL.size + sum(struct.unpack_from("<3H", directory, listed + 28))
        count += 1
    return listed, count


#: The newest "version needed to extract" Python's zipfile reads (6.3).
MAX_EXTRACT_VERSION = 63
# Bit 11 of the flags: the name is UTF-8 (else code page 437).
_UTF8_NAME = 0x800


class CentralEntry(NamedTuple):
    """One central directory entry: what :class:`zipfile.ZipInfo` says of it.

    Attributes:
        name: The entry's name, decoded, cut at a NUL, with ``/`` separators
            (``ZipInfo.filename``).
        raw_name: The name's bytes as the directory holds them.
        flags: The general purpose flags.
        method: The compression method (``zipfile.ZIP_STORED``...).
        crc32: The CRC-32 of the data.
        compressed_size: Bytes stored (zip64 extra field applied).
        size: Bytes once inflated (zip64 extra field applied).
        disk: The disk the entry starts on.
        header_offset: Where its local header starts.
    """

    name: str
    raw_name: bytes
    flags: int
    method: int
    crc32: int
    compressed_size: int
    size: int
    disk: int
    header_offset: int


def _zip64_sizes(extra: bytes, size: int, compressed: int, offset: int) -> tuple[int, int, int]:
    # Walk the extra fields as zipfile does; the zip64 field holds, in this order,
    # only the values whose 32-bit field is saturated.
    while len(extra) >= 4:
        kind, length = struct.unpack_from("<HH", extra)
        if length + 4 > len(extra):
            raise zipfile.BadZipFile(f"Corrupt extra field {kind:04x} (size={length})")
        if kind == ZIP64_EXTRA_ID:
            data = extra[4 : length + 4]
            values = [size, compressed, offset]
            saturated = (size in (U64_MAX, U32_MAX), compressed == U32_MAX, offset == U32_MAX)
            for i, field in enumerate(("File size", "Compress size", "Header offset")):
                if saturated[i]:
                    if len(data) < 8:
                        raise zipfile.BadZipFile(f"Corrupt zip64 extra field. {field} not found.")
                    (values[i],) = struct.unpack("<Q", data[:8])
                    data = data[8:]
            size, compressed, offset = values
        extra = extra[length + 4 :]
    return size, compressed, offset


def parse_directory(
    directory: bytes, end: ZipEnd, read_at: Callable[[int, int], bytes]
) -> list[CentralEntry]:
    """The entries of a raw central directory, read the way Python's zipfile reads them.

    One pass over the bytes :func:`read_directory` returned, instead of
    ``zipfile.ZipFile`` reading the directory again and building a ``ZipInfo``
    (with its date and extra-field decoding) per entry. It accepts and refuses
    what ``zipfile.ZipFile`` does, with the same exceptions and messages, so a
    reader moving from one to the other reports damage as before.

    Args:
        directory: The directory's bytes, as :func:`read_directory` returned them.
        end: The end records that located it.
        read_at: ``read_at(offset, length)`` returns up to ``length`` bytes of
            the file; used only where zipfile would read the directory from
            elsewhere (damaged end records).

    Returns:
        The entries, in directory order.

    Raises:
        zipfile.BadZipFile: A truncated entry, a wrong signature, a damaged extra field.
        NotImplementedError: An entry needs a zip version zipfile cannot read.
        UnicodeDecodeError: A name flagged UTF-8 is not.

    Example:
        >>> entry = CENTRAL.pack(CENTRAL_SIGNATURE, 20, 20, 0x800, 0, 0, 0, 7, 3, 3, 1,
        ...                      0, 0, 0, 0, 0, 0) + b"x"
        >>> end = ZipEnd(0, 0, 1, 1, len(entry), 50, 50 + len(entry), ())
        >>> entries = parse_directory(entry, end, lambda o, n: b"")
        >>> [(e.name, e.crc32, e.size, e.header_offset) for e in entries]
        [('x', 7, 3, 0)]
    """
    view = end.zipfile_view or ZipfileView(end.cd_offset, end.cd_size, 0)
    if view.error:
        raise zipfile.BadZipFile(view.error)
    if (view.start, view.size) != (end.cd_offset, end.cd_size):
        directory = read_at(view.start, view.size)
    concat = view.concat
    # zipfile.ZipInfo writes names with "/" whatever the system's separator.
    other_sep = os.sep != "/"
    entries: list[CentralEntry] = []
    pos = 0
    while pos < view.size:
        if pos + CENTRAL.size > len(directory):
            raise zipfile.BadZipFile("Truncated central directory")
        fields = CENTRAL.unpack_from(directory, pos)
        if fields[0] != CENTRAL_SIGNATURE:
            raise zipfile.BadZipFile("Bad magic number for central directory")
        flags, method = fields[3], fields[4]
        crc, compressed, size, name_len, extra_len, comment_len = fields[7:13]
        at = pos + CENTRAL.size
        raw_name = directory[at : at + name_len]
        extra = directory[at + name_len : at + name_len + extra_len]
        name = raw_name.decode("utf-8" if flags & _UTF8_NAME else "cp437")
        # zipfile reads "version needed" as two bytes: the version, then the host system.
        needed = fields[2] & 0xFF
        if needed > MAX_EXTRACT_VERSION:
            raise NotImplementedError(f"zip file version {needed / 10:.1f}")
        offset = fields[16]
        if extra:
            size, compressed, offset = _zip64_sizes(extra, size, compressed, offset)
        if "\0" in name:
            name = name[: name.index("\0")]
        if other_sep:
            name = name.replace(os.sep, "/")
        entries.append(
            CentralEntry(
                name, raw_name, flags, method, crc, compressed, size, fields[13], offset + concat
            )
        )
        pos = at + name_len + extra_len + comment_len
    return entries
