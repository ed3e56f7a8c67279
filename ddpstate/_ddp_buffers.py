"""DDP's buffer broadcast: what this torch's DDP takes, and the in-place error it causes.

DDP copies rank 0's buffers into every replica in place before each forward; with
BatchNorm and two forwards before one backward that trips autograd's "modified by an
inplace operation" check. This module knows which keyword this torch's DDP takes for
that copy, whether its copy still trips autograd, and how to explain the error.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any, Optional

import torch
from packaging.version import Version
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from ddpstate._keys.wrappers import wrapper_chain
from ddpstate._warn import warn
from ddpstate.dist import get_rank
from ddpstate.errors import BatchNormBufferSyncError, DDPStateError

# The in-place autograd error text, stable since torch 1.x.
_INPLACE_TEXT = "modified by an inplace operation"


DDP_PARAMS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters)
#: The name DDP prefers for "sync buffers before each forward" on this torch.
BUFFER_SYNC_KWARG = (
    "forward_sync_buffers" if "forward_sync_buffers" in DDP_PARAMS else "broadcast_buffers"
)
BUFFER_SYNC_NAMES = ("broadcast_buffers", "forward_sync_buffers")
#: Whether DDP's buffer copy leaves version counters alone. torch 2.6-2.12's DDP copies
#: buffers in place and bumps them (pytorch#175024); torch 2.13 wraps the copy in
#: ``torch.autograd._unsafe_preserve_version_counter`` (pytorch#175851, in
#: ``DistributedDataParallel._sync_buffers``), so a version gate tells.
DDP_SYNC_KEEPS_VERSIONS = Version(torch.__version__).release >= (2, 13)


def find_ddp(model: nn.Module) -> Optional[DistributedDataParallel]:
    """The DDP wrapper in ``model``'s chain of wrappers (DataParallel, compile), if any.

    Args:
        model: A plain or wrapped module.

    Returns:
        The outermost ``DistributedDataParallel`` layer, or None.

    Example:
        >>> import torch
        >>> from ddpstate._ddp_buffers import find_ddp
        >>> find_ddp(torch.nn.DataParallel(torch.nn.Linear(2, 2))) is None
        True
    """
    return next((m for m in wrapper_chain(model) if isinstance(m, DistributedDataParallel)), None)


def ddp_syncs_buffers(ddp: DistributedDataParallel) -> bool:
    """True when ``ddp`` copies rank 0's buffers into every replica before each forward.

    Args:
        ddp: A DDP model.

    Returns:
        Its ``forward_sync_buffers`` (torch >= 2.13), else its ``broadcast_buffers``.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from torch.nn.parallel import DistributedDataParallel
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> off = {BUFFER_SYNC_KWARG: False}  # this torch's name for broadcast_buffers
        >>> ddp_syncs_buffers(DistributedDataParallel(torch.nn.Linear(2, 2), **off))
        False
        >>> ddp_syncs_buffers(DistributedDataParallel(torch.nn.Linear(2, 2)))
        True
        >>> dist.destroy_process_group()
    """
    value = ddp.__dict__.get("forward_sync_buffers")
    if value is None:
        value = getattr(ddp, "broadcast_buffers", True)
    return bool(value)


def plain_bn_names(model: nn.Module) -> list[str]:
    """The names of ``model``'s BatchNorm layers that keep running statistics (not Sync).

    Args:
        model: A module.

    Returns:
        Their module paths (``"<root>"`` for the model itself).

    Example:
        >>> import torch
        >>> from ddpstate._ddp_buffers import plain_bn_names
        >>> plain_bn_names(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)))
        ['1']
    """
    return [
        name or "<root>"
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm)
        and not isinstance(m, nn.SyncBatchNorm)
        and m.running_mean is not None
    ]


def listed(names: list[str]) -> str:
    """The first three names, quoted, and how many more.

    Example:
        >>> from ddpstate._ddp_buffers import listed
        >>> listed(["a", "b", "c", "d"])
        "'a', 'b', 'c' and 1 more"
    """
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(map(repr, names[:3])) + more


def _explanation(layer_names: list[str], opening: str) -> str:
    torch_note = ""
    if DDP_SYNC_KEEPS_VERSIONS:
        torch_note = (
            f" (this torch, {torch.__version__}, keeps DDP's own copy from tripping autograd, "
            "so look also for code that writes BatchNorm buffers in place between forward "
            "and backward)"
        )
    return (
        f"ddpstate: {opening} This DDP model has BatchNorm layers ({listed(layer_names)}) and "
        "buffer broadcasting on (broadcast_buffers=True, DDP's default): at the start of every "
        "forward DDP copies rank 0's running_mean/running_var into each replica in place, so "
        "when the model runs forward twice before one backward (GANs, siamese nets, two-view "
        f"losses) the first forward's saved buffers are overwritten{torch_note}. Fix it either "
        "way: (1) SyncBatchNorm (GPU only): ddpstate.wrap_ddp(model, batchnorm='sync'), or "
        "ddpstate.convert_sync_batchnorm(model) before wrapping in DDP; or "
        "(2) no buffer broadcast: ddpstate.wrap_ddp(model, batchnorm='unsynced') or "
        f"DDP(model, {BUFFER_SYNC_KWARG}=False), then call ddpstate.sync_batchnorm_stats(model) "
        "on every rank before evaluating and saving."
    )


@contextlib.contextmanager
def explain_ddp_errors(model: nn.Module) -> Iterator[None]:
    """Explain the "modified by an inplace operation" error of DDP with BatchNorm.

    Wrap the backward (or the whole training step) of a DDP model. If torch
    raises its ``RuntimeError`` "one of the variables needed for gradient
    computation has been modified by an inplace operation" and ``model`` is
    DDP (possibly inside DataParallel or ``torch.compile``) with plain
    BatchNorm layers and buffer broadcasting on, it is re-raised as
    :class:`BatchNormBufferSyncError` (also a ``RuntimeError``), chained from
    torch's error, with a message naming the cause, the BatchNorm layers and
    both fixes: SyncBatchNorm, or ``broadcast_buffers=False`` plus
    :func:`sync_batchnorm_stats`. Any other exception, or this one on a model
    where that is not the cause, passes through untouched.

    Args:
        model: The DDP-wrapped model that ran the forward passes.

    Raises:
        BatchNormBufferSyncError: The explained error, from torch's ``RuntimeError``.

    Example:
        >>> import torch, ddpstate
        >>> net = torch.nn.Linear(2, 1)
        >>> with ddpstate.explain_ddp_errors(net):
        ...     net(torch.ones(1, 2)).sum().backward()
    """
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, DDPStateError) or _INPLACE_TEXT not in str(err):
            raise
        ddp = find_ddp(model)
        names = plain_bn_names(ddp.module) if ddp is not None and ddp_syncs_buffers(ddp) else []
        if not names:
            raise
        first_line = str(err).strip().splitlines()[0]
        raise BatchNormBufferSyncError(
            _explanation(names, f"the backward failed with {first_line!r}.")
        ) from err


def _output_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _output_tensors(item)


class TwoForwardGuard:
    """Warn once when a DDP model that would hit the in-place error starts a second forward.

    Installed by :func:`wrap_ddp` only where the error can happen: buffer
    broadcasting on, plain BatchNorm layers, and a torch whose DDP bumps the
    buffers' version counters. "Pending" means a grad-enabled forward produced
    outputs that no backward has reached yet.
    """

    def __init__(self, layer_names: list[str]) -> None:
        self.layer_names = layer_names
        self.pending = False
        self.warned = False

    def before_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook: warn when a forward starts while another awaits its backward."""
        if self.pending and not self.warned and torch.is_grad_enabled():
            self.warned = True
            opening = (
                "a forward started before the previous forward's backward; a backward through "
                "both will fail with 'one of the variables needed for gradient computation has "
                "been modified by an inplace operation'."
            )
            warn(_explanation(self.layer_names, opening), rank=get_rank())

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook: mark a backward pending until it reaches this forward's outputs."""
        if not torch.is_grad_enabled():
            return
        outputs = [t for t in _output_tensors(output) if t.requires_grad]
        if outputs:
            self.pending = True
            torch.autograd.graph.register_multi_grad_hook(outputs, self._reached, mode="any")

    def _reached(self, grad: Any) -> None:
        self.pending = False
