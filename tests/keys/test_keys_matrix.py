"""Every wrapping's real state_dict() loads into every other wrapping via adapt_state_dict."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from ddpstate.keys import adapt_state_dict, match_keys, normalize_keys, unwrap_model
from tests.multiproc import run_ranks


class Net(nn.Module):
    """A model with a submodule to compile or wrap on its own and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _compile(module: nn.Module) -> nn.Module:
    # The eager backend runs Dynamo's real wrapper and tracing without a C compiler.
    return torch.compile(module, backend="eager")  # type: ignore[return-value]


def _ddp(module: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(module)


def _partial(net: Net) -> nn.Module:
    net.encoder = _compile(net.encoder)  # type: ignore[assignment]
    return net


def _inner_dp(net: Net) -> nn.Module:
    net.head = nn.DataParallel(net.head)  # type: ignore[assignment]
    return net


def _lead(prefix: str) -> Callable[[str], str]:
    return lambda k: prefix + k


def _inner(sub: str, wrapper: str) -> Callable[[str], str]:
    return lambda k: k.replace(f"{sub}.", f"{sub}.{wrapper}.", 1) if k.startswith(sub) else k


# name -> (wrap the plain Net, how a plain key is spelt in that wrapping).
# The spelling is written out by hand here, independently of ddpstate's rules.
WRAPPINGS: dict[str, tuple[Callable[[Net], nn.Module], Callable[[str], str]]] = {
    "plain": (lambda n: n, lambda k: k),
    "dp": (nn.DataParallel, _lead("module.")),
    "compiled": (_compile, _lead("_orig_mod.")),
    "dp(compiled)": (lambda n: nn.DataParallel(_compile(n)), _lead("module._orig_mod.")),
    "compiled(dp)": (lambda n: _compile(nn.DataParallel(n)), _lead("_orig_mod.module.")),
    "dp(dp)": (lambda n: nn.DataParallel(nn.DataParallel(n)), _lead("module.module.")),
    "partially compiled": (_partial, _inner("encoder", "_orig_mod")),
    "inner dp": (_inner_dp, _inner("head", "module")),
    "compiled(partially compiled)": (
        lambda n: _compile(_partial(n)),
        lambda k: "_orig_mod." + _inner("encoder", "_orig_mod")(k),
    ),
}
DDP_WRAPPINGS: dict[str, tuple[Callable[[Net], nn.Module], Callable[[str], str]]] = {
    "ddp": (_ddp, _lead("module.")),
    "ddp(compiled)": (lambda n: _ddp(_compile(n)), _lead("module._orig_mod.")),
    "compiled(ddp)": (lambda n: _compile(_ddp(n)), _lead("_orig_mod.module.")),
    "dp(ddp)": (lambda n: nn.DataParallel(_ddp(n)), _lead("module.module.")),
}
ALL_NAMES = list(WRAPPINGS) + list(DDP_WRAPPINGS)
PLAIN_KEYS = list(Net().state_dict())


def _build(name: str, seed: int) -> nn.Module:
    """A wrapped Net whose every entry, buffers included, depends on ``seed``."""
    wrap, _ = {**WRAPPINGS, **DDP_WRAPPINGS}[name]
    torch.manual_seed(seed)
    net = Net()
    bn = net.encoder[1]
    assert isinstance(bn, nn.BatchNorm1d)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(4))  # type: ignore[union-attr]
        bn.running_var.copy_(torch.rand(4) + 0.5)  # type: ignore[union-attr]
        bn.num_batches_tracked.fill_(seed + 3)  # type: ignore[union-attr]
    return wrap(net)


def _spelling(name: str) -> Callable[[str], str]:
    return {**WRAPPINGS, **DDP_WRAPPINGS}[name][1]


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(as_bytes(a), as_bytes(b))


def _check_pair(src_name: str, src_sd: dict[str, Any], tgt_name: str, target: nn.Module) -> None:
    """Adapt, load strictly, and compare every entry bit for bit with the source."""
    expected_keys = list(target.state_dict())
    adapted = adapt_state_dict(src_sd, target)
    assert list(adapted) == expected_keys, (src_name, tgt_name)
    result = target.load_state_dict(adapted, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == [], (src_name, tgt_name)
    loaded = target.state_dict()
    src_spell, tgt_spell = _spelling(src_name), _spelling(tgt_name)
    for key in PLAIN_KEYS:
        assert _bitwise_equal(loaded[tgt_spell(key)], src_sd[src_spell(key)]), (
            src_name,
            tgt_name,
            key,
        )


def test_spellings_match_the_real_models() -> None:
    """The hand-written spellings are what torch really produces (guards the oracle)."""
    for name in WRAPPINGS:
        keys = list(_build(name, 0).state_dict())
        assert keys == [_spelling(name)(k) for k in PLAIN_KEYS], name


def test_compiled_wrappers_are_real_and_run() -> None:
    """The compiled wrappers are torch's OptimizedModule and really run here."""
    from torch._dynamo.eval_frame import OptimizedModule

    model = _build("compiled", 1)
    assert isinstance(model, OptimizedModule)
    try:
        out = model.eval()(torch.randn(5, 3))
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"torch.compile(backend='eager') cannot run a forward here: {exc}")
    assert out.shape == (5, 2)
    plain = _build("plain", 2)
    plain.load_state_dict(adapt_state_dict(model.state_dict(), plain))
    assert torch.equal(plain.eval()(torch.ones(2, 3)), model(torch.ones(2, 3)))


@pytest.mark.parametrize("src_name", list(WRAPPINGS))
@pytest.mark.parametrize("tgt_name", list(WRAPPINGS))
def test_matrix_without_ddp(src_name: str, tgt_name: str) -> None:
    """Each wrapping's state_dict() loads into each other wrapping, bitwise equal."""
    src_sd = _build(src_name, 10 + ALL_NAMES.index(src_name)).state_dict()
    target = _build(tgt_name, 40 + ALL_NAMES.index(tgt_name))
    _check_pair(src_name, src_sd, tgt_name, target)


def _ddp_matrix(rank: int, world_size: int) -> dict[str, Any]:
    """Every pair with DDP on either side, on a real 2-rank gloo group."""
    checked = 0
    for src_name in ALL_NAMES:
        for tgt_name in ALL_NAMES:
            if src_name not in DDP_WRAPPINGS and tgt_name not in DDP_WRAPPINGS:
                continue
            # Both ranks build the same models in the same order: DDP's
            # constructor is a collective.
            src_sd = _build(src_name, 10 + ALL_NAMES.index(src_name)).state_dict()
            target = _build(tgt_name, 40 + ALL_NAMES.index(tgt_name))
            _check_pair(src_name, src_sd, tgt_name, target)
            checked += 1
    # torch.save bytes, not tensors: run_ranks' queue would pass tensors as
    # shared-memory handles that die with the child process.
    state_dicts = {}
    for name in DDP_WRAPPINGS:
        buffer = io.BytesIO()
        torch.save(_build(name, 70).state_dict(), buffer)
        state_dicts[name] = buffer.getvalue()
    return {"checked": checked, "state_dicts": state_dicts}


@pytest.mark.slow
def test_matrix_with_ddp() -> None:
    """DDP, DDP(compiled), compiled(DDP) and DP(DDP) in both directions, every rank."""
    results = run_ranks(_ddp_matrix, 2, timeout=120)
    n_all, n_plain = len(ALL_NAMES), len(WRAPPINGS)
    for result in results:
        assert result["checked"] == n_all * n_all - n_plain * n_plain
    # The DDP state dicts, brought home as CPU tensors, load here too.
    for name, payload in results[0]["state_dicts"].items():
        src_sd = torch.load(io.BytesIO(payload), weights_only=True)
        assert src_sd._metadata[""] == {"version": 1}  # a wrapper's root entry came along
        assert list(src_sd) == [_spelling(name)(k) for k in PLAIN_KEYS], name
        for tgt_name in WRAPPINGS:
            _check_pair(name, src_sd, tgt_name, _build(tgt_name, 5))


def test_inner_dataparallel_layout_both_ways() -> None:
    """``head.module.weight`` (DataParallel inside the model) to plain and back."""
    inner_sd = _build("inner dp", 3).state_dict()
    assert "head.module.weight" in inner_sd
    # normalize_keys alone must not touch an inner `.module.`: it may be real.
    assert list(normalize_keys(inner_sd)) == list(inner_sd)
    plain = _build("plain", 4)
    assert match_keys(inner_sd, plain).complete
    _check_pair("inner dp", inner_sd, "plain", plain)
    _check_pair("plain", _build("plain", 5).state_dict(), "inner dp", _build("inner dp", 6))


def test_unwrap_model_on_every_wrapping() -> None:
    """unwrap_model reaches the Net under any outer wrapping built here."""
    for name in ("plain", "dp", "compiled", "dp(compiled)", "compiled(dp)", "dp(dp)"):
        assert isinstance(unwrap_model(_build(name, 0)), Net), name
