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
        reading the copies.
        """
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
        used: set[tuple[Any, ...]] = set()
        memo: dict[Any, Any] = {}
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
        memo: dict[Any, Any],
        events: list[Any],
    ) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj, path, used, memo, events)
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
        memo: dict[Any, Any],
        events: list[Any],
    ) -> torch.Tensor:
        """A CPU copy of ``tensor``, sharing storage with the copies of its storage's other views.

        ``state_dict()`` returns a new tensor object per key, so tied weights are
        found by their storage, not by ``id``: each storage is copied once, whole
        (what ``torch.save`` writes of it), and every view is rebuilt on the copy
        with its own offset, shape and stride. The writer then sees the ties the
        synchronous save sees, and writes files of the same size and aliases.
        """
        t = tensor.detach()
        if t.layout != torch.strided or t.is_quantized or t.device.type not in ("cpu", "cuda"):
            if id(tensor) not in memo:
                memo[id(tensor)] = t.to("cpu", copy=True)
            return memo[id(tensor)]  # type: ignore[no-any-return]
        # Lazy conjugate/negative bits are not in the storage's bytes: materialise them.
        t = t.resolve_conj().resolve_neg()
        source = t.untyped_storage()
        # A live storage owns its address, so (device, address) names it while the
        # state holds it; empty storages all sit at address 0 and share nothing.
        key = (t.device, source.data_ptr()) if source.nbytes() else None
        copied = memo.get(key) if key is not None else None
        if copied is None:
            copied = self._copy_storage(source, t.device, path, used, events)
            if key is not None:
                memo[key] = copied
        view = torch.empty(0, dtype=t.dtype, device="cpu")
        return view.set_(copied.untyped_storage(), t.storage_offset(), t.shape, t.stride())

    def _copy_storage(
        self,
        source: torch.UntypedStorage,
        device: torch.device,
        path: tuple[Any, ...],
        used: set[tuple[Any, ...]],
        events: list[Any],
    ) -> torch.Tensor:
        """Copy a whole storage into the CPU buffer kept for ``path`` (its first view's path)."""
        on_cuda = device.type == "cuda"
        nbytes = source.nbytes()
        buffer = self.buffers.get(path)
        if (
            buffer is None
            or buffer.numel() != nbytes
            or buffer.dtype != torch.uint8
            or (on_cuda and not buffer.is_pinned())
        ):
            buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=on_cuda)
            self.buffers[path] = buffer
        used.add(path)
        raw = torch.empty(0, dtype=torch.uint8, device=device).set_(source)
        # The copy is queued on the training stream, so later kernels that change
        # the tensor run after it; the writer thread waits on the event before reading.
        buffer.copy_(raw, non_blocking=on_cuda)
        if on_cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return buffer

    # ------------------------------------------------------------------ writing (rank 0)
