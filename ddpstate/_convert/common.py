"""What the file commands share: the state edit and its key rule, old argument names,
output names, damage.

Also used by :mod:`ddpstate._convert.dcp` (the torch side of the commands).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch

from ddpstate import _fs, formats, keys, storage
from ddpstate._convert.results import ConvertResult
from ddpstate._fs import PathLike
from ddpstate._progress import human_bytes
from ddpstate._warn import warn
from ddpstate.errors import (
    CheckpointExistsError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    StateDictNotFoundError,
    concerning,
)
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


@dataclasses.dataclass(frozen=True)
class StateEdit:
    """What :func:`~ddpstate.convert.convert_file` changes in a checkpoint's state.

    The model state dict is found as :func:`ddpstate.keys.find_state_dict` finds
    it (or at ``key``); at most one key rule applies to it (:mod:`ddpstate.keys`'
    own); everything else in the checkpoint comes through unchanged unless
    ``drop_optimizer`` leaves optimizer state out.

    Attributes:
        key: Dotted path of the model state dict inside the checkpoint.
        strip_prefix: Remove this prefix (e.g. ``"module."``) from the model's keys.
        add_prefix: Add this prefix to every model key.
        normalize: Remove every wrapper prefix (``module.``, ``_orig_mod.``).
        drop_optimizer: Leave optimizer state out of the output.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (or torch's names): cast every
            floating tensor written to it, exactly as ``tensor.to(dtype)``; integer
            and bool tensors are kept as they are.
        on_collision: When the rule makes two keys equal: ``"error"``,
            ``"keep_existing"`` or ``"keep_prefixed"`` (:func:`ddpstate.keys.strip_prefix`).

    Raises:
        InvalidArgumentError: More than one key rule.

    Example:
        >>> from ddpstate.convert import StateEdit
        >>> StateEdit(strip_prefix="module.").renames
        True
    """

    key: Optional[str] = None
    strip_prefix: Optional[str] = None
    add_prefix: Optional[str] = None
    normalize: bool = False
    drop_optimizer: bool = False
    dtype: Optional[str] = None
    on_collision: keys.OnCollision = "error"

    def __post_init__(self) -> None:
        rules = [self.strip_prefix is not None, self.add_prefix is not None, bool(self.normalize)]
        if sum(rules) > 1:
            raise InvalidArgumentError("pass at most one of strip_prefix, add_prefix and normalize")

    @property
    def renames(self) -> bool:
        """True when a key rule is given."""
        return self.strip_prefix is not None or self.add_prefix is not None or self.normalize

    def rename(self, sd: Any) -> Any:
        """The state dict with the one key rule given applied (itself when none is)."""
        rule = self.on_collision
        if self.strip_prefix is not None:
            return keys.strip_prefix(sd, self.strip_prefix, on_collision=rule)
        if self.add_prefix is not None:
            return keys.add_prefix(sd, self.add_prefix, on_collision=rule)
        return keys.normalize_keys(sd, on_collision=rule) if self.normalize else sd


def find_state_dict(root: Any, key: Optional[str]) -> tuple[tuple[Any, ...], Any]:
    """``(path, state dict)`` in ``root``; a failure carries ``key`` for the CLI's ``--key``."""
    try:
        return keys.find_state_dict(root, key)
    except StateDictNotFoundError as exc:
        concerning("key", exc)
        raise


_EDIT_FIELDS = frozenset(f.name for f in dataclasses.fields(StateEdit))


def old_arguments(
    call: str, legacy: Mapping[str, Any], *, weights_only: bool, format: Optional[str] = None
) -> tuple[bool, Optional[str], dict[str, Any]]:
    """``(weights_only, format, StateEdit fields)`` with the old keyword names folded in.

    ``unsafe=`` became ``weights_only=`` (inverted), ``to=`` became ``format=`` and
    ``convert_file``'s key options the fields of :class:`StateEdit`; each old name
    still works, with a ``DeprecationWarning`` naming the new one. Any other name
    is a ``TypeError``, as Python's own for an unexpected keyword.
    """
    fields: dict[str, Any] = {}
    for name, value in legacy.items():
        if name == "unsafe":
            weights_only = weights_only and not value
            new = f"weights_only={not value!r}"
        elif name == "to" and call == "convert_file":
            if format is not None:
                raise InvalidArgumentError("pass format= only (to= is its old name)")
            format, new = value, f"format={value!r}"
        elif name in _EDIT_FIELDS and call == "convert_file":
            fields[name] = value
            new = f"edit=StateEdit({name}={value!r})"
        else:
            raise InvalidArgumentTypeError(f"{call}() got an unexpected keyword argument {name!r}")
        warn(f"{call}({name}=...) is deprecated: pass {new}", DeprecationWarning)
    return weights_only, format, fields


@dataclasses.dataclass
class Edited:
    """A state after :func:`apply_edit`: what to write and what to tell of it."""

    root: Any
    sd: Any = None  # the model state dict after the rule; None when none was needed
    path: Optional[tuple[Any, ...]] = None  # where it sits; None: it is the whole output
    source_sd: Any = None
    renamed: int = 0
    metadata_changed: bool = False
    dropped: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()
    notes: list[str] = dataclasses.field(default_factory=list)

    def result(
        self,
        src: str,
        dst: str,
        src_format: FormatName,
        dst_format: FormatName,
        tensors: int,
        nbytes: int,
        **extra: Any,
    ) -> ConvertResult:
        """The :class:`ConvertResult` of writing this state."""
        return ConvertResult(
            src=src, dst=dst, src_format=src_format, dst_format=dst_format,
            state_dict_path=dotted(self.path), renamed=self.renamed, tensors=tensors,
            bytes_copied=nbytes, dropped=self.dropped, left_out=self.left_out,
            notes=tuple(self.notes), **extra,
        )  # fmt: skip


def apply_edit(root: Any, edit: StateEdit, *, whole: bool) -> Edited:
    """Find the model state dict, apply the key rule and ``drop_optimizer``.

    ``whole`` is False for an output that holds the model state dict only
    (safetensors): then the rest is listed as left out, never dropped.
    """
    done = Edited(root)
    if edit.renames or edit.key is not None or not whole:
        if isinstance(root, torch.nn.Module):
            done.sd = root.state_dict()
            done.notes.append(
                f"the source is a pickled whole nn.Module ({type(root).__name__}); its "
                f"parameters and buffers were written as a plain state dict"
            )
        else:
            done.path, done.sd = find_state_dict(root, edit.key)
    done.source_sd = sd = done.sd
    if sd is not None:
        new_sd = edit.rename(sd)
        done.renamed = sum(1 for a, b in zip(sd, new_sd, strict=False) if a != b)
        done.renamed += abs(len(sd) - len(new_sd))
        done.metadata_changed = getattr(sd, "_metadata", None) != getattr(new_sd, "_metadata", None)
        if done.path is None:
            done.root = new_sd
        elif new_sd is not sd:
            done.root = keys.replace_state_dict(root, done.path, new_sd)
        done.sd = new_sd
    if not whole:
        path = done.path
        if isinstance(done.root, Mapping) and path:
            left_out = tuple(str(k) for k in done.root if k != path[0])
            done.left_out = (f"the rest of {path[0]!s}", *left_out) if len(path) > 1 else left_out
    elif edit.drop_optimizer:
        done.root, done.dropped = drop_optimizer_state(done.root, done.path)
        if not done.dropped:
            done.notes.append("no optimizer state found to drop")
    return done


def find_or_note(root: Any, notes: list[str]) -> tuple[Optional[tuple[Any, ...]], Any]:
    """``(path, state dict)`` for ``inspect``, or ``(None, None)`` with a note saying why."""
    try:
        return find_state_dict(root, None)
    except StateDictNotFoundError as exc:
        notes.append(f"no model state dict found: {exc}")
        return None, None


def structure(
    root: Any, path: Optional[tuple[Any, ...]], summarize: Callable[[Any, Optional[str]], str]
) -> tuple[tuple[str, str], ...]:
    """``(top-level key, summary)`` of a nested checkpoint; the model's entry says what it is."""
    if not (isinstance(root, Mapping) and path):
        return ()
    held = "model state dict" if len(path) == 1 else f"holds the model at {dotted(path)}"
    return tuple((str(k), summarize(v, held if k == path[0] else None)) for k, v in root.items())


def counted(text: str, role: Optional[str], count: int, size: int) -> str:
    """A summary: ``role: N tensors, size``, else ``text`` with its tensors' count and size."""
    if role is not None:
        return f"{role}: {count} tensors, {human_bytes(size)}"
    return text + (f" ({count} tensors, {human_bytes(size)})" if count else "")


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


def is_dcp_folder(path: str, storage_options: Optional[dict[str, Any]]) -> bool:
    """True when ``path`` is a torch.distributed.checkpoint folder."""
    # A stat first: files (the common case) are not sniffed twice.
    return storage.isdir(path, storage_options=storage_options) and (
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
    if dst is not None and storage.isdir(dst_text, storage_options=storage_options):
        name = default_destination(base, dst_format).replace("\\", "/")
        dst_text = storage.join(dst_text, name.rsplit("/", 1)[-1])
    if storage.exists(dst_text, storage_options=storage_options):
        if same_file(src, dst_text):
            raise concerning("in_place", CheckpointExistsError(
                f"{dst_text} is the source file; pass --in-place (in_place=True) to replace it"
            ))  # fmt: skip
        if not overwrite:
            raise concerning("overwrite", CheckpointExistsError(
                f"{dst_text} already exists; pass --force (overwrite=True) to replace "
                f"it, or name another destination"
            ))  # fmt: skip
    return dst_text


def format_from_name(dst: Optional[PathLike]) -> Optional[FormatName]:
    """The format a destination's suffix names, as ``ddpstate.save`` reads it (None: no say)."""
    name = "" if dst is None else os.fspath(dst).lower()
    return next((f for f in (SAFETENSORS, PT) if name.endswith(formats.TABLE[f].suffixes)), None)


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: how results and messages name a dtype."""
    return str(dtype).removeprefix("torch.")


def describe(value: Any) -> str:
    """A short description of one value of a checkpoint (``tensor float32 [2]``...)."""
    if isinstance(value, torch.Tensor):
        return f"tensor {dtype_name(value.dtype)} {list(value.shape)}"
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (int, float)):
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, str):
        return f"str {value[:40]!r}" + ("..." if len(value) > 40 else "")
    if isinstance(value, (bytes, bytearray)):
        return f"{type(value).__name__} of {len(value)} bytes"
    if isinstance(value, torch.nn.Module):
        return f"pickled nn.Module {type(value).__name__}"
    if isinstance(value, Mapping):
        return f"{type(value).__name__} of {len(value)} entries"
    if isinstance(value, (list, tuple, set, frozenset)):
        return f"{type(value).__name__} of {len(value)} items"
    return type(value).__name__
