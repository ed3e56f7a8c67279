"""A minimal zip writer laid out the way torch.save lays out its archives."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from typing import Callable, NamedTuple

from ddpstate._layout.zip import (
    CENTRAL,
    CENTRAL_SIGNATURE,
    DESCRIPTOR,
    DESCRIPTOR64,
    DESCRIPTOR_SIGNATURE,
    EOCD,
    EOCD64,
    EOCD64_LOCATOR,
    EOCD64_LOCATOR_SIGNATURE,
    EOCD64_SIGNATURE,
    EOCD_SIGNATURE,
    LOCAL,
    LOCAL_SIGNATURE,
    U16_MAX,
    U32_MAX,
    ZIP64_EXTRA_ID,
)
from ddpstate._streaming.stream import ReadWindow as ReadWindow
from ddpstate._streaming.stream import Sink, Source

# torch.save (through miniz) writes every record stored (uncompressed), aligns
# each record's data to 64 bytes with an extra field named "FB" full of "Z",
# leaves CRC and sizes out of the local header and appends a data descriptor.
# torch.load's offset shortcut (config.load.calculate_storage_offsets) and
# torch.load(mmap=True) depend on that layout, so it is reproduced exactly.
# zipfile's own writer cannot: on a seekable file it rewrites each local header
# instead of writing a data descriptor, and puts its zip64 field after the others.
_ALIGNMENT = 64
_FLAGS = 0x0808  # bit 3: sizes and CRC in a data descriptor; bit 11: UTF-8 names


# The "FB" extra field padding data to the next multiple of 64, by padding length.
_PADDING = tuple(b"FB" + struct.pack("<H", n) + b"Z" * n for n in range(_ALIGNMENT))


def _zip64_extra(size: int, offset: int) -> bytes:
    """The zip64 extra field of a record whose size or offset passes 32 bits; else empty."""
    fields = (struct.pack("<QQ", size, size) if size >= U32_MAX else b"") + (
        struct.pack("<Q", offset) if offset >= U32_MAX else b""
    )
    return struct.pack("<HH", ZIP64_EXTRA_ID, len(fields)) + fields if fields else b""


def _local_header(encoded: bytes, offset: int, size: int) -> bytes:
    """The local header, name and extra fields of a record written at ``offset``."""
    zip64 = _zip64_extra(size, offset) if size >= U32_MAX or offset >= U32_MAX else b""
    padding = -(offset + LOCAL.size + len(encoded) + len(zip64) + 4) % _ALIGNMENT
    sizes = U32_MAX if size >= U32_MAX else 0  # else in the data descriptor only
    # Method 0 (stored); time and date left zero, like torch, so identical input
    # gives identical output.
    header = LOCAL.pack(LOCAL_SIGNATURE, 45 if zip64 else 20, _FLAGS, 0, 0, 0, 0, sizes, sizes,
                        len(encoded), len(zip64) + 4 + padding)  # fmt: skip
    return header + encoded + zip64 + _PADDING[padding]


def _descriptor(offset: int, size: int, crc: int) -> bytes:
    """The data descriptor that follows the data of a record written at ``offset``."""
    zip64 = size >= U32_MAX or offset >= U32_MAX
    return (DESCRIPTOR64 if zip64 else DESCRIPTOR).pack(DESCRIPTOR_SIGNATURE, crc, size, size)


class CopyCandidate(NamedTuple):
    """A record for :meth:`ZipWriter.add_copies`: a stored stretch of the source, or data to write.

    Attributes:
        name: The record's name in the output.
        size: Its data size.
        crc: Its CRC-32 as the source's directory records it (used when copied).
        data_offset: Where its data starts in the source, when it is copied as it
            is; -1 to have ``write_data`` write it.
        write_data: Writes the data (see :meth:`ZipWriter.add_record`); used for
            records of 64 KiB or more and those with no ``data_offset``.
    """

    name: str
    size: int
    crc: int
    data_offset: int
    write_data: Callable[[Sink], int]


class _Entry(NamedTuple):
    name: bytes
    offset: int
    size: int
    crc: int


class ZipWriter:
    """Writes a torch-compatible zip archive record by record, in constant memory.

    Args:
        sink: Where the bytes go; the archive starts at its current position.

    Example:
        >>> import io
        >>> from ddpstate._streaming.stream import Sink
        >>> out = io.BytesIO()
        >>> writer = ZipWriter(Sink(out))
        >>> _ = writer.add_bytes("archive/version", b"3\\n")
        >>> writer.close()
        >>> import zipfile; zipfile.ZipFile(out).read("archive/version")
        b'3\\n'
    """

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._entries: list[_Entry] = []
        self._closed = False

    def add_bytes(self, name: str, data: bytes) -> int:
        """Add a record held in memory (the pickle, version markers...); returns its CRC-32."""

        def write(sink: Sink) -> int:
            sink.write(data)
            return zlib.crc32(data)

        return self.add_record(name, len(data), write)

    def add_record(self, name: str, size: int, write_data: Callable[[Sink], int]) -> int:
        """Add a record of ``size`` bytes that ``write_data`` streams into the sink.

        Args:
            name: The record's name inside the archive.
            size: Exactly how many bytes ``write_data`` writes.
            write_data: Writes the data and returns its CRC-32.

        Returns:
            The record's CRC-32.

        Raises:
            ValueError: ``write_data`` wrote a different number of bytes.
        """
        encoded = name.encode("utf-8")
        offset = self._sink.position
        header = _local_header(encoded, offset, size)
        self._sink.write(header)
        crc = write_data(self._sink) & U32_MAX
        written = self._sink.position - (offset + len(header))
        if written != size:
            raise ValueError(f"record {name}: wrote {written} bytes, expected {size}")
        self._sink.write(_descriptor(offset, size, crc))
        self._entries.append(_Entry(encoded, offset, size, crc))
        return crc

    def add_copies(self, source: Source, records: Iterable[CopyCandidate]) -> list[int]:
        """Add records whose data is a stored stretch of ``source``, with its CRC-32 known.

        The same bytes as :meth:`add_record` for each record in turn, in fewer
        system calls: small records (a checkpoint with 100,000 tensors has mostly
        small ones) are read from the source in runs of neighbours and written
        out, headers and descriptors included, in large blocks. Records of 64 KiB
        or more, and those with a negative ``data_offset``, go through
        :meth:`add_record` with their ``write_data`` (convert's copies them in the
        kernel).

        Args:
            source: The file the records' data comes from.
            records: The records, in output order.

        Returns:
            The CRC-32 of each record (the recorded one for copied records).

        Raises:
            ValueError: A record's ``write_data`` wrote a different number of bytes.
            CheckpointCorruptError: The source ends before a record's data.

        Example:
            >>> import io, os, tempfile, zlib
            >>> from ddpstate._streaming.stream import Sink, Source
            >>> path = os.path.join(tempfile.mkdtemp(), "data")
            >>> _ = open(path, "wb").write(b"x" * 100)
            >>> out = io.BytesIO()
            >>> with Source(path) as src:
            ...     record = CopyCandidate("archive/data/0", 100, zlib.crc32(b"x" * 100), 0,
            ...                            lambda sink: 0)
            ...     crcs = ZipWriter(Sink(out)).add_copies(src, [record])
            >>> crcs == [zlib.crc32(b"x" * 100)], out.getvalue()[-116:-16] == b"x" * 100
            (True, True)
        """
        sink = self._sink
        entries = self._entries
        window = ReadWindow(source)
        crcs: list[int] = []
        block = bytearray()
        copied = 0  # source data in ``block``
        position = sink.position
        for record in records:
            size = record.size
            if record.data_offset < 0 or size >= ReadWindow.SMALL:
                sink.write_copied(block, copied)  # what was gathered first
                block, copied = bytearray(), 0
                crcs.append(self.add_record(record.name, size, record.write_data))
                position = sink.position
                continue
            encoded = record.name.encode("utf-8")
            crc = record.crc & U32_MAX
            header = _local_header(encoded, position, size)
            descriptor = _descriptor(position, size, crc)
            block += header
            block += window.read(record.data_offset, size)
            block += descriptor
            copied += size
            entries.append(_Entry(encoded, position, size, crc))
            crcs.append(crc)
            position += len(header) + size + len(descriptor)
            if len(block) >= ReadWindow.BLOCK:
                sink.write_copied(block, copied)
                block, copied = bytearray(), 0
        sink.write_copied(block, copied)
        return crcs

    def close(self) -> None:
        """Write the central directory; the archive is complete afterwards."""
        if self._closed:
            return
        self._closed = True
        cd_start = self._sink.position
        for name, offset, size, crc in self._entries:
            extra = _zip64_extra(size, offset)
            version = 45 if extra else 20
            size32 = min(size, U32_MAX)
            self._sink.write(
                CENTRAL.pack(CENTRAL_SIGNATURE, version, version, _FLAGS, 0, 0, 0, crc, size32,
                             size32, len(name), len(extra), 0, 0, 0, 0, min(offset, U32_MAX))
                + name
                + extra
            )  # fmt: skip
        cd_end = self._sink.position
        cd_size = cd_end - cd_start
        count = len(self._entries)
        if count >= U16_MAX or cd_start >= U32_MAX or cd_size >= U32_MAX:
            self._sink.write(
                EOCD64.pack(EOCD64_SIGNATURE, EOCD64.size - 12, 45, 45, 0, 0, count, count, cd_size,
                             cd_start)
                + EOCD64_LOCATOR.pack(EOCD64_LOCATOR_SIGNATURE, 0, cd_end, 1)
            )  # fmt: skip
        # Saturated fields send a reader to the zip64 record; below the limits, the values.
        self._sink.write(
            EOCD.pack(EOCD_SIGNATURE, 0, 0, min(count, U16_MAX), min(count, U16_MAX),
                       min(cd_size, U32_MAX), min(cd_start, U32_MAX), 0)
        )  # fmt: skip
