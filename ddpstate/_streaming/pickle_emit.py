"""Writing a scanned object tree back as a torch.save pickle, storages renumbered, tagged CPU.

The writer is this module's own protocol-2 pickler, built from :mod:`pickle`'s
public opcode constants and :mod:`struct` alone. Its output is byte for byte
what a pure-Python ``pickle.Pickler`` at protocol 2 writes for the same tree
(with tensors and placeholders reduced as below): the same opcodes, the same
batches of 1,000 items per ``APPENDS``/``SETITEMS``, and the same memo slot
numbers, including one slot for every temporary object the reduction of a
tensor creates. ``_streaming/pickle_rewrite.py`` relies on that numbering when
it re-emits part of an existing pickle (:func:`dump_within`).
"""

from __future__ import annotations

import codecs
import collections
import copyreg
import functools
import io
import itertools
import pickle
import re
import struct
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

from ddpstate._streaming.pickle_scan import (
    DtypeRef,
    GlobalRef,
    Opaque,
    OpaqueCall,
    StandIn,
    StorageRecord,
    StorageTypeRef,
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
# Items per APPENDS/SETITEMS opcode: what CPython's picklers write, so the same.
_BATCH = 1000
# The opcodes are precomputed for the small arguments nearly every pickle uses.
_PUTS = tuple(pickle.BINPUT + bytes((i,)) for i in range(256))
_GETS = tuple(pickle.BINGET + bytes((i,)) for i in range(256))
_SMALL_INTS = tuple(pickle.BININT1 + bytes((i,)) for i in range(256))
_SHORT_TUPLES = (pickle.EMPTY_TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)
_U16 = struct.Struct("<H")
_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_F64 = struct.Struct(">d")
# pickle.dumps(global) is PROTO 2, GLOBAL module\nname\n, BINPUT 0, STOP.
_PREFIX = pickle.PROTO + bytes((_PROTOCOL,))
_GLOBAL_TAIL = pickle.BINPUT + b"\x00" + pickle.STOP
_EXT = (pickle.EXT1, pickle.EXT2, pickle.EXT4)
# The types whose class pickle writes as a call, not a name (type(None)...).
_SINGLETON_TYPES: dict[type, Any] = {
    type(None): None,
    type(NotImplemented): NotImplemented,
    type(...): ...,
}


def put_op(index: int) -> bytes:
    if index < 256:
        return _PUTS[index]
    return pickle.LONG_BINPUT + _U32.pack(index)


def get_op(index: int) -> bytes:
    if index < 256:
        return _GETS[index]
    return pickle.LONG_BINGET + _U32.pack(index)


def int_op(value: int) -> bytes:
    """The opcode writing ``value``: BININT1/BININT2/BININT, else LONG1/LONG4."""
    if 0 <= value <= 0xFF:
        return _SMALL_INTS[value]
    if 0 <= value <= 0xFFFF:
        return pickle.BININT2 + _U16.pack(value)
    if -0x80000000 <= value <= 0x7FFFFFFF:
        return pickle.BININT + _I32.pack(value)
    # Two's complement, little-endian, in as few bytes as keep the sign.
    data = value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)
    if value < 0 and len(data) > 1 and data[-1] == 0xFF and data[-2] & 0x80:
        data = data[:-1]
    if len(data) < 256:
        return pickle.LONG1 + bytes((len(data),)) + data
    return pickle.LONG4 + _I32.pack(len(data)) + data


def _global_op(obj: Any) -> Optional[tuple[bytes, bool]]:
    """``(opcode, memoize?)`` naming a real class or function, as pickle names it.

    ``pickle.dumps`` resolves the module the way the pickler does (including
    protocol 2's Python 2 names, ``__builtin__.set``); its answer is cut out of
    the one-object pickle it writes. None for a nested name (``Outer.Inner``),
    which protocol 2 writes as ``getattr(Outer, "Inner")``.
    """
    try:
        data = pickle.dumps(obj, _PROTOCOL)
    except (AttributeError, TypeError, ImportError) as error:
        # CPython's C pickler says AttributeError where the pure-Python one
        # (which this writer matches) says PicklingError.
        raise pickle.PicklingError(f"Can't pickle {obj!r}: {error}") from error
    body = data[len(_PREFIX) :]
    if body[:1] == pickle.GLOBAL and body.endswith(_GLOBAL_TAIL) and body.count(b"\n") == 2:
        return body[: -len(_GLOBAL_TAIL)], True
    if body[:1] in _EXT and body.endswith(pickle.STOP):
        return body[:-1], False  # a copyreg extension code is not memoized
    return None


def _nested_parent(obj: Any) -> tuple[Any, str]:
    """``(Outer, "Inner")`` for ``Outer.Inner``, found the way pickle finds it."""
    qualname = getattr(obj, "__qualname__", None) or obj.__name__
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    *path, last = qualname.split(".")
    parent: Any = module
    for part in path:
        parent = getattr(parent, part, None)
    if module is None or "<locals>" in path or getattr(parent, last, None) is not obj:
        raise pickle.PicklingError(f"Can't pickle {obj!r}: it's not found as {qualname}")
    return parent, last


def _storage_ref(record: StorageRecord) -> GlobalRef:
    if record.type_name == "UntypedStorage":
        return GlobalRef("torch.storage", "UntypedStorage")
    return GlobalRef("torch", record.type_name)


def _opaque_reduce(obj: Opaque) -> tuple[Any, ...]:
    state = obj.state if has_state(obj) else None
    listitems = iter(obj.listitems) if obj.listitems else None
    dictitems = iter(obj.dictitems) if obj.dictitems else None
    if isinstance(obj, OpaqueCall):
        return (obj.func, obj.args, state, listitems, dictitems)
    if obj.kwargs:
        return (_NEWOBJ_EX, (type(obj), obj.args, obj.kwargs), state, listitems, dictitems)
    if obj.how == "new":
        # Named __newobj__, the reduction is written as NEWOBJ (cls, args).
        newobj = copyreg.__newobj__  # type: ignore[attr-defined]
        return (newobj, (type(obj), *obj.args), state, listitems, dictitems)
    return (type(obj), obj.args, state, listitems, dictitems)


class _Emitter:
    """A protocol-2 pickler that writes placeholders back under their original names.

    Tensors are written as torch.save writes them (``_rebuild_tensor_v2`` and
    friends on persistent storage ids), placeholder globals under the names
    they were read with, other objects as pickle writes them.
    """

    def __init__(
        self, memo_base: int = 0, replace: Optional[Mapping[int, TensorRecord]] = None
    ) -> None:
        self._buffer = io.BytesIO()
        self.write: Callable[[bytes], int] = self._buffer.write
        # id -> (slot, object); the object is held so that its id stays unique.
        self.memo: dict[int, tuple[int, Any]] = {}
        # The next memo slot: a pickle written into the middle of another
        # continues its numbering (see pickle_rewrite).
        self.next_slot = memo_base
        # Tensor records written in place of others (by id): convert --dtype's casts.
        self._replace = replace or {}
        self.storages: list[StorageRecord] = []
        self._storage_keys: dict[int, str] = {}
        # Slot of each placeholder global written, by qualname.
        self.global_slots: dict[str, int] = {}
        # Exact types with a writer of their own; anything else takes _save_other.
        write = self.write
        self._writers: dict[type, Callable[[Any], object]] = {
            int: lambda obj: write(_SMALL_INTS[obj] if 0 <= obj <= 0xFF else int_op(obj)),
            float: lambda obj: write(pickle.BINFLOAT + _F64.pack(obj)),
            bool: lambda obj: write(pickle.NEWTRUE if obj else pickle.NEWFALSE),
            type(None): lambda obj: write(pickle.NONE),
            str: self._save_str,
            tuple: self._save_tuple,
            list: self._save_list,
            dict: self._save_dict,
            TensorRecord: self._save_tensor,
            StorageRecord: self._save_storage,
            **dict.fromkeys((GlobalRef, DtypeRef, StorageTypeRef), self._save_ref),
        }

    def getvalue(self) -> bytes:
        """The bytes written so far."""
        return self._buffer.getvalue()

    # -- memo ---------------------------------------------------------------

    def _memoize(self, obj: Any) -> None:
        index = self.next_slot
        self.next_slot = index + 1
        self.write(put_op(index))
        self.memo[id(obj)] = (index, obj)

    def _fresh_slot(self) -> None:
        """A memo slot for a temporary object nothing else can refer to.

        pickle memoizes the tuples and hook dicts a tensor's reduction creates;
        the slot numbers must match, but the objects need not exist.
        """
        index = self.next_slot
        self.next_slot = index + 1
        self.write(put_op(index))

    def _fetched(self, obj: Any) -> bool:
        """Write a GET and return True when ``obj`` is in the memo already."""
        hit = self.memo.get(id(obj))
        if hit is not None:
            self.write(get_op(hit[0]))
        return hit is not None

    def _after_reduce(self, obj: Any) -> None:
        hit = self.memo.get(id(obj))
        if hit is not None:
            # Built again inside its own arguments: drop this copy, use the first.
            self.write(pickle.POP + get_op(hit[0]))
        else:
            self._memoize(obj)

    # -- dispatch -----------------------------------------------------------

    def save(self, obj: Any) -> None:
        """Write the opcodes that push ``obj``."""
        writer = self._writers.get(type(obj))
        if writer is not None:
            writer(obj)
        else:
            self._save_other(obj)

    def _save_other(self, obj: Any) -> None:
        kind = type(obj)
        if isinstance(obj, GlobalRef):
            self._save_ref(obj)
        elif isinstance(obj, StandIn) or (isinstance(obj, type) and issubclass(obj, Opaque)):
            self._save_ref(obj.ref)
        elif isinstance(obj, StorageRecord):
            self._save_storage(obj)
        elif self._fetched(obj):
            pass  # in the memo already: a GET is written
        elif isinstance(obj, TensorRecord):
            self._write_tensor(obj)
        elif isinstance(obj, Opaque):
            self._save_reduce(*_opaque_reduce(obj), obj=obj)
        elif kind is bytes:
            args = (str(obj, "latin1"), "latin1") if obj else ()
            self._save_reduce(codecs.encode if obj else bytes, args, obj=obj)
        elif kind is bytearray:
            self._save_reduce(bytearray, (bytes(obj),) if obj else (), obj=obj)
        elif kind is set or kind is frozenset:
            self._save_reduce(kind, (list(obj),), obj=obj)
        elif kind is types.FunctionType:
            self._save_global(obj)
        elif kind is type:
            self._save_type(obj)
        elif kind is pickle.PickleBuffer:
            raise pickle.PicklingError("PickleBuffer can only be pickled with protocol >= 5")
        else:
            self._save_reduced(obj, kind)

    def _save_reduced(self, obj: Any, kind: type) -> None:
        reducer = copyreg.dispatch_table.get(kind)
        if reducer is not None:
            rv = reducer(obj)
        elif issubclass(kind, type):
            self._save_global(obj)
            return
        else:
            reduce_ex = getattr(obj, "__reduce_ex__", None)
            if reduce_ex is not None:
                rv = reduce_ex(_PROTOCOL)
            else:
                reduce = getattr(obj, "__reduce__", None)
                if reduce is None:
                    raise pickle.PicklingError(f"Can't pickle {kind.__name__!r} object: {obj!r}")
                rv = reduce()
        if isinstance(rv, str):
            self._save_global(obj)
            return
        if not isinstance(rv, tuple) or not 2 <= len(rv) <= 6:
            raise pickle.PicklingError(f"the reduction of {kind.__name__} is not a 2 to 6-tuple")
        self._save_reduce(*rv, obj=obj)

    # -- strings and containers ---------------------------------------------

    def _save_str(self, obj: str) -> None:
        if self._fetched(obj):
            return
        encoded = obj.encode("utf-8", "surrogatepass")
        self.write(pickle.BINUNICODE + _U32.pack(len(encoded)) + encoded)
        self._memoize(obj)

    def _save_tuple(self, obj: tuple[Any, ...]) -> None:
        if not obj:
            self.write(pickle.EMPTY_TUPLE)  # the one empty tuple; never memoized
            return
        if self._fetched(obj):
            return
        size = len(obj)
        if size > 3:
            self.write(pickle.MARK)
        save = self.save
        for item in obj:
            save(item)
        hit = self.memo.get(id(obj))
        if hit is not None:
            # The tuple holds itself (through a list or dict): its items were
            # written for nothing; drop them and use the copy already made.
            drop = pickle.POP_MARK if size > 3 else pickle.POP * size
            self.write(drop + get_op(hit[0]))
            return
        self.write(_SHORT_TUPLES[size] if size <= 3 else pickle.TUPLE)
        self._memoize(obj)

    def _save_list(self, obj: list[Any]) -> None:
        if self._fetched(obj):
            return
        self.write(pickle.EMPTY_LIST)
        self._memoize(obj)
        self._batches(obj, self.save, pickle.APPEND, pickle.APPENDS)

    def _save_dict(self, obj: dict[Any, Any]) -> None:
        if self._fetched(obj):
            return
        self.write(pickle.EMPTY_DICT)
        self._memoize(obj)
        self._batches(obj.items(), self._save_pair, pickle.SETITEM, pickle.SETITEMS)

    def _save_pair(self, pair: tuple[Any, Any]) -> None:
        self.save(pair[0])
        self.save(pair[1])

    def _batches(
        self, items: Iterable[Any], save: Callable[[Any], None], one: bytes, many: bytes
    ) -> None:
        # ``many`` after a MARK in batches of 1,000 items; a batch of one is ``one``.
        values = iter(items)
        while True:
            batch = list(itertools.islice(values, _BATCH))
            if len(batch) > 1:
                self.write(pickle.MARK)
            for value in batch:
                save(value)
            if batch:
                self.write(one if len(batch) == 1 else many)
            if len(batch) < _BATCH:
                return

    # -- globals ------------------------------------------------------------

    def _save_ref(self, ref: GlobalRef) -> None:
        index = self.global_slots.get(ref.qualname)
        if index is not None:
            self.write(get_op(index))
            return
        if not (_NAME.match(ref.module) and _NAME.match(ref.name)):
            # A newline in a name would let it smuggle opcodes into the output.
            raise pickle.PicklingError(f"refusing to write the global name {ref.qualname!r}")
        self.write(
            pickle.GLOBAL + ref.module.encode("utf-8") + b"\n" + ref.name.encode("utf-8") + b"\n"
        )
        self._memoize(ref)
        self.global_slots[ref.qualname] = self.next_slot - 1

    def _save_global(self, obj: Any) -> None:
        if self._fetched(obj):
            return
        found = _global_op(obj)
        if found is None:
            self._save_reduce(getattr, _nested_parent(obj))
            self._memoize(obj)
            return
        op, memoize = found
        self.write(op)
        if memoize:
            self._memoize(obj)

    def _save_type(self, obj: type) -> None:
        if obj in _SINGLETON_TYPES:
            self._save_reduce(type, (_SINGLETON_TYPES[obj],), obj=obj)
        else:
            self._save_global(obj)

    # -- reductions ---------------------------------------------------------

    def _save_reduce(
        self,
        func: Any,
        args: Any,
        state: Any = None,
        listitems: Any = None,
        dictitems: Any = None,
        state_setter: Any = None,
        *,
        obj: Any = None,
    ) -> None:
        """Write ``func(*args)``, then its items and state (``__reduce__``'s tuple)."""
        if not isinstance(args, tuple):
            raise pickle.PicklingError("args from save_reduce() must be a tuple")
        if not callable(func):
            raise pickle.PicklingError("func from save_reduce() must be callable")
        save = self.save
        name = getattr(func, "__name__", "")
        if name == "__newobj_ex__":
            cls, args, kwargs = args
            self._check_newobj(cls, obj, name)
            # Protocol 2 has no NEWOBJ_EX: the keyword arguments go in a partial.
            save(functools.partial(cls.__new__, cls, *args, **kwargs))
            save(())
            self.write(pickle.REDUCE)
        elif name == "__newobj__":
            cls = args[0]
            self._check_newobj(cls, obj, name)
            save(cls)
            save(args[1:])
            self.write(pickle.NEWOBJ)
        else:
            save(func)
            save(args)
            self.write(pickle.REDUCE)
        if obj is not None:
            self._after_reduce(obj)
        if listitems is not None:
            self._batches(listitems, self.save, pickle.APPEND, pickle.APPENDS)
        if dictitems is not None:
            self._batches(dictitems, self._save_pair, pickle.SETITEM, pickle.SETITEMS)
        if state is not None:
            if state_setter is None:
                save(state)
                self.write(pickle.BUILD)
            else:
                save(state_setter)
                save(obj)
                save(state)
                self.write(pickle.TUPLE2 + pickle.REDUCE + pickle.POP)

    @staticmethod
    def _check_newobj(cls: Any, obj: Any, name: str) -> None:
        if not hasattr(cls, "__new__"):
            raise pickle.PicklingError(f"args[0] from {name} args has no __new__")
        if obj is not None and cls is not obj.__class__:
            raise pickle.PicklingError(f"args[0] from {name} args has the wrong class")

    # -- storages and tensors -----------------------------------------------

    def _save_storage(self, obj: StorageRecord) -> None:
        key = self._storage_keys.get(id(obj))
        if key is None:
            # torch.save numbers storages 0, 1, ... in first-use order and writes
            # them in that order; torch.load's offset shortcut relies on it.
            key = str(len(self.storages))
            self._storage_keys[id(obj)] = key
            self.storages.append(obj)
        # The persistent id ("storage", class, key, "cpu", numel), a new tuple
        # each time. "cpu": the output must load on a machine without the GPU.
        self.write(pickle.MARK)
        self._save_str("storage")
        self._save_ref(_storage_ref(obj))
        self._save_str(key)
        self._save_str("cpu")
        self.save(obj.numel)
        self.write(pickle.TUPLE)
        self._fresh_slot()
        self.write(pickle.BINPERSID)

    def _save_tensor(self, obj: TensorRecord) -> None:
        if not self._fetched(obj):
            self._write_tensor(obj)

    def _write_tensor(self, obj: TensorRecord) -> None:
        """``obj`` the way torch's ``Tensor.__reduce_ex__`` has pickle write it.

        The reduction's argument tuples, its empty backward-hooks OrderedDicts
        and a Parameter's inner tensor are written straight from the record,
        each taking the memo slot pickle gives it.
        """
        record = self._replace.get(id(obj), obj)
        save = self.save
        if record.from_type is not None:
            self._save_ref(_REBUILD_FROM_TYPE)
            self.write(pickle.MARK)
            self._save_ref(_REBUILD_V3 if record.rebuild == "v3" else _REBUILD_V2)
            save(record.from_type[0])
            self._save_rebuild_args(record)
            save(record.from_type[1])
            self.write(pickle.TUPLE)
            self._fresh_slot()
        elif record.parameter:
            with_state = record.param_state is not None
            self._save_ref(_REBUILD_PARAM_STATE if with_state else _REBUILD_PARAM)
            if with_state:
                self.write(pickle.MARK)
            self._save_plain(record)  # the tensor inside, without the Parameter
            save(record.param_requires_grad)
            self._save_hooks()
            if with_state:
                save(record.param_state)
                self.write(pickle.TUPLE)
            else:
                self.write(pickle.TUPLE3)
            self._fresh_slot()
        else:
            self._save_ref(_REBUILD_V3 if record.rebuild == "v3" else _REBUILD_V2)
            self._save_rebuild_args(record)
        self.write(pickle.REDUCE)
        self._after_reduce(obj)

    def _save_plain(self, record: TensorRecord) -> None:
        self._save_ref(_REBUILD_V3 if record.rebuild == "v3" else _REBUILD_V2)
        self._save_rebuild_args(record)
        self.write(pickle.REDUCE)
        self._fresh_slot()

    def _save_rebuild_args(self, record: TensorRecord) -> None:
        """``(storage, offset, shape, stride, requires_grad, hooks[, dtype][, metadata])``."""
        save = self.save
        self.write(pickle.MARK)
        save(record.storage)
        save(record.offset)
        save(record.shape)
        save(record.stride)
        save(record.requires_grad)
        self._save_hooks()
        if record.rebuild == "v3":
            self._save_ref(GlobalRef("torch", record.dtype))
        if record.metadata:
            save(record.metadata)
        self.write(pickle.TUPLE)
        self._fresh_slot()

    def _save_hooks(self) -> None:
        # An empty OrderedDict reduces to OrderedDict() with no items or state.
        self._save_global(collections.OrderedDict)
        self.write(pickle.EMPTY_TUPLE + pickle.REDUCE)
        self._fresh_slot()


def dump_within(
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

    Raises:
        pickle.PicklingError: ``obj`` holds a storage, or something pickle cannot write.

    Example:
        >>> dump_within({"a": 1}, 5, {}, {})
        (b'}q\\x05X\\x01\\x00\\x00\\x00aq\\x06K\\x01s', 2)
    """
    emitter = _Emitter(memo_base)
    emitter.memo.update(memo)
    emitter.global_slots.update(global_slots)
    emitter.save(obj)
    if emitter.storages:
        raise pickle.PicklingError("dump_within writes no storages")
    return emitter.getvalue(), emitter.next_slot - memo_base


def dump_checkpoint_pickle(
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

    Raises:
        pickle.PicklingError: The tree holds something pickle cannot write.

    Example:
        >>> data, storages = dump_checkpoint_pickle({"epoch": 3})
        >>> storages
        []
    """
    emitter = _Emitter(replace=replace)
    emitter.write(_PREFIX)
    emitter.save(obj)
    emitter.write(pickle.STOP)
    return emitter.getvalue(), emitter.storages
