"""Where the real-world sample checkpoints live: ../shared/samples beside the checkout."""

from __future__ import annotations

from pathlib import Path

_CANDIDATES = (
    Path(__file__).resolve().parents[2] / "shared" / "samples",
    Path("/work/shared/samples"),
)
SAMPLES = next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[0])
#: A DataParallel ResNet-20 (legacy format, storages tagged cuda:0, keys all "module.").
RESNET20 = SAMPLES / "resnet20-12fca82f.th"
