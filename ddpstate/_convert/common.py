"""What the file commands share: the model state dict and its key rule, output names, damage.

Also used by :mod:`ddpstate._convert.dcp` (the torch side of the commands).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from ddpstate import _fs, formats
from ddpstate._fs import PathLike
from ddpstate._streaming.pickle_scan import (
    GlobalRef,
    Opaque,
    StorageRecord,
    TensorRecord,
    is_pickled_module,
    iter_tensors,
    opaque_name,
)
from ddpstate._streaming.reader import Checkpoint
from ddpstate.errors import CheckpointCorruptError, CheckpointExistsError, InvalidArgumentError
from ddpstate.formats import PT, SAFETENSORS, FormatName

# Entries drop_optimizer removes besides those whose value looks like optimizer
# state (see is_optimizer_state). Short names such as "opt" are left out on
# purpose: YOLO-style checkpoints keep their command-line options under "opt".
_OPTIMIZER_NAMES = frozenset(
    {"optimizer", "optimizers", "optimizer_state", "optimizer_states", "optimizer_state_dict"}
)


def dotted(path: Optional[Sequence[Any]]) -> Optional[str]:
    """A state-dict path as a dotted string (``None`` stays ``None``)."""
    return None if path is None else ".".join(str(p) for p in path)


def find_state_dict(root: Any, key: Optional[str]) -> tuple[tuple[Any, ...], Any]:
    """``(path, state dict)`` of the model state dict in ``root`` (torch-free on scanned trees)."""
    # keys.find_state_dict counts TensorRecord placeholders as tensors (they
    # are marked `_ddpstate_tensor_like`), so the scanned tree goes in as is
    # and the streaming path never needs torch.
    from ddpstate import keys

    return keys.find_state_dict(root, key)


def rename(sd: Any, strip: Optional[str], add: Optional[str], normalize: bool) -> Any:
    """The state dict with the one key rule given applied (itself when none is)."""
    from ddpstate import keys

    if strip is not None:
        return keys.strip_prefix(sd, strip)
    if add is not None:
        return keys.add_prefix(sd, add)
    if normalize:
        return keys.normalize_keys(sd)
    return sd


def check_rules(strip: Optional[str], add: Optional[str], normalize: bool) -> None:
    """Refuse more than one of strip_prefix, add_prefix and normalize."""
    if sum([strip is not None, add is not None, bool(normalize)]) > 1:
        raise InvalidArgumentError("pass at most one of strip_prefix, add_prefix and normalize")


def is_optimizer_state(value: Any) -> bool:
    """True for an optimizer state dict, or a non-empty container of them only."""
    if isinstance(value, Mapping):
        if "state" in value and "param_groups" in value:
            return True
        return bool(value) and all(is_optimizer_state(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return bool(value) and all(is_optimizer_state(v) for v in value)
    return False


def drop_optimizer_state(root: Any, keep: Optional[tuple[Any, ...]]) -> tuple[Any, tuple[str, ...]]:
    """``(root without optimizer entries, their names)``; ``keep`` (the model's path) stays."""
    if not isinstance(root, Mapping):
        return root, ()
    head = keep[0] if keep else None
    dropped = [
        k
        for k, v in root.items()
        if k != head
        and (
            is_optimizer_state(v)
            or (isinstance(k, str) and k.lower() in _OPTIMIZER_NAMES and v is not None)
        )
    ]
    if not dropped:
        return root, ()
    import copy

    new = copy.copy(root) if isinstance(root, dict) else dict(root)
    for k in dropped:
        del new[k]
    return new, tuple(str(k) for k in dropped)


def default_destination(src: PathLike, dst_format: str) -> str:
    """The output name :func:`convert_file` uses when none is given.

    ``--to safetensors`` on ``model.pt`` gives ``model.safetensors``; a
    conversion that keeps the format gives ``model.converted.pt``.

    Args:
        src: The source path or URL.
        dst_format: ``"pt"`` or ``"safetensors"``.

    Returns:
        The derived path, next to ``src``.

    Example:
        >>> default_destination("runs/ckpt.pt", "pt")
        'runs/ckpt.converted.pt'
        >>> default_destination("runs/ckpt.pt", "safetensors")
        'runs/ckpt.safetensors'
    """
    text = os.fspath(src)
    if _fs.is_remote(text):
        head, tail = text.rsplit("/", 1) if "/" in text else ("", text)
    else:
        head, tail = os.path.split(text)
    stem, dot, ext = tail.rpartition(".")
    if not dot or not stem:
        stem, ext = tail, ""
    ext = f".{ext}" if ext else ""
    if dst_format == SAFETENSORS:
        name = f"{stem}.safetensors" if ext != ".safetensors" else f"{stem}.converted.safetensors"
    elif ext == ".safetensors" or not ext:
        name = f"{stem}.pt" if ext else f"{stem}.converted.pt"
    else:
        name = f"{stem}.converted{ext}"
    if not head:
        return name
    return f"{head}/{name}" if _fs.is_remote(text) else os.path.join(head, name)


def _exists(path: str, storage_options: Optional[dict[str, Any]]) -> bool:
    from ddpstate import storage

    return storage.exists(path, storage_options=storage_options)


def _isdir(path: str, storage_options: Optional[dict[str, Any]]) -> bool:
    from ddpstate import storage

    return storage.isdir(path, storage_options=storage_options)


def _join(folder: str, name: str) -> str:
    from ddpstate import storage

    return storage.join(folder, name)


def is_dcp_folder(path: str, storage_options: Optional[dict[str, Any]]) -> bool:
    """True when ``path`` is a torch.distributed.checkpoint folder."""
    # A stat first: files (the common case) are not sniffed twice.
    return _isdir(path, storage_options) and (
        formats.detect_format(path, storage_options=storage_options) == formats.DCP
    )


def same_file(a: str, b: str) -> bool:
    """True when two paths name the same file (URLs: the same text)."""
    if _fs.is_remote(a) or _fs.is_remote(b):
        return a.rstrip("/") == b.rstrip("/")
    try:
        return os.path.samefile(_fs.local_path(a), _fs.local_path(b))
    except OSError:
        return os.path.abspath(_fs.local_path(a)) == os.path.abspath(_fs.local_path(b))


def extent_problems(ckpt: Checkpoint) -> list[str]:
    """A line per tensor whose view reaches past the end of its storage."""
    # A damaged shape, stride or offset can make a view reach past its storage;
    # torch.load refuses such a file, so copying it through would hide the damage.
    problems = []
    for path, rec in iter_tensors(ckpt.obj):
        if isinstance(rec, TensorRecord):
            reach = rec.extent() * rec.itemsize
            if reach > rec.storage.nbytes:
                problems.append(
                    f"tensor {dotted(path)} reaches byte {reach} of a "
                    f"{rec.storage.nbytes}-byte storage"
                )
    return problems


def raise_problems(ckpt: Checkpoint) -> None:
    """Raise :class:`CheckpointCorruptError` naming the first damage found, if any."""
    problems = [*ckpt.problems, *extent_problems(ckpt)]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointCorruptError(
            f"{ckpt.path}: {problems[0]}{more}; the file is damaged or truncated "
            f"(`ddpstate verify` lists everything): re-save or re-download it"
        )


def destination(
    src: str,
    dst: Optional[PathLike],
    dst_format: str,
    overwrite: bool,
    storage_options: Optional[dict[str, Any]],
    base: Optional[str] = None,
) -> str:
    """The output file: ``dst``, inside ``dst`` when it is a folder, or the default name.

    The default name derives from ``base`` (a sharded source's folder) or ``src``.
    Refuses the source itself and an existing file unless ``overwrite``.
    """
    base = base or src
    dst_text = os.fspath(dst) if dst is not None else default_destination(base, dst_format)
    if dst is not None and _isdir(dst_text, storage_options):
        name = default_destination(base, dst_format).replace("\\", "/")
        dst_text = _join(dst_text, name.rsplit("/", 1)[-1])
    if _exists(dst_text, storage_options):
        if same_file(src, dst_text):
            raise CheckpointExistsError(
                f"{dst_text} is the source file; pass --in-place (in_place=True) to replace it"
            )
        if not overwrite:
            raise CheckpointExistsError(
                f"{dst_text} already exists; pass --force (overwrite=True) to replace "
                f"it, or name another destination"
            )
    return dst_text


def format_from_name(dst: Optional[PathLike]) -> Optional[FormatName]:
    """The format a destination's suffix names, as ``ddpstate.save`` reads it (None: no say)."""
    if dst is None:
        return None
    name = os.fspath(dst).lower()
    if name.endswith(".safetensors"):
        return SAFETENSORS
    if name.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return PT
    return None


def describe(value: Any) -> str:
    """A short description of one value of a scanned checkpoint (``tensor float32 [2]``...)."""
    if isinstance(value, TensorRecord):
        return f"tensor {value.dtype} {list(value.shape)}"
    if isinstance(value, StorageRecord):
        return f"storage {value.dtype} x{value.numel}"
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (int, float)):
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, str):
        return f"str {value[:40]!r}" + ("..." if len(value) > 40 else "")
    if isinstance(value, (bytes, bytearray)):
        return f"{type(value).__name__} of {len(value)} bytes"
    if is_pickled_module(value):
        return f"pickled nn.Module {opaque_name(value)}"
    if isinstance(value, (Opaque, GlobalRef)) or (
        isinstance(value, type) and issubclass(value, Opaque)
    ):
        return f"{opaque_name(value)} object"
    if isinstance(value, Mapping):
        return f"{type(value).__name__} of {len(value)} entries"
    if isinstance(value, (list, tuple, set, frozenset)):
        return f"{type(value).__name__} of {len(value)} items"
    return type(value).__name__
