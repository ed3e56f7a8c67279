"""The copies an async save writes from: every tensor of the state, copied into reused CPU buffers.

``CheckpointManager(async_save=True)`` and the node-local tier return to
training right after :meth:`Snapshot.collect`; their writer threads read the
copies. Each owner keeps its own :class:`Snapshot`, so the buffers one write
is still reading are never overwritten by another's copy.

The call blocks the training loop, so per tensor it does only what it must
(issue 42: 25,640 tensors): it takes a model's state with ``keep_vars=True``
(no detached tensor made per key: the copies are plain data anyway), picks each
tensor's buffer in one pass, and runs every copy in one batched
``torch._foreach_copy_`` per source device.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ddpstate._gc import gc_paused
from ddpstate._io import savecheck as _savecheck
from ddpstate._keys.wrappers import unwrapped_state_dict
from ddpstate._manager import optim_state
from ddpstate._manager.entries import (
    KIND_MODULE,
    KIND_STATEFUL,
    KIND_VALUE,
    Entry,
    has_state_dict,
)

#: The tensor types a state holds as plain data (``keep_vars=True`` yields the Parameters).
_PLAIN = (torch.Tensor, nn.Parameter)
#: Each read of a Parameter's attributes costs about 0.2 µs: a CPU tensor's device is not read.
_CPU = torch.device("cpu")


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
            entries = {name: _entry(name, obj, state, snapshot) for name, obj in state.items()}
            if not snapshot:
                return entries, []
            copies = _Copies(self.buffers)
            # The copies are plain data: no autograd history, whatever the source's requires_grad.
            with torch.no_grad():
                copied = {
                    name: Entry(e.kind, copies.copy(e.value, (name,), e.kind == KIND_MODULE))
                    for name, e in entries.items()
                }
                events = copies.run()
            self.buffers = copies.used  # the buffers of paths this state no longer has are let go
            return copied, events


def _entry(name: str, obj: Any, state: Mapping[str, Any], snapshot: bool) -> Entry:
    """What entry ``name`` saves of ``obj``; a model's tensors are its live ones when copied."""
    if isinstance(obj, nn.Module):
        # keep_vars: the snapshot copies every tensor, so the detached tensor state_dict()
        # makes per key would be thrown away (about half of state_dict()'s time).
        return Entry(KIND_MODULE, unwrapped_state_dict(obj, keep_vars=snapshot))
    if isinstance(obj, torch.optim.Optimizer):
        return Entry(KIND_STATEFUL, optim_state.saved_form(name, obj, state))
    if has_state_dict(obj):
        return Entry(KIND_STATEFUL, obj.state_dict())
    return Entry(KIND_VALUE, obj)


class _Copies:
    """One snapshot being taken: the buffers it uses and its copies, queued per source device."""

    def __init__(self, kept: dict[tuple[Any, ...], torch.Tensor]) -> None:
        self.kept = kept
        self.used: dict[tuple[Any, ...], torch.Tensor] = {}
        self.memo: dict[Any, Any] = {}
        #: Source device -> (buffers, sources) for one ``_foreach_copy_``.
        self.queued: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def run(self) -> list[Any]:
        """Run the queued copies; return the CUDA events the writer waits on (one per device)."""
        events = []
        for device, (buffers, sources) in self.queued.items():
            on_cuda = device.type == "cuda"
            # Copies from a GPU are queued on the training stream, so later kernels that
            # change the tensors run after them; the writer thread waits on the event.
            torch._foreach_copy_(buffers, sources, non_blocking=on_cuda)
            if on_cuda:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(device))
                events.append(event)
        return events

    def copy(self, obj: Any, path: tuple[Any, ...], fresh_metadata: bool = False) -> Any:
        """A copy of ``obj`` whose tensors are snapshot copies (containers copied, not shared).

        ``fresh_metadata``: ``obj`` is a module's state dict, whose ``_metadata``
        ``Module.state_dict()`` builds anew per call and the writer only reads, so
        it is kept, not deep-copied (7,762 entries for 25,640 tensors: issue 42).
        """
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, Mapping):
            new: Any = OrderedDict() if isinstance(obj, OrderedDict) else {}
            for key, value in obj.items():
                if isinstance(value, torch.Tensor):  # most values: skip a call per tensor
                    new[key] = self.tensor(value, (*path, key))
                else:
                    new[key] = self.copy(value, (*path, key))
            metadata = getattr(obj, "_metadata", None)
            if metadata is not None:
                new._metadata = metadata if fresh_metadata else copy.deepcopy(metadata)
            return new
        if isinstance(obj, list):
            return [self.copy(v, (*path, i)) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return tuple(self.copy(v, (*path, i)) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        """A CPU copy of ``t`` (queued), sharing storage with its storage's other views' copies.

        ``state_dict()`` returns a new tensor object per key, so tied weights are
        found by their storage, not by ``id``: each storage is copied once, whole
        (what ``torch.save`` writes of it), and every other view is rebuilt on the
        copy with its own offset, shape and stride. The writer then sees the ties
        the synchronous save sees, and writes files of the same size and aliases.
        """
        on_cuda = not t.is_cpu
        if (
            type(t) not in _PLAIN
            or (on_cuda and not t.is_cuda)
            or t.layout != torch.strided
            or t.is_quantized
        ):
            return self._other(t)
        if t.is_conj() or t.is_neg():
            # Lazy conjugate/negative bits are not in the storage's bytes: materialise them.
            t = t.resolve_conj().resolve_neg()
        source, device = t.untyped_storage(), t.device if on_cuda else _CPU
        nbytes = source.nbytes()
        # A live storage owns its address, so (device, address) names it while the
        # state holds it; empty storages all sit at address 0 and share nothing.
        key = (device, source.data_ptr()) if nbytes else None
        copied = self.memo.get(key) if key is not None else None
        if copied is None:
            if t.storage_offset() == 0 and t.nbytes == nbytes and t.is_contiguous():
                # The common case (most tensors own their storage): the buffer, shaped like
                # the tensor, is the copy itself; no view to build per key.
                copied = self._queue(t, device, on_cuda, path)
                if key is not None:
                    self.memo[key] = copied
                return copied
            # Another view of the storage: the whole storage is copied, in bytes.
            raw = torch.empty(0, dtype=torch.uint8, device=device).set_(source)
            copied = self._queue(raw, device, on_cuda, path)
            if key is not None:
                self.memo[key] = copied
        view = torch.empty(0, dtype=t.dtype)
        return view.set_(copied.untyped_storage(), t.storage_offset(), t.shape, t.stride())

    def _other(self, tensor: torch.Tensor) -> torch.Tensor:
        """A sparse, quantized, subclassed, meta or sharded tensor: copied now, or kept to refuse.

        A meta tensor holds no data and a sharded one only this rank's shards: both are
        kept as they are, for the check that follows the snapshot to refuse by path.
        """
        sharded = _savecheck.sharded_types()
        if tensor.is_meta or (sharded and isinstance(tensor, sharded)):
            return tensor
        if id(tensor) not in self.memo:
            self.memo[id(tensor)] = tensor.detach().to("cpu", copy=True)
        return self.memo[id(tensor)]  # type: ignore[no-any-return]

    def _queue(
        self, source: torch.Tensor, device: torch.device, on_cuda: bool, path: tuple[Any, ...]
    ) -> torch.Tensor:
        """Queue the copy of ``source`` (a whole storage) into the buffer kept for ``path``."""
        shape, dtype = source.shape, source.dtype
        buffer = self.kept.get(path)
        if (
            buffer is None
            or buffer.dtype != dtype
            or buffer.shape != shape
            or (on_cuda and not buffer.is_pinned())
        ):
            buffer = torch.empty(shape, dtype=dtype, pin_memory=on_cuda)
        self.used[path] = buffer
        queue = self.queued.get(device)
        if queue is None:
            queue = self.queued[device] = ([], [])
        queue[0].append(buffer)
        queue[1].append(source)
        return buffer
