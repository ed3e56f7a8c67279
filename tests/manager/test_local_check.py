"""The local tier's restore check split across a node's ranks (_manager/local_check.py).

Real gloo groups and real files: a byte flipped in a file that a non-zero local
rank checks must make that node skip the step, with the warning one process
checking the whole folder gives, on every rank of the node.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch import nn

from ddpstate import _checksum, _manifest
from ddpstate._manager import verify_split
from ddpstate.manager import MANIFEST_NAME, CheckpointManager, NodeLocal
from tests.multiproc import run_ranks

_LOCAL_STEP = 4


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {
        "model": nn.Linear(64, 64),
        "head": nn.Linear(64, 8),
        "extra": {"momentum": torch.randn(512)},
        "epoch": seed,
    }


def _place(rank: int, per_node: int, lws: Optional[str], root: str) -> str:
    """Set this rank's node environment; return its node's local folder."""
    os.environ["LOCAL_RANK"] = str(rank % per_node)
    if lws is not None:
        os.environ["LOCAL_WORLD_SIZE"] = lws
    else:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    return os.path.join(root, "shm", f"node{rank // per_node}")


def _save(rank: int, world: int, root: str, per_node: int, lws: Optional[str]) -> None:
    local = _place(rank, per_node, lws, root)
    with CheckpointManager(os.path.join(root, "run"), local=NodeLocal(local, every=2)) as m:
        m.save(2, _state(2))
        m.save_local(_LOCAL_STEP, _state(_LOCAL_STEP))


def _spied_restore(root: str, local: str, state: dict[str, Any]) -> dict[str, Any]:
    """Restore ``state``, spying on each share: (step, index, count, [(file, start, size)])."""
    checked: list[tuple[int, int, int, list[tuple[str, int, int]]]] = []
    real = verify_split.check_share

    def recording(folder: str, manifest: Any, opts: Any, index: int, count: int) -> Any:
        found = real(folder, manifest, opts, index, count)
        checked.append((manifest["step"], index, count, [(f, r.start, r.size) for f, r in found]))
        return found

    verify_split.check_share = recording  # a spy: the real check runs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(os.path.join(root, "run"), local=NodeLocal(local, every=2)) as m:
            step = m.restore(state)
            source = m.restored_from
    assert source is not None
    return {
        "step": step,
        "tier": source.tier,
        "sender": source.sender,
        "warnings": [str(w.message) for w in caught if "local" in str(w.message)],
        "checked": checked,
    }


def _restore(rank: int, world: int, root: str, per_node: int, lws: Optional[str]) -> dict[str, Any]:
    state = _state(99)
    result = _spied_restore(root, _place(rank, per_node, lws, root), state)
    return {
        **result,
        "epoch": state["epoch"],
        "momentum": state["extra"]["momentum"].tolist(),
        # The files each share read.
        "checked": [(*share, [f for f, _, _ in reads]) for *share, reads in result["checked"]],
    }


def _flip_a_file_of_local_rank_1(folder: Path) -> str:
    files = json.loads((folder / MANIFEST_NAME).read_text())["files"]
    shares = _checksum.assign({n: e["size"] for n, e in files.items()}, 2)
    assert shares[0] and shares[1], shares  # both ranks have work, or the test proves nothing
    victim, start, stop = shares[1][0]
    data = bytearray((folder / victim).read_bytes())
    data[(start + (len(data) if stop is None else stop)) // 2] ^= 0xFF  # in rank 1's piece
    (folder / victim).write_bytes(bytes(data))
    return victim


def _local_shares(result: dict[str, Any]) -> list[tuple[int, int]]:
    # The durable restore's split check goes through check_share too (step 2).
    return [(index, count) for step, index, count, _ in result["checked"] if step == _LOCAL_STEP]


def _expected_warning(folder: Path) -> str:
    # What one process checking the whole folder reports (the text before the split).
    problems = _manifest.check_folder(str(folder), _LOCAL_STEP, None).problems
    assert problems
    return f"CheckpointManager.restore: skipping the local {folder}: {'; '.join(problems)}"


@pytest.mark.slow
@pytest.mark.parametrize("lws", ["2", None, "4"], ids=["launcher", "unset", "wrong"])
def test_a_flip_in_local_rank_1s_share_falls_back_to_durable(
    tmp_path: Path, lws: Optional[str]
) -> None:
    args = (str(tmp_path), 2, lws)
    run_ranks(_save, 2, args=args)
    folder = tmp_path / "shm" / "node0" / _manifest.step_name(_LOCAL_STEP)
    victim = _flip_a_file_of_local_rank_1(folder)
    expected = _expected_warning(folder)
    after = run_ranks(_restore, 2, args=args)
    durable_momentum = _state(2)["extra"]["momentum"].tolist()
    for result in after:
        assert (result["step"], result["tier"], result["epoch"]) == (2, "durable", 2)
        assert result["momentum"] == durable_momentum
        assert result["warnings"] == [expected]  # the same text, on every rank of the node
    if lws is not None:
        # Local rank 1 checked its share of the node's step and found the flipped file
        # (under a wrong LOCAL_WORLD_SIZE, in the second round, split by the real membership).
        assert any(c[:3] == (_LOCAL_STEP, 1, 2) and victim in c[3] for c in after[1]["checked"])
    if lws == "2":
        assert _local_shares(after[0]) == [(0, 2)]
    elif lws is None:
        # Without LOCAL_WORLD_SIZE the node's local rank 0 checks it all in the one round
        # (share 0 of 1; local rank 1 holds share 1 of 1, which is empty).
        assert (_local_shares(after[0]), _local_shares(after[1])) == ([(0, 1)], [(1, 1)])
        assert victim in after[0]["checked"][0][3]
    else:
        # A LOCAL_WORLD_SIZE of 4 left shares 2 and 3 unchecked: a second round.
        assert _local_shares(after[1]) == [(1, 4), (1, 2)]


@pytest.mark.slow
def test_sound_local_step_takes_one_round_split_by_local_rank(tmp_path: Path) -> None:
    args = (str(tmp_path), 2, "2")
    run_ranks(_save, 2, args=args)
    after = run_ranks(_restore, 2, args=args)
    expected_momentum = _state(_LOCAL_STEP)["extra"]["momentum"].tolist()
    for rank, result in enumerate(after):
        assert (result["step"], result["tier"], result["warnings"]) == (_LOCAL_STEP, "local", [])
        assert result["momentum"] == expected_momentum
        assert _local_shares(result) == [(rank, 2)]


@pytest.mark.slow
def test_four_ranks_a_node_with_a_flipped_share_receives_the_other_nodes_copy(
    tmp_path: Path,
) -> None:
    args = (str(tmp_path), 2, "2")  # ranks 0-1 on node 0, ranks 2-3 on node 1
    run_ranks(_save, 4, args=args)
    folder = tmp_path / "shm" / "node1" / _manifest.step_name(_LOCAL_STEP)
    victim = _flip_a_file_of_local_rank_1(folder)
    expected = _expected_warning(folder)
    after = run_ranks(_restore, 4, args=args)
    assert [(r["tier"], r["sender"]) for r in after] == [
        ("local", None),
        ("local", None),
        ("peer", 0),
        ("peer", 0),
    ]
    expected_momentum = _state(_LOCAL_STEP)["extra"]["momentum"].tolist()
    assert all(r["step"] == _LOCAL_STEP and r["momentum"] == expected_momentum for r in after)
    assert [r["warnings"] for r in after] == [[], [], [expected], [expected]]
    # Node 1's local rank 1 read the victim.
    assert any(c[:3] == (_LOCAL_STEP, 1, 2) and victim in c[3] for c in after[3]["checked"])
    # The received copy replaced the damaged one and checks clean.
    assert _manifest.check_folder(str(folder), _LOCAL_STEP, None).problems == []


def _big(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"weights": torch.randn(5 << 20), "epoch": seed}  # 20 MiB: split across ranks


def _save_big(rank: int, world: int, root: str) -> None:
    local = _place(rank, 2, "2", root)
    with CheckpointManager(os.path.join(root, "run"), local=NodeLocal(local, every=2)) as m:
        m.save(2, _big(2))
        m.save_local(_LOCAL_STEP, _big(_LOCAL_STEP))


def _restore_big(rank: int, world: int, root: str) -> dict[str, Any]:
    state = _big(99)
    result = _spied_restore(root, _place(rank, 2, "2", root), state)
    return {
        **result,
        "exact": bool(torch.equal(state["weights"], _big(result["step"])["weights"])),
        "reads": [
            read
            for step, _, _, reads in result["checked"]
            if step == _LOCAL_STEP
            for read in reads
            if read[0] == "weights.pt"
        ],
    }


@pytest.mark.slow
@pytest.mark.parametrize("flip", [False, True], ids=["sound", "flipped"])
def test_one_large_local_file_is_checked_half_by_each_local_rank(
    tmp_path: Path, flip: bool
) -> None:
    run_ranks(_save_big, 2, args=(str(tmp_path),))
    folder = tmp_path / "shm" / "node0" / _manifest.step_name(_LOCAL_STEP)
    size = (folder / "weights.pt").stat().st_size
    expected: list[str] = []
    if flip:
        victim = _flip_a_file_of_local_rank_1(folder)
        assert victim == "weights.pt"
        expected.append(_expected_warning(folder))
    after = run_ranks(_restore_big, 2, args=(str(tmp_path),))
    for result in after:
        want = (2, "durable", True) if flip else (_LOCAL_STEP, "local", True)
        assert (result["step"], result["tier"], result["exact"]) == want
        assert result["warnings"] == expected
    # Each local rank read its own part of the one file, the two parts adding up to it.
    (first,), (second,) = after[0]["reads"], after[1]["reads"]
    assert first[1] == 0 and second[1] == first[2] > 0
    assert first[2] + second[2] == size
