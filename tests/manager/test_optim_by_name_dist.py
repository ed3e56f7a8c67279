"""Optimizer state by parameter name across DDP: a 2-rank gloo save restores into a plain model
(and a plain save into DDP) after the layers were declared in another order, bitwise.

Every rank trains on the same batches, so DDP's averaged gradient is each rank's own
gradient exactly (two equal halves) and a plain model's step is the same step bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpstate.errors import OptimizerStateMismatchError
from ddpstate.manager import CheckpointManager
from tests.manager.test_optim_by_name import (
    Original,
    Reordered,
    _assert_bitwise,
    _restore_and_step,
    _run_and_save,
    _step,
    adam,
)
from tests.multiproc import run_ranks

pytestmark = pytest.mark.slow

K = 3


def _ddp_train_and_save(rank: int, world: int, directory: str) -> dict[str, torch.Tensor]:
    return _run_and_save(Path(directory), adam, wrap=DDP, k=K)


def _ddp_restore_and_step(rank: int, world: int, directory: str) -> dict[str, torch.Tensor]:
    return _restore_and_step(Path(directory), adam, wrap=DDP, k=K)


@pytest.mark.filterwarnings("ignore:CheckpointManager.restore. step 3 was saved by 2 ranks")
def test_ddp_save_restores_into_plain_reordered_model(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    expected = run_ranks(_ddp_train_and_save, 2, args=(str(directory),))
    _assert_bitwise(expected[0], expected[1])
    _assert_bitwise(expected[0], _restore_and_step(directory, adam, k=K))


def test_plain_save_restores_into_ddp_reordered_model(tmp_path: Path) -> None:
    expected = _run_and_save(tmp_path, adam, k=K)
    results = run_ranks(_ddp_restore_and_step, 2, args=(str(tmp_path),))
    for rank in range(2):
        _assert_bitwise(expected, results[rank])


def _refused_on_every_rank(rank: int, world: int, directory: str) -> dict[str, Any]:
    model = DDP(Reordered())
    every = adam(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    try:
        CheckpointManager(directory).restore({"model": model, "optimizer": every})
    except OptimizerStateMismatchError as exc:
        untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        return {"error": str(exc), "untouched": untouched, "state": len(every.state)}
    return {"error": None}


def test_layout_refusal_reaches_every_rank_before_anything_loads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Original()
    enc_only = adam(model.enc.parameters())
    _step(model, enc_only, 0)
    CheckpointManager(tmp_path).save(1, {"model": model, "optimizer": enc_only})
    results = run_ranks(_refused_on_every_rank, 2, args=(str(tmp_path),))
    for rank in range(2):
        assert results[rank]["error"] is not None, rank
        assert "'dec.weight'" in results[rank]["error"]
        assert results[rank]["untouched"] and results[rank]["state"] == 0
