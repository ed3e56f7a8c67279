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

from ddpstate._keys.wrappers import unwrapped_state_dict
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
        reading the copies.
        """
        entries: dict[str, Entry] = {}
        for name, obj in state.items():
            if isinstance(obj, nn.Module):
                entry = Entry(KIND_MODULE, unwrapped_state_dict(obj))
            elif has_state_dict(obj):
                entry = Entry(KIND_STATEFUL, obj.state_dict())
            else:
                entry = Entry(KIND_VALUE, obj)
            entries[name] = entry
        if not snapshot:
            return entries, []
        used: set[tuple[Any, ...]] = set()
        memo: dict[int, Any] = {}
        events: list[Any] = []
        copied = {
            name: Entry(e.kind, self._copy(e.value, (name,), used, memo, events))
            for name, e in entries.items()
        }
        for key in [k for k in self.buffers if k not in used]:
            del self.buffers[key]
        return copied, events

    def _copy(
        self,
        obj: Any,
        path: tuple[Any, ...],
        used: set[tuple[Any, ...]],
        memo: dict[int, Any],
        events: list[Any],
    ) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) in memo:  # tied tensors stay tied in the snapshot
                return memo[id(obj)]
            copied = self._copy_tensor(obj, path, used, events)
            memo[id(obj)] = copied
            return copied
        if isinstance(obj, Mapping):
            new: Any = OrderedDict() if isinstance(obj, OrderedDict) else {}
            for key, value in obj.items():
                new[key] = self._copy(value, (*path, key), used, memo, events)
            metadata = getattr(obj, "_metadata", None)
            if metadata is not None:
                new._metadata = copy.deepcopy(metadata)
            return new
        if isinstance(obj, list):
            return [self._copy(v, (*path, i), used, memo, events) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return tuple(self._copy(v, (*path, i), used, memo, events) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _copy_tensor(
        self,
        tensor: torch.Tensor,
        path: tuple[Any, ...],
        used: set[tuple[Any, ...]],
        events: list[Any],
    ) -> torch.Tensor:
        t = tensor.detach()
        if t.layout != torch.strided or t.is_quantized or t.device.type not in ("cpu", "cuda"):
            return t.to("cpu", copy=True)
        on_cuda = t.device.type == "cuda"
        buffer = self.buffers.get(path)
        if (
            buffer is None
            or buffer.shape != t.shape
            or buffer.dtype != t.dtype
            or (on_cuda and not buffer.is_pinned())
        ):
            buffer = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=on_cuda)
            self.buffers[path] = buffer
        used.add(path)
        # The copy is queued on the training stream, so later kernels that change
        # the tensor run after it; the writer thread waits on the event before reading.
        buffer.copy_(t, non_blocking=on_cuda)
        if on_cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(t.device))
            events.append(event)
        return buffer

    # ------------------------------------------------------------------ writing (rank 0)
