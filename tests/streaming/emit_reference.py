"""A frozen copy of ddpstate's pickle emitter before it had its own writer (reference only).

``ddpstate/_streaming/pickle_emit.py`` once subclassed CPython's private pure-Python
``pickle._Pickler``; it now writes protocol 2 itself and must write the very same
bytes. tests/streaming/test_pickle_emit.py compares the two over random trees. Do not edit:
this is what the bytes were, not what they should become.
"""

from __future__ import annotations

import collections
import copyreg
import io
import pickle
import re
from collections.abc import Mapping
from typing import Any, Optional

from ddpstate._streaming.pickle_scan import (
    DtypeRef,
    GlobalRef,
    Opaque,
    OpaqueCall,
    StandIn,
    StorageRecord,
    TensorRecord,
    has_state,
)

_REBUILD_V2 = GlobalRef("torch._utils", "_rebuild_tensor_v2")
_REBUILD_V3 = GlobalRef("torch._utils", "_rebuild_tensor_v3")
_REBUILD_PARAM = GlobalRef("torch._utils", "_rebuild_parameter")
_REBUILD_PARAM_STATE = GlobalRef("torch._utils", "_rebuild_parameter_with_state")
_REBUILD_FROM_TYPE = GlobalRef("torch._tensor", "_rebuild_from_type_v2")
_NEWOBJ_EX = GlobalRef("copyreg", "__newobj_ex__")
# torch.save's default pickle protocol; torch.load reads any, older tools expect 2.
_PROTOCOL = 2
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*\Z")
# Exact built-in types that are never a storage, a placeholder or reduced by
# reducer_override, so ``_Emitter.save`` skips those questions for them. Scalars
# are never memoized: their opcodes are what ``pickle.dumps`` writes for them,
# less its PROTO header and STOP. A string is memoized: the same, less the
# BINPUT 0 that ends it, then a PUT of the emitter's own slot number.
_SCALARS = frozenset({int, float, bool, type(None)})
_HEADER = len(pickle.PROTO) + 1
_STR_TAIL = len(pickle.BINPUT) + 1 + len(pickle.STOP)
# The containers go through the memo first, then to the pickler's writer for
# their type (which saves each item through ``_Emitter.save``).
_CONTAINERS: dict[type, str] = {tuple: "save_tuple", list: "save_list", dict: "save_dict"}


class _PlainTensor:
    """The tensor inside a Parameter, written without the Parameter wrapper."""

    __slots__ = ("record",)

    def __init__(self, record: TensorRecord) -> None:
        self.record = record


def _storage_ref(record: StorageRecord) -> GlobalRef:
    if record.type_name == "UntypedStorage":
        return GlobalRef("torch.storage", "UntypedStorage")
    return GlobalRef("torch", record.type_name)


class _Emitter(pickle._Pickler):
    """A pure-Python Pickler that writes placeholders back under their original names."""

    def __init__(
        self,
        file: io.BytesIO,
        memo_base: int = 0,
        replace: Optional[Mapping[int, TensorRecord]] = None,
    ) -> None:
        super().__init__(file, protocol=_PROTOCOL)
        # Tensor records written in place of others (by id): convert --dtype's casts.
        self._replace = replace or {}
        self.storages: list[StorageRecord] = []
        self._storage_keys: dict[int, str] = {}
        self._globals: dict[str, int] = {}
        # Memo slot numbers are the memo's size plus this: a pickle written into
        # the middle of another continues its numbering (see pickle_rewrite).
        self._memo_base = memo_base

    def memoize(self, obj: Any) -> None:
        index = self._memo_base + len(self.memo)  # type: ignore[attr-defined]
        self.write(self.put(index))  # type: ignore[attr-defined]
        self.memo[id(obj)] = (index, obj)  # type: ignore[attr-defined]

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, StorageRecord):
            return None
        key = self._storage_keys.get(id(obj))
        if key is None:
            # torch.save numbers storages 0, 1, ... in first-use order and writes
            # them in that order; torch.load's offset shortcut relies on it.
            key = str(len(self.storages))
            self._storage_keys[id(obj)] = key
            self.storages.append(obj)
        # "cpu": the output must load on a machine without the original GPU.
        return ("storage", _storage_ref(obj), key, "cpu", obj.numel)

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        # Fast path: a 100,000-tensor checkpoint makes ~2 million save calls, and
        # pickle's generic path asks persistent_id and reducer_override about
        # each one (half the time of ``convert`` at that size). For these exact
        # types both answers are known, so skip straight to the type's writer.
        # Protocol 2 has no frames, so pickle's commit_frame() has nothing to do.
        kind = type(obj)
        if kind in _SCALARS:
            self.write(pickle.dumps(obj, _PROTOCOL)[_HEADER:-1])  # type: ignore[attr-defined]
            return
        if kind is str or kind in _CONTAINERS:
            memo = self.memo.get(id(obj))  # type: ignore[attr-defined]
            if memo is not None:
                self.write(self.get(memo[0]))  # type: ignore[attr-defined]
            elif kind is str:
                self.write(pickle.dumps(obj, _PROTOCOL)[_HEADER:-_STR_TAIL])  # type: ignore[attr-defined]
                self.memoize(obj)
            else:
                getattr(self, _CONTAINERS[kind])(obj)
            return
        ref: Optional[GlobalRef] = None
        if isinstance(obj, GlobalRef):
            ref = obj
        elif isinstance(obj, StandIn) or (isinstance(obj, type) and issubclass(obj, Opaque)):
            ref = obj.ref
        if ref is None:
            super().save(obj, save_persistent_id)  # type: ignore[misc]
            return
        index = self._globals.get(ref.qualname)
        if index is not None:
            self.write(self.get(index))  # type: ignore[attr-defined]
            return
        if not (_NAME.match(ref.module) and _NAME.match(ref.name)):
            # A newline in a name would let it smuggle opcodes into the output.
            raise pickle.PicklingError(f"refusing to write the global name {ref.qualname!r}")
        self.write(  # type: ignore[attr-defined]
            pickle.GLOBAL + ref.module.encode("utf-8") + b"\n" + ref.name.encode("utf-8") + b"\n"
        )
        # Memo slots are numbered by the memo's size, so the entry goes in there.
        index = self._memo_base + len(self.memo)  # type: ignore[attr-defined]
        self.write(self.put(index))  # type: ignore[attr-defined]
        self.memo[id(ref)] = (index, ref)  # type: ignore[attr-defined]
        self._globals[ref.qualname] = index

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, TensorRecord):
            return _tensor_reduce(self._replace.get(id(obj), obj))
        if isinstance(obj, _PlainTensor):
            return _plain_reduce(obj.record)
        if isinstance(obj, Opaque):
            return _opaque_reduce(obj)
        return NotImplemented


def _plain_reduce(record: TensorRecord) -> tuple[Any, tuple[Any, ...]]:
    hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    extra = (record.metadata,) if record.metadata else ()
    base = (record.storage, record.offset, record.shape, record.stride, record.requires_grad, hooks)
    if record.rebuild == "v3":
        return _REBUILD_V3, (*base, DtypeRef("torch", record.dtype), *extra)
    return _REBUILD_V2, (*base, *extra)


def _tensor_reduce(record: TensorRecord) -> tuple[Any, tuple[Any, ...]]:
    if record.from_type is not None:
        func, args = _plain_reduce(record)
        return _REBUILD_FROM_TYPE, (func, record.from_type[0], args, record.from_type[1])
    if record.parameter:
        hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        inner = _PlainTensor(record)
        if record.param_state is None:
            return _REBUILD_PARAM, (inner, record.param_requires_grad, hooks)
        return _REBUILD_PARAM_STATE, (inner, record.param_requires_grad, hooks, record.param_state)
    return _plain_reduce(record)


def _opaque_reduce(obj: Opaque) -> tuple[Any, ...]:
    state = obj.state if has_state(obj) else None
    listitems = iter(obj.listitems) if obj.listitems else None
    dictitems = iter(obj.dictitems) if obj.dictitems else None
    if isinstance(obj, OpaqueCall):
        return (obj.func, obj.args, state, listitems, dictitems)
    if obj.kwargs:
        return (_NEWOBJ_EX, (type(obj), obj.args, obj.kwargs), state, listitems, dictitems)
    if obj.how == "new":
        # pickle writes NEWOBJ for a reduce whose function is named __newobj__.
        newobj = copyreg.__newobj__  # type: ignore[attr-defined]
        return (newobj, (type(obj), *obj.args), state, listitems, dictitems)
    return (type(obj), obj.args, state, listitems, dictitems)


def reference_dump_within(
    obj: Any, memo_base: int, memo: dict[int, Any], global_slots: dict[str, int]
) -> tuple[bytes, int]:
    """The opcodes that pickle ``obj`` at a point of a larger pickle, with no header or STOP.

    Args:
        obj: What to write (no storages or tensors).
        memo_base: The memo slot the first new object takes.
        memo: Objects already in the memo there, ``id -> (slot, object)``.
        global_slots: Globals already written there, ``qualname -> slot``.

    Returns:
        ``(bytes, number of memo slots the bytes fill)``.

    """
    buffer = io.BytesIO()
    emitter = _Emitter(buffer, memo_base - len(memo))
    emitter.memo.update(memo)  # type: ignore[attr-defined]
    emitter._globals.update(global_slots)
    emitter.save(obj)
    if emitter.storages:
        raise pickle.PicklingError("dump_within writes no storages")
    return buffer.getvalue(), len(emitter.memo) - len(memo)  # type: ignore[attr-defined]


def reference_dump_checkpoint_pickle(
    obj: Any, replace: Optional[Mapping[int, TensorRecord]] = None
) -> tuple[bytes, list[StorageRecord]]:
    """Pickle a scanned object tree the way torch.save would, without torch.

    Tensors become ``_rebuild_tensor_v2``/``v3`` calls on persistent storage
    ids numbered in first-use order and tagged ``"cpu"``; placeholders of other
    globals are written back under their original names, unchanged.

    Args:
        obj: A tree from :func:`ddpstate._streaming.pickle_scan.scan_pickle`, possibly rewritten.
        replace: Records to write in place of others, by the ``id`` of the one
            in ``obj`` (how ``convert --dtype`` swaps in cast tensors without
            rebuilding the tree).

    Returns:
        ``(data.pkl bytes, storages)``: storage ``i`` of the list has key ``str(i)``.

    """
    buffer = io.BytesIO()
    emitter = _Emitter(buffer, replace=replace)
    emitter.dump(obj)
    return buffer.getvalue(), emitter.storages
