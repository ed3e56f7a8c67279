"""The copies an async save writes from: every tensor of the state, copied into reused CPU buffers.

``CheckpointManager(async_save=True)`` and the node-local tier return to
training right after :meth:`Snapshot.collect`; their writer threads read the
copies. Each owner keeps its own :class:`Snapshot`, so the buffers one write
is still reading are never overwritten by another's copy.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ddpstate._gc import gc_paused
from ddpstate._keys.wrappers import unwrapped_state_dict
from ddpstate._manager import optim_state
from ddpstate._manager.entries import (
    KIND_MODULE,
    KIND_STATEFUL,
    KIND_VALUE,
    Entry,
    has_state_dict,
)


class Snapshot:
    """CPU copy buffers kept between saves (pinned for CUDA tensors), keyed by the tensor's path."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def collect(
        self, state: Mapping[str, Any], *, snapshot: bool
    ) -> tuple[dict[str, Entry], list[Any]]:
        """Turn ``state`` into what gets written; with ``snapshot`` every tensor is copied.

        Returns the entries and the CUDA events the writer must wait on before
        reading the copies (one per device).
        """
        # state_dict() and the copies make a few objects per tensor, none in a cycle;
        # with 25,000 tensors the collector's passes over them took a third of the call.
        with gc_paused():
            return self._collect(state, snapshot)

    def _collect(
        self, state: Mapping[str, Any], snapshot: bool
    ) -> tuple[dict[str, Entry], list[Any]]:
        entries: dict[str, Entry] = {}
        for name, obj in state.items():
            if isinstance(obj, nn.Module):
                entry = Entry(KIND_MODULE, unwrapped_state_dict(obj))
            elif isinstance(obj, torch.optim.Optimizer):
                entry = Entry(KIND_STATEFUL, optim_state.saved_form(name, obj, state))
            elif has_state_dict(obj):
                entry = Entry(KIND_STATEFUL, obj.state_dict())
            else:
                entry = Entry(KIND_VALUE, obj)
            entries[name] = entry
        if not snapshot:
            return entries, []
        used: dict[tuple[Any, ...], torch.Tensor] = {}
        memo: dict[Any, Any] = {}
        devices: set[torch.device] = set()
        copied: dict[str, Entry] = {}
        # The copies are plain data: no autograd history, whatever the source's requires_grad.
        with torch.no_grad():
            for name, e in entries.items():
                value = self._copy(e.value, (name,), used, memo, devices, e.kind == KIND_MODULE)
                copied[name] = Entry(e.kind, value)
        self.buffers = used  # the buffers of paths this state no longer has are let go
        events = []
        for device in devices:
            # Every copy was queued on the device's current stream: one event after the last
            # covers them all; the writer thread waits on it before reading.
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return copied, events

    def _copy(
        self,
        obj: Any,
        path: tuple[Any, ...],
        used: dict[tuple[Any, ...], torch.Tensor],
        memo: dict[Any, Any],
        devices: set[torch.device],
        fresh_metadata: bool = False,
    ) -> Any:
        """A copy of ``obj`` whose tensors are snapshot copies (containers copied, not shared).

        ``fresh_metadata``: ``obj`` is a module's state dict, whose ``_metadata``
        ``Module.state_dict()`` builds anew per call and the writer only reads, so
        it is kept, not deep-copied (7,762 entries for 25,640 tensors: issue 42).
        """
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj, path, used, memo, devices)
        if isinstance(obj, Mapping):
            new: Any = OrderedDict() if isinstance(obj, OrderedDict) else {}
            for key, value in obj.items():
                new[key] = self._copy(value, (*path, key), used, memo, devices)
            metadata = getattr(obj, "_metadata", None)
            if metadata is not None:
                new._metadata = metadata if fresh_metadata else copy.deepcopy(metadata)
            return new
        if isinstance(obj, list):
            return [self._copy(v, (*path, i), used, memo, devices) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return tuple(self._copy(v, (*path, i), used, memo, devices) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _copy_tensor(
        self,
        tensor: torch.Tensor,
        path: tuple[Any, ...],
        used: dict[tuple[Any, ...], torch.Tensor],
        memo: dict[Any, Any],
        devices: set[torch.device],
    ) -> torch.Tensor:
        """A CPU copy of ``tensor``, sharing storage with the copies of its storage's other views.

        ``state_dict()`` returns a new tensor object per key, so tied weights are
        found by their storage, not by ``id``: each storage is copied once, whole
        (what ``torch.save`` writes of it), and every other view is rebuilt on the
        copy with its own offset, shape and stride. The writer then sees the ties
        the synchronous save sees, and writes files of the same size and aliases.
        """
        if (
            tensor.layout != torch.strided
            or tensor.is_quantized
            or not (tensor.is_cpu or tensor.is_cuda)
        ):
            if id(tensor) not in memo:
                memo[id(tensor)] = tensor.detach().to("cpu", copy=True)
            return memo[id(tensor)]  # type: ignore[no-any-return]
        t = tensor
        if t.is_conj() or t.is_neg():
            # Lazy conjugate/negative bits are not in the storage's bytes: materialise them.
            t = t.resolve_conj().resolve_neg()
        source = t.untyped_storage()
        nbytes = source.nbytes()
        # A live storage owns its address, so (device, address) names it while the
        # state holds it; empty storages all sit at address 0 and share nothing.
        key = (t.device, source.data_ptr()) if nbytes else None
        copied = memo.get(key) if key is not None else None
        if copied is None:
            if t.storage_offset() == 0 and t.nbytes == nbytes and t.is_contiguous():
                # The common case (most tensors own their storage): the buffer, shaped like
                # the tensor, is the copy itself; no view to build per key.
                copied = self._copy_whole(t, path, used, devices)
                if key is not None:
                    memo[key] = copied
                return copied
            copied = self._copy_storage(source, t.device, path, used, devices)
            if key is not None:
                memo[key] = copied
        view = torch.empty(0, dtype=t.dtype, device="cpu")
        return view.set_(copied.untyped_storage(), t.storage_offset(), t.shape, t.stride())

    def _buffer(
        self,
        path: tuple[Any, ...],
        like: torch.Tensor,
        on_cuda: bool,
        used: dict[tuple[Any, ...], torch.Tensor],
    ) -> torch.Tensor:
        """The CPU buffer kept for ``path``; a new one unless it has ``like``'s shape and dtype."""
        buffer = self.buffers.get(path)
        if (
            buffer is None
            or buffer.shape != like.shape
            or buffer.dtype != like.dtype
            or (on_cuda and not buffer.is_pinned())
        ):
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=on_cuda)
        used[path] = buffer
        return buffer

    def _copy_whole(
        self,
        tensor: torch.Tensor,
        path: tuple[Any, ...],
        used: dict[tuple[Any, ...], torch.Tensor],
        devices: set[torch.device],
    ) -> torch.Tensor:
        """Copy a contiguous tensor that is its whole storage into the buffer kept for ``path``."""
        on_cuda = tensor.is_cuda
        buffer = self._buffer(path, tensor, on_cuda, used)
        # The copy is queued on the training stream, so later kernels that change
        # the tensor run after it; the writer thread waits on the event before reading.
        buffer.copy_(tensor, non_blocking=on_cuda)
        if on_cuda:
            devices.add(tensor.device)
        return buffer

    def _copy_storage(
        self,
        source: torch.UntypedStorage,
        device: torch.device,
        path: tuple[Any, ...],
        used: dict[tuple[Any, ...], torch.Tensor],
        devices: set[torch.device],
    ) -> torch.Tensor:
        """Copy a whole storage into the byte buffer kept for ``path`` (its first view's path)."""
        raw = torch.empty(0, dtype=torch.uint8, device=device).set_(source)
        return self._copy_whole(raw, path, used, devices)

    # ------------------------------------------------------------------ writing (rank 0)
