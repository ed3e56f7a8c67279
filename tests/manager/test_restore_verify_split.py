"""restore() on several ranks: each rank checksums a share of the step's files (_verify_split)."""

from __future__ import annotations

import itertools
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpstate import _checksum, _manifest
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
    shares = _checksum.assign(_sizes(folder), 2)
    assert shares[0] and shares[1], shares  # both ranks have work, or the test proves nothing
    name, start, stop = shares[1][0]
    data = bytearray((folder / name).read_bytes())
    data[(start + (len(data) if stop is None else stop)) // 2] ^= 0xFF  # same size: CRC only
    (folder / name).write_bytes(bytes(data))
    return name


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_exact_step_failing_on_rank_1_raises_on_every_rank(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    run_ranks(_save_two_steps, 2, args=(str(directory),))
    bad = _corrupt_a_file_of_rank_1(directory / "step_0000000002")

    results = run_ranks(_restore, 2, args=(str(directory), 2))

    for result in results:
        assert "cannot restore step 2" in result["error"]
        assert bad in result["error"]


@pytest.mark.slow
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


def _covered(shares: list[list[Any]], sizes: dict[str, int]) -> dict[str, list[tuple[int, Any]]]:
    pieces: dict[str, list[tuple[int, Any]]] = {}
    for share in shares:
        for name, start, stop in share:
            pieces.setdefault(name, []).append((start, stop))
    assert sorted(pieces) == sorted(sizes)  # every file has pieces
    for name, ranges in pieces.items():
        ranges.sort()
        # Consecutive from byte 0; only the last reads on to the end (None).
        assert ranges[0][0] == 0 and ranges[-1][1] is None
        for (_, stop), (start, _) in itertools.pairwise(ranges):
            assert stop == start and 0 < start < sizes[name]
    return pieces


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("min_piece", [1, 300, 10**9])
def test_assign_covers_every_byte_once_balanced_and_deterministic(
    world: int, min_piece: int
) -> None:
    sizes = {f"f{i}.pt": (i * 7919) % 1000 for i in range(23)} | {"rng.pt": 0, "a.pt": 999}
    shares = _checksum.assign(sizes, world, min_piece)

    assert len(shares) == world
    pieces = _covered(shares, sizes)
    assert _checksum.assign(dict(reversed(sizes.items())), world, min_piece) == shares
    loads = [
        sum((sizes[n] if stop is None else stop) - start for n, start, stop in share)
        for share in shares
    ]
    assert sum(loads) == sum(sizes.values())
    # Runs of equal length, give or take one unsplit file below min_piece.
    slack = max((s for s in sizes.values() if s < min_piece), default=0)
    assert max(loads) - min(loads) <= 2 * slack + world
    if min_piece > max(sizes.values()):
        assert all(len(ranges) == 1 for ranges in pieces.values())  # nothing split


def test_assign_splits_one_large_file_evenly_and_keeps_small_ones_whole() -> None:
    shares = _checksum.assign({"model.pt": 4000, "_rng.pt": 10}, 4, min_piece=100)
    assert shares == [
        [("_rng.pt", 0, None), ("model.pt", 0, 992)],
        [("model.pt", 992, 1995)],
        [("model.pt", 1995, 2997)],
        [("model.pt", 2997, None)],
    ]
    # Below min_piece a file is read whole by one rank.
    assert _checksum.assign({"a": 50, "b": 50}, 2, min_piece=100) == [
        [("a", 0, None)],
        [("b", 0, None)],
    ]


_DAMAGE = ["none", "flip", "truncate", "truncate_to_piece", "extend", "missing", "empty"]


@pytest.mark.parametrize("damage", _DAMAGE)
@pytest.mark.parametrize("world", [2, 3, 7])
def test_pieces_put_together_judge_as_one_pass_over_the_file(
    tmp_path: Path, damage: str, world: int
) -> None:
    import random
    import zlib

    rng = random.Random(f"{damage}-{world}")
    data = {"big.pt": rng.randbytes(5000), "small.pt": rng.randbytes(40), "zero.pt": b""}
    files = {
        n: {"size": len(d), "crc32": _checksum.checksum_hex(zlib.crc32(d))} for n, d in data.items()
    }
    for name, blob in data.items():
        (tmp_path / name).write_bytes(blob)
    shares = _checksum.assign({n: e["size"] for n, e in files.items()}, world, min_piece=100)
    big_pieces = [p for share in shares for p in share if p[0] == "big.pt"]
    assert len(big_pieces) >= 2  # the large file really is split
    blob = bytearray(data["big.pt"])
    if damage == "flip":
        blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
    elif damage == "truncate":
        del blob[rng.randrange(1, len(blob)) :]
    elif damage == "truncate_to_piece":  # the last pieces find nothing at all
        del blob[big_pieces[1][1] - 1 :]
    elif damage == "extend":
        blob += b"x" * rng.randrange(1, 50)
    elif damage == "empty":
        blob = bytearray()
    (tmp_path / "big.pt").write_bytes(bytes(blob))
    if damage == "missing":
        (tmp_path / "big.pt").unlink()
    manifest = {"files": files}

    found = [
        _verify_split.check_share(str(tmp_path), manifest, None, i, world) for i in range(world)
    ]
    split = _checksum.file_problems(_manifest.checked_files(manifest), found)

    alone, _, _ = _checksum.check_files(str(tmp_path), files, None, workers=1)  # one pass a file
    threads, _, _ = _checksum.check_files(str(tmp_path), files, None, world, min_piece=100)
    assert split == alone == threads
    assert bool(split) == (damage != "none")


_BIG = 5 << 20  # float32 elements: a 20 MiB file, above MIN_PIECE, so split across ranks


def _big_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"weights": torch.randn(_BIG), "epoch": seed}


def _save_big(rank: int, world: int, directory: str) -> None:
    with CheckpointManager(directory, keep_last=3) as manager:
        manager.save(1, _big_state(1))
        manager.save(2, _big_state(2))


def _restore_big(rank: int, world: int, directory: str) -> dict[str, Any]:
    pieces: list[tuple[str, int, int]] = []
    real = _verify_split.check_share

    def recording(folder: str, manifest: Any, opts: Any, index: int, count: int) -> Any:
        found = real(folder, manifest, opts, index, count)
        pieces.extend((name, read.start, read.size) for name, read in found)
        return found

    _verify_split.check_share = recording  # a spy: the real check runs
    state = _big_state(99)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(directory) as manager:
            step = manager.restore(state)
    return {
        "step": step,
        "epoch": state["epoch"],
        "weights_ok": bool(torch.equal(state["weights"], _big_state(step)["weights"])),
        "warnings": [str(w.message) for w in caught if "skipping" in str(w.message)],
        "pieces": pieces,
    }


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_one_large_file_is_checked_by_both_ranks_and_its_damage_found(
    tmp_path: Path, damage: str
) -> None:
    directory = tmp_path / "run"
    run_ranks(_save_big, 2, args=(str(directory),))
    folder = directory / "step_0000000002"
    shares = _checksum.assign(_sizes(folder), 2)
    name, start, stop = shares[1][0]
    assert name == "weights.pt" and start > 0 and stop is None  # rank 1 reads its second half
    blob = bytearray((folder / name).read_bytes())
    if damage == "flip":
        blob[start + 12345] ^= 0x10
    else:
        del blob[start + 100 :]  # rank 1 reads 100 bytes of it
    (folder / name).write_bytes(bytes(blob))
    alone = verify_checkpoint(folder)
    assert not alone.ok

    results = run_ranks(_restore_big, 2, args=(str(directory),))

    for result in results:
        assert (result["step"], result["epoch"], result["weights_ok"]) == (1, 1, True)
    assert results[0]["warnings"] == [
        f"CheckpointManager.restore: skipping {folder}: {'; '.join(alone.problems)}; restoring "
        f"step 1 instead"
    ]
    # Each rank read its own part of step 2's weights.pt (then all of step 1's share).
    read0 = [(s, n) for f, s, n in results[0]["pieces"] if f == name]
    read1 = [(s, n) for f, s, n in results[1]["pieces"] if f == name]
    assert read0[0] == (0, start)
    assert read1[0] == (start, len(blob) - start)


@pytest.mark.slow
def test_a_sound_large_file_restores_from_pieces(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    run_ranks(_save_big, 2, args=(str(directory),))
    results = run_ranks(_restore_big, 2, args=(str(directory),))
    for result in results:
        assert (result["step"], result["weights_ok"], result["warnings"]) == (2, True, [])
    sizes = _sizes(directory / "step_0000000002")
    read = sum(n for r in results for f, _, n in r["pieces"] if f == "weights.pt")
    assert read == sizes["weights.pt"]  # every byte once, split over the two ranks
    assert all(any(f == "weights.pt" and n > 0 for f, _, n in r["pieces"]) for r in results)


def test_threads_share_a_remote_file_in_pieces() -> None:
    import random
    import uuid
    import zlib

    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"memory://pieces-{uuid.uuid4().hex}"
    blob = random.Random(3).randbytes(100_000)
    with fs.open(f"{root}/model.pt", "wb") as f:
        f.write(blob)
    files = {"model.pt": {"size": len(blob), "crc32": _checksum.checksum_hex(zlib.crc32(blob))}}
    assert len(_checksum.assign({"model.pt": len(blob)}, 4, 1000)) == 4
    assert _checksum.check_files(root, files, None, 4, min_piece=1000) == ([], 1, len(blob))
    with fs.open(f"{root}/model.pt", "wb") as f:
        f.write(blob[:60_000])  # truncated: the last two pieces read nothing
    problems, _, read = _checksum.check_files(root, files, None, 4, min_piece=1000)
    assert problems == ["model.pt is truncated: 60000 bytes, the manifest says 100000"]
    assert read == 60_000
