"""Optimizer state saved and restored by parameter name; dtype changes never silent.

Real optimizers, real manager folders: a model refactored so its layers are
declared in another order (or wrapped differently) must take each parameter's
own moments; a float32 checkpoint must not slip into a bfloat16 model unnoticed.
"""

from __future__ import annotations

import json
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpstate import load_model_state
from ddpstate._manifest import (
    MANIFEST_CRC_FIELD,
    manifest_bytes,
    manifest_crc,
    verify_checkpoint,
)
from ddpstate.errors import DTypeMismatchError, InvalidArgumentError, OptimizerStateMismatchError
from ddpstate.manager import MANIFEST_NAME, CheckpointManager

Opt = Callable[[Any], torch.optim.Optimizer]


class Original(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.tanh(self.enc(x)))


class Reordered(nn.Module):
    """The same model after a refactor: ``dec`` declared before ``enc``."""

    def __init__(self) -> None:
        super().__init__()
        self.dec = nn.Linear(4, 4)
        self.enc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.tanh(self.enc(x)))


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, dampening=0.1)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)


def _step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    x, y = _batch(i)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    inner = getattr(model, "module", model)
    inner = getattr(inner, "_orig_mod", inner)
    return {k: v.detach().clone() for k, v in inner.named_parameters()}


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for state in opt.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _run_and_save(
    directory: Path, make_opt: Opt, wrap: Callable[[nn.Module], nn.Module] = lambda m: m, k: int = 3
) -> dict[str, torch.Tensor]:
    """Train Original k steps, save, take step k+1; return the parameters after it, by name."""
    torch.manual_seed(0)
    model = wrap(Original())
    opt = make_opt(model.parameters())
    for i in range(k):
        _step(model, opt, i)
    CheckpointManager(directory).save(k, {"model": model, "optimizer": opt})
    _step(model, opt, k)
    return _named(model)


def _restore_and_step(
    directory: Path, make_opt: Opt, wrap: Callable[[nn.Module], nn.Module] = lambda m: m, k: int = 3
) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
    model = wrap(Reordered())
    opt = make_opt(model.parameters())
    assert CheckpointManager(directory).restore({"model": model, "optimizer": opt}) == k
    _step(model, opt, k)
    return _named(model)


def _assert_bitwise(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(got)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


# --------------------------------------------------------------------------- by name


@pytest.mark.parametrize("make_opt", [adam, sgd], ids=["adam", "sgd_momentum"])
def test_reordered_module_resumes_bitwise(tmp_path: Path, make_opt: Opt) -> None:
    expected = _run_and_save(tmp_path, make_opt)
    _assert_bitwise(expected, _restore_and_step(tmp_path, make_opt))


def _data_parallel(m: nn.Module) -> nn.Module:
    return nn.DataParallel(m)


def _compiled(m: nn.Module) -> nn.Module:
    return torch.compile(m, backend="eager")  # type: ignore[return-value]


@pytest.mark.parametrize(
    "save_wrap, restore_wrap",
    [(_data_parallel, lambda m: m), (lambda m: m, _data_parallel), (_compiled, lambda m: m)],
    ids=["dataparallel_to_plain", "plain_to_dataparallel", "compiled_to_plain"],
)
def test_wrapped_save_restores_by_name(
    tmp_path: Path, save_wrap: Callable[[nn.Module], nn.Module], restore_wrap: Any
) -> None:
    expected = _run_and_save(tmp_path, adam, save_wrap)
    _assert_bitwise(expected, _restore_and_step(tmp_path, adam, restore_wrap))


def test_saved_file_is_plain_and_keyed_by_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.DataParallel(Original())
    opt = adam(model.parameters())
    _step(model, opt, 0)
    CheckpointManager(tmp_path).save(1, {"model": model, "optimizer": opt})
    saved = torch.load(tmp_path / "step_0000000001" / "optimizer.pt", weights_only=True)
    names = ["enc.weight", "enc.bias", "dec.weight", "dec.bias"]
    assert saved["param_groups"][0]["params"] == names
    assert sorted(saved["state"]) == sorted(names)
    assert torch.equal(
        saved["state"]["dec.weight"]["exp_avg"], opt.state[model.module.dec.weight]["exp_avg"]
    )


def _two_groups(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(
        [
            {"params": list(model.enc.parameters()), "lr": 1e-2},
            {"params": list(model.dec.parameters()), "lr": 3e-3},
        ]
    )


def test_split_group_restores_each_groups_settings_by_name(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Original()
    opt = _two_groups(model)
    for i in range(3):
        _step(model, opt, i)
    CheckpointManager(tmp_path).save(3, {"model": model, "optimizer": opt})
    _step(model, opt, 3)
    expected = _named(model)

    torch.manual_seed(1)
    live = Reordered()
    # Three groups, in another order: dec's group split, enc's whole.
    three = torch.optim.Adam(
        [
            {"params": [live.dec.bias], "lr": 0.5},
            {"params": [live.enc.weight, live.enc.bias], "lr": 0.5},
            {"params": [live.dec.weight], "lr": 0.5},
        ]
    )
    CheckpointManager(tmp_path).restore({"model": live, "optimizer": three})
    assert [g["lr"] for g in three.param_groups] == [3e-3, 1e-2, 3e-3]
    _step(live, three, 3)
    _assert_bitwise(expected, _named(live))


def _saved_two_groups(directory: Path) -> None:
    torch.manual_seed(0)
    model = Original()
    opt = _two_groups(model)
    _step(model, opt, 0)
    CheckpointManager(directory).save(1, {"model": model, "optimizer": opt})


def test_merged_groups_are_refused_and_nothing_changes(tmp_path: Path) -> None:
    _saved_two_groups(tmp_path)
    torch.manual_seed(1)
    live = Reordered()
    one = adam(live.parameters())
    _step(live, one, 5)
    before = _snapshot(live, one)
    with pytest.raises(OptimizerStateMismatchError) as info:
        CheckpointManager(tmp_path).restore({"model": live, "optimizer": one})
    text = str(info.value)
    assert "live param group 0" in text and "saved group 0" in text and "saved group 1" in text
    assert "'dec.weight'" in text and "'enc.weight'" in text
    assert _same(before, _snapshot(live, one))
    assert one.param_groups[0]["lr"] == 1e-2


def test_parameter_in_no_saved_group_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Original()
    enc_only = adam(model.enc.parameters())
    _step(model, enc_only, 0)
    CheckpointManager(tmp_path).save(1, {"model": model, "optimizer": enc_only})
    live = Reordered()
    every = adam(live.parameters())
    _step(live, every, 2)
    before = _snapshot(live, every)
    with pytest.raises(OptimizerStateMismatchError) as info:
        CheckpointManager(tmp_path).restore({"model": live, "optimizer": every})
    assert "'dec.weight'" in str(info.value) and "'dec.bias'" in str(info.value)
    assert sorted(info.value.missing) == ["dec.bias", "dec.weight"]
    assert _same(before, _snapshot(live, every))


def test_optimizer_without_its_model_warns_and_restores_by_position(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Original()
    opt = adam(model.parameters())
    _step(model, opt, 0)
    with pytest.warns(UserWarning, match="no model in the same state") as record:
        CheckpointManager(tmp_path).save(1, {"optimizer": opt})
    assert record[0].filename == __file__
    assert "'model': model, 'optimizer': optimizer" in str(record[0].message)
    twin = Original()
    fresh = adam(twin.parameters())
    CheckpointManager(tmp_path).restore({"optimizer": fresh})
    assert torch.equal(
        fresh.state[twin.enc.weight]["exp_avg"], opt.state[model.enc.weight]["exp_avg"]
    )


def test_optimizer_over_two_model_entries_is_refused(tmp_path: Path) -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = adam([*a.parameters(), *b.parameters()])
    with pytest.raises(InvalidArgumentError, match="exactly one model entry") as info:
        CheckpointManager(tmp_path).save(1, {"a": a, "b": b, "optimizer": opt})
    assert "nn.ModuleDict" in str(info.value)


def test_by_name_state_without_model_at_restore_is_refused(tmp_path: Path) -> None:
    _run_and_save(tmp_path, adam)
    live = Original()
    opt = adam(live.parameters())
    with pytest.raises(InvalidArgumentError, match="pass its model in the same state"):
        CheckpointManager(tmp_path).restore({"optimizer": opt}, strict=False)
    assert not opt.state


def _rewrite_entry(step_folder: Path, entry_file: str, value: Any) -> None:
    """Replace one entry file as an earlier ddpstate wrote it, manifest updated to match."""
    path = step_folder / entry_file
    torch.save(value, path)
    data = path.read_bytes()
    manifest = json.loads((step_folder / MANIFEST_NAME).read_text())
    record = manifest["files"][entry_file]
    record["size"] = len(data)
    record["crc32"] = f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
    manifest[MANIFEST_CRC_FIELD] = manifest_crc(manifest)
    (step_folder / MANIFEST_NAME).write_bytes(manifest_bytes(manifest))


def test_old_positional_checkpoint_still_restores(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Original()
    opt = adam(model.parameters())
    for i in range(3):
        _step(model, opt, i)
    CheckpointManager(tmp_path).save(3, {"model": model, "optimizer": opt})
    _rewrite_entry(tmp_path / "step_0000000003", "optimizer.pt", opt.state_dict())
    _step(model, opt, 3)
    expected = _named(model)
    torch.manual_seed(1)
    live = Original()  # the saving class: position is right for it
    live_opt = adam(live.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not verify_checkpoint(tmp_path / "step_0000000003").problems
        CheckpointManager(tmp_path).restore({"model": live, "optimizer": live_opt})
    _step(live, live_opt, 3)
    _assert_bitwise(expected, _named(live))


# --------------------------------------------------------------------------- dtypes


def test_restore_refuses_float32_into_bfloat16_unless_allowed(tmp_path: Path) -> None:
    _run_and_save(tmp_path, adam)
    live = Original().to(torch.bfloat16)
    opt = adam(live.parameters())
    before = _snapshot(live, opt)
    with pytest.raises(DTypeMismatchError) as info:
        CheckpointManager(tmp_path).restore({"model": live, "optimizer": opt})
    text = str(info.value)
    assert "'enc.weight' (saved float32, model bfloat16)" in text
    assert "allow_dtype_change=True" in text
    assert _same(before, _snapshot(live, opt)) and not opt.state
    CheckpointManager(tmp_path).restore({"model": live, "optimizer": opt}, allow_dtype_change=True)
    assert live.enc.weight.dtype == torch.bfloat16
    assert opt.state[live.enc.weight]["exp_avg"].dtype == torch.bfloat16


def test_restore_refuses_optimizer_state_of_another_dtype(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Original()
    opt = adam(model.parameters())
    _step(model, opt, 0)
    CheckpointManager(tmp_path).save(1, {"model": model, "optimizer": opt})
    live = Original().to(torch.bfloat16)
    live_opt = adam(live.parameters())
    # The model entry is left out: only the optimizer's state meets bfloat16 parameters.
    with pytest.raises(
        DTypeMismatchError, match=r"'enc.weight'/exp_avg \(saved float32, parameter bfloat16\)"
    ):
        CheckpointManager(tmp_path).restore({"net": live, "optimizer": live_opt}, strict=False)
    assert not live_opt.state


class _Counter(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("seen", torch.zeros(3, dtype=dtype))


def test_restore_refuses_int64_into_float32_even_when_allowed(tmp_path: Path) -> None:
    CheckpointManager(tmp_path).save(1, {"model": _Counter(torch.int64)})
    live = _Counter(torch.float32)
    with pytest.raises(DTypeMismatchError, match=r"'seen' \(saved int64, model float32\)"):
        CheckpointManager(tmp_path).restore({"model": live}, allow_dtype_change=True)


def test_load_model_state_warns_once_with_count_and_pairs(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save(Original().state_dict(), path)
    live = Original().to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        load_model_state(live, path)
    casts = [w for w in record if "cast" in str(w.message)]
    assert len(casts) == 1
    assert "cast 4 tensor(s)" in str(casts[0].message)
    assert "float32 -> bfloat16 (4)" in str(casts[0].message)
    assert casts[0].filename == __file__
    assert live.enc.weight.dtype == torch.bfloat16


def test_load_model_state_refuses_int64_into_float32(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    state = Original().state_dict()
    state["enc.weight"] = torch.ones(4, 4, dtype=torch.int64)
    torch.save(state, path)
    live = Original()
    before = live.enc.weight.detach().clone()
    with pytest.raises(DTypeMismatchError, match=r"'enc.weight' \(saved int64, model float32\)"):
        load_model_state(live, path)
    assert torch.equal(before, live.enc.weight)


@pytest.mark.parametrize("make_opt", [adam, sgd], ids=["adam", "sgd_momentum"])
def test_save_before_the_first_step_leaves_the_optimizer_as_it_was(
    tmp_path: Path, make_opt: Opt
) -> None:
    # torch's get_optimizer_state_dict would run a zero-gradient step here (Adam's
    # step count 1, SGD's first dampened step changed); the by-name save must not.
    expected = _run_and_save(tmp_path, make_opt, k=0)
    saved = torch.load(tmp_path / "step_0000000000" / "optimizer.pt", weights_only=True)
    assert saved["state"] == {}
    assert saved["param_groups"][0]["params"] == [
        "enc.weight",
        "enc.bias",
        "dec.weight",
        "dec.bias",
    ]
    _assert_bitwise(expected, _restore_and_step(tmp_path, make_opt, k=0))
