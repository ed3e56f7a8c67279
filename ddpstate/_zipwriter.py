"""A minimal zip writer laid out the way torch.save lays out its archives."""

from __future__ import annotations

import struct
import zlib
from typing import Callable

from ddpstate._stream import Sink

# torch.save (through miniz) writes every record stored (uncompressed), aligns
# each record's data to 64 bytes with an extra field named "FB" full of "Z",
# leaves CRC and sizes out of the local header and appends a data descriptor.
# torch.load's offset shortcut (config.load.calculate_storage_offsets) and
# torch.load(mmap=True) depend on that layout, so it is reproduced exactly.
_ALIGNMENT = 64
_U32_MAX = 0xFFFFFFFF
_U16_MAX = 0xFFFF
_FLAGS = 0x0808  # bit 3: sizes and CRC in a data descriptor; bit 11: UTF-8 names
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_EOCD64_LOCATOR = struct.Struct("<IIQI")


class _Entry:
    __slots__ = ("crc", "name", "offset", "size")

    def __init__(self, name: bytes, offset: int, size: int, crc: int) -> None:
        self.name = name
        self.offset = offset
        self.size = size
        self.crc = crc


class ZipWriter:
    """Writes a torch-compatible zip archive record by record, in constant memory.

    Args:
        sink: Where the bytes go; the archive starts at its current position.

    Example:
        >>> import io
        >>> from ddpstate._stream import Sink
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
        zip64_size = size >= _U32_MAX
        zip64_offset = offset >= _U32_MAX
        extra = b""
        if zip64_size or zip64_offset:
            fields = (struct.pack("<QQ", size, size) if zip64_size else b"") + (
                struct.pack("<Q", offset) if zip64_offset else b""
            )
            extra = struct.pack("<HH", 0x0001, len(fields)) + fields
        start = offset + _LOCAL.size + len(encoded) + len(extra) + 4
        padding = -start % _ALIGNMENT
        extra += b"FB" + struct.pack("<H", padding) + b"Z" * padding
        header = _LOCAL.pack(
            0x04034B50,
            45 if extra.startswith(b"\x01\x00") else 20,
            _FLAGS,
            0,  # stored
            0,  # time: left zero, like torch, so identical input gives identical output
            0,  # date
            0,
            _U32_MAX if zip64_size else 0,
            _U32_MAX if zip64_size else 0,
            len(encoded),
            len(extra),
        )
        self._sink.write(header + encoded + extra)
        crc = write_data(self._sink) & _U32_MAX
        written = self._sink.position - (offset + len(header) + len(encoded) + len(extra))
        if written != size:
            raise ValueError(f"record {name}: wrote {written} bytes, expected {size}")
        if zip64_size or zip64_offset:
            self._sink.write(struct.pack("<IIQQ", 0x08074B50, crc, size, size))
        else:
            self._sink.write(struct.pack("<IIII", 0x08074B50, crc, size, size))
        self._entries.append(_Entry(encoded, offset, size, crc))
        return crc

    def close(self) -> None:
        """Write the central directory; the archive is complete afterwards."""
        if self._closed:
            return
        self._closed = True
        cd_start = self._sink.position
        for entry in self._entries:
            big_size = entry.size >= _U32_MAX
            big_offset = entry.offset >= _U32_MAX
            fields = (struct.pack("<QQ", entry.size, entry.size) if big_size else b"") + (
                struct.pack("<Q", entry.offset) if big_offset else b""
            )
            extra = struct.pack("<HH", 0x0001, len(fields)) + fields if fields else b""
            self._sink.write(
                _CENTRAL.pack(
                    0x02014B50,
                    45 if fields else 20,
                    45 if fields else 20,
                    _FLAGS,
                    0,
                    0,
                    0,
                    entry.crc,
                    _U32_MAX if big_size else entry.size,
                    _U32_MAX if big_size else entry.size,
                    len(entry.name),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    _U32_MAX if big_offset else entry.offset,
                )
                + entry.name
                + extra
            )
        cd_end = self._sink.position
        cd_size = cd_end - cd_start
        count = len(self._entries)
        if count >= _U16_MAX or cd_start >= _U32_MAX or cd_size >= _U32_MAX:
            self._sink.write(
                _EOCD64.pack(0x06064B50, _EOCD64.size - 12, 45, 45, 0, 0, count, count, cd_size,
                             cd_start)
                + _EOCD64_LOCATOR.pack(0x07064B50, 0, cd_end, 1)
            )  # fmt: skip
            self._sink.write(
                _EOCD.pack(0x06054B50, 0, 0, min(count, _U16_MAX), min(count, _U16_MAX),
                           min(cd_size, _U32_MAX), min(cd_start, _U32_MAX), 0)
            )  # fmt: skip
        else:
            self._sink.write(_EOCD.pack(0x06054B50, 0, 0, count, count, cd_size, cd_start, 0))
