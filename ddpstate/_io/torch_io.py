"""Reading torch.save files and DCP folders safely, turning torch's failures into clear errors."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import re
import struct
import sys
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from typing import IO, Any, Optional, Union

import torch

from ddpstate import storage
from ddpstate._io.savecheck import allow_advice, loading_allowed
from ddpstate._layout.torch_zip import TorchZip, read_torch_zip
from ddpstate._manifest import MANIFEST_NAME
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    DDPStateError,
    DeviceMapError,
    UnsafeCheckpointError,
)
from ddpstate.formats import LEGACY, TORCH_ZIP

__all__ = [
    "DESCRIPTIONS",
    "check_container",
    "check_dcp_metadata",
    "dcp_failure",
    "dcp_read_errors",
    "dcp_reader",
    "load_dcp",
    "load_torch_file",
    "module_globals",
    "too_large",
    "unsafe_globals",
]

Source = Union[str, IO[bytes]]

#: How messages name the two torch.save formats.
DESCRIPTIONS = {TORCH_ZIP: "torch.save file", LEGACY: "legacy (pre-1.6) torch.save file"}
_SHOW = 10
# Exceptions torch.load raises on damaged bytes (zip reader, unpickler, storage reads).
_DAMAGE = (
    RuntimeError,
    EOFError,
    OSError,
    ValueError,
    struct.error,
    zipfile.BadZipFile,
    pickle.UnpicklingError,
    KeyError,
    IndexError,
    TypeError,
    UnicodeDecodeError,
    # torch's legacy reader asserts that each listed storage key was unpickled.
    AssertionError,
    OverflowError,
)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _corrupt(name: str, kind: str, exc: BaseException) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{name}: damaged {DESCRIPTIONS.get(kind, kind)} ({type(exc).__name__}: "
        f"{_first_line(exc)}); it is probably truncated or overwritten: re-save or re-download it"
    )


@contextlib.contextmanager
def _rewound(source: Source) -> Iterator[Source]:
    if isinstance(source, str):
        yield source
        return
    source.seek(0)
    try:
        yield source
    finally:
        source.seek(0)


# ------------------------------------------------------------------------- unsafe globals


def _refused_by_torch(exc: BaseException) -> list[str]:
    """The globals torch's weights_only unpickler names in its refusal."""
    return re.findall(r"GLOBAL ([\w.]+)", str(exc))


def unsafe_globals(source: Source, kind: str) -> list[str]:
    """List the globals a torch.save file needs beyond torch's weights_only allowlist.

    Nothing in the file is executed: a zip's by
    ``torch.serialization.get_unsafe_globals_in_checkpoint``; a legacy file's, which
    torch cannot list, by the first one its weights_only unpickler refuses.

    Args:
        source: A local path or a readable, seekable binary file.
        kind: ``"pt"`` or ``"pt_legacy"`` (see :mod:`ddpstate.formats`).

    Returns:
        Sorted, de-duplicated fully qualified names such as ``"__main__.Net"``.

    Raises:
        Exception: Whatever the pickle reader raises on damaged bytes.

    Example:
        >>> import io, torch, collections
        >>> from ddpstate._io.torch_io import unsafe_globals
        >>> buf = io.BytesIO()
        >>> torch.save({"c": collections.Counter("ab")}, buf)
        >>> unsafe_globals(buf, "pt")
        []
    """
    with _rewound(source) as src:
        if kind == TORCH_ZIP:
            return sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(src)))
        try:
            torch.load(src, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            return _refused_by_torch(exc)
        return []


def _resolve_loaded(qualname: str) -> Any:
    """The object a global names, if its module is already imported (nothing is imported)."""
    parts = qualname.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module: Any = sys.modules.get(".".join(parts[:cut]))
        if module is not None:
            return functools.reduce(lambda obj, attr: getattr(obj, attr, None), parts[cut:], module)
    return None


def module_globals(names: Iterable[str]) -> list[str]:
    """Return the names among ``names`` that are ``nn.Module`` classes.

    Only modules that are already imported are looked at, so nothing new runs.

    Example:
        >>> from ddpstate._io.torch_io import module_globals
        >>> module_globals(["torch.nn.modules.linear.Linear", "__main__.Config"])
        ['torch.nn.modules.linear.Linear']
    """
    found = []
    for name in names:
        obj = _resolve_loaded(name)
        if name.startswith(("torch.nn.modules.", "torch.nn.parallel.")) or (
            isinstance(obj, type) and issubclass(obj, torch.nn.Module)
        ):
            found.append(name)
    return found


def _unsafe_error(source: Source, kind: str, name: str, exc: BaseException) -> DDPStateError:
    try:
        needed = unsafe_globals(source, kind) if kind == TORCH_ZIP else _refused_by_torch(exc)
    except Exception as scan_exc:
        # torch's scan reads the same bytes; if it cannot, they are damaged.
        return _corrupt(name, kind, scan_exc)
    if not needed:
        reason = str(exc).strip().splitlines()
        detail = next((r for r in reason if "WeightsUnpickler error" in r), reason[-1:])
        if "Unsupported operand" in str(exc):  # an opcode no torch.save pickle holds
            return _corrupt(name, kind, exc)
        return UnsafeCheckpointError(
            f"{name}: loading needs more than weights_only=True allows ({str(detail).strip()}). "
            f"If these are your own data-only types, allow them by name with "
            + allow_advice("...", "safe_globals=[...] (ddpstate.load, CheckpointManager)")
            + "; only if you trust the file's source, load it with weights_only=False",
        )
    shown = ", ".join(needed[:_SHOW]) + (
        f" and {len(needed) - _SHOW} more" if len(needed) > _SHOW else ""
    )
    modules = module_globals(needed)
    if modules:
        return UnsafeCheckpointError(
            f"{name}: this file is a whole pickled nn.Module ({', '.join(modules[:3])}), not a "
            f"state dict; unpickling it would run code from the file, so it is refused with "
            f"weights_only=True. Only if you trust its source: load it with weights_only=False, "
            f"then save model.state_dict() (e.g. ddpstate.save_model_state(model, path)) so it "
            f"loads safely from then on. It needs: {shown}",
            unsafe_globals=needed,
        )
    return UnsafeCheckpointError(
        f"{name}: loading would import and call {shown}, which weights_only=True refuses "
        f"because unpickling them can run arbitrary code. If they are your own data-only "
        f"types, allow just these by name: "
        + allow_advice(
            "...",
            "safe_globals=[...] (ddpstate.load, CheckpointManager(..., safe_globals=[...]))",
        )
        + "; only if you trust the file's source: load it with weights_only=False",
        unsafe_globals=needed,
    )


# ------------------------------------------------------------------------- torch.load


def _targets_cuda(map_location: Any) -> bool:
    """Whether a resolved ``map_location`` itself sends tensors to a CUDA device."""
    if isinstance(map_location, torch.device):
        return map_location.type == "cuda"
    if isinstance(map_location, dict):
        return any(str(v).startswith("cuda") for v in map_location.values())
    return False


def load_torch_file(
    source: Source,
    *,
    kind: str,
    name: str,
    map_location: Any,
    weights_only: bool,
    mmap: bool,
    safe_globals: Sequence[Any] = (),
) -> Any:
    """Run ``torch.load`` and turn each of its failures into the matching ddpstate error.

    Args:
        source: A local path or a readable, seekable binary file.
        kind: ``"pt"`` or ``"pt_legacy"``.
        name: How to name the file in messages.
        map_location: Passed to ``torch.load`` (already resolved).
        weights_only: Passed to ``torch.load``.
        mmap: Passed to ``torch.load`` (zip files on a local path only).
        safe_globals: Types allowed with ``weights_only`` beyond torch's list and
            ddpstate's everyday ones (numpy values, paths, datetime...), for this
            call only.

    Returns:
        The loaded object.

    Raises:
        UnsafeCheckpointError: weights_only=True refused the file; the error
            lists the globals it needs.
        CheckpointCorruptError: The bytes are damaged.
        DDPStateError: Tensors were saved on a CUDA device this machine lacks,
            or (weights_only=False) a class the file needs cannot be imported.

    Example:
        >>> import io, torch
        >>> from ddpstate._io.torch_io import load_torch_file
        >>> buf = io.BytesIO()
        >>> torch.save({"w": torch.ones(1)}, buf)
        >>> load_torch_file(buf, kind="pt", name="buf", map_location="cpu",
        ...                 weights_only=True, mmap=False)
        {'w': tensor([1.])}
    """
    allowed = loading_allowed(safe_globals) if weights_only else contextlib.nullcontext()
    try:
        if kind == TORCH_ZIP:
            check_container(source, name)
        with allowed, _rewound(source) as src:
            return torch.load(src, map_location=map_location, weights_only=weights_only, mmap=mmap)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{name}: no such file; check the path") from exc
    except pickle.UnpicklingError as exc:
        if weights_only and "Weights only load failed" in str(exc):
            with loading_allowed(safe_globals):
                refusal = _unsafe_error(source, kind, name, exc)
            raise refusal from exc
        raise _corrupt(name, kind, exc) from exc
    except RuntimeError as exc:
        if "Attempting to deserialize object on" in str(exc):
            if _targets_cuda(map_location):
                raise DeviceMapError(
                    f"{name}: map_location={map_location!r} asks for a CUDA device, but CUDA is "
                    f"not available on this machine (torch.cuda.is_available() is False); load "
                    f"with map_location='auto' (this rank's device) or 'cpu'"
                ) from exc
            raise DeviceMapError(
                f"{name}: its tensors were saved on a CUDA device this machine does not have "
                f"({_first_line(exc)}); load with map_location='auto' (this rank's device), "
                f"'cpu', or a dict such as {{'cuda:0': 'cpu'}}"
            ) from exc
        raise _corrupt(name, kind, exc) from exc
    except (AttributeError, ImportError) as exc:
        if weights_only:
            raise _corrupt(name, kind, exc) from exc
        raise DDPStateError(
            f"{name}: unpickling needs a class or function that cannot be found here "
            f"({type(exc).__name__}: {exc}); import the code that defined it before loading"
        ) from exc
    except _DAMAGE as exc:
        raise _corrupt(name, kind, exc) from exc
    except (MemoryError, RecursionError) as exc:
        raise too_large(name, exc) from exc


def too_large(name: str, exc: BaseException) -> CheckpointFormatError:
    """The error for a file whose reading ran out of memory or of Python's recursion limit."""
    what = "nests deeper than" if isinstance(exc, RecursionError) else "needs more memory than"
    return CheckpointFormatError(
        f"{name}: reading it {what} this process allows ({type(exc).__name__}); if the file "
        f"is genuine, load it with torch.load in a process with more, and save it flatter"
    )


def check_container(source: Source, name: str) -> TorchZip:
    """Check a torch.save zip's container (:func:`~ddpstate._layout.torch_zip.read_torch_zip`).

    Raises:
        CheckpointCorruptError: The container is damaged or crafted.
    """
    with (
        _rewound(source) as src,
        open(src, "rb") if isinstance(src, str) else contextlib.nullcontext(src) as f,
    ):
        size = f.seek(0, os.SEEK_END)
        return read_torch_zip(f, size, name)


# ------------------------------------------------------------------------- DCP folders

_DCP_METADATA_MODULES = frozenset({"torch.distributed.checkpoint.metadata"})
_DCP_ALLOWED = frozenset(
    {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("torch", "device"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("builtins", "complex"),
    }
)


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Unpickle a DCP ``.metadata`` file, allowing only the classes such files use."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_METADATA_MODULES:
            obj = getattr(sys.modules.get(module), name, None)
            if isinstance(obj, type):
                return obj
        elif (module, name) in _DCP_ALLOWED:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _UnsafeGlobal(f"{module}.{name}")


class _UnsafeGlobal(Exception):
    pass


def check_dcp_metadata(data: bytes, name: str) -> Any:
    """Unpickle a DCP ``.metadata`` file's bytes, allowing only DCP's metadata classes.

    Returns the ``Metadata`` object, so callers read the folder's layout without
    a second, unchecked unpickling.
    """
    import torch.distributed.checkpoint.metadata  # noqa: F401 - the allowed classes live there

    try:
        metadata = _DCPMetadataUnpickler(io.BytesIO(data)).load()
    except _UnsafeGlobal as exc:
        raise UnsafeCheckpointError(
            f"{name}: the .metadata of this torch.distributed.checkpoint folder would import "
            f"{exc}, which is not a DCP metadata class; only if you trust the folder, pass "
            f"weights_only=False",
            unsafe_globals=[str(exc)],
        ) from exc
    except Exception as exc:
        raise CheckpointCorruptError(
            f"{name}: the .metadata of this torch.distributed.checkpoint folder is damaged "
            f"({type(exc).__name__}: {exc}); re-save the checkpoint"
        ) from exc
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointCorruptError(
            f"{name}: the .metadata of this torch.distributed.checkpoint folder holds "
            f"{type(metadata).__name__}, not DCP's Metadata; re-save the checkpoint"
        )
    return metadata


@contextlib.contextmanager
def dcp_read_errors(
    name: str, *, into: str = "", advice: str = "re-save the checkpoint"
) -> Iterator[None]:
    """Turn a failure of torch's DCP reader inside the block into the error it stands for.

    DCP wraps each rank's exception in a ``CheckpointException``; the first one inside is
    what went wrong. A ddpstate error found there (an unsafe item...) is raised as is,
    an interrupt or ``MemoryError`` passes through, anything else becomes
    :class:`CheckpointCorruptError` naming the folder.

    Args:
        name: The folder, for the message.
        into: Says what was being read into (``" into Net's shards"``), or nothing.
        advice: What the message tells the user to do.

    Raises:
        CheckpointCorruptError: The reader failed (the original is chained).
        DDPStateError: The reader failed with one of ddpstate's own errors.

    Example:
        >>> from ddpstate._io.torch_io import dcp_read_errors
        >>> with dcp_read_errors("ckpt/"):  # doctest: +ELLIPSIS
        ...     raise OSError("gone")
        Traceback (most recent call last):
        ...
        ddpstate.errors.CheckpointCorruptError: ckpt/: reading ... failed (OSError: gone); ...
    """
    try:
        yield
    except BaseException as exc:
        inner = dcp_failure(exc) or exc
        if isinstance(inner, DDPStateError):
            raise inner from exc
        if isinstance(inner, (KeyboardInterrupt, SystemExit, MemoryError)):
            raise
        raise CheckpointCorruptError(
            f"{name}: reading this torch.distributed.checkpoint folder{into} failed "
            f"({type(inner).__name__}: {_first_line(inner)}); a shard file may be missing or "
            f"damaged: {advice}"
        ) from exc


def dcp_failure(exc: BaseException) -> Optional[BaseException]:
    """The first rank's exception inside DCP's ``CheckpointException`` (None if not one)."""
    # DCP wraps each rank's exception in CheckpointException.failures[rank] = (exc, trace).
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for value in failures.values():
            inner = value[0] if isinstance(value, tuple) and value else value
            if isinstance(inner, BaseException):
                return inner
    return None


def load_dcp(
    path: str,
    *,
    name: str,
    weights_only: bool,
    storage_options: Optional[dict[str, Any]] = None,
    safe_globals: Sequence[Any] = (),
) -> dict[str, Any]:
    """Read a whole ``torch.distributed.checkpoint`` folder into this process.

    Reads without a process group, so every rank (or one rank) can call it
    independently, through :func:`dcp_reader` (a committed folder's bytes are
    checked as they are read). With ``weights_only=True`` the folder's
    ``.metadata`` pickle may only name DCP's metadata classes, and every
    non-tensor item is loaded with ``torch.load(weights_only=True)``, allowing
    the everyday types ``ddpstate.save`` writes (numpy values, paths,
    ``datetime``, ``argparse.Namespace``, ``defaultdict``) and ``safe_globals``,
    as the torch.save file paths do.

    Args:
        path: The folder (local path or fsspec URL).
        name: How to name it in messages.
        weights_only: Refuse arbitrary unpickling.
        storage_options: fsspec options for a remote folder.
        safe_globals: The caller's own data-only types to allow with ``weights_only``.

    Returns:
        The state dict, nested as it was saved, tensors on the CPU.

    Raises:
        UnsafeCheckpointError: Something in the folder needs arbitrary unpickling.
        CheckpointCorruptError: The folder's files are damaged or missing.
        CheckpointNotFoundError: The folder does not exist.

    Example:
        >>> import tempfile, torch, warnings
        >>> import torch.distributed.checkpoint as dcp
        >>> from ddpstate._io.torch_io import load_dcp
        >>> folder = tempfile.mkdtemp()
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     _ = dcp.save({"w": torch.ones(2)}, checkpoint_id=folder)
        >>> load_dcp(folder, name=folder, weights_only=True)
        {'w': tensor([1., 1.])}
    """
    # Imported here: torch.distributed.checkpoint is large, and only DCP reads need it.
    # Its private planner and loader read a folder without a process group (no public way).
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if weights_only:  # on a URL saved over another checkpoint: the version its manifest names
        committed = storage.committed_folder(path, storage_options=storage_options)
        with storage.open_read(
            storage.join(committed, ".metadata"), storage_options=storage_options
        ) as f:
            check_dcp_metadata(f.read(), name)

    class _Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            if weights_only:
                key = read_item.dest_index.fqn
                try:
                    with loading_allowed(safe_globals):
                        torch.load(value, weights_only=True)
                except pickle.UnpicklingError as exc:
                    raise UnsafeCheckpointError(
                        f"{name}: item {key!r} needs arbitrary unpickling "
                        f"({_first_line(exc)}); only if you trust the folder, pass "
                        f"weights_only=False"
                    ) from exc
                # The bytes passed the weights_only check, so torch's own reader may take them.
                value.seek(0)
            super().load_bytes(read_item, value)

    state: dict[str, Any] = {}
    with dcp_read_errors(name):
        reader = dcp_reader(path, storage_options)
        _load_state_dict(state, storage_reader=reader, planner=_Planner(), no_dist=True)  # type: ignore[no-untyped-call]
    return state


def dcp_reader(path: str, storage_options: Optional[dict[str, Any]]) -> Any:
    """The storage reader for a DCP folder: ``VerifiedReader`` where ddpstate committed it.

    A folder with a ddpstate manifest (``DurableWriter``, ``ddpstate.save``) is read
    through ``ddpstate.dcp.VerifiedReader``, every byte range checked as it is read;
    a plain DCP folder through torch's own reader (``FsspecReader`` for a URL); either
    refuses an item whose file lies outside the folder before reading (``check_item_files``).

    Args:
        path: The folder (local path or fsspec URL).
        storage_options: fsspec options for a URL.

    Returns:
        A ``torch.distributed.checkpoint`` storage reader.
    """
    from ddpstate._io import dcp_items, durable_dcp  # import DCP (seconds): DCP reads only

    if storage.exists(storage.join(path, MANIFEST_NAME), storage_options=storage_options):
        return durable_dcp.VerifiedReader(path, storage_options=storage_options)
    return dcp_items.plain_reader(path, storage_options)
