"""Misuse refused with the real fix, on real 2-rank gloo groups (issue #28 rows 5-8, 10).

Row 5: a whole model or a function in the state; row 6: a folder given to ``save``;
row 7: ``load_model_state`` with unrelated keys names the file; row 8: warnings name the
caller's line, once per job; row 10: the "still waiting" warning names ``barrier=False``.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ddpstate
from ddpstate.errors import DDPStateError, UnsafeCheckpointError
from tests.multiproc import run_ranks


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except DDPStateError as exc:
        return type(exc).__name__, str(exc)
    return "returned", ""


def _scale(x: float) -> float:
    return 2 * x


# --------------------------------------------------------------------------- row 5


def _save_whole_models(rank: int, world: int, folder: str) -> dict[str, tuple[str, str]]:
    model = ddpstate.wrap_ddp(nn.Linear(3, 2))
    out = {"ddp": _outcome(lambda: ddpstate.save(model, Path(folder, "model.pt")))}
    plain = nn.Linear(3, 2)
    out["plain"] = _outcome(lambda: ddpstate.save({"net": plain}, Path(folder, "plain.pt")))
    manager = ddpstate.CheckpointManager(Path(folder, "run"))
    state = {"model": model, "loss_fn": lambda y: y.sum(), "extra": {"net": plain}}
    out["manager_lambda"] = _outcome(lambda: manager.save(1, state))
    out["manager_model"] = _outcome(lambda: manager.save(1, {"model": model, "x": {"m": plain}}))
    manager.close()
    return out


@pytest.mark.slow
def test_a_whole_model_or_a_lambda_is_refused_with_the_real_fix_on_every_rank(
    tmp_path: Path,
) -> None:
    for out in run_ranks(_save_whole_models, 2, args=(str(tmp_path),)):
        for case, (kind, message) in out.items():
            assert kind == "UnsafeCheckpointError", (case, kind, message)
            assert "safe_globals" not in message, (case, message)
            assert "free space" not in message and "permissions" not in message, message
        assert "model.state_dict()" in out["ddp"][1]
        assert "save_model_state(model, path)" in out["ddp"][1]
        assert "DistributedDataParallel" in out["ddp"][1]
        assert "obj['net'] is a whole model (Linear" in out["plain"][1]
        message = out["manager_lambda"][1]
        assert "state['loss_fn'] is a function (" in message and "<lambda>" in message
        assert "cannot be saved" in message
        assert "save what it computes or its configuration" in message
        assert "state['x']['m'] is a whole model" in out["manager_model"][1]
    assert not list(tmp_path.glob("*.pt"))
    assert not list((tmp_path / "run").glob("step_*"))


def _local_object() -> Any:
    class Settings:
        lr = 0.1

    return Settings()


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (_scale, "is a function (tests.mistakes.test_mistakes_misuse._scale)"),
        (
            functools.partial(_scale, 2.0),
            "is a function (tests.mistakes.test_mistakes_misuse._scale)",
        ),
        (nn.Linear(1, 1).forward, "is a function (torch.nn.modules.linear.Linear.forward)"),
        (len, "is a function (builtins.len)"),
        (_local_object(), "a class defined inside a function"),
    ],
)
def test_functions_and_local_objects_never_get_safe_globals_advice(
    tmp_path: Path, value: Any, shown: str
) -> None:
    with pytest.raises(UnsafeCheckpointError) as info:
        ddpstate.save({"config": {"hook": value}}, tmp_path / "x.pt")
    message = str(info.value)
    assert "obj['config']['hook']" in message and shown in message, message
    assert "safe_globals" not in message
    assert not (tmp_path / "x.pt").exists()


# --------------------------------------------------------------------------- row 6


def _save_to_a_folder(rank: int, world: int, folder: str) -> dict[str, tuple[str, str]]:
    return {
        "save": _outcome(lambda: ddpstate.save({"w": torch.ones(2)}, folder)),
        "load": _outcome(lambda: ddpstate.load(folder)),
    }


@pytest.mark.slow
def test_a_folder_given_to_save_asks_for_a_file_path_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("kept")
    for out in run_ranks(_save_to_a_folder, 2, args=(str(tmp_path),)):
        kind, message = out["save"]
        assert kind == "InvalidArgumentError", message
        assert f"{tmp_path} is a folder; save needs a file path such as" in message
        assert os.path.join(str(tmp_path), "model.pt") in message
        assert "free space" not in message
        kind, message = out["load"]
        assert kind == "CheckpointFormatError" and "a folder, not a checkpoint" in message
        assert str(tmp_path) in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# --------------------------------------------------------------------------- row 7


def _unrelated_keys(rank: int, world: int, path: str) -> tuple[str, str]:
    return _outcome(lambda: ddpstate.load_model_state(nn.Linear(3, 2), path))


@pytest.mark.slow
def test_key_mismatch_from_load_model_state_names_the_file_on_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "other.pt"
    torch.save({"epoch": 3, "model": {"encoder.w": torch.ones(2)}}, path)
    for kind, message in run_ranks(_unrelated_keys, 2, args=(str(path),)):
        assert kind == "KeyMismatchError", message
        assert message.startswith(f"{path} (the state dict at checkpoint['model'])"), message
        assert "'encoder.w'" in message


# --------------------------------------------------------------------------- row 8


def _tied() -> nn.Module:
    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight
    return model


def test_tied_tensor_warning_names_the_caller_and_is_said_once_per_model(tmp_path: Path) -> None:
    model = _tied()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddpstate.save_model_state(model, tmp_path / "a.safetensors")
        ddpstate.save_model_state(model, tmp_path / "b.safetensors")  # the same tied model
        ddpstate.save(model.state_dict(), tmp_path / "c.safetensors")
    tied = [w for w in caught if "share memory" in str(w.message)]
    assert len(tied) == 1, [str(w.message) for w in tied]
    assert tied[0].filename == __file__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddpstate.save_model_state(_tied(), tmp_path / "d.safetensors")  # another model: said
    assert [w.filename for w in caught if "share memory" in str(w.message)] == [__file__]


def test_manager_warnings_name_the_callers_line(tmp_path: Path) -> None:
    model = _tied()
    with ddpstate.CheckpointManager(tmp_path, format="safetensors") as manager:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manager.save(0, {"model": model})
            manager.save(3, {"model": model})  # the same tied model: not said again
        assert [w.filename for w in caught if "share memory" in str(w.message)] == [__file__]
    with ddpstate.CheckpointManager(tmp_path / "plain") as manager:
        manager.save(1, {"w": torch.ones(2)})
        manager.save(2, {"w": torch.ones(2)})
        (tmp_path / "plain" / "step_0000000002" / "w.pt").write_bytes(b"damaged")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert manager.restore({"w": torch.zeros(2)}) == 1
    skipped = [w for w in caught if "skipping" in str(w.message)]
    assert skipped and {w.filename for w in skipped} == {__file__}


def _warnings_on_two_ranks(rank: int, world: int, folder: str) -> dict[str, list[str]]:
    tied = _tied()
    bn = ddpstate.wrap_ddp(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), batchnorm="auto")
    bn(torch.randn(8, 3) + rank)  # the ranks' running statistics now differ
    source = nn.Linear(3, 4)
    ddpstate.save(source.state_dict(), Path(folder, "wide.pt"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddpstate.save_model_state(tied, Path(folder, "tied.safetensors"))
        ddpstate.save_model_state(bn, Path(folder, "bn.safetensors"))
        ddpstate.load_model_state(nn.Linear(3, 2), Path(folder, "wide.pt"), ignore_mismatched=True)
    found: dict[str, list[str]] = {}
    for w in caught:
        text = str(w.message)
        kind = (
            "tied" if "share memory" in text
            else "batchnorm" if "BatchNorm running statistics differ" in text
            else "skipped" if "ignore_mismatched" in text
            else "other"
        )  # fmt: skip
        found.setdefault(kind, []).append(w.filename)
    return found


@pytest.mark.slow
def test_on_two_ranks_only_rank_zero_warns_and_at_the_callers_line(tmp_path: Path) -> None:
    here = [__file__]
    ranks = run_ranks(_warnings_on_two_ranks, 2, args=(str(tmp_path),))
    assert ranks[0] == {"tied": here, "batchnorm": here, "skipped": here}, ranks[0]
    assert ranks[1] == {}, ranks[1]


# --------------------------------------------------------------------------- row 10


def _only_rank_zero_saves(rank: int, world: int, folder: str) -> Any:
    if rank == 1:
        time.sleep(4)
        return []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ddpstate.BarrierTimeoutError):
            ddpstate.save({"w": torch.ones(2)}, Path(folder, "model.pt"), timeout=1.5)
    return [(str(w.message), w.filename) for w in caught if "still waiting" in str(w.message)]


@pytest.mark.slow
def test_still_waiting_names_barrier_false_for_one_rank_code_at_the_callers_line(
    tmp_path: Path,
) -> None:
    env = {"DDPSTATE_WARN_AFTER": "0.5"}
    warned, quiet = run_ranks(_only_rank_zero_saves, 2, args=(str(tmp_path),), env=env)
    assert warned and not quiet
    for message, filename in warned:
        assert "a framework hook, evaluation on rank 0" in message
        assert "pass barrier=False" in message
        assert filename == __file__


def _two_ranks_wait_for_a_third(rank: int, world: int) -> Any:
    if rank == 2:
        time.sleep(3)
        return []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ddpstate.BarrierTimeoutError):
            ddpstate.barrier(timeout=1.5)
    return [str(w.message) for w in caught if "still waiting" in str(w.message)]


@pytest.mark.slow
def test_of_several_waiting_ranks_only_the_lowest_warns() -> None:
    env = {"DDPSTATE_WARN_AFTER": "0.5"}
    zero, one, two = run_ranks(_two_ranks_wait_for_a_third, 3, env=env)
    assert zero and all("rank 0: still waiting" in m and "for rank 2 of 3" in m for m in zero)
    assert one == [] and two == []
