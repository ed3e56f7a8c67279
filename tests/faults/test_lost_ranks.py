"""A rank that exits before a collective, and one that arrives after the timeout."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults import _harness as h


@pytest.mark.slow
@pytest.mark.parametrize("op", h.LOST_RANK_OPS)
def test_lost_and_late_ranks_are_named_within_the_timeout(op: str, tmp_path: Path) -> None:
    """Three gloo ranks, 2 s timeout; rank 1 exits before save/load/restore, rank 2 arrives
    3 s late. Rank 0 raises BarrierTimeoutError naming ranks 1 and 2, the late rank 2 one
    naming rank 1, each within [0.95 x timeout, timeout x 1.1 + 0.3 s]; no rank survives."""
    trial = h.lost_rank_trial(op, tmp_path, timeout=2.0)
    assert not trial.defects, trial.defects
    assert set(trial.verdicts) == {"rank 0", "rank 2"}
