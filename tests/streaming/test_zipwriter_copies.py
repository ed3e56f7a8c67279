"""ZipWriter.add_copies: the same archive bytes as adding each record on its own (issue 20)."""

from __future__ import annotations

import io
import os
import random
import zipfile
import zlib
from pathlib import Path

import pytest

from ddpstate._streaming.stream import Sink, Source
from ddpstate._streaming.zipwriter import CopyCandidate, ZipWriter
from ddpstate.errors import CheckpointCorruptError


def _source(tmp_path: Path, sizes: list[int]) -> tuple[Path, list[tuple[int, int, int]]]:
    """A file of random stretches; returns it and (offset, size, crc) of each."""
    rng = random.Random(20)
    path = tmp_path / "source.bin"
    spans = []
    with open(path, "wb") as f:
        f.write(b"\0" * 7)  # stretches at unaligned offsets
        for size in sizes:
            data = rng.randbytes(size)
            spans.append((f.tell(), size, zlib.crc32(data)))
            f.write(data)
    return path, spans


def _one_by_one(path: Path, spans: list[tuple[int, int, int]], prefix: bytes) -> bytes:
    out = io.BytesIO()
    writer = ZipWriter(Sink(out))
    writer.add_bytes("archive/data.pkl", prefix)
    with Source(str(path)) as src:
        for index, (offset, size, _) in enumerate(spans):

            def write(sink: Sink, offset: int = offset, size: int = size) -> int:
                return sink.copy_from(src, offset, size, crc=True)

            writer.add_record(f"archive/data/{index}", size, write)
    writer.close()
    return out.getvalue()


def _copied(
    path: Path, spans: list[tuple[int, int, int]], prefix: bytes, unknown: set[int]
) -> tuple[bytes, list[int]]:
    out = io.BytesIO()
    writer = ZipWriter(Sink(out))
    writer.add_bytes("archive/data.pkl", prefix)
    with Source(str(path)) as src:

        def candidates() -> list[CopyCandidate]:
            made = []
            for index, (offset, size, crc) in enumerate(spans):

                def write(sink: Sink, offset: int = offset, size: int = size) -> int:
                    return sink.copy_from(src, offset, size, crc=True)

                made.append(
                    CopyCandidate(
                        f"archive/data/{index}",
                        size,
                        crc,
                        -1 if index in unknown else offset,
                        write,
                    )
                )
            return made

        crcs = writer.add_copies(src, candidates())
    writer.close()
    return out.getvalue(), crcs


@pytest.mark.parametrize("prefix_size", [0, 1, 63, 100])
def test_same_bytes_as_record_by_record(tmp_path: Path, prefix_size: int) -> None:
    # Small records (gathered), large ones (copied in the kernel), empty ones and
    # ones without a source offset (written by their callback), interleaved.
    sizes = [0, 1, 5, 700, 64 << 10, (64 << 10) - 1, 3, 200_000, 12, 0, 999] + [48] * 3000
    path, spans = _source(tmp_path, sizes)
    prefix = b"p" * prefix_size
    expected = _one_by_one(path, spans, prefix)
    got, crcs = _copied(path, spans, prefix, unknown={2, 6, 11})
    assert got == expected
    assert crcs == [crc for _, _, crc in spans]
    with zipfile.ZipFile(io.BytesIO(got)) as archive:
        assert archive.testzip() is None
        assert len(archive.infolist()) == len(sizes) + 1


def test_truncated_source_fails_loudly(tmp_path: Path) -> None:
    path, spans = _source(tmp_path, [100, 200, 300])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        _copied(path, spans, b"", unknown=set())
