"""Only wrapper objects lose their key segments: AveragedModel's real `module` child stays."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import ddpstate
from ddpstate.keys import strip_prefix


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize("wrap", ["plain", "DataParallel"])
def test_save_model_state_of_an_averaged_model_keeps_its_module_child(
    wrap: str, tmp_path: Path
) -> None:
    ema = AveragedModel(_net())
    ema.update_parameters(_net())
    model: nn.Module = ema if wrap == "plain" else nn.DataParallel(ema)
    path = tmp_path / "ema.pt"
    ddpstate.save_model_state(model, path)
    saved = torch.load(path, weights_only=True)
    assert set(saved) == set(ema.state_dict())
    assert "module.0.weight" in saved and "n_averaged" in saved
    fresh = AveragedModel(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))
    fresh.load_state_dict(saved)  # plain torch, strict
    for a, b in zip(fresh.state_dict().values(), ema.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    again = AveragedModel(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))
    assert ddpstate.load_model_state(again, path) == ([], [])
    assert torch.equal(again.module[0].weight, ema.module[0].weight)


def test_a_manager_step_of_an_averaged_model_keeps_its_module_child(tmp_path: Path) -> None:
    ema = AveragedModel(_net())
    with ddpstate.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, {"ema": nn.DataParallel(ema)})
    (file,) = (tmp_path / "run").glob("step_*/ema.pt")
    assert "module.0.weight" in torch.load(file, weights_only=True)
    restored = AveragedModel(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))
    with ddpstate.CheckpointManager(tmp_path / "run") as manager:
        assert manager.restore({"ema": restored}) == 1
    assert torch.equal(restored.module[2].bias, ema.module[2].bias)


def test_strip_prefix_warns_when_it_strips_more_than_one_level() -> None:
    with pytest.warns(UserWarning, match=r"removed 2 leading 'module\.'.*AveragedModel"):
        out = strip_prefix({"module.module.w": 1, "module.n_averaged": 2})
    assert out == {"w": 1, "n_averaged": 2}  # today's rule kept
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert strip_prefix({"module.w": 1}) == {"w": 1}
