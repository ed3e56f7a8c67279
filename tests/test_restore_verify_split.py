"""restore() on several ranks: each rank checksums a share of the step's files (_verify_split)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpstate._manager import verify_split as _verify_split
from ddpstate.errors import CheckpointCorruptError
from ddpstate.manager import MANIFEST_NAME, CheckpointManager, verify_checkpoint
from tests.multiproc import run_ranks


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {
        "model": nn.Linear(64, 64),
        "head": nn.Linear(64, 8),
        "optimizer_like": {"lr": 0.1, "momentum": torch.randn(256)},
        "epoch": seed,
    }


def _save_two_steps(rank: int, world: int, directory: str) -> None:
    with CheckpointManager(directory, keep_last=3) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))


def _restore(rank: int, world: int, directory: str, step: Any) -> dict[str, Any]:
    state = _state(99)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(directory) as manager:
            try:
                restored = manager.restore(state, step=step)
            except CheckpointCorruptError as exc:
                return {"error": str(exc)}
    return {
        "step": restored,
        "epoch": state["epoch"],
        "warnings": [str(w.message) for w in caught],
    }


def _sizes(folder: Path) -> dict[str, int]:
    files = json.loads((folder / MANIFEST_NAME).read_text())["files"]
    return {name: entry["size"] for name, entry in files.items()}


def _corrupt_a_file_of_rank_1(folder: Path) -> str:
    shares = _verify_split.assign(_sizes(folder), 2)
    assert shares[0] and shares[1], shares  # both ranks have work, or the test proves nothing
    name = shares[1][0]
    data = bytearray((folder / name).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the CRC-32 can tell
    (folder / name).write_bytes(bytes(data))
    return name


def test_a_file_checked_by_rank_1_failing_falls_back_on_every_rank(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    run_ranks(_save_two_steps, 2, args=(str(directory),))
    folder = directory / "step_0000000002"
    bad = _corrupt_a_file_of_rank_1(folder)
    # The text a single process finds, for the warning to repeat word for word.
    alone = verify_checkpoint(folder)
    assert not alone.ok and bad in alone.problems[0]

    results = run_ranks(_restore, 2, args=(str(directory), None))

    assert [r["step"] for r in results] == [1, 1]
    assert [r["epoch"] for r in results] == [1, 1]
    (warning,) = [w for w in results[0]["warnings"] if "skipping" in w]
    assert warning == (
        f"CheckpointManager.restore: skipping {folder}: {'; '.join(alone.problems)}; restoring "
        f"step 1 instead"
    )
    assert bad in warning and "fails its checksum" in warning


def test_the_exact_step_failing_on_rank_1_raises_on_every_rank(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    run_ranks(_save_two_steps, 2, args=(str(directory),))
    bad = _corrupt_a_file_of_rank_1(directory / "step_0000000002")

    results = run_ranks(_restore, 2, args=(str(directory), 2))

    for result in results:
        assert "cannot restore step 2" in result["error"]
        assert bad in result["error"]


def test_an_uncommitted_newest_folder_is_skipped_and_the_good_step_restores(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    run_ranks(_save_two_steps, 2, args=(str(directory),))
    # A folder without a manifest (an interrupted save) is skipped on rank 0 without a round.
    os.makedirs(directory / "step_0000000003")

    results = run_ranks(_restore, 2, args=(str(directory), None))

    assert [(r["step"], r["epoch"]) for r in results] == [(2, 2), (2, 2)]
    (warning,) = [w for w in results[0]["warnings"] if "skipping" in w]
    assert "step_0000000003" in warning and "restoring step 2 instead" in warning
    assert not [w for w in results[1]["warnings"] if "skipping" in w]  # rank 0 warns, as before


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_assign_covers_every_file_exactly_once_balanced_and_deterministic(world: int) -> None:
    sizes = {f"f{i}.pt": (i * 7919) % 1000 for i in range(23)} | {"rng.pt": 0, "a.pt": 999}
    shares = _verify_split.assign(sizes, world)

    assert len(shares) == world
    assigned = [name for share in shares for name in share]
    assert sorted(assigned) == sorted(sizes)  # every file, exactly once
    assert _verify_split.assign(dict(reversed(sizes.items())), world) == shares  # any order
    loads = [sum(sizes[n] for n in share) for share in shares]
    # Greedy largest-first: no rank exceeds another by more than the largest file.
    assert max(loads) - min(loads) <= max(sizes.values())


def test_assign_gives_the_largest_files_to_different_ranks() -> None:
    shares = _verify_split.assign({"big1": 100, "big2": 100, "small": 1, "tiny": 0}, 2)
    assert shares == [["big1", "small"], ["big2", "tiny"]]
