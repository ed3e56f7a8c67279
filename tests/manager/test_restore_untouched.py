"""A restore that finds damage leaves the live state as it was, or restores an older step whole.

Every rank checks the whole step (every byte's CRC-32, DCP shards included; entry files
and RNG states read; DCP's load plan against the live keys and shapes) before anything
is loaded into the live model and optimizer.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ddpstate
from ddpstate._manifest import DCP_SUBDIR
from tests.multiproc import run_ranks

_UNTOUCHED = "the live state is as it was before restore"


class Marker:
    """A class weights_only loading refuses unless it is allowed by safe_globals."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Marker) and other.value == self.value


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 8))


def _train(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(4, 64, generator=gen)).pow(2).sum().backward()
    opt.step()


def _live(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _flip_late(shard: Path) -> None:
    """Damage the last item of a shard: the items before it read (and pass) first."""
    data = bytearray(shard.read_bytes())
    data[-16] ^= 0xFF
    shard.write_bytes(bytes(data))


def _saved_run(folder: Path, steps: tuple[int, ...]) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with ddpstate.CheckpointManager(folder, writers="all") as manager:
        for step in steps:
            _train(model, opt, step)
            manager.save(step, {"model": model, "optimizer": opt})
    _train(model, opt, 99)  # the live state has moved on since the last save
    return model, opt


@pytest.mark.parametrize("named", [True, False])
def test_a_shard_failing_its_check_mid_restore_leaves_model_and_optimizer_as_they_were(
    named: bool, tmp_path: Path
) -> None:
    """Regression: DCP read straight into the live tensors, so a CRC failure in the middle of
    a restore (step= given, or no older step to fall back to) left the model half-loaded."""
    model, opt = _saved_run(tmp_path, (1,))
    before = _live(model, opt)
    _flip_late(tmp_path / "step_0000000001" / DCP_SUBDIR / "__0_0.distcp")
    with (
        ddpstate.CheckpointManager(tmp_path, writers="all") as manager,
        pytest.raises(ddpstate.CheckpointCorruptError) as caught,
    ):
        manager.restore({"model": model, "optimizer": opt}, step=1 if named else None)
    assert _same(_live(model, opt), before)
    assert "__0_0.distcp" in str(caught.value) and _UNTOUCHED in str(caught.value)


def test_a_damaged_newest_step_restores_the_older_one_whole(tmp_path: Path) -> None:
    """restore(step=None): the newest step's shard fails mid-read; the older step is
    restored whole, as if the newest had failed its check before."""
    _saved_run(tmp_path, (1, 2))
    _flip_late(tmp_path / "step_0000000002" / DCP_SUBDIR / "__0_0.distcp")
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with ddpstate.CheckpointManager(tmp_path, writers="all") as manager:
            assert manager.restore({"model": model, "optimizer": opt}) == 1
    assert any("step_0000000002" in str(w.message) for w in seen)
    torch.manual_seed(0)
    reference = _net()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.1)
    _train(reference, ref_opt, 1)  # what step 1 saved
    assert _same(_live(model, opt), _live(reference, ref_opt))


def test_an_entry_file_refused_after_the_dcp_entries_read_leaves_them_untouched(
    tmp_path: Path,
) -> None:
    """A step with DCP entries and a file entry: the file is refused (a class weights_only
    loading does not allow) after the shards were read; the model stays as it was."""
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt, 1)
    state = {"model": model, "optimizer": opt, "marker": Marker(3)}
    with ddpstate.CheckpointManager(tmp_path, writers="all", safe_globals=[Marker]) as manager:
        manager.save(1, state)
    _train(model, opt, 2)
    before = _live(model, opt)
    with (
        ddpstate.CheckpointManager(tmp_path, writers="all") as manager,
        pytest.raises(ddpstate.UnsafeCheckpointError) as caught,
    ):
        manager.restore({"model": model, "optimizer": opt, "marker": None})
    assert _same(_live(model, opt), before)
    assert "marker.pt" in str(caught.value) and _UNTOUCHED in str(caught.value)


def test_a_read_failing_after_every_check_passed_says_the_state_may_be_partly_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step passed its checks, then a shard vanished before it was read (an I/O failure
    midway): the error must not claim the state is untouched, and no older step is tried."""
    from ddpstate._manager import restore as restore_module

    model, opt = _saved_run(tmp_path, (1, 2))
    staged = restore_module._stage_step

    def vanish_after_checks(*args: Any, **kwargs: Any) -> Any:
        out = staged(*args, **kwargs)
        (tmp_path / "step_0000000002" / DCP_SUBDIR / "__0_0.distcp").unlink()
        return out

    monkeypatch.setattr(restore_module, "_stage_step", vanish_after_checks)
    with (
        ddpstate.CheckpointManager(tmp_path, writers="all") as manager,
        pytest.raises(ddpstate.CheckpointCorruptError) as caught,
    ):
        manager.restore({"model": model, "optimizer": opt})
    text = str(caught.value)
    assert "step_0000000002" in text and restore_module.PARTLY in text, text
    assert _UNTOUCHED not in text


# --------------------------------------------------------------------------- DTensors


def _fsdp_damaged_restore(rank: int, world: int, folder: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = _net()
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt, 1 + rank)
    with ddpstate.CheckpointManager(folder) as manager:
        manager.save(1, {"model": model, "optimizer": opt})
    _train(model, opt, 7 + rank)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    before = copy.deepcopy(get_state_dict(model, opt, options=options))
    torch.distributed.barrier()
    if rank == 0:
        _flip_late(Path(folder, "step_0000000001", DCP_SUBDIR, "__1_0.distcp"))
    torch.distributed.barrier()
    error = ""
    with ddpstate.CheckpointManager(folder) as manager:
        try:
            manager.restore({"model": model, "optimizer": opt}, step=1)
        except ddpstate.CheckpointCorruptError as exc:
            error = str(exc)
    after = get_state_dict(model, opt, options=options)
    return {"error": error, "unchanged": rank != 0 or _same(before, after)}


@pytest.mark.slow
def test_dtensor_shards_stay_as_they_were_on_every_rank_when_a_shard_fails(
    tmp_path: Path,
) -> None:
    outcomes = run_ranks(_fsdp_damaged_restore, 2, args=(str(tmp_path / "run"),), timeout=150)
    for out in outcomes:
        assert out["unchanged"]
        assert "__1_0.distcp" in out["error"] and _UNTOUCHED in out["error"], out["error"]
