"""CheckpointManager's grouped options (KeepBest, NodeLocal) and their old flat keywords."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import ddpstate
from ddpstate.errors import DDPStateError, InvalidArgumentError
from ddpstate.manager import CheckpointManager, KeepBest, NodeLocal

LOSSES = {10: 0.9, 20: 0.1, 30: 0.5, 40: 0.95, 50: 0.2, 60: 0.7, 70: 0.6}


def _rotate(manager: CheckpointManager) -> list[int]:
    with manager:
        for step, loss in LOSSES.items():
            manager.save(step, {"x": step}, metrics={"loss": loss})
        return manager.steps()


def test_keep_best_keeps_the_best_by_metric(tmp_path: Path) -> None:
    best = KeepBest(2, "loss", mode="max")
    assert _rotate(CheckpointManager(tmp_path, keep_last=2, best=best)) == [10, 40, 60, 70]


def test_node_local_writes_the_local_tier(tmp_path: Path) -> None:
    local = NodeLocal(tmp_path / "shm", every=2, keep=1)
    with CheckpointManager(tmp_path / "run", local=local) as m:
        assert [m.save_local(s, {"w": torch.full((2,), float(s))}) for s in (1, 2, 3, 4)] == [
            False,
            True,
            False,
            True,
        ]
        m.wait()
        assert sorted(p.name for p in (tmp_path / "shm").iterdir() if p.name.startswith("step_"))
        w = {"w": torch.zeros(2)}
        assert m.restore(w) == 4 and m.restored_from is not None
        assert m.restored_from.tier == "local" and torch.equal(w["w"], torch.full((2,), 4.0))
    kept = [p.name for p in (tmp_path / "shm").iterdir() if p.name.startswith("step_")]
    assert kept == ["step_0000000004"]  # keep=1


def test_the_options_are_importable_from_ddpstate_and_frozen() -> None:
    assert ddpstate.KeepBest is KeepBest and ddpstate.NodeLocal is NodeLocal
    assert "KeepBest" not in ddpstate.__all__ and "KeepBest" in ddpstate.manager.__all__
    with pytest.raises(AttributeError):
        KeepBest(1, "loss").count = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "new"),
    [
        ({"keep_best": 2, "metric": "loss"}, "best=KeepBest(count=...)"),
        ({"local_dir": "shm"}, "local=NodeLocal(directory=...)"),
    ],
)
def test_old_keywords_warn_at_the_callers_line(
    tmp_path: Path, kwargs: dict[str, object], new: str
) -> None:
    if "local_dir" in kwargs:
        kwargs = {"local_dir": tmp_path / "shm"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CheckpointManager(tmp_path, **kwargs).close()  # type: ignore[arg-type]
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == len(kwargs)
    assert new in str(deprecations[0].message)
    assert all(w.filename == __file__ for w in deprecations)


def test_old_keywords_still_work(tmp_path: Path) -> None:
    with pytest.warns(DeprecationWarning, match=r"mode=\.\.\.\) is deprecated"):
        old = CheckpointManager(tmp_path / "a", keep_last=2, keep_best=2, metric="loss", mode="max")
    new = CheckpointManager(tmp_path / "b", keep_last=2, best=KeepBest(2, "loss", mode="max"))
    assert (old.keep_best, old.metric, old.mode) == (new.keep_best, new.metric, new.mode)
    assert _rotate(old) == _rotate(new) == [10, 40, 60, 70]
    with pytest.warns(DeprecationWarning, match="local_keep"):
        m = CheckpointManager(
            tmp_path / "c", local_dir=tmp_path / "shm", local_every=3, local_keep=1
        )
    with m:
        assert [m.save_local(s, {"w": torch.ones(1)}) for s in (2, 3)] == [False, True]


def test_mixing_old_and_new_spelling_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"pass best=KeepBest\(\.\.\.\) only"):
        CheckpointManager(tmp_path, best=KeepBest(1, "loss"), metric="acc")
    with pytest.raises(InvalidArgumentError, match="local_every= is its old spelling"):
        CheckpointManager(tmp_path, local=NodeLocal(tmp_path / "shm"), local_every=2)
    assert not tmp_path.joinpath("shm").exists()


def test_an_unknown_keyword_is_a_type_error(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_bets'"):
        CheckpointManager(tmp_path, keep_bets=2)
    with pytest.raises(TypeError, match="KeepBest"):
        CheckpointManager(tmp_path, best=2)  # type: ignore[arg-type]


def test_the_new_options_are_checked_with_todays_messages(tmp_path: Path) -> None:
    cases = [
        (KeepBest(-1, "loss"), None, "keep_best=-1 must be an int >= 0"),
        (KeepBest(1, ""), None, "needs metric="),
        (KeepBest(1, "loss", mode="best"), None, "mode='best' must be 'min' or 'max'"),
        (None, NodeLocal(tmp_path / "shm", every=0), "local_every=0 must be an int >= 1"),
        (None, NodeLocal(tmp_path / "shm", keep=0), "local_keep=0 must be an int >= 1"),
        (None, NodeLocal("memory://shm"), "not a URL"),
    ]
    for best, local, message in cases:
        with pytest.raises(DDPStateError, match=message):
            CheckpointManager(tmp_path, best=best, local=local)


def test_a_node_local_tier_without_a_folder_is_refused(tmp_path: Path) -> None:
    """NodeLocal(None) asks for a tier and names no folder: loud, not a silently absent tier."""
    with pytest.raises(InvalidArgumentError, match=r"NodeLocal\(directory=None\)"):
        CheckpointManager(tmp_path, local=NodeLocal(None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # The old spelling's local_dir=None still means "no tier", as it always did.
        manager = CheckpointManager(tmp_path, local_dir=None, local_every=5)
    with manager, pytest.raises(InvalidArgumentError, match="local_dir"):
        manager.save_local(1, {"w": torch.ones(1)})
