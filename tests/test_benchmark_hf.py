"""The Hugging Face sharded benchmark runs and records its comparisons (no timings asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.slow
def test_hf_sharded_family_writes_its_rows(tmp_path: Path) -> None:
    from benchmarks.__main__ import main

    results = main(
        ["--only", "hf_sharded", "--sizes", "1", "--repeats", "1", "--no-peers", "--no-plot",
         "--out", str(tmp_path / "results"), "--work", str(tmp_path)]
    )  # fmt: skip
    rows = [c for c in results.comparisons if c.case.startswith("load HF 4 shards")]
    assert {c.baseline for c in rows} == {
        "load_file x 4 shards",
        "load_file x 4 shards, every page touched",
        "ddpstate.load x 4 shards",
    }
    assert any("(disk)" in c.case for c in rows)
    assert all(c.ours.startswith("ddpstate.load (HF folder)") and c.ours_s > 0 for c in rows)
    touched = [c for c in rows if c.baseline.endswith("touched")]
    assert touched and all(c.ours.endswith("every page touched") for c in touched)
    assert "load HF 4 shards" in (tmp_path / "results" / "results.md").read_text()
