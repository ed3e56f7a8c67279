"""The benchmark suite runs and writes readable results (correctness only, no timings asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.slow
def test_quickest_case_writes_a_row_and_parseable_files(tmp_path: Path) -> None:
    from benchmarks.__main__ import main

    out = tmp_path / "results"
    results = main(
        ["--only", "save_load", "--sizes", "1", "--counts", "", "--repeats", "1",
         "--no-peers", "--out", str(out), "--work", str(tmp_path)]
    )  # fmt: skip
    save_rows = [c for c in results.comparisons if c.case == "save"]
    assert save_rows, "no save comparison recorded"
    for row in results.comparisons:
        assert row.ours_s > 0 and row.baseline_s > 0, row
    data = json.loads((out / "results.json").read_text())
    assert {c["case"] for c in data["comparisons"]} >= {"save", "load", "load mmap"}
    table = (out / "results.md").read_text()
    assert "| save | 1 MiB | ddpstate.save | torch.save + fsync |" in table
    assert (out / "results.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_scale_benchmark_runs_every_collective_and_counts_store_operations() -> None:
    from benchmarks.scale import main

    result = main(["--ranks", "4,32", "--rounds", "1", "--procs", ""])
    small, large = result["simulated"]
    assert (small["n"], large["n"]) == (4, 32)
    assert all(ms > 0 for ms in small["ms"].values())
    # O(1) per rank: append (with the call's identity) + add + get, plus the last arriver's
    # read of the log, done key and clean-up spread over the ranks; constant in N.
    for collective, (mean, most) in large["ops"].items():
        assert mean <= 4 and most <= 9, (collective, large["ops"])
        assert mean <= small["ops"][collective][0], (collective, small["ops"], large["ops"])


def test_safetensors_family_compares_with_the_library_on_tmpfs_and_disk(tmp_path: Path) -> None:
    from benchmarks.__main__ import main

    results = main(
        ["--only", "safetensors", "--counts", "600", "--count-size", "1", "--repeats", "1",
         "--no-plot", "--out", str(tmp_path / "results"), "--work", str(tmp_path)]
    )  # fmt: skip
    cases = {(c.case, c.baseline) for c in results.comparisons}
    assert ("st save (disk)", "safetensors save_file + fsync") in cases
    assert ("st load mmap (disk)", "safetensors load_file") in cases
    assert ("st load read (disk)", "safetensors load_file (pread)") in cases
    assert all(c.x == 600 and c.target == 1.05 for c in results.comparisons)


@pytest.mark.slow
def test_strip_module_family_runs_against_cp_and_the_script(tmp_path: Path) -> None:
    """Issue 40's family at its quick points: every row measured, RssAnon recorded."""
    from benchmarks import strip_module
    from benchmarks.__main__ import main

    results = main(
        ["--only", "strip_module", "--quick", "--no-plot", "--out", str(tmp_path / "results"),
         "--work", str(tmp_path)]
    )  # fmt: skip
    cases = {(c.case, c.x, c.baseline) for c in results.comparisons}
    for place in ("disk", "tmpfs"):
        for size in strip_module.QUICK.sizes_mib:
            assert (f"strip-module ({place})", size, strip_module.CP) in cases
            assert (f"strip-module ({place})", size, strip_module.SCRIPT) in cases
        assert (f"strip-module ({place})", 1000, strip_module.SCRIPT) in cases
    for row in results.comparisons:
        assert row.ours_s > 0 and row.baseline_s > 0 and row.peak_rss_mib is not None, row


@pytest.mark.slow
def test_dcp_family_measures_storage_on_1_and_2_ranks_with_zstandard(tmp_path: Path) -> None:
    """Issue 42's rows side by side at a tiny size: every pair measured, each with its target."""
    from benchmarks.__main__ import main

    results = main(
        ["--only", "dcp", "--dist-size", "8", "--repeats", "1", "--no-plot",
         "--out", str(tmp_path / "results"), "--work", str(tmp_path)]
    )  # fmt: skip
    targets = {(c.case, c.baseline): c.target for c in results.comparisons}
    writer = "FileSystemWriter(sync_files=True)"
    for place in ("disk", "/dev/shm"):
        for world, near in ((1, 1.05), (2, 1.10)):
            assert targets[(f"{world}-rank dcp.save ({place})", writer)] == near
            assert targets[(f"{world}-rank dcp.load ({place})", "FileSystemReader")] == near
            assert targets[(f"{world}-rank dcp.save, ZStandard ({place})", writer)] == 1.05
        assert targets[(f"2-rank FSDP2 save ({place})", "dcp.save")] == 1.10
        assert targets[(f"2-rank FSDP2 restore ({place})", "dcp.load")] == 1.10
    assert any("CRC-32 by " in note for note in results.notes)
    assert all(c.ours_s > 0 and c.baseline_s > 0 for c in results.comparisons)


@pytest.mark.slow
def test_small_tensors_family_runs_on_two_ranks_and_names_the_crc(tmp_path: Path) -> None:
    """Issue 42's family: the three comparisons recorded from two real gloo ranks (the
    restore twice: against torch.load and with load_state_dict), the CRC-32 in the notes."""
    from benchmarks import harness, small_tensors
    from benchmarks.__main__ import main

    results = main(
        ["--only", "small_tensors", "--repeats", "1", "--no-plot",
         "--out", str(tmp_path / "results"), "--work", str(tmp_path)]
    )  # fmt: skip
    rows = {(c.case, c.baseline): c for c in results.comparisons}
    assert {case for case, _ in rows} == {
        "MoE save (2 ranks)", "MoE async save() call", "MoE restore (2 ranks)"
    }  # fmt: skip
    assert len(rows) == 4
    for row in rows.values():
        assert row.x == small_tensors.TENSORS == 25_640
        assert row.ours_s > 0 and row.baseline_s > 0, row
    assert f"small_tensors: {harness.crc32_in_use()}" in results.notes
