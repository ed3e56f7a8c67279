"""What a checkpoint may hold: the save-time checks that keep save and load symmetric.

A file that saves but cannot load is found when resuming after a crash, the
worst moment. So before anything is written:

- sharded tensors (FSDP2 ``DTensor``, ``ShardedTensor``) are refused: one rank
  holds only its own shards, and writing them would pass part of the model off
  as all of it;
- meta tensors are refused: they hold no data;
- every global the pickle would need must be one ``torch.load(weights_only=True)``
  accepts: torch's own allowlist, the everyday types below, or the caller's
  ``safe_globals``. The check runs inside the real pickling (a ``reducer_override``
  sees each class and function as pickle writes it), so it costs no second pass.

Loading adds the same list to torch's weights_only allowlist for the duration
of the ``torch.load`` call only (:func:`loading_allowed`), so nothing leaks into
torch's process-wide list.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import importlib
import pickle
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from typing import IO, Any, Optional

import torch

from ddpstate.errors import (
    CheckpointFormatError,
    InvalidArgumentError,
    ShardedStateError,
    UnsafeCheckpointError,
)

__all__ = [
    "EVERYDAY_GLOBALS",
    "allowed_globals",
    "allow_advice",
    "check_safe_globals",
    "check_saveable",
    "check_tensors",
    "loading_allowed",
    "save_torch",
    "safe_globals_named",
    "sharded_types",
]

#: ``module.name`` of every global the everyday values ddpstate saves and loads with
#: ``weights_only`` name, beyond torch's own list. They carry data and run no code of
#: the file's choosing: numpy scalars and numeric arrays (numpy 1.x and 2.x names),
#: paths, datetime values, ``argparse.Namespace``, the empty ``bytes`` of protocol 2
#: (only as ``_empty_bytes``: the real ``bytes(n)`` would allocate what a file asks) and
#: ddpstate's own ``defaultdict`` rebuilder, which only files of earlier versions name.
EVERYDAY_GLOBALS: tuple[str, ...] = (
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.core.multiarray.scalar",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray.scalar",
    "numpy._core.multiarray._reconstruct",
    "builtins.bytes",
    "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath",
    "pathlib.PosixPath",
    "pathlib.WindowsPath",
    "pathlib._local.PurePosixPath",
    "pathlib._local.PureWindowsPath",
    "pathlib._local.PosixPath",
    "pathlib._local.WindowsPath",
    "datetime.datetime",
    "datetime.date",
    "datetime.time",
    "datetime.timedelta",
    "datetime.timezone",
    "argparse.Namespace",
    "ddpstate._io.savecheck._rebuild_defaultdict",
)


def _empty_bytes(*args: Any) -> bytes:
    """``builtins.bytes`` as protocol 2 pickles ``b""``; any argument is refused."""
    # Non-empty bytes pickle as _codecs.encode(str, "latin1"), on torch's own list;
    # bytes(2**33) would allocate 8 GiB because a 100-byte file asks.
    if args:
        raise pickle.UnpicklingError(f"builtins.bytes{args!r}: only bytes() is allowed")
    return b""


# Files ddpstate wrote before it refused defaultdicts name this rebuilder; loading
# them still works (the factory comes from this fixed table, never from the file).
_FACTORIES: dict[str, Any] = {
    t.__name__: t for t in (list, dict, set, frozenset, tuple, int, float, complex, str, bool)
}
_FACTORIES["OrderedDict"] = collections.OrderedDict


def _rebuild_defaultdict(factory: Optional[str], items: dict[Any, Any]) -> Any:
    """Rebuild a ``collections.defaultdict`` written by :func:`save_torch`."""
    if factory is not None and factory not in _FACTORIES:
        raise pickle.UnpicklingError(f"defaultdict factory {factory!r} is not allowed")
    return collections.defaultdict(_FACTORIES[factory] if factory else None, items)


# The everyday globals loaded through ddpstate's own function, never the real one.
_SHIMS = {
    "builtins.bytes": _empty_bytes,
    "ddpstate._io.savecheck._rebuild_defaultdict": _rebuild_defaultdict,
}

# Where a global lives under another numpy or Python version than the one that wrote it.
_MOVED = (
    ("numpy.core.", "numpy._core."),
    ("numpy._core.", "numpy.core."),
    ("pathlib._local.", "pathlib."),
)


def _resolve(qualname: str) -> Any:
    """The object ``module.name`` names here, or None (numpy only when already imported)."""
    for old, new in ((qualname, qualname), *_MOVED):
        if not qualname.startswith(old):
            continue
        module, _, attr = (new + qualname[len(old) :]).rpartition(".")
        obj: Any = sys.modules.get(module)
        if obj is None and module in ("pathlib", "datetime", "argparse"):
            obj = importlib.import_module(module)
        if getattr(obj, attr, None) is not None:
            return getattr(obj, attr)
    return None


def allowed_globals(extra: Sequence[Any] = ()) -> list[Any]:
    """The globals ddpstate adds to torch's weights_only list: the everyday ones + ``extra``.

    Each everyday global is given with its pickled name, so a file written by
    another Python or numpy version (``numpy.core`` / ``numpy._core``,
    ``pathlib._local``) finds it too.
    """
    found: list[Any] = []
    for name in EVERYDAY_GLOBALS:
        obj = _SHIMS[name] if name in _SHIMS else _resolve(name)
        if obj is not None:
            found.append((obj, name))
    np = sys.modules.get("numpy")  # torch imports numpy when it is installed
    if np is not None:
        # Their classes never appear as globals, but weights_only checks them when it
        # builds a dtype: every numeric and bool dtype, never object, string or datetime.
        codes = np.typecodes["AllInteger"] + np.typecodes["AllFloat"] + "?"
        found.extend(sorted({type(np.dtype(c)) for c in codes}, key=str))
    found.extend(extra)
    return found


# loading_allowed's globals: how many blocks (in any thread) currently need each one
# that ddpstate added. Added on 0 -> 1, removed on 1 -> 0, under the lock, so one
# thread's exit never takes out a global another thread's load is still using.
_ALLOWED_LOCK = threading.Lock()
_ALLOWED_COUNTS: collections.Counter[Any] = collections.Counter()


def _remove_safe_globals(remove: list[Any]) -> None:
    """Take ``remove`` out of torch's weights_only list, leaving every other entry."""
    # torch has no public remover: its private one where it exists, else the list is
    # rebuilt through the public get/clear/add.
    from torch import _weights_only_unpickler as unpickler

    remover = getattr(unpickler, "_remove_safe_globals", None)
    if remover is not None:
        remover(remove)
        return
    serialization = torch.serialization  # older torch: rebuild the list (under our lock)
    now = serialization.get_safe_globals()
    serialization.clear_safe_globals()
    serialization.add_safe_globals([g for g in now if g not in remove])


def check_safe_globals(value: Any, where: str) -> tuple[Any, ...]:
    """Return ``safe_globals`` as a tuple, or raise InvalidArgumentError naming the bad item.

    Each item must be what torch's weights_only list takes: a class or function,
    or a ``(class_or_function, "module.Name")`` pair. Checked up front so a wrong
    argument is never reported later as a damaged file.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise InvalidArgumentError(
            f"{where}: safe_globals={value!r} must be a list of classes or functions, e.g. "
            f"safe_globals=[MyEnum]"
        )
    for item in value:
        pair = isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], str)
        target = item[0] if pair else item
        if not callable(target) or isinstance(target, str):
            raise InvalidArgumentError(
                f"{where}: safe_globals item {item!r} is not a class or function (nor a "
                f"(class, 'module.Name') pair); pass the type itself, e.g. safe_globals=[MyEnum] "
                f"rather than 'module.MyEnum' or MyEnum.A"
            )
        try:
            hash(item)
        except TypeError:
            raise InvalidArgumentError(
                f"{where}: safe_globals item {item!r} is not hashable; pass the class itself"
            ) from None
    return tuple(value)


@contextlib.contextmanager
def loading_allowed(extra: Sequence[Any] = ()) -> Iterator[None]:
    """Allow :func:`allowed_globals` in torch's weights_only list inside the block only.

    Unlike ``torch.serialization.safe_globals``, which on exit puts back the list
    it found, this takes out only what it added: a module imported inside the
    block (``torch.distributed.tensor`` registers DTensor this way) keeps its
    entries. Thread-safe: a global is counted per block that needs it and
    removed when the last such block (in any thread) exits.
    """
    serialization = torch.serialization
    with _ALLOWED_LOCK:
        present = set(serialization.get_safe_globals())
        # Someone else's entries stay theirs: only ours, or ones torch lacks, are counted.
        held = [
            g
            for g in dict.fromkeys(allowed_globals(extra))
            if g in _ALLOWED_COUNTS or g not in present
        ]
        serialization.add_safe_globals([g for g in held if g not in _ALLOWED_COUNTS])
        _ALLOWED_COUNTS.update(held)
    try:
        yield
    finally:
        with _ALLOWED_LOCK:
            _ALLOWED_COUNTS.subtract(held)
            done = [g for g in held if _ALLOWED_COUNTS[g] == 0]
            for g in done:
                del _ALLOWED_COUNTS[g]
            if done:
                _remove_safe_globals(done)


# ------------------------------------------------------------------------- walking


def _children(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, collections.abc.Mapping):
        for k, v in value.items():
            yield f"[{k!r}]", v
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield f"[{i}]", v
    elif isinstance(value, (set, frozenset)):
        for v in value:
            yield "[...]", v
    elif hasattr(value, "__dict__") and not isinstance(
        value, (type, torch.Tensor, types.ModuleType)
    ):  # objects: dataclasses, argparse.Namespace...
        for k, v in vars(value).items():
            yield f".{k}", v


def walk(value: Any, path: str, seen: set[int]) -> Iterator[tuple[str, Any]]:
    """Every object nested in ``value`` (itself included) with its path, depth first.

    Args:
        value: The object to walk (dicts, lists, tuples, dataclasses... are entered).
        path: How to name ``value`` itself; children append ``['key']`` or ``[i]``.
        seen: Ids already visited (updated); an object reached twice is yielded once.

    Returns:
        An iterator of ``(path, object)``.

    Example:
        >>> from ddpstate._io.savecheck import walk
        >>> [where for where, _ in walk({"a": [1]}, "obj", set())]
        ['obj', "obj['a']", "obj['a'][0]"]
    """
    # Depth first, in order, with an explicit stack: nesting never hits the recursion limit.
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield where, item
        if not isinstance(item, (torch.Tensor, str, bytes, int, float)):
            children = [(where + step, child) for step, child in _children(item)]
            stack.extend(reversed(children))


def sharded_types() -> tuple[type, ...]:
    """The sharded tensor classes whose modules are imported (only those can exist)."""
    found = [
        getattr(sys.modules.get(module), name, None)
        for module, name in (
            ("torch.distributed.tensor", "DTensor"),
            ("torch.distributed._tensor.api", "DTensor"),
            ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor"),
        )
    ]
    return tuple(cls for cls in found if isinstance(cls, type))


def check_tensors(obj: Any, what: str, where: str, *, sharded_only: bool = False) -> None:
    """Refuse sharded and meta tensors anywhere in ``obj``; name the first one found.

    Args:
        obj: The state to save (nested dicts, lists, tuples, objects).
        what: How to name ``obj`` in paths, e.g. ``"state"`` or ``"state['model']"``.
        where: The destination, for the message.
        sharded_only: Look for sharded tensors only.

    Raises:
        ShardedStateError: A ``DTensor``/``ShardedTensor`` is in ``obj``.
        CheckpointFormatError: A tensor is on the meta device.
    """
    sharded = sharded_types()
    if sharded_only and not sharded:
        return
    if isinstance(obj, dict) and all(
        type(v) is torch.Tensor and not v.is_meta for v in obj.values()
    ):
        return  # a flat state dict of plain tensors, the common case: no paths to build
    for path, value in walk(obj, what, set()):
        if sharded and isinstance(value, sharded):
            raise ShardedStateError(
                f"cannot save {where}: {path} is a {type(value).__name__} (FSDP2 / "
                f"tensor-parallel state): each rank holds only its own shards, so one rank's "
                f"file would be part of the model passed off as all of it. Save sharded state "
                f"with torch.distributed.checkpoint (dcp.save, every rank writes its shards), or "
                f"gather a full state dict first: torch.distributed.checkpoint.state_dict."
                f"get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, "
                f"cpu_offload=True))"
            )
        if not sharded_only and isinstance(value, torch.Tensor) and value.is_meta:
            raise CheckpointFormatError(
                f"cannot save {where}: {path} is a tensor on the meta device, which holds no "
                f"data (shape {list(value.shape)}); materialize it first (e.g. "
                f"model.to_empty(device='cpu') and then initialise or load the weights)"
            )


# ------------------------------------------------------------------------- pickling


class _Refused(Exception):
    def __init__(self, obj: Any) -> None:
        super().__init__(obj)
        self.obj = obj


def _qualified(obj: Any) -> str:
    qualname = getattr(obj, "__qualname__", None)
    if qualname is None and _reduces_to_name(obj):
        name = obj.__reduce_ex__(2)
        module = getattr(obj, "__module__", None) or pickle.whichmodule(obj, name)  # type: ignore[attr-defined]
        return f"{module}.{name}"
    return f"{getattr(obj, '__module__', '?')}.{qualname or repr(obj)}"


def _reduces_to_name(obj: Any) -> bool:
    """True when pickle writes ``obj`` as a global name (its reduce value is a string).

    Only types overriding ``__reduce__``/``__reduce_ex__`` can (``object``'s never
    does); numpy values are skipped, since their reduce copies the data.
    """
    kind: Any = type(obj)
    if kind.__reduce_ex__ is object.__reduce_ex__ and kind.__reduce__ is object.__reduce__:
        return False
    if kind.__module__.startswith("numpy"):
        return False
    try:
        return isinstance(obj.__reduce_ex__(2), str)
    except Exception:
        return False  # pickle itself reports it


_GLOBAL_KINDS = (type, types.FunctionType, types.BuiltinFunctionType)


def _pickle_module(extra: Sequence[Any]) -> Any:
    from torch import _weights_only_unpickler as wou

    # torch's built-in allowlist has no public getter; what users added has one.
    allowed = {id(v) for v in wou._get_allowed_globals().values()}
    for item in (*torch.serialization.get_safe_globals(), *allowed_globals(extra)):
        allowed.add(id(item[0] if isinstance(item, tuple) else item))
    allowed.add(id(bytes))  # protocol 2 pickles b"" as bytes(), loaded by _empty_bytes
    # Storage classes travel in torch's persistent ids, which its loader handles itself.
    allowed |= {id(c) for c in (*torch._storage_classes, torch.UntypedStorage)}
    # Every tensor's reduce value holds a torch.Size (allowed, and not reduced to a name):
    # passed through at once, not reduced a second time to look (issue 42: per tensor).
    plain = (torch.Tensor, torch.nn.Parameter, torch.Size)
    np = sys.modules.get("numpy")
    # A numpy dtype pickles as numpy.dtype(...) plus state, and weights_only loading
    # checks the class of what it builds: an object or string dtype fails there.
    dtype_base: Any = np.dtype if np is not None else ()

    class _CheckingPickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            kind = type(obj)
            if kind in plain:
                return NotImplemented
            if kind is collections.defaultdict:
                raise _Refused(obj)  # see _defaultdict_refusal
            if isinstance(obj, _GLOBAL_KINDS) and id(obj) not in allowed:
                raise _Refused(obj)
            if isinstance(obj, dtype_base):
                if id(kind) not in allowed:
                    raise _Refused(kind)
                return _plain_dtype(obj)
            if _reduces_to_name(obj) and id(obj) not in allowed:
                raise _Refused(obj)  # pickled as a global (Ellipsis, NotImplemented...)
            return NotImplemented

    return types.SimpleNamespace(Pickler=_CheckingPickler, __name__="pickle")


def _plain_dtype(dtype: Any) -> tuple[Any, tuple[str]]:
    """A numeric numpy dtype as ``numpy.dtype('<f4')``: one call, no state to set.

    numpy's own pickle sets the dtype's state after building it, and
    ``weights_only`` loading then wants the dtype's class (``numpy.dtypes.
    Float32DType``) allowed too, a global no pickle names, so
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` could not list it
    and plain torch could not open the file with the globals it lists.
    """
    return type(dtype).__mro__[-2], (dtype.str,)  # numpy.dtype, below object


def _find(root: Any, what: str, refused: Any) -> Optional[tuple[str, Any]]:
    for path, value in walk(root, what, set()):
        if value is refused or type(value) is refused:
            return path, value
        if refused is getattr and isinstance(value, types.MethodType):
            return path, value  # a bound method pickles as getattr(obj, name)
        if type(getattr(value, "dtype", None)) is refused:  # e.g. a numpy object array
            return path, value
    return None


def _defaultdict_refusal(
    root: Any, what: str, where: str, refused: collections.defaultdict[Any, Any]
) -> UnsafeCheckpointError:
    """A defaultdict is refused: only a global of ddpstate's own could rebuild it."""
    # Plain torch.load(weights_only=True) builds a dict subclass only through a call
    # of an allowed global, and torch allows none that makes a defaultdict; a file
    # naming ddpstate's rebuilder would not open where ddpstate is not installed.
    found = _find(root, what, refused)
    at = found[0] if found else f"a defaultdict in {what}"
    factory = getattr(refused.default_factory, "__name__", "None")
    return UnsafeCheckpointError(
        f"cannot save {where}: {at} is a collections.defaultdict, which plain "
        f"torch.load(weights_only=True) cannot rebuild (no allowed global makes one). Store "
        f"dict(...) of it there instead, and after loading rebuild it with "
        f"collections.defaultdict({factory}, loaded)",
        unsafe_globals=["collections.defaultdict"],
    )


# How the caller's user passes safe_globals: None is ddpstate's own API (CheckpointManager,
# save/load); an integration names its own parameter (DDPStateCheckpointIO(safe_globals=...)).
_ALLOW_AS: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    "ddpstate_safe_globals_as", default=None
)


@contextlib.contextmanager
def safe_globals_named(template: str) -> Iterator[None]:
    """In the block, unsafe-type errors say to allow a type as ``template`` does.

    Args:
        template: The caller's own parameter, ``{}`` standing for the types
            (``"DDPStateCheckpointIO(safe_globals=[{}])"``).

    Returns:
        A context manager.

    Example:
        >>> from ddpstate._io.savecheck import allow_advice, safe_globals_named
        >>> with safe_globals_named("MyIO(safe_globals=[{}])"):
        ...     allow_advice("Config", "ddpstate.load(..., safe_globals=[Config])")
        'MyIO(safe_globals=[Config])'
    """
    token = _ALLOW_AS.set(template)
    try:
        yield
    finally:
        _ALLOW_AS.reset(token)


def allow_advice(names: str, default: str) -> str:
    """How to allow ``names`` by name: ``default`` (ddpstate's own API) or the caller's parameter.

    Args:
        names: The types, as the user writes them (``"Config"``, ``"..."``).
        default: The advice in ddpstate's terms.

    Returns:
        ``default``, or the :func:`safe_globals_named` template filled with ``names``.

    Example:
        >>> from ddpstate._io.savecheck import allow_advice
        >>> allow_advice("Config", "save/load(..., safe_globals=[Config])")
        'save/load(..., safe_globals=[Config])'
    """
    template = _ALLOW_AS.get()
    return default if template is None else template.format(names)


def _refusal(root: Any, what: str, where: str, refused: Any) -> UnsafeCheckpointError:
    if isinstance(refused, collections.defaultdict):
        return _defaultdict_refusal(root, what, where, refused)
    name = _qualified(refused)
    found = _find(root, what, refused)
    code = _code_refusal(where, found, refused, name)
    if code is not None:
        return code
    at, value = found if found is not None else (f"something in {what}", refused)
    shown = name if value is refused else f"a {type(value).__qualname__}"
    cls = refused.__qualname__ if isinstance(refused, type) else name
    if name.startswith("numpy."):
        return UnsafeCheckpointError(
            f"cannot save {where}: {at} is {shown} whose dtype needs {name}, which "
            f"torch.load(weights_only=True) refuses (only numeric and bool numpy dtypes load "
            f"safely); store it as a numeric array, a list or a string instead",
            unsafe_globals=[name],
        )
    return UnsafeCheckpointError(
        f"cannot save {where}: {at} is {shown}, and loading it would need {name}, which "
        f"torch.load(weights_only=True) refuses (unpickling it could run code). If the type is "
        f"yours and holds only data, allow it by name for both the save and the restore: "
        + allow_advice(
            cls,
            f"CheckpointManager(..., safe_globals=[{cls}]) (or ddpstate.save/load(..., "
            f"safe_globals=[{cls}]))",
        )
        + "; else store plain values (dicts, numbers, strings, tensors)",
        unsafe_globals=[name],
    )


_FUNCTION_KINDS = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    functools.partial,
)


def _code_refusal(
    where: str, found: Optional[tuple[str, Any]], refused: Any, name: str
) -> Optional[UnsafeCheckpointError]:
    """The refusal of a model, a function or a local class: never fixed by safe_globals.

    Allowing such a global would let the file run code when loaded (a model's class
    rebuilds a whole module; a function is code), and a class defined inside a
    function cannot even be imported again; so the message says what to save instead.
    """
    at, value = found if found is not None else (f"something in {where}", refused)
    if isinstance(value, torch.nn.Module) or (
        isinstance(refused, type) and issubclass(refused, torch.nn.Module)
    ):
        kind = type(value).__qualname__ if isinstance(value, torch.nn.Module) else refused.__name__
        return UnsafeCheckpointError(
            f"{where} cannot be saved: {at} is a whole model ({kind}, an nn.Module), whose "
            f"loading would run its class's code. Pass model.state_dict() or use "
            f"save_model_state(model, path); in a CheckpointManager state, put the model at "
            f"the top level ({{'model': model}}), where its state dict is saved",
            unsafe_globals=[name],
        )
    if isinstance(value, _FUNCTION_KINDS) or isinstance(refused, _FUNCTION_KINDS):
        shown = _qualified(value.func if isinstance(value, functools.partial) else value)
        return UnsafeCheckpointError(
            f"{where} cannot be saved: {at} is a function ({shown}); save what it computes "
            f"or its configuration (the name or settings that rebuild it) instead",
            unsafe_globals=[name],
        )
    if "<locals>" in name or "<lambda>" in name:
        return UnsafeCheckpointError(
            f"{where} cannot be saved: {at} is a {name}, an object of a class defined inside "
            f"a function, which no other process can import to load it; save its fields as "
            f"a dict (or plain values) instead",
            unsafe_globals=[name],
        )
    return None


def save_torch(
    obj: Any, fileobj: IO[bytes], *, what: str, where: str, extra: Sequence[Any] = ()
) -> None:
    """``torch.save(obj, fileobj)``, refusing anything ``weights_only`` loading would refuse.

    Args:
        obj: What to save.
        fileobj: A writable binary file.
        what: How to name ``obj`` in paths (``"state"``).
        where: The destination, for messages.
        extra: Types (or ``(obj, "qualified.name")`` pairs) allowed beyond the everyday ones.

    Raises:
        UnsafeCheckpointError: ``obj`` holds something only ``weights_only=False``
            could load; the message names its path and the way to allow it.
    """
    try:
        torch.save(obj, fileobj, pickle_module=_pickle_module(extra))
    except _Refused as exc:
        raise _refusal(obj, what, where, exc.obj) from None


class _Discarded:
    """A sink for :func:`check_saveable`'s pickle: the bytes are not needed, only the refusal."""

    def write(self, data: Any) -> int:
        return len(data)


def check_saveable(obj: Any, *, what: str, where: str, extra: Sequence[Any] = ()) -> None:
    """Refuse ``obj`` as :func:`save_torch` would, without writing or copying a tensor's bytes.

    The same checking pickler runs over the structure; each tensor's storage is
    pickled as a reference (as ``torch.save`` does), so a GPU model is not copied.
    For a check before the first checkpoint (Lightning's ``on_fit_start``).

    Args:
        obj: What a later save will hold.
        what: How to name ``obj`` in paths (``"checkpoint"``).
        where: The destination, for messages.
        extra: Types allowed beyond the everyday ones (``safe_globals``).

    Raises:
        UnsafeCheckpointError: As :func:`save_torch` would.

    Example:
        >>> import torch
        >>> from ddpstate._io.savecheck import check_saveable
        >>> check_saveable({"w": torch.ones(2)}, what="state", where="ck.pt")
    """
    checking = _pickle_module(extra).Pickler

    class _StorageByReference(checking):  # type: ignore[misc, valid-type]
        # torch.save's pickler gives each storage a persistent id too: no bytes in the pickle.
        def persistent_id(self, value: Any) -> Any:
            if isinstance(value, (torch.storage.TypedStorage, torch.UntypedStorage)):
                return ("storage", id(value))
            return None

    try:
        _StorageByReference(_Discarded(), protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    except _Refused as exc:
        raise _refusal(obj, what, where, exc.obj) from None
