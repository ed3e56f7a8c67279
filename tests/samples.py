"""Sample checkpoints for tests: the real-world ones in ../shared/samples; zip offsets."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

_CANDIDATES = (
    Path(__file__).resolve().parents[2] / "shared" / "samples",
    Path("/work/shared/samples"),
)
SAMPLES = next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[0])
#: A DataParallel ResNet-20 (legacy format, storages tagged cuda:0, keys all "module.").
RESNET20 = SAMPLES / "resnet20-12fca82f.th"


def data_offset(path: Path, suffix: str) -> tuple[int, int]:
    """(offset, size) of the data of the zip record whose name ends with ``suffix``."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack(
        "<HH", raw[info.header_offset + 26 : info.header_offset + 30]
    )
    return info.header_offset + 30 + name_len + extra_len, info.file_size
