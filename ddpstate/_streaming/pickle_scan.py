"""Reading a checkpoint pickle's structure without running it: placeholders, never imports."""

from __future__ import annotations

import collections
import dataclasses
import math
import pickle
from collections.abc import Iterator, Mapping
from typing import IO, Any, Callable, ClassVar, Optional, cast

from ddpstate._layout.everyday import EVERYDAY_GLOBALS
from ddpstate._streaming.pickle_memo import check_memo_indexes
from ddpstate._streaming.torch_tables import DTYPE_ITEMSIZE as DTYPE_ITEMSIZE
from ddpstate._streaming.torch_tables import SAFE_GLOBALS as SAFE_GLOBALS
from ddpstate._streaming.torch_tables import STORAGE_DTYPE as STORAGE_DTYPE

# Everything here stays importable without torch: `ddpstate convert` streams a
# multi-GB file in the memory and time of a copy, and importing torch alone
# costs more than 200 MiB and a second.

# torch's own tables (dtype sizes, storage classes, the weights-only allowlist)
# come from torch_tables, generated from torch and checked against the installed
# torch by tests/streaming/test_safe_globals.py. A global outside SAFE_GLOBALS means the
# pickle wants arbitrary code, which ddpstate refuses by default.

#: The dtype -> typed storage class torch.save uses (dtypes without one go through
#: ``UntypedStorage`` and ``_rebuild_tensor_v3``).
DTYPE_STORAGE: dict[str, str] = {
    dtype: name for name, dtype in STORAGE_DTYPE.items() if name != "UntypedStorage"
}


class UnknownTorchTypeError(pickle.UnpicklingError):
    """The pickle names a torch dtype or storage class the generated tables lack.

    Raised instead of a plain ``UnpicklingError`` so readers call the file
    one from a newer torch, not a damaged one.
    """


def not_a_torch_type(value: Any, what: str) -> pickle.UnpicklingError:
    """The error for ``value`` found where a torch ``what`` (dtype, storage class) belongs.

    A ``torch.<name>`` the tables lack is a newer torch's type
    (:class:`UnknownTorchTypeError`); anything else, a malformed pickle.
    """
    name = opaque_name(value)
    if name is not None and name.rsplit(".", 1)[0] in ("torch", "torch.cuda", "torch.storage"):
        return UnknownTorchTypeError(f"its pickle names {what} {name}")
    return pickle.UnpicklingError(f"a tensor's {what} is {value!r}, not a torch {what}")


# Python 2 pickles name a few modules differently.
_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg", "_abcoll": "collections.abc"}


class GlobalRef:
    """A ``module.name`` global named by a pickle, kept by name and never imported.

    Calling one is refused: nothing in ddpstate runs code found in a checkpoint.
    """

    __slots__ = ("module", "name")
    module: str
    name: str

    def __init__(self, module: str, name: str) -> None:
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "name", name)

    def __setattr__(self, name: str, value: Any) -> None:
        # A pickle's BUILD could otherwise rename an allowed global after the check.
        raise AttributeError(f"{type(self).__name__} is read-only")

    @property
    def qualname(self) -> str:
        """``module.name``."""
        return f"{self.module}.{self.name}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.qualname} is a placeholder for a pickled global; not callable")

    def __repr__(self) -> str:
        return self.qualname

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GlobalRef) and other.qualname == self.qualname

    def __hash__(self) -> int:
        return hash(self.qualname)


class DtypeRef(GlobalRef):
    """A torch dtype global such as ``torch.float32``."""

    __slots__ = ()

    @property
    def dtype(self) -> str:
        """The dtype's name, e.g. ``"float32"``."""
        return self.name


class StorageTypeRef(GlobalRef):
    """A torch storage class global such as ``torch.FloatStorage``."""

    __slots__ = ()

    @property
    def dtype(self) -> str:
        """The dtype of the storage's elements."""
        return STORAGE_DTYPE[self.name]


# slots: a 100,000-tensor checkpoint holds 200,000 of these records in memory.
@dataclasses.dataclass(eq=False, slots=True)
class StorageRecord:
    """One serialized storage: what the pickle says about it, and where its bytes lie.

    Attributes:
        key: The storage's key in the source file (``data/<key>`` in a zip).
        type_name: The storage class name, e.g. ``"FloatStorage"``.
        dtype: The dtype of the storage's elements.
        location: The device tag the file records (``"cpu"``, ``"cuda:0"``...).
        numel: Number of elements of ``dtype``.
        data_offset: Byte offset of the data in the source file (-1: unknown yet).
        stored_size: Bytes the file holds for it (-1: unknown yet).
        crc32: The CRC-32 the source zip records, or None.
        compressed: True when a zip record is compressed (not torch.save's own output).
        record_name: The zip record's name, when the source is a zip.
    """

    key: str
    type_name: str
    dtype: str
    location: str
    numel: int
    data_offset: int = -1
    stored_size: int = -1
    crc32: Optional[int] = None
    compressed: bool = False
    record_name: Optional[str] = None

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_ITEMSIZE.get(self.dtype, 1)

    @property
    def nbytes(self) -> int:
        """Bytes of data the storage holds."""
        return self.numel * self.itemsize

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError("a pickle may not set the state of a storage")


@dataclasses.dataclass(frozen=True)
class StorageView:
    """A legacy (pre-1.6) storage view: ``numel`` elements of ``root`` from ``offset``."""

    root: StorageRecord
    offset: int
    numel: int


@dataclasses.dataclass(eq=False, slots=True)
class TensorRecord:
    """A tensor as the pickle describes it: a view into a storage, no data.

    Attributes:
        storage: The storage holding the data.
        offset: Start of the view, in elements of ``dtype``.
        shape: The tensor's shape.
        stride: The tensor's strides, in elements.
        dtype: The tensor's dtype name.
        requires_grad: The pickled ``requires_grad`` flag of the tensor itself.
        rebuild: ``"v2"`` (typed storage) or ``"v3"`` (untyped storage plus dtype).
        metadata: torch's per-tensor metadata (conj/neg bits), or None.
        parameter: True for an ``nn.Parameter``.
        param_requires_grad: The Parameter's ``requires_grad``.
        param_state: Python attributes pickled with the Parameter, or None.
        from_type: ``(class, state)`` when torch pickled it through
            ``_rebuild_from_type_v2`` (a tensor subclass or one with attributes).
    """

    # Marks a stand-in for a tensor to code that must not import torch to ask
    # (a state dict of these is still a state dict).
    _ddpstate_tensor_like: ClassVar[bool] = True

    storage: StorageRecord
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    rebuild: str = "v2"
    metadata: Any = None
    parameter: bool = False
    param_requires_grad: bool = True
    param_state: Any = None
    from_type: Optional[tuple[Any, Any]] = None

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_ITEMSIZE.get(self.dtype, 1)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's own elements (not of its whole storage)."""
        return self.numel * self.itemsize

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError("a pickle may not set the state of a tensor")

    def is_contiguous(self) -> bool:
        """True when the elements are laid out densely in row-major order."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def extent(self) -> int:
        """One past the last storage element (of ``dtype``) the view touches."""
        # ``0 in shape``: numel is 0 (the scan admits only ints >= 0), without the product.
        if 0 in self.shape:
            return self.offset
        return (
            self.offset + 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        )

    def byte_range(self) -> tuple[int, int]:
        """``(start, length)`` in bytes inside the storage, for a contiguous tensor."""
        return self.offset * self.itemsize, self.nbytes


_NOTHING: Any = object()


class Opaque:
    """An object the pickle builds by calling a global; kept as its recipe, never built.

    Each distinct global gets its own subclass (so ``NEWOBJ``, which needs a
    class, works), carrying the name in ``ref``.
    """

    __slots__ = ("args", "dictitems", "how", "kwargs", "listitems", "state")
    ref: ClassVar[GlobalRef] = GlobalRef("builtins", "object")
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    how: str
    state: Any
    listitems: list[Any]
    dictitems: list[tuple[Any, Any]]

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        self = object.__new__(cls)
        # NEWOBJ calls only __new__; a REDUCE call also runs __init__ below.
        self.how = "new"
        self.args = args
        self.kwargs = kwargs
        self.state = _NOTHING
        self.listitems = []
        self.dictitems = []
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.how = "call"

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, item: Any) -> None:
        self.listitems.append(item)

    add = append  # a set's items (ADDITEMS)

    def extend(self, items: Any) -> None:
        self.listitems.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.dictitems.append((key, value))

    def __call__(self, *args: Any, **kwargs: Any) -> Opaque:
        return OpaqueCall(self, args)

    def __repr__(self) -> str:
        return f"<{self.ref.qualname}(...)>"


class OpaqueCall(Opaque):
    """The result of calling an opaque object (``getattr(x, 'f')(...)`` in a pickle)."""

    __slots__ = ("func",)
    func: Any

    def __new__(cls, func: Any = None, args: tuple[Any, ...] = ()) -> OpaqueCall:
        self = cast(OpaqueCall, super().__new__(cls))
        self.func = func
        self.args = args
        self.how = "call"
        return self

    def __init__(self, func: Any = None, args: tuple[Any, ...] = ()) -> None:
        pass

    def __repr__(self) -> str:
        return f"<call of {self.func!r}>"


def opaque_name(obj: Any) -> Optional[str]:
    """The global behind an opaque placeholder object or class, else None."""
    if isinstance(obj, OpaqueCall):
        return opaque_name(obj.func)
    if isinstance(obj, Opaque) or (isinstance(obj, type) and issubclass(obj, Opaque)):
        return obj.ref.qualname
    if isinstance(obj, GlobalRef):
        return obj.qualname
    return None


def _module_state(obj: Any) -> Optional[dict[str, Any]]:
    if not isinstance(obj, Opaque):
        return None
    state = obj.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
        state = state[0]
    if isinstance(state, dict) and "_parameters" in state and "_modules" in state:
        return state
    return None


def is_pickled_module(obj: Any) -> bool:
    """True when ``obj`` is the placeholder of a pickled ``nn.Module`` (not a state dict)."""
    return _module_state(obj) is not None


def module_state_dict(obj: Any) -> collections.OrderedDict[str, Any]:
    """The parameters and persistent buffers of a pickled nn.Module, by their state-dict keys.

    Walks the module's pickled ``_parameters``, ``_buffers`` and ``_modules``
    the way ``nn.Module.state_dict`` would, without building the module.
    """
    out: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def visit(module: Any, prefix: str) -> None:
        state = _module_state(module)
        if state is None:
            return
        for name, value in _items(state.get("_parameters")):
            if value is not None:
                out[prefix + name] = value
        skip = state.get("_non_persistent_buffers_set") or ()
        skip_names = set(skip) if isinstance(skip, (set, frozenset, list, tuple)) else set()
        for name, value in _items(state.get("_buffers")):
            if value is not None and name not in skip_names:
                out[prefix + name] = value
        for name, child in _items(state.get("_modules")):
            visit(child, f"{prefix}{name}.")

    visit(obj, "")
    return out


def _items(mapping: Any) -> list[tuple[str, Any]]:
    if isinstance(mapping, Mapping):
        return [(str(k), v) for k, v in mapping.items()]
    return []


_INTS = {int}


def _as_shape(value: Any, what: str) -> tuple[int, ...]:
    # torch.save writes plain tuples of ints: check those in C (a 100,000-tensor
    # checkpoint has 200,000 of them); anything else takes the general path.
    if type(value) is tuple and (not value or (set(map(type, value)) == _INTS and min(value) >= 0)):
        return value
    if isinstance(value, Opaque) and value.ref.qualname == "torch.Size" and value.args:
        value = value.args[0]
    if isinstance(value, (tuple, list)) and all(type(v) is int and v >= 0 for v in value):
        return tuple(value)
    raise pickle.UnpicklingError(f"a tensor's {what} is {value!r}, not a tuple of ints >= 0")


def _view(storage: Any, offset: Any, size: Any, stride: Any, dtype: Optional[str]) -> TensorRecord:
    """A tensor record, each argument checked in whatever form the pickle gives it."""
    if isinstance(storage, StorageView):
        record, base = storage.root, storage.offset
    elif isinstance(storage, StorageRecord):
        record, base = storage, 0
    else:
        raise pickle.UnpicklingError(f"a tensor refers to {storage!r} instead of a storage")
    shape, strides = _as_shape(size, "size"), _as_shape(stride, "stride")
    if len(shape) != len(strides):
        raise pickle.UnpicklingError(f"a tensor has size {shape} but stride {strides}")
    if type(offset) is not int or offset < 0:
        raise pickle.UnpicklingError(f"a tensor's storage offset is {offset!r}, not an int >= 0")
    return TensorRecord(
        record, base + offset, shape, strides, record.dtype if dtype is None else dtype
    )


def _rebuild_tensor(storage: Any, offset: int, size: Any, stride: Any) -> TensorRecord:
    return _view(storage, offset, size, stride, None)


def _rebuild_tensor_v2(
    storage: Any,
    offset: int,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> TensorRecord:
    if (
        type(storage) is StorageRecord
        and type(offset) is int
        and offset >= 0
        and type(size) is tuple
        and type(stride) is tuple
        and len(size) == len(stride)
        and (not size or (set(map(type, size)) == _INTS and min(size) >= 0))
        and (not stride or (set(map(type, stride)) == _INTS and min(stride) >= 0))
    ):
        # What torch.save writes, checked in one go (once per tensor of the file);
        # the same checks as _view's, which handles every other form.
        return TensorRecord(
            storage, offset, size, stride, storage.dtype, bool(requires_grad), "v2", metadata
        )
    tensor = _rebuild_tensor(storage, offset, size, stride)
    tensor.requires_grad = bool(requires_grad)
    tensor.metadata = metadata
    return tensor


def _rebuild_tensor_v3(
    storage: Any,
    offset: int,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> TensorRecord:
    if not isinstance(dtype, DtypeRef):
        raise not_a_torch_type(dtype, "dtype")
    tensor = _view(storage, offset, size, stride, dtype.dtype)
    tensor.requires_grad = bool(requires_grad)
    tensor.rebuild = "v3"
    tensor.metadata = metadata
    return tensor


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> TensorRecord:
    if not isinstance(data, TensorRecord):
        raise pickle.UnpicklingError(f"a Parameter wraps {data!r}, not a tensor")
    return dataclasses.replace(data, parameter=True, param_requires_grad=bool(requires_grad))


def _rebuild_parameter_with_state(
    data: Any, requires_grad: Any, backward_hooks: Any, state: Any
) -> TensorRecord:
    param = _rebuild_parameter(data, requires_grad, backward_hooks)
    param.param_state = state
    return param


_TENSOR_BUILDERS: dict[str, Callable[..., TensorRecord]] = {
    "torch._utils._rebuild_tensor": _rebuild_tensor,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter_with_state,
}


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # Python 2-compatible pickles (protocol 2) store bytes as encode(str, "latin1").
    if isinstance(text, str) and encoding in ("latin1", "latin-1", "utf-8", "utf8", "ascii"):
        return text.encode(encoding)
    raise pickle.UnpicklingError(f"_codecs.encode({text!r}, {encoding!r}) is not plain bytes")


def _bytearray(*args: Any) -> bytearray:
    if not args:
        return bytearray()
    if isinstance(args[0], str):
        return bytearray(_codecs_encode(*args))
    if len(args) == 1 and isinstance(args[0], (bytes, list)):
        return bytearray(args[0])
    raise pickle.UnpicklingError(f"bytearray{args!r}: unexpected arguments")


def _checked(factory: Callable[..., Any], *allowed: type) -> Callable[..., Any]:
    def build(*args: Any) -> Any:
        if not args:
            return factory()  # every tensor's empty backward-hooks OrderedDict
        if len(args) > 1 or not all(isinstance(a, allowed) for a in args):
            raise pickle.UnpicklingError(f"{factory.__name__}{args!r}: unexpected arguments")
        return factory(*args)

    return build


_BUILTINS: dict[str, Callable[..., Any]] = {
    "collections.OrderedDict": _checked(collections.OrderedDict, list, tuple, dict),
    "collections.Counter": _checked(collections.Counter, dict, list, tuple),
    "builtins.set": _checked(set, list, tuple),
    "builtins.frozenset": _checked(frozenset, list, tuple),
    "builtins.bytearray": _bytearray,
    "_codecs.encode": _codecs_encode,
}


class StandIn:
    """A callable standing in for an allowed global; read-only, so a pickle cannot alter it.

    Attributes:
        ref: The global it stands for.
        builds_tensor: True for torch's tensor rebuild functions.
    """

    __slots__ = ("_fn", "builds_tensor", "ref")
    ref: GlobalRef
    builds_tensor: bool
    _fn: Callable[..., Any]

    def __init__(self, qualname: str, fn: Callable[..., Any], builds_tensor: bool) -> None:
        object.__setattr__(self, "ref", GlobalRef(*qualname.rsplit(".", 1)))
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "builds_tensor", builds_tensor)

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("StandIn is read-only")

    def __repr__(self) -> str:
        return f"<stand-in for {self.ref.qualname}>"


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if isinstance(func, StandIn) and func.builds_tensor and isinstance(args, tuple):
        tensor = func(*args)
        if isinstance(tensor, TensorRecord):
            tensor.from_type = (new_type, state)
            return tensor
    raise pickle.UnpicklingError("_rebuild_from_type_v2 around something other than a tensor")


_STAND_INS: dict[str, StandIn] = {
    **{name: StandIn(name, fn, True) for name, fn in _TENSOR_BUILDERS.items()},
    **{name: StandIn(name, fn, False) for name, fn in _BUILTINS.items()},
    "torch._tensor._rebuild_from_type_v2": StandIn(
        "torch._tensor._rebuild_from_type_v2", _rebuild_from_type_v2, False
    ),
}


@dataclasses.dataclass
class ScanResult:
    """What reading one pickle found.

    Attributes:
        obj: The object tree, with :class:`TensorRecord`, :class:`StorageRecord`
            and :class:`Opaque` placeholders where the real pickle would build objects.
        globals_used: Every global the pickle names, sorted.
        unsafe_globals: Those that ``torch.load(weights_only=True)`` would refuse.
    """

    obj: Any
    globals_used: tuple[str, ...]
    unsafe_globals: tuple[str, ...]


class _ScanUnpickler(pickle.Unpickler):
    """An Unpickler whose every global is a harmless stand-in."""

    def __init__(self, file: IO[bytes], persistent: Callable[[Any], Any]) -> None:
        super().__init__(file)
        self._persistent = persistent
        self.seen: set[str] = set()
        self._classes: dict[str, type[Opaque]] = {}

    def persistent_load(self, pid: Any) -> Any:
        return self._persistent(pid)

    def find_class(self, module: str, name: str) -> Any:
        module = _PY2_MODULES.get(module, module)
        qualname = f"{module}.{name}"
        self.seen.add(qualname)
        stand_in = _STAND_INS.get(qualname)
        if stand_in is not None:
            return stand_in
        if module in ("torch", "torch.cuda", "torch.storage") and name in STORAGE_DTYPE:
            return StorageTypeRef(module, name)
        if module == "torch" and name in DTYPE_ITEMSIZE:
            return DtypeRef(module, name)
        cls = self._classes.get(qualname)
        if cls is None:
            # The odd class name keeps pickle from mistaking one for copyreg.__newobj__.
            cls = type(
                f"<{qualname}>", (Opaque,), {"__slots__": (), "ref": GlobalRef(module, name)}
            )
            self._classes[qualname] = cls
        return cls


def scan_pickle(
    file: IO[bytes], persistent_load: Callable[[Any], Any], *, memo_checked: bool = False
) -> ScanResult:
    """Read one pickle from ``file`` into placeholders; no code from the file runs.

    Args:
        file: Positioned at the pickle; left just after its STOP opcode.
        persistent_load: Turns each persistent id into an object (storage records).
        memo_checked: The caller already walked these bytes with a check at
            least as strict as :func:`~ddpstate._streaming.pickle_memo.check_memo_indexes`
            (:func:`ddpstate._streaming.pickle_rewrite.walk` accepted them).

    Returns:
        The object tree and the globals it names.

    Raises:
        pickle.UnpicklingError, EOFError, ValueError...: The bytes are not a
            well-formed pickle (callers turn these into ddpstate errors).

    Example:
        >>> import io, pickle
        >>> scan_pickle(io.BytesIO(pickle.dumps({"a": 1})), lambda pid: None).obj
        {'a': 1}
    """
    if not memo_checked:
        check_memo_indexes(file)
    unpickler = _ScanUnpickler(file, persistent_load)
    obj = unpickler.load()
    used = tuple(sorted(unpickler.seen))
    unsafe = tuple(n for n in used if n not in SAFE_GLOBALS and n not in EVERYDAY_GLOBALS)
    return ScanResult(obj=obj, globals_used=used, unsafe_globals=unsafe)


def iter_tensors(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Yield ``(path, record)`` for every tensor and bare storage in an object tree.

    Opaque placeholders are searched too (their arguments, state and items),
    so tensors inside a pickled module or a custom class are counted.
    """
    seen: set[int] = set()

    def walk(node: Any, where: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], Any]]:
        if isinstance(node, (TensorRecord, StorageRecord)):
            yield where, node
            return
        if isinstance(node, (str, bytes, int, float, bool, type(None), GlobalRef)):
            return
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, Mapping):
            for key, value in node.items():
                yield from walk(value, (*where, key))
        elif isinstance(node, (list, tuple)):
            for index, value in enumerate(node):
                yield from walk(value, (*where, index))
        elif isinstance(node, Opaque):
            yield from walk(node.args, (*where, "<args>"))
            if node.state is not _NOTHING:
                yield from walk(node.state, (*where, "<state>"))
            yield from walk(node.listitems, (*where, "<items>"))
            yield from walk([v for _, v in node.dictitems], (*where, "<items>"))

    yield from walk(obj, path)


def has_state(obj: Opaque) -> bool:
    """True when BUILD gave the placeholder a state."""
    return obj.state is not _NOTHING
