"""Zip end records that point zipfile and torch at different central directories.

Python's ``zipfile`` reads the central directory just before the end record (it assumes
any gap is data prepended to the archive), while torch's reader (miniz) reads it at the
offset the end record states. A file holding two archives and an end record that states
the first one's offset is read as the second archive by ddpstate's container check and as
the first by ``torch.load``: ``verify`` would check bytes torch never loads. Every reader
refuses such a file.
"""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from tests.faults.test_one_reader import assert_corrupt_everywhere

_EOCD = b"PK\x05\x06"


def _saved(value: float) -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.full((4,), value)}, buf)
    return buf.getvalue()


def _two_archives(path: Path) -> None:
    """[torch's archive][its directory][zipfile's archive][its directory][end record].

    The two saves have the same layout, so the end record of either states the same
    directory offset and size: the first archive's for torch, the last bytes for zipfile.
    """
    seen, loaded = _saved(1.0), _saved(666.0)
    end = loaded.rfind(_EOCD)
    size, offset = struct.unpack("<2L", loaded[end + 12 : end + 20])
    assert seen.rfind(_EOCD) == end and len(seen) == len(loaded)
    path.write_bytes(loaded[: offset + size] + seen[: offset + size] + loaded[end:])


def test_a_second_archive_before_the_end_record_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch loads 666s, zipfile sees the 1s (checked here): every reader refuses the file."""
    src = tmp_path / "two_archives.pt"
    _two_archives(src)
    assert torch.equal(torch.load(src, weights_only=True)["w"], torch.full((4,), 666.0))
    folder = zipfile.ZipFile(src).namelist()[0].split("/")[0]
    record = zipfile.ZipFile(src).read(f"{folder}/data/0")
    assert torch.equal(torch.frombuffer(bytearray(record), dtype=torch.float32), torch.ones(4))
    assert_corrupt_everywhere(src, tmp_path, capsys)
