"""BatchNorm under DDP: SyncBatchNorm both ways, synced running statistics, and ``wrap_ddp``."""

from __future__ import annotations

import copy
import functools
import hashlib
import weakref
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.utils.parametrize
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from ddpstate import _crc, _ddp_buffers
from ddpstate._ddp_buffers import (
    BUFFER_SYNC_KWARG,
    BUFFER_SYNC_NAMES,
    DDP_PARAMS,
    TwoForwardGuard,
    ddp_syncs_buffers,
    explain_ddp_errors,
    find_ddp,
    listed,
    plain_bn_names,
)
from ddpstate._dist.launch import device_for
from ddpstate._warn import warn
from ddpstate.dist import (
    compare_across_ranks,
    get_local_rank,
    get_rank,
    get_world_size,
    is_distributed,
)
from ddpstate.errors import (
    BatchNormBufferSyncError,
    BatchNormPolicyError,
)
from ddpstate.keys import unwrap_model

__all__ = [
    "BatchNormBufferSyncError",
    "BatchNormNd",
    "BatchNormPolicy",
    "convert_sync_batchnorm",
    "explain_ddp_errors",
    "revert_sync_batchnorm",
    "sync_batchnorm_stats",
    "wrap_ddp",
]

#: What :func:`wrap_ddp` does with BatchNorm layers (its ``batchnorm=`` argument).
BatchNormPolicy = Literal["auto", "sync", "unsynced", "keep"]
_POLICIES: tuple[str, ...] = ("auto", "sync", "unsynced", "keep")
_STATS_OPS: tuple[str, ...] = ("mean", "broadcast")

# Set on every SyncBatchNorm that convert_sync_batchnorm makes; revert reads it
# to restore BatchNorm1d/2d/3d or the user's own subclass exactly.
_ORIGINAL_CLASS = "_ddpstate_original_class"
# Set on the DDP model wrap_ddp returns under the "unsynced" policy: CheckpointManager
# then averages the running statistics itself before each save.
_UNSYNCED_MARK = "_ddpstate_unsynced_batchnorm"
# Models already warned about by warn_if_stats_differ (one warning per model).
_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# SyncBatchNorm-only attributes (ddp_gpu_size: torch < 1.9 set it from DDP).
_SYNC_ONLY_ATTRS = frozenset({"process_group", "ddp_gpu_size", _ORIGINAL_CLASS})
# Module registries get their own shallow copies so the old and new layer are
# independent objects; hook dicts stay shared so existing hook handles still work.
_REGISTRIES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
# Device types SyncBatchNorm synchronises on (torch raises for the others).
_SYNC_DEVICE_TYPES = frozenset({"cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name()})


class BatchNormNd(_BatchNorm):
    """BatchNorm over ``(N, C, *)`` input of any dimensionality (2-D and up).

    What :func:`revert_sync_batchnorm` turns a SyncBatchNorm into when ddpstate
    did not convert it and so does not know whether it was 1-D, 2-D or 3-D.
    Like SyncBatchNorm it normalises over every dimension but the channel
    dimension 1, so it computes exactly what SyncBatchNorm computes on one
    process, for any input a BatchNorm1d/2d/3d would take. Its state-dict keys
    are the same as theirs, so a state dict moves between them freely.

    Example:
        >>> import torch, ddpstate
        >>> bn = ddpstate.BatchNormNd(3)
        >>> bn(torch.randn(4, 3, 5, 5)).shape
        torch.Size([4, 3, 5, 5])
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"BatchNormNd expects input of shape (N, C, *) with at least 2 dimensions, "
                f"got {input.dim()}-D input"
            )


# --------------------------------------------------------------------------- layer swapping


def _recast(src: nn.Module, cls: type[nn.Module], drop: frozenset[str] = frozenset()) -> nn.Module:
    """A new ``cls`` instance (no ``__init__`` run) holding ``src``'s state but ``drop``."""
    new = cls.__new__(cls)
    state = {k: v for k, v in vars(src).items() if k not in drop}
    for key in _REGISTRIES:
        if key in state:
            state[key] = copy.copy(state[key])
    new.__dict__.update(state)
    return new


def _refuse_unconvertible(layer: nn.Module, name: str) -> None:
    where = name or "the root module"
    if nn.utils.parametrize.is_parametrized(layer):
        raise BatchNormPolicyError(
            f"BatchNorm layer {where!r} has parametrizations ({type(layer).__name__}); "
            "converting its class would drop them. Remove them first with "
            "torch.nn.utils.parametrize.remove_parametrizations, convert, then add them back"
        )
    if isinstance(layer, nn.modules.lazy.LazyModuleMixin) and layer.has_uninitialized_params():
        raise BatchNormPolicyError(
            f"BatchNorm layer {where!r} is a lazy layer whose parameters are not created yet; "
            "run one forward pass (or pass num_features) before converting it"
        )


def _swap_layers(root: nn.Module, swap: Callable[[nn.Module, str], nn.Module]) -> nn.Module:
    """Apply ``swap`` to every module, replacing children in their parents' registries.

    A module registered under several parents is swapped once and the same
    replacement goes everywhere. Writing ``parent._modules`` directly (not
    ``add_module``/``setattr``) works for modules that override those.
    """
    # id -> (old, new); keeping ``old`` alive stops its id being reused mid-walk.
    memo: dict[int, tuple[nn.Module, nn.Module]] = {}

    def visit(module: nn.Module, name: str) -> nn.Module:
        seen = memo.get(id(module))
        if seen is not None:
            return seen[1]
        new = swap(module, name)
        memo[id(module)] = (module, new)
        for child_name, child in list(new._modules.items()):
            if child is None:
                continue
            replacement = visit(child, f"{name}.{child_name}" if name else child_name)
            if replacement is not child:
                new._modules[child_name] = replacement
        return new

    return visit(root, "")


def convert_sync_batchnorm(model: nn.Module, process_group: Any = None) -> nn.Module:
    """Turn every BatchNorm layer into ``torch.nn.SyncBatchNorm``, keeping all its state.

    Converts in place, like torch's own ``SyncBatchNorm.convert_sync_batchnorm``,
    but keeps much more: the same Parameter objects (so an optimizer built
    before still works), the same buffer tensors, ``eps``, ``momentum``,
    ``affine``, ``track_running_stats``, ``training``, ``requires_grad``,
    ``qconfig``, hooks and any other attribute, device and dtype. Each new
    layer remembers its original class, so :func:`revert_sync_batchnorm`
    restores BatchNorm1d/2d/3d (or your own subclass) exactly. Layers are
    found at any depth (Sequential, ModuleList, ModuleDict, custom containers,
    including ones that override ``add_module``); InstanceNorm, LayerNorm and
    GroupNorm are left alone. Layers that already are SyncBatchNorm are kept,
    and get ``process_group`` when one is passed.

    Args:
        model: A module; it may itself be a BatchNorm layer.
        process_group: The group each SyncBatchNorm synchronises over
            (default: the whole world).

    Returns:
        ``model`` (changed in place), or a new SyncBatchNorm when ``model``
        itself is a BatchNorm layer: always use the return value.

    Raises:
        BatchNormPolicyError: A BatchNorm layer has parametrizations, or is a
            lazy layer that has not run yet; the message names it.

    Example:
        >>> import torch, ddpstate
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
        >>> net = ddpstate.convert_sync_batchnorm(net)
        >>> type(net[1]).__name__
        'SyncBatchNorm'
    """

    def swap(layer: nn.Module, name: str) -> nn.Module:
        if isinstance(layer, nn.SyncBatchNorm):
            if process_group is not None:
                layer.process_group = process_group
            return layer
        if not isinstance(layer, _BatchNorm):
            return layer
        _refuse_unconvertible(layer, name)
        sync = _recast(layer, nn.SyncBatchNorm)
        sync.process_group = process_group
        setattr(sync, _ORIGINAL_CLASS, type(layer))
        return sync

    return _swap_layers(model, swap)


def _revert_layers(model: nn.Module) -> nn.Module:
    """Swap every SyncBatchNorm for plain BatchNorm; return the (maybe new) root, still wrapped."""

    def swap(layer: nn.Module, name: str) -> nn.Module:
        if not isinstance(layer, nn.SyncBatchNorm):
            return layer
        # Only convert_sync_batchnorm sets it, to the plain BatchNorm class it replaced.
        return _recast(layer, layer.__dict__.get(_ORIGINAL_CLASS, BatchNormNd), _SYNC_ONLY_ATTRS)

    return _swap_layers(model, swap)


def revert_sync_batchnorm(model: nn.Module) -> nn.Module:
    """Turn every SyncBatchNorm back into a plain BatchNorm: the inverse of the conversion.

    A layer that :func:`convert_sync_batchnorm` made gets its exact original
    class back (BatchNorm1d/2d/3d or your subclass). A SyncBatchNorm that
    ddpstate did not convert (built directly, or by torch's converter) becomes
    :class:`BatchNormNd`, which accepts input of any dimensionality just as
    SyncBatchNorm does, since nothing records whether it was 1-D, 2-D or 3-D.
    Parameters (the same objects), buffers, flags, ``training``, ``qconfig``,
    hooks, device and dtype are kept; the process group is dropped. State-dict
    keys and values, and eval-mode outputs, are bitwise the same as before the
    round trip. Works in place through DataParallel, DDP and ``torch.compile``
    wrappers, and returns the plain module, ready for single-device inference
    or export on CPU.

    Args:
        model: A plain or wrapped module; it may itself be a SyncBatchNorm.

    Returns:
        The plain (unwrapped) module with no SyncBatchNorm left. When the
        model itself is a SyncBatchNorm this is a new object: use the return
        value.

    Example:
        >>> import torch, ddpstate
        >>> net = ddpstate.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(4)))
        >>> type(ddpstate.revert_sync_batchnorm(net)[0]).__name__
        'BatchNorm1d'
        >>> plain = ddpstate.revert_sync_batchnorm(torch.nn.SyncBatchNorm(4))
        >>> type(plain).__name__
        'BatchNormNd'
    """
    return unwrap_model(_revert_layers(model))


# --------------------------------------------------------------------------- running statistics


def _stat_layers(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    return [
        (name, m)
        for name, m in unwrap_model(model).named_modules()
        if isinstance(m, _BatchNorm) and m.running_mean is not None and m.running_var is not None
    ]


def _stat_shape(layer: _BatchNorm) -> tuple[int, ...]:
    return tuple(layer.running_mean.shape) if layer.running_mean is not None else ()


def _stat_bytes(layer: _BatchNorm) -> bytes:
    # Bytes, not sums: NaN compares unequal to itself, and different statistics can share a sum.
    return b"".join(
        t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        for t in (layer.running_mean, layer.running_var)
        if t is not None
    )


def _reduce_in_place(tensors: list[torch.Tensor], op: str, *, counts: bool) -> None:
    """All-reduce (or broadcast from rank 0) ``tensors`` in one collective per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for same_device in by_device.values():
        # Floats at least float32: gloo has no bfloat16 sum, and summing float16
        # statistics over many ranks loses precision.
        dtypes = [t.dtype for t in same_device]
        dtype = (
            torch.int64 if counts else functools.reduce(torch.promote_types, dtypes, torch.float32)
        )
        flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in same_device])
        if op == "broadcast":
            dist.broadcast(flat, src=0)
        elif counts:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        else:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat /= dist.get_world_size()
        with torch.no_grad():
            parts = torch.split(flat, [t.numel() for t in same_device])
            for t, part in zip(same_device, parts, strict=True):
                t.copy_(part.view_as(t))


def sync_batchnorm_stats(
    model: nn.Module,
    *,
    op: Literal["mean", "broadcast"] = "mean",
    timeout: Optional[float] = None,
) -> None:
    """Make every rank's BatchNorm running statistics the same: a collective.

    For training with plain (unsynchronised) BatchNorm under DDP with
    ``broadcast_buffers=False`` (``wrap_ddp(..., batchnorm="unsynced")``), where
    each rank's ``running_mean``/``running_var`` drift apart. Call it on every
    rank before evaluating and before saving, so every rank evaluates with the
    same statistics and the checkpoint holds their average, not rank 0's alone.
    All layers' statistics travel in one ``torch.distributed`` collective per
    device on the default process group; ``num_batches_tracked`` becomes the
    largest count of any rank (``op="mean"``) or rank 0's (``op="broadcast"``).
    A no-op when not distributed. Every rank must call it, with the same
    BatchNorm layers; this is checked first, with a timeout, so a rank that
    never arrives or has a different model gives an error, not a hang.

    Args:
        model: A plain or wrapped (DDP, DataParallel, compiled) module.
        op: ``"mean"`` averages the statistics over ranks; ``"broadcast"``
            copies rank 0's to everyone (what DDP's ``broadcast_buffers`` does).
        timeout: Seconds to wait for the other ranks at the check (default:
            ``DDPSTATE_TIMEOUT`` or 1800 s).

    Raises:
        BatchNormPolicyError: ``op`` is not ``"mean"`` or ``"broadcast"``.
        DDPStateError: The ranks have different BatchNorm layers (names the ranks).
        BarrierTimeoutError: A rank did not call it within ``timeout`` (named).

    Example:
        >>> import torch, ddpstate
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        >>> ddpstate.sync_batchnorm_stats(net)  # every rank, e.g. before eval and save
    """
    if op not in _STATS_OPS:
        raise BatchNormPolicyError(
            f"sync_batchnorm_stats: op={op!r} is not one of {', '.join(map(repr, _STATS_OPS))}"
        )
    if not is_distributed():
        return
    layers = _stat_layers(model)
    signature = repr(
        [(name, _stat_shape(m), m.num_batches_tracked is not None) for name, m in layers]
    )
    digests = compare_across_ranks(
        (len(layers), hashlib.sha256(signature.encode()).hexdigest()),
        name="sync_batchnorm_stats",
        timeout=timeout,
    )
    if digests is not None:
        differ = [rank for rank, d in enumerate(digests) if d != digests[0]]
        counts = ", ".join(f"rank {r}: {d[0]}" for r, d in enumerate(digests))
        raise BatchNormPolicyError(
            f"sync_batchnorm_stats: ranks {', '.join(map(str, differ))} have different BatchNorm "
            f"layers (names or sizes) than rank 0 (layers with running statistics: {counts}); "
            "every rank must build the same model and call sync_batchnorm_stats with it"
        )
    # No layers (or no counters): _reduce_in_place has no device to reduce on, a no-op.
    floats = [t for _, m in layers for t in (m.running_mean, m.running_var) if t is not None]
    counters = [m.num_batches_tracked for _, m in layers if m.num_batches_tracked is not None]
    _reduce_in_place(floats, op, counts=False)
    _reduce_in_place(counters, op, counts=True)


def warn_if_stats_differ(model: nn.Module, *, where: str, timeout: Optional[float] = None) -> None:
    """Warn once per model when ranks' BatchNorm running statistics differ; a collective.

    Each rank sends one CRC-32 per layer (of ``running_mean`` and
    ``running_var``'s bytes) through one ``compare_across_ranks`` (one rank
    compares; the lists reach every rank only when they differ); synced
    statistics are bit-identical on every rank, so equal checksums mean equal
    statistics (NaN included). Nothing is exchanged when not distributed,
    under a DDP wrapper that broadcasts buffers (rank 0's are then the model's),
    or when the model has no BatchNorm statistics (the same on every rank).

    Args:
        model: A plain or wrapped module.
        where: What is being saved, for the message.
        timeout: Seconds to wait for the other ranks.
    """
    mine = stats_checksums(model)
    if mine is None:
        return
    differing = compare_across_ranks(mine, name="BatchNorm statistics check", timeout=timeout)
    if differing is not None:
        warn_if_checksums_differ(model, differing, where=where)


def stats_checksums(model: nn.Module) -> Optional[list[int]]:
    """This rank's CRC-32 per BatchNorm layer, or None when there is nothing to compare.

    Not a collective: callers exchange the result (``warn_if_stats_differ``,
    or ``CheckpointManager.save`` inside its own agreement exchange) and pass
    every rank's list to :func:`warn_if_checksums_differ`. None when not
    distributed, under a DDP wrapper that broadcasts buffers, or without
    BatchNorm statistics.
    """
    if not is_distributed():
        return None
    ddp = find_ddp(model)
    if ddp is not None and ddp_syncs_buffers(ddp):
        # DDP copies rank 0's buffers to every rank at each forward: rank 0's are the
        # model's statistics, and the others differ only until the next forward.
        return None
    layers = _stat_layers(model)
    if not layers:
        return None
    # One CRC of both tensors' bytes: the same as chaining the CRC-32 over each.
    return [_crc.crc32(_stat_bytes(m)) for _, m in layers]


def warn_if_checksums_differ(model: nn.Module, gathered: list[Any], *, where: str) -> None:
    """Warn once per model when the ranks' :func:`stats_checksums` lists differ.

    ``gathered`` holds every rank's list (rank order); a None anywhere means
    some rank had nothing to compare, and nothing is reported.
    """
    if any(g is None for g in gathered):
        return
    layers = _stat_layers(model)
    mine = gathered[0]
    differing = [
        name
        for i, (name, _) in enumerate(layers)
        if any(len(g) != len(mine) or g[i] != mine[i] for g in gathered)
    ]
    if not differing or model in _WARNED:
        return
    _WARNED.add(model)
    warn(
        f"{where}: BatchNorm running statistics differ across ranks ({listed(differing)}), so "
        f"the file holds rank 0's alone. Call ddpstate.sync_batchnorm_stats(model) on every rank "
        f"before saving (and evaluating), or use SyncBatchNorm",
        rank=get_rank(),
    )


def wrapped_unsynced(model: nn.Module) -> bool:
    """True for a model ``wrap_ddp`` prepared with unsynced BatchNorm under DDP.

    Args:
        model: Any module (wrapped or not).

    Returns:
        Whether :func:`wrap_ddp` left its BatchNorm statistics unsynced on purpose,
        so a checkpoint must sync them before saving.

    Example:
        >>> import torch
        >>> from ddpstate.batchnorm import wrapped_unsynced
        >>> wrapped_unsynced(torch.nn.BatchNorm1d(2))
        False
    """
    return bool(getattr(model, _UNSYNCED_MARK, False))


# --------------------------------------------------------------------------- wrap_ddp


def _resolve_device(device: Union[str, int, torch.device, None]) -> torch.device:
    if device is None:
        return device_for(None, get_local_rank())
    if isinstance(device, int):
        return torch.device("cuda", device)
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return resolved


def _take_buffer_sync(kwargs: dict[str, Any]) -> tuple[Optional[bool], list[str]]:
    """Pop both names of DDP's buffer-sync setting; the value passed (if any) and its names."""
    given = {k: v for k in BUFFER_SYNC_NAMES if (v := kwargs.pop(k, None)) is not None}
    values = {bool(v) for v in given.values()}
    if len(values) > 1:
        raise BatchNormPolicyError(
            "wrap_ddp: broadcast_buffers and forward_sync_buffers were both passed, with "
            f"different values ({given}); they are two names for one setting: pass only one"
        )
    return (values.pop() if values else None), sorted(given)


def _resolve_policy(batchnorm: str, device: torch.device, has_bn: bool) -> str:
    if batchnorm not in _POLICIES:
        raise BatchNormPolicyError(
            f"wrap_ddp: batchnorm={batchnorm!r} is not one of {', '.join(map(repr, _POLICIES))}"
        )
    if batchnorm != "auto":
        return batchnorm
    if not has_bn:
        return "keep"
    return "sync" if device.type == "cuda" and get_world_size() > 1 else "unsynced"


def wrap_ddp(
    model: nn.Module,
    *,
    batchnorm: BatchNormPolicy = "auto",
    device: Union[str, int, torch.device, None] = None,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Move a model to this rank's device, apply a BatchNorm policy, and wrap it in DDP.

    Policies (``batchnorm=``):

    - ``"sync"``: convert BatchNorm to SyncBatchNorm (:func:`convert_sync_batchnorm`,
      with DDP's ``process_group`` if you pass one). GPU only: on CPU it raises.
    - ``"unsynced"``: plain BatchNorm (SyncBatchNorm layers are reverted) and
      buffer broadcasting off (``broadcast_buffers=False``; on torch >= 2.13
      ``forward_sync_buffers=False``, which still syncs buffers once at
      construction), which avoids the "modified by an inplace operation"
      error of two forwards before one backward. Each rank's running
      statistics then drift apart: call :func:`sync_batchnorm_stats` before
      evaluating and saving. :class:`~ddpstate.CheckpointManager` does it
      itself for the model this returns; ``save_model_state`` warns when the
      ranks' statistics differ.
    - ``"keep"``: no change to the layers or to what you pass.
    - ``"auto"`` (default): ``"sync"`` on CUDA with more than one rank, else
      ``"unsynced"``; ``"keep"`` when the model has no BatchNorm layer.

    ``broadcast_buffers`` and its torch 2.13 name ``forward_sync_buffers`` are
    both accepted and passed under a name this torch takes; a value that
    contradicts the policy is an error, never silently overridden. On CUDA,
    ``device_ids``/``output_device`` default to this rank's device.

    In-place error explanation: under ``"keep"`` with buffer broadcasting on
    and plain BatchNorm layers, on a torch whose DDP still trips autograd with
    its buffer copy (2.6 to 2.12), the returned model warns once, naming the
    cause and both fixes, when a forward starts before the previous forward's
    backward. To turn the error itself into an explained one, wrap the
    backward in :func:`explain_ddp_errors`.

    Args:
        model: The plain model (changed in place: moved, layers converted).
        batchnorm: The BatchNorm policy, as above.
        device: Where this rank's replica lives; default ``cuda:LOCAL_RANK``
            when CUDA is available, else CPU. An int means that CUDA device.
        **ddp_kwargs: Passed on to ``torch.nn.parallel.DistributedDataParallel``.

    Returns:
        The DDP model; when not distributed, the model itself on its device
        (with the same layer conversion, so state dicts match across runs).

    Raises:
        BatchNormPolicyError: Unknown policy; ``"sync"`` on a device
            SyncBatchNorm does not run on; ``broadcast_buffers`` contradicting
            the policy; SyncBatchNorm layers under ``"keep"`` on CPU.

    Example:
        >>> import torch, ddpstate
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        >>> model = ddpstate.wrap_ddp(net, batchnorm="unsynced")  # under torchrun: DDP
        >>> model is net  # a plain single process gets the model back
        True
    """
    target = _resolve_device(device)
    has_bn = any(isinstance(m, _BatchNorm) for m in model.modules())
    policy = _resolve_policy(batchnorm, target, has_bn)
    explicit, names_given = _take_buffer_sync(ddp_kwargs)
    chosen = f"batchnorm={batchnorm!r}" + (f" (chose {policy!r})" if batchnorm == "auto" else "")

    if policy == "sync" and target.type not in _SYNC_DEVICE_TYPES:
        raise BatchNormPolicyError(
            f"wrap_ddp: {chosen} needs GPU modules: SyncBatchNorm only works with GPU modules "
            f"under DDP, and this model would run on {target}. Use batchnorm='unsynced' on CPU "
            "(and call ddpstate.sync_batchnorm_stats(model) before evaluating or saving), or "
            "batchnorm='auto', which picks 'sync' on CUDA and 'unsynced' elsewhere"
        )
    if policy == "unsynced" and explicit is True:
        raise BatchNormPolicyError(
            f"wrap_ddp: {chosen} turns DDP's buffer broadcast off, but "
            f"{names_given[0]}=True was passed. Drop {names_given[0]}, or pass "
            "batchnorm='keep' to keep broadcasting (and risk the 'modified by an inplace "
            "operation' error when the model runs forward twice before one backward)"
        )

    buffer_sync = False if policy == "unsynced" else explicit
    if buffer_sync is not None:
        # Keep the caller's own spelling where this torch takes it: on torch 2.13
        # broadcast_buffers=False also skips the init-time buffer sync, which
        # forward_sync_buffers=False does not.
        own = len(names_given) == 1 and names_given[0] in DDP_PARAMS
        ddp_kwargs[names_given[0] if own else BUFFER_SYNC_KWARG] = buffer_sync

    if policy == "sync":
        model = convert_sync_batchnorm(model, ddp_kwargs.get("process_group"))
    elif policy == "unsynced":
        model = _revert_layers(model)
    model = model.to(target)

    if not is_distributed():
        return model
    if policy == "keep" and target.type not in _SYNC_DEVICE_TYPES:
        sync_layers = [n for n, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)]
        if sync_layers:
            raise BatchNormPolicyError(
                f"wrap_ddp: SyncBatchNorm layers ({listed(sync_layers)}) only work with GPU "
                f"modules under DDP, and this model runs on {target}; pass batchnorm='unsynced' "
                "(or call ddpstate.revert_sync_batchnorm(model) first)"
            )
    if target.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [target.index])
        ddp_kwargs.setdefault("output_device", target.index)
    ddp = DistributedDataParallel(model, **ddp_kwargs)
    if policy == "unsynced" and _stat_layers(model):
        setattr(ddp, _UNSYNCED_MARK, True)

    layer_names = plain_bn_names(model)
    if not _ddp_buffers.DDP_SYNC_KEEPS_VERSIONS and layer_names and ddp_syncs_buffers(ddp):
        guard = TwoForwardGuard(layer_names)
        ddp.register_forward_pre_hook(guard.before_forward)
        ddp.register_forward_hook(guard.after_forward)
    return ddp
