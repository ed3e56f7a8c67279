"""Restoring a model's own checkpoint without per-key Python work, with load_state_dict's meaning.

Issue 42: with 25,000 small tensors ``restore`` cost 1.9x ``torch.load``; a model
whose state is plainly its own is now copied tensor by tensor, every other model
still goes through key adaptation, the checks and ``load_state_dict``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ddpstate
from ddpstate._io.model_state import copy_pairs, plain_pairs
from ddpstate._keys.match import _adapted_metadata, _full_match, adapted_if_same


class _Net(nn.Module):
    """Parameters, a persistent and a non-persistent buffer, a nested child."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.inner = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
        self.register_buffer("scratch", torch.full((2,), 7.0), persistent=False)


def _saved(model: nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        k: (torch.randn(v.shape, generator=gen) * 3).to(v.dtype)
        for k, v in model.state_dict().items()
    }


def test_plain_copy_is_load_state_dict() -> None:
    saved = _saved(_Net())
    plain, reference = _Net(), _Net()
    params = {k: (p, p._version) for k, p in plain.named_parameters()}
    pairs = plain_pairs(plain, saved)
    assert pairs is not None and len(pairs) == len(saved)
    assert copy_pairs(pairs)
    reference.load_state_dict(saved)
    for (key, got), want in zip(
        plain.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(got, want) and got.dtype == want.dtype, key
    # The same Parameter objects, written in place once (as copy_ does), still trainable.
    for key, p in plain.named_parameters():
        assert p is params[key][0] and p._version == params[key][1] + 1 and p.requires_grad
    assert torch.equal(plain.scratch, torch.full((2,), 7.0))  # not in the state dict


def _tied() -> nn.Module:
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    model[1].weight = model[0].weight
    return model


class _OwnLoad(nn.Linear):
    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return super().load_state_dict(*args, **kwargs)


def _with_hook(model: nn.Module) -> nn.Module:
    model.register_load_state_dict_post_hook(lambda module, keys: None)
    return model


def _meta() -> nn.Module:
    with torch.device("meta"):
        return nn.Linear(2, 2)


_DECLINED: dict[str, tuple[Callable[[], nn.Module], Callable[[dict[str, Any]], Any]]] = {
    "batchnorm overrides its loading": (lambda: nn.BatchNorm1d(2), dict),
    "a load post-hook": (lambda: _with_hook(nn.Linear(2, 2)), dict),
    "load_state_dict overridden": (lambda: _OwnLoad(2, 2), dict),
    "tied weights": (_tied, dict),
    "meta parameters": (_meta, dict),
    "a missing key": (lambda: nn.Linear(2, 2), lambda sd: {"weight": sd["weight"]}),
    "an extra key": (lambda: nn.Linear(2, 2), lambda sd: {**sd, "extra": torch.ones(1)}),
    "another dtype": (lambda: nn.Linear(2, 2), lambda sd: {k: v.double() for k, v in sd.items()}),
    "a tensor subclass": (
        lambda: nn.Linear(2, 2),
        lambda sd: {k: v.as_subclass(_Sub) for k, v in sd.items()},
    ),
    "a non-tensor": (lambda: nn.Linear(2, 2), lambda sd: {**sd, "bias": [0.0, 0.0]}),
}


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("case", list(_DECLINED))
def test_plain_pairs_declines_what_load_state_dict_does_otherwise(case: str) -> None:
    build, change = _DECLINED[case]
    model = build()
    source = nn.Linear(2, 2) if case in ("meta parameters",) else build()
    assert plain_pairs(model, change(source.state_dict())) is None


def test_plain_pairs_declines_swap_tensors() -> None:
    model = nn.Linear(2, 2)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        assert plain_pairs(model, _saved(model)) is None
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


def test_same_keys_adapt_as_the_matching_rules_do() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Sequential(nn.Linear(2, 3)))
    saved = model.state_dict()
    reordered: Any = collections.OrderedDict(reversed(list(saved.items())))
    reordered._metadata = saved._metadata  # type: ignore[attr-defined]
    for source in (saved, reordered):
        match, src, tgt, attempt = _full_match(source, model)
        fast = adapted_if_same(source, model.state_dict())
        assert fast is not None and list(fast) == list(match.mapping)
        assert all(fast[k] is source[v] for k, v in match.mapping.items())
        want = _adapted_metadata(src, tgt, attempt, saved._metadata)  # type: ignore[attr-defined]
        assert list(fast._metadata.items()) == list(want.items())  # type: ignore[attr-defined]
    assert adapted_if_same({"module.0.weight": 1}, model.state_dict()) is None


class _Counted(_Net):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.register_state_dict_post_hook(self._count)

    @staticmethod
    def _count(module: nn.Module, state_dict: Any, prefix: str, local_metadata: Any) -> None:
        assert isinstance(module, _Counted)
        module.calls += 1


def test_restore_takes_the_live_state_dict_once(tmp_path: Path) -> None:
    # A state-dict hook makes the model not plain: the full route (adapt, check, load).
    model = _Counted()
    manager = ddpstate.CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, {"model": model})
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.calls = 0
    manager.restore({"model": model})
    manager.close()
    assert model.calls == 1
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key


def test_restore_of_a_plain_model_keeps_its_parameters(tmp_path: Path) -> None:
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ddpstate.CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, {"model": model, "opt": opt})
    want = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    manager.restore({"model": model, "opt": opt})
    manager.close()
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert opt.param_groups[0]["params"][0] is params[0]
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key
