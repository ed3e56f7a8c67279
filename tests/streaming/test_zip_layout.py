"""The zip layout module reads a directory the way Python's zipfile does, damage included.

The streaming reader parses a checkpoint's central directory once, from the bytes
format detection already read (:func:`ddpstate._layout.zip.parse_directory`),
instead of a second parse by ``zipfile.ZipFile``. These tests hold the two equal:
same entries for intact archives, and for every single-bit flip of a torch.save
file's directory and end records either the same entries or the same exception.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpstate._layout.zip import parse_directory, read_directory
from ddpstate.errors import CheckpointCorruptError


def _by_zipfile(data: bytes) -> Any:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return [
                (i.filename, i.orig_filename.encode("utf-8" if i.flag_bits & 0x800 else "cp437"),
                 i.flag_bits, i.compress_type, i.CRC, i.compress_size, i.file_size, i.volume,
                 i.header_offset)
                for i in archive.infolist()
            ]  # fmt: skip
    except (zipfile.BadZipFile, NotImplementedError, ValueError) as exc:
        return (type(exc), str(exc))


def _by_layout(data: bytes) -> Any:
    end, directory = read_directory(lambda o, n: data[o : o + n], len(data), "f")
    try:
        return [
            (e.name, e.raw_name, e.flags, e.method, e.crc32, e.compressed_size, e.size, e.disk,
             e.header_offset)
            for e in parse_directory(directory, end, lambda o, n: data[o : o + n])
        ]  # fmt: skip
    except (zipfile.BadZipFile, NotImplementedError, ValueError) as exc:
        return (type(exc), str(exc))


def _sample(tmp_path: Path) -> bytes:
    path = tmp_path / "s.pt"
    torch.save({"w": torch.arange(4.0), "b": torch.zeros(2, dtype=torch.int64)}, path)
    return path.read_bytes()


def test_parse_directory_matches_zipfile_on_intact_archives(tmp_path: Path) -> None:
    deflated = io.BytesIO()
    with zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("a/data.pkl", b"x" * 1000)
        archive.writestr("a/\u00e9t\u00e9", b"y")  # a UTF-8 name
        archive.comment = b"a comment"
    for data in (_sample(tmp_path), deflated.getvalue()):
        found = _by_layout(data)
        assert isinstance(found, list) and found
        assert found == _by_zipfile(data)


def test_parse_directory_matches_zipfile_for_every_bit_flip(tmp_path: Path) -> None:
    data = _sample(tmp_path)
    start = data.find(b"PK\x01\x02")
    differ = []
    for pos in range(start, len(data)):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[pos] ^= 1 << bit
            try:
                found = _by_layout(bytes(damaged))
            except CheckpointCorruptError:
                continue  # format detection refuses it before either parse runs
            expected = _by_zipfile(bytes(damaged))
            if found != expected:
                differ.append((pos, bit, found, expected))
    assert not differ, differ[:3]


@pytest.mark.parametrize("flip", [(28, 0x80), (8, 0x01)])
def test_a_damaged_entry_reads_as_zipfile_reads_it(tmp_path: Path, flip: tuple[int, int]) -> None:
    data = bytearray(_sample(tmp_path))
    where, bit = flip
    data[data.find(b"PK\x01\x02") + where] ^= bit
    assert _by_layout(bytes(data)) == _by_zipfile(bytes(data))
