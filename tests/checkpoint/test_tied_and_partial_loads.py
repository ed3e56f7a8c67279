"""Tied weights stored once load (and stay tied); a non-strict load that matches nothing warns."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import ddpstate


class TinyLM(nn.Module):
    """An LM head tied to the embedding, as Hugging Face ties them."""

    _tied_weights_keys: ClassVar[list[str]] = ["lm_head.weight"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.block = nn.Linear(6, 6)
        self.lm_head = nn.Linear(6, 11, bias=False)
        self.lm_head.weight = self.embed.weight


def _stored_once(model: TinyLM) -> dict[str, Any]:
    # Hugging Face's save_pretrained writes a tied weight under one name only.
    return {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_tied_embedding_stored_once_loads_strict_and_stays_tied(
    suffix: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    trained = TinyLM()
    path = tmp_path / f"lm{suffix}"
    ddpstate.save(_stored_once(trained), path)
    torch.manual_seed(1)
    model = TinyLM()
    assert ddpstate.load_model_state(model, path) == ([], [])
    assert model.lm_head.weight is model.embed.weight
    assert torch.equal(model.lm_head.weight, trained.embed.weight)
    # Into a wrapped model too, and through the manager's restore.
    wrapped = nn.DataParallel(TinyLM())
    assert ddpstate.load_model_state(wrapped, path) == ([], [])
    assert wrapped.module.lm_head.weight.data_ptr() == wrapped.module.embed.weight.data_ptr()
    assert torch.equal(wrapped.module.lm_head.weight, trained.embed.weight)


def test_a_tied_weight_missing_from_a_manager_step_restores(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trained = TinyLM()
    with ddpstate.CheckpointManager(tmp_path / "run") as manager:
        manager.save(3, {"model": _stored_once(trained)})
    model = TinyLM()
    with ddpstate.CheckpointManager(tmp_path / "run") as manager:
        assert manager.restore({"model": model}) == 3
    assert model.lm_head.weight is model.embed.weight
    assert torch.equal(model.embed.weight, trained.embed.weight)


def test_an_untied_missing_weight_is_still_missing(tmp_path: Path) -> None:
    model = TinyLM()
    model.lm_head.weight = nn.Parameter(model.embed.weight.detach().clone())  # untied
    path = tmp_path / "lm.pt"
    ddpstate.save(_stored_once(TinyLM()), path)
    with pytest.raises(ddpstate.KeyMismatchError, match=r"lm_head\.weight"):
        ddpstate.load_model_state(model, path)


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(9))
        self.norm = nn.LayerNorm(4)


class ForCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Base()
        self.lm_head = nn.Linear(4, 10, bias=False)


def test_a_non_strict_load_that_matches_nothing_warns_with_the_prefix_fix(
    tmp_path: Path,
) -> None:
    path = tmp_path / "causal.safetensors"
    ddpstate.save_model_state(ForCausalLM(), path)
    base = Base()
    with pytest.warns(UserWarning) as caught:
        result = ddpstate.load_model_state(base, path, strict=False)
    assert len(result.missing_keys) == 20 and len(result.unexpected_keys) == 21
    (warning,) = [w for w in caught if "strict=False" in str(w.message)]
    text = str(warning.message)
    assert str(path) in text and "loaded 0 of the file's 21 entries" in text
    assert "start with 'model.'" in text and "strip_prefix(state_dict, 'model.')" in text
    assert warning.filename == __file__  # points at this call, not inside ddpstate
    # The fix it names works.
    fixed = ddpstate.strip_prefix(ddpstate.load(path), "model.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = ddpstate.load_model_state(base, fixed, strict=False)
    assert again.missing_keys == [] and again.unexpected_keys == ["lm_head.weight"]


def test_a_non_strict_load_of_the_base_into_the_head_model_names_add_prefix(
    tmp_path: Path,
) -> None:
    path = tmp_path / "base.pt"
    ddpstate.save_model_state(Base(), path)
    with pytest.warns(UserWarning, match=r"model's keys start with 'model\.'.*add_prefix"):
        ddpstate.load_model_state(ForCausalLM(), path, strict=False)


def test_a_partial_non_strict_load_that_matches_most_keys_stays_quiet(tmp_path: Path) -> None:
    path = tmp_path / "base.pt"
    state = Base().state_dict()
    del state["norm.bias"]
    ddpstate.save(state, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = ddpstate.load_model_state(Base(), path, strict=False)
    assert result.missing_keys == ["norm.bias"]
