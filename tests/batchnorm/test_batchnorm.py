"""One process: convert/revert SyncBatchNorm, BatchNormNd, wrap_ddp's checks, explain_ddp_errors."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddpstate.batchnorm import (
    BatchNormBufferSyncError,
    BatchNormNd,
    convert_sync_batchnorm,
    explain_ddp_errors,
    revert_sync_batchnorm,
    sync_batchnorm_stats,
    wrap_ddp,
)
from ddpstate.errors import BatchNormPolicyError, DDPStateError

# --------------------------------------------------------------------------- the composite model


class ScaledBatchNorm2d(nn.BatchNorm2d):
    """A user subclass with its own attribute and forward: revert must bring both back."""

    def __init__(self, num_features: int, scale: float) -> None:
        super().__init__(num_features)
        self.scale = scale

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * self.scale


class NoAddModule(nn.Module):
    """A container that forbids add_module after construction (some frameworks do this)."""

    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            super().add_module(name, child)
        self.frozen = True

    def add_module(self, name: str, module: nn.Module | None) -> None:
        if getattr(self, "frozen", False):
            raise RuntimeError("add_module is not allowed on this container")
        super().add_module(name, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for child in self.children():
            x = child(x)
        return x


class Composite(nn.Module):
    """Every BatchNorm flavour the issue lists, plus norms that must stay untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.bn1d = nn.BatchNorm1d(6, affine=False).double()  # float64 must survive
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn2d_untracked = nn.BatchNorm2d(4, track_running_stats=False)
        self.nested = nn.Sequential(
            nn.Sequential(nn.BatchNorm2d(4, eps=1e-3, momentum=0.3, bias=False), nn.ReLU())
        )
        self.listed = nn.ModuleList([nn.Conv3d(2, 2, 1), nn.BatchNorm3d(2)])
        self.keyed = nn.ModuleDict({"scaled": ScaledBatchNorm2d(4, scale=2.5)})
        self.guarded = NoAddModule(inner=nn.BatchNorm2d(4, momentum=None))
        self.instance = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
        self.layer = nn.LayerNorm([4, 5, 5])
        self.group = nn.GroupNorm(2, 4)

    def forward(
        self, x2d: torch.Tensor, x1d: torch.Tensor, x3d: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.bn2d_untracked(self.conv(x2d))
        y = self.keyed["scaled"](self.nested(y))
        y = self.group(self.layer(self.instance(self.guarded(y))))
        z = self.listed[1](self.listed[0](x3d))
        return y, self.bn1d(x1d), z


def _composite() -> Composite:
    torch.manual_seed(0)
    model = Composite()
    # Non-default statistics and weights, so "kept" means something.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm) and m.running_mean is not None:
                assert m.running_var is not None and m.num_batches_tracked is not None
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.num_batches_tracked.fill_(7)
            if isinstance(m, (_BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.InstanceNorm2d)):
                for p in m.parameters():
                    p.uniform_(0.5, 1.5)
    model.nested[0][0].weight.requires_grad_(False)
    model.nested[0][0].qconfig = torch.ao.quantization.default_qconfig  # type: ignore[assignment]
    model.eval()
    model.listed[1].train()  # one layer left in train mode
    return model


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(4, 3, 5, 5, generator=g),
        torch.randn(4, 6, generator=g, dtype=torch.float64),
        torch.randn(4, 2, 3, 3, 3, generator=g),
    )


BN_NAMES = ["bn1d", "bn2d_untracked", "nested.0.0", "listed.1", "keyed.scaled", "guarded.inner"]
UNTOUCHED = {"conv", "instance", "layer", "group", "listed.0", "nested.0.1"}
FLAGS = ("eps", "momentum", "affine", "track_running_stats", "training", "num_features")


def _assert_state_dicts_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].device == b[key].device, key
        assert torch.equal(a[key], b[key]), key


def test_round_trip_composite_model_is_exact() -> None:
    model = _composite()
    reference = copy.deepcopy(model)
    classes = {name: type(m) for name, m in model.named_modules()}
    params = {name: p for name, p in model.named_parameters()}
    buffers = {name: b for name, b in model.named_buffers()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    group = object()  # stands in for a process group: it is only stored, never used here

    converted = convert_sync_batchnorm(model, process_group=group)

    assert converted is model
    modules = dict(converted.named_modules())
    for name in BN_NAMES:
        layer = modules[name]
        assert type(layer) is nn.SyncBatchNorm, name
        assert layer.process_group is group, name  # reached at every depth
        for flag in FLAGS:
            assert getattr(layer, flag) == getattr(reference.get_submodule(name), flag), (
                name,
                flag,
            )
    for name in UNTOUCHED:
        assert type(modules[name]) is classes[name], name
    assert all(p is params[n] for n, p in converted.named_parameters())
    assert all(b is buffers[n] for n, b in converted.named_buffers())
    assert converted.nested[0][0].qconfig is torch.ao.quantization.default_qconfig
    assert converted.bn1d.running_mean.dtype == torch.float64
    # SyncBatchNorm on one CPU process computes what BatchNorm computes (the
    # first output goes through the subclass, whose own forward SyncBatchNorm lacks);
    # listed.1 is in train mode, so both take the same step of its statistics.
    got, want = converted(*_inputs()), reference(*_inputs())
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])

    reverted = revert_sync_batchnorm(converted)

    assert reverted is model
    for name, m in reverted.named_modules():
        assert type(m) is classes[name], name
        assert "process_group" not in vars(m), name
    for name in BN_NAMES:
        for flag in FLAGS:
            assert getattr(reverted.get_submodule(name), flag) == getattr(
                reference.get_submodule(name), flag
            )
    assert reverted.keyed["scaled"].scale == 2.5
    assert reverted.nested[0][0].bias is None
    assert reverted.nested[0][0].weight.requires_grad is False
    assert reverted.nested[0][0].qconfig is torch.ao.quantization.default_qconfig
    assert [p for p in reverted.parameters()] == [p for p in optimizer.param_groups[0]["params"]]
    assert all(p is params[n] for n, p in reverted.named_parameters())
    _assert_state_dicts_bitwise_equal(reverted.state_dict(), reference.state_dict())
    reverted.eval()
    reference.eval()
    for got, want in zip(reverted(*_inputs()), reference(*_inputs()), strict=True):
        assert torch.equal(got, want)
    # The user subclass's own forward is back (SyncBatchNorm's would not scale).
    x = torch.randn(2, 4, 5, 5)
    plain = nn.BatchNorm2d(4).eval()
    plain.load_state_dict(reverted.keyed["scaled"].state_dict())
    assert torch.equal(reverted.keyed["scaled"](x), plain(x) * 2.5)


def test_the_optimizer_built_before_conversion_still_trains_the_model() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model = convert_sync_batchnorm(model)
    before = model[1].weight.detach().clone()
    (model(torch.randn(8, 3)) ** 2).sum().backward()
    optimizer.step()
    assert not torch.equal(model[1].weight, before)


def test_root_module_that_is_a_batchnorm() -> None:
    bn = nn.BatchNorm3d(5, eps=0.01)
    weight = bn.weight
    sync = convert_sync_batchnorm(bn)
    assert type(sync) is nn.SyncBatchNorm and sync is not bn
    assert sync.weight is weight and sync.eps == 0.01
    back = revert_sync_batchnorm(sync)
    assert type(back) is nn.BatchNorm3d and back.weight is weight


def test_module_registered_twice_is_converted_once() -> None:
    shared = nn.BatchNorm1d(4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    model = convert_sync_batchnorm(model)
    assert model[0] is model[2] and type(model[0]) is nn.SyncBatchNorm
    model = revert_sync_batchnorm(model)
    assert model[0] is model[2] and type(model[0]) is nn.BatchNorm1d


def test_forward_hooks_survive_the_round_trip() -> None:
    calls: list[str] = []
    bn = nn.BatchNorm1d(2)
    bn.register_forward_hook(lambda m, i, o: calls.append(type(m).__name__))
    model = convert_sync_batchnorm(nn.Sequential(bn))
    model(torch.randn(3, 2))
    model = revert_sync_batchnorm(model)
    model(torch.randn(3, 2))
    assert calls == ["SyncBatchNorm", "BatchNorm1d"]


def test_converting_twice_and_copies_still_revert_to_the_original_class() -> None:
    model = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)))
    model = convert_sync_batchnorm(model)
    copied = copy.deepcopy(model)
    unpickled = pickle.loads(pickle.dumps(model))
    for m in (model, copied, unpickled):
        assert type(revert_sync_batchnorm(m)[0]) is nn.BatchNorm2d


def test_revert_of_a_syncbatchnorm_built_directly_trains_on_cpu() -> None:
    sync = nn.SyncBatchNorm(3, momentum=0.5)
    model = nn.Sequential(nn.Identity(), sync)
    weight = sync.weight
    model = revert_sync_batchnorm(model)
    layer = model[1]
    assert type(layer) is BatchNormNd and layer.weight is weight
    assert layer.training
    for shape in [(8, 3), (8, 3, 4), (8, 3, 4, 4), (8, 3, 2, 2, 2)]:
        before = layer.running_mean.clone()
        out = model(torch.randn(*shape) + 3.0)
        assert out.shape == shape
        assert not torch.equal(layer.running_mean, before)  # statistics were updated
        out.sum().backward()
    assert int(layer.num_batches_tracked) == 4
    # Same numbers as the dimension-specific class.
    as2d = nn.BatchNorm2d(3, momentum=0.5)
    as2d.load_state_dict(layer.state_dict())
    x = torch.randn(4, 3, 5, 5)
    assert torch.equal(layer(x), as2d(x))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        layer(torch.randn(3))


@pytest.mark.slow
def test_revert_through_wrappers_returns_the_plain_module() -> None:
    inner = convert_sync_batchnorm(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    wrapped = torch.compile(nn.DataParallel(inner))
    plain = revert_sync_batchnorm(wrapped)
    assert plain is inner
    assert type(inner[1]) is nn.BatchNorm1d
    assert type(wrapped._orig_mod.module[1]) is nn.BatchNorm1d


def test_parametrized_and_uninitialised_lazy_layers_are_refused() -> None:
    from torch.nn.utils import parametrize

    class Positive(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w.abs()

    bn = nn.BatchNorm1d(3)
    parametrize.register_parametrization(bn, "weight", Positive())
    with pytest.raises(BatchNormPolicyError, match=r"'block\.0'.*remove_parametrizations"):
        convert_sync_batchnorm(nn.ModuleDict({"block": nn.Sequential(bn)}))
    lazy = nn.Sequential(nn.LazyBatchNorm1d())
    with pytest.raises(BatchNormPolicyError, match="run one forward"):
        convert_sync_batchnorm(lazy)
    lazy(torch.randn(4, 3))  # materialised: now an ordinary BatchNorm1d
    assert type(revert_sync_batchnorm(convert_sync_batchnorm(lazy))[0]) is nn.BatchNorm1d


# --------------------------------------------------------------------------- single-process API


def test_sync_batchnorm_stats_is_a_no_op_without_a_process_group() -> None:
    model = _composite()
    before = copy.deepcopy(model.state_dict())
    sync_batchnorm_stats(model)
    _assert_state_dicts_bitwise_equal(model.state_dict(), before)
    with pytest.raises(BatchNormPolicyError, match="op='median'"):
        sync_batchnorm_stats(model, op="median")  # type: ignore[arg-type]


def test_wrap_ddp_single_process_returns_the_model_on_its_device() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    assert wrap_ddp(model, device="cpu") is model
    assert wrap_ddp(model, batchnorm="keep", device="cpu", broadcast_buffers=True) is model
    with_sync = nn.Sequential(nn.SyncBatchNorm(3))
    out = wrap_ddp(with_sync, batchnorm="unsynced", device="cpu")
    assert type(out[0]) is BatchNormNd  # "unsynced" means plain BatchNorm
    compiled = torch.compile(nn.Sequential(nn.SyncBatchNorm(3)))
    assert wrap_ddp(compiled, device="cpu") is compiled  # the wrapper is kept
    assert type(compiled._orig_mod[0]) is BatchNormNd


@pytest.mark.parametrize("batchnorm", ["sync", "auto"])
def test_sync_on_cpu_is_refused_with_the_way_out(batchnorm: str) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    if batchnorm == "sync":
        with pytest.raises(BatchNormPolicyError, match=r"needs GPU modules.*'unsynced'") as info:
            wrap_ddp(model, batchnorm="sync", device="cpu")
        assert isinstance(info.value, DDPStateError)
        assert type(model[1]) is nn.BatchNorm1d  # nothing was converted
    else:
        assert wrap_ddp(model, batchnorm="auto", device="cpu") is model  # picks "unsynced"


def test_contradicting_buffer_settings_are_errors() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    with pytest.raises(BatchNormPolicyError, match=r"broadcast_buffers=True.*batchnorm='keep'"):
        wrap_ddp(model, batchnorm="unsynced", device="cpu", broadcast_buffers=True)
    with pytest.raises(BatchNormPolicyError, match=r"chose 'unsynced'.*forward_sync_buffers=True"):
        wrap_ddp(model, device="cpu", forward_sync_buffers=True)
    with pytest.raises(BatchNormPolicyError, match="pass only one"):
        wrap_ddp(
            model,
            batchnorm="keep",
            device="cpu",
            broadcast_buffers=True,
            forward_sync_buffers=False,
        )
    with pytest.raises(BatchNormPolicyError, match="batchnorm='fast'"):
        wrap_ddp(model, batchnorm="fast", device="cpu")  # type: ignore[arg-type]
    # A model with no BatchNorm: "auto" leaves broadcast_buffers alone.
    linear = nn.Linear(2, 2)
    assert wrap_ddp(linear, device="cpu", broadcast_buffers=True) is linear


def _inplace_autograd_error() -> None:
    w = torch.randn(3, requires_grad=True)
    y = w.exp()  # exp saves its output for backward
    y.add_(1)
    y.sum().backward()


def test_explain_passes_other_errors_and_plain_models_through() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    not_ddp = explain_ddp_errors(model)  # not DDP: nothing to explain
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info, not_ddp:
        _inplace_autograd_error()
    assert not isinstance(info.value, BatchNormBufferSyncError)
    with pytest.raises(KeyError), explain_ddp_errors(model):
        raise KeyError("unrelated")
    with explain_ddp_errors(model):
        model(torch.randn(4, 2)).sum().backward()
    assert model[0].weight.grad is not None


def test_the_version_gate_for_ddps_buffer_copy_matches_this_torchs_source() -> None:
    # DDP_SYNC_KEEPS_VERSIONS is a version gate; the installed torch's DDP must agree.
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    from ddpstate import _ddp_buffers

    fixed = "_unsafe_preserve_version_counter" in inspect.getsource(
        DistributedDataParallel._sync_buffers
    )
    assert _ddp_buffers.DDP_SYNC_KEEPS_VERSIONS is fixed
