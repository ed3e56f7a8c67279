"""Checkpoint formats: telling them apart by their bytes, never by their names."""

from __future__ import annotations

import dataclasses
import os
import pickle
import posixpath
import struct
import zipfile
from collections.abc import Callable, Iterable
from typing import IO, Any, Final, Literal, Optional, Union, cast

from ddpstate import _fs, storage
from ddpstate._layout.folders import folder_kind
from ddpstate._layout.hf_index import find_index, is_index_name
from ddpstate._layout.safetensors import SAFETENSORS_MAX_HEADER
from ddpstate._layout.torch_zip import ZIP_ERRORS
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    InvalidArgumentError,
)

__all__ = [
    "ACCELERATE",
    "DCP",
    "DESCRIPTIONS",
    "FORMATS",
    "HF_SHARDED",
    "HF_TRAINER",
    "LEGACY",
    "MANAGER",
    "PT",
    "PT_LEGACY",
    "SAFETENSORS",
    "TABLE",
    "TORCHSCRIPT",
    "TORCH_ZIP",
    "TRAINING_FOLDERS",
    "Format",
    "FormatName",
    "detect_format",
    "parse_format",
    "sniff_format",
]

#: torch.save's zip container (torch >= 1.6), ``<root>/data.pkl`` + ``<root>/data/<key>``.
TORCH_ZIP: Final = "pt"
#: torch.save's pre-1.6 format, a stream of pickles starting with a magic number.
LEGACY: Final = "pt_legacy"
#: The safetensors format (8-byte little-endian header length, JSON header, raw data).
SAFETENSORS: Final = "safetensors"
#: A TorchScript archive (``torch.jit.save``), a zip with ``code/`` and ``constants.pkl``.
TORCHSCRIPT: Final = "torchscript"
#: A ``torch.distributed.checkpoint`` folder (has a ``.metadata`` file).
DCP: Final = "dcp"
#: A :class:`ddpstate.CheckpointManager` folder (step folders committed by a manifest).
MANAGER: Final = "manager"
#: A Hugging Face sharded checkpoint, ``*.safetensors.index.json`` or
#: ``*.bin.index.json`` (a ``weight_map`` of key -> shard file) and its shards.
HF_SHARDED: Final = "hf_sharded"
#: An Accelerate ``save_state`` folder (``model.safetensors``, ``optimizer.bin``,
#: ``random_states_<i>.pkl``...), with or without ddpstate's manifest.
ACCELERATE: Final = "accelerate"
#: A Hugging Face Trainer ``checkpoint-N`` folder (weights, ``optimizer.pt``,
#: ``trainer_state.json``...), with or without ddpstate's manifest.
HF_TRAINER: Final = "hf_trainer"
#: The folders whose model weights are one file (or sharded set) among a training
#: run's other files; ``ddpstate inspect``/``verify``/``convert`` take them as units.
TRAINING_FOLDERS: Final = (MANAGER, ACCELERATE, HF_TRAINER)
#: Clearer names for the two torch.save formats (same values).
PT: Final = TORCH_ZIP
#: The clearer name of :data:`LEGACY` (the same value).
PT_LEGACY: Final = LEGACY

#: The name of a format, one of :data:`FORMATS`.
FormatName = Literal[
    "pt",
    "pt_legacy",
    "safetensors",
    "torchscript",
    "dcp",
    "manager",
    "hf_sharded",
    "accelerate",
    "hf_trainer",
]

#: torch's legacy format pickles this number first (LONG1 of 10 bytes, any protocol 2-5).
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_NUMBER = pickle.LONG1 + b"\x0a" + LEGACY_MAGIC.to_bytes(10, "little") + pickle.STOP


def _is_zip(head: bytes, size: Optional[int]) -> bool:
    return head.startswith(b"PK\x03\x04")  # a zip's first local header


def _is_legacy(head: bytes, size: Optional[int]) -> bool:
    protocol = head[1] if len(head) > 1 else 0
    return head[:1] == pickle.PROTO and 2 <= protocol <= 5 and head[2:].startswith(_LEGACY_NUMBER)


def _is_safetensors(head: bytes, size: Optional[int]) -> bool:
    if len(head) < 9:
        return False
    (header_len,) = struct.unpack("<Q", head[:8])
    fits = size is None or 8 + header_len <= size
    return 2 <= header_len <= SAFETENSORS_MAX_HEADER and fits and head[8:9] == b"{"


@dataclasses.dataclass(frozen=True)
class Format:
    """What one checkpoint format is; :data:`TABLE` holds one per format.

    Attributes:
        name: Its one name (one of :data:`FORMATS`).
        description: How it is named to a person (the CLI's output).
        folder: A folder of files rather than one file.
        suffixes: File-name suffixes that ask for it on output, the default first.
        mappable: A local file of it can be memory-mapped when loaded.
        sniff: Whether a file's first bytes (and size, if known) are this format;
            None for folders and for what a zip's directory tells (TorchScript).
    """

    name: FormatName
    description: str
    folder: bool = False
    suffixes: tuple[str, ...] = ()
    mappable: bool = False
    sniff: Optional[Callable[[bytes, Optional[int]], bool]] = None


#: Every format by its name; adding a format adds a row here (and its reader).
TABLE: dict[FormatName, Format] = {
    f.name: f
    for f in (
        Format(TORCH_ZIP, "torch.save zip", suffixes=(".pt", ".pth", ".bin", ".ckpt"),
               mappable=True, sniff=_is_zip),
        Format(LEGACY, "legacy torch.save (pre-1.6)", sniff=_is_legacy),
        Format(SAFETENSORS, "safetensors", suffixes=(".safetensors",),
               mappable=True, sniff=_is_safetensors),
        Format(TORCHSCRIPT, "TorchScript archive"),
        Format(DCP, "torch.distributed.checkpoint folder", folder=True),
        Format(MANAGER, "CheckpointManager folder", folder=True),
        Format(HF_SHARDED, "Hugging Face sharded checkpoint", folder=True),
        Format(ACCELERATE, "Accelerate save_state folder", folder=True),
        Format(HF_TRAINER, "Hugging Face Trainer checkpoint folder", folder=True),
    )
}  # fmt: skip
#: Every format's name, in the order of :data:`TABLE`.
FORMATS: tuple[FormatName, ...] = tuple(TABLE)
#: How each format is named to a person (the CLI's output).
DESCRIPTIONS: dict[FormatName, str] = {name: f.description for name, f in TABLE.items()}

# Names accepted on input, each for a reason: the canonical names; "torch", the
# name save(format=) documented first; "torch_zip"/"torch_legacy", what detection
# said before the names were unified; "pth", the other suffix torch.save files
# go by. Not accepted: "bin" (GGML, raw dumps and others share the suffix, so it
# does not name a format) and "st" (no tool in the ecosystem uses it).
_ALIASES: dict[str, FormatName] = {
    **{name: name for name in FORMATS},
    "torch": TORCH_ZIP,
    "torch_zip": TORCH_ZIP,
    "pth": TORCH_ZIP,
    "torch_legacy": LEGACY,
}


def parse_format(
    alias: Any, *, allowed: Optional[Iterable[FormatName]] = None, what: str = "format"
) -> FormatName:
    """The one name of a checkpoint format, from any name ddpstate accepts for it.

    Every API edge that takes a format (``save(format=)``,
    ``CheckpointManager(format=)``, ``convert_file(to=)``, the CLI's ``--to``)
    goes through here, so each accepts the same names and every result says
    one of :data:`FORMATS`.

    Args:
        alias: A format name in any case: ``"pt"`` (also ``"torch"``,
            ``"torch_zip"``, ``"pth"``), ``"pt_legacy"`` (also
            ``"torch_legacy"``), ``"safetensors"``, ``"torchscript"``,
            ``"dcp"``, ``"manager"``, ``"hf_sharded"``.
        allowed: The formats this caller can handle; default: all.
        what: How the caller names the argument, for the message (``"to"``...).

    Returns:
        The canonical name, one of :data:`FORMATS`.

    Raises:
        InvalidArgumentError: ``alias`` names no format, or one not in
            ``allowed``; the message lists the names that are.

    Example:
        >>> from ddpstate.formats import parse_format
        >>> parse_format("torch"), parse_format("SafeTensors")
        ('pt', 'safetensors')
    """
    name = _ALIASES.get(alias.strip().lower()) if isinstance(alias, str) else None
    choices = tuple(FORMATS if allowed is None else allowed)
    if name is None or name not in choices:
        known = "" if name is None else f" ({name} is not one this call handles)"
        raise InvalidArgumentError(
            f"{what}={alias!r} is not a format here{known}; choose one of "
            f"{', '.join(repr(c) for c in choices)}"
        )
    return name


_SNIFF_BYTES = 64

Source = Union[str, "os.PathLike[str]", IO[bytes]]


# Records only torch.save writes: a zip holding them and no data.pkl is a damaged one.
_TORCH_RECORDS = ("/version", "/byteorder", "/.format_version")


def _zip_kind(fileobj: IO[bytes], name: str) -> FormatName:
    fileobj.seek(0)
    try:
        names = zipfile.ZipFile(fileobj).namelist()
    except ZIP_ERRORS as exc:
        raise CheckpointCorruptError(
            f"{name}: starts like a zip archive (torch.save) but its directory cannot be read "
            f"({type(exc).__name__}: {exc}); it is truncated or damaged: re-save or re-download it"
        ) from exc
    # torch.jit.save writes code/ and constants.pkl, torch.save a data.pkl.
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        return TORCHSCRIPT
    if any(n.endswith("data.pkl") for n in names):
        return TORCH_ZIP
    if any(n.endswith(_TORCH_RECORDS) for n in names):
        raise CheckpointCorruptError(
            f"{name}: a torch.save archive without its data.pkl record; the file is damaged "
            f"or was crafted: re-save or re-download it"
        )
    raise CheckpointFormatError(
        f"{name}: a zip archive without data.pkl, so not a torch.save checkpoint "
        f"(entries: {', '.join(names[:5])}{'...' if len(names) > 5 else ''})"
    )


def sniff_format(head: bytes, size: Optional[int] = None) -> Optional[FormatName]:
    """Guess the format from a file's first bytes alone.

    Zip archives come back as ``"pt"``; only :func:`detect_format`, which
    reads the zip directory, tells a TorchScript archive apart.

    Args:
        head: At least the first 16 bytes of the file (64 are plenty).
        size: The file's total size, to reject impossible safetensors headers.

    Returns:
        A format name, or None when the bytes match no known format.

    Example:
        >>> from ddpstate.formats import sniff_format
        >>> sniff_format(b"PK\\x03\\x04" + bytes(60))
        'pt'
    """
    return next((f.name for f in TABLE.values() if f.sniff and f.sniff(head, size)), None)


def _describe(head: bytes) -> str:
    if head.startswith(b"\x80"):
        return "a plain pickle, not a torch.save checkpoint"
    if head.startswith((b"{", b"[")):
        return "JSON text, not a checkpoint"
    if head.startswith(b"\x89HDF"):
        return "an HDF5 file (Keras?), not a PyTorch checkpoint"
    if head.startswith(b"\x08") or head[:1] == b"\n":
        return "possibly an ONNX/protobuf file, not a checkpoint"
    if not head:
        return "an empty file"
    return f"unknown bytes {head[:8].hex(' ')}"


def detect_format(
    source: Source, *, storage_options: Optional[dict[str, Any]] = None
) -> FormatName:
    """Tell which checkpoint format a file or folder holds, from its bytes.

    Args:
        source: A local path, an fsspec URL (``s3://...``, ``memory://...``),
            or a readable, seekable binary file object.
        storage_options: fsspec options for URLs.

    Returns:
        One of ``"pt"``, ``"pt_legacy"``, ``"safetensors"``, ``"torchscript"``,
        ``"dcp"``, ``"hf_sharded"`` (an index file, or a folder holding exactly
        one); see :func:`parse_format`.

    Raises:
        CheckpointNotFoundError: The path does not exist.
        CheckpointFormatError: The bytes match no format ddpstate knows.
        CheckpointCorruptError: The bytes start like a torch.save zip or a
            safetensors file but are cut short or damaged.

    Example:
        >>> import torch, tempfile, os, ddpstate
        >>> path = os.path.join(tempfile.mkdtemp(), "w.bin")
        >>> torch.save({"w": torch.ones(2)}, path)
        >>> ddpstate.detect_format(path)
        'pt'
    """
    if hasattr(source, "read"):
        fileobj: IO[bytes] = source  # type: ignore[assignment]
        start = fileobj.tell()
        head = fileobj.read(_SNIFF_BYTES)
        fileobj.seek(0, os.SEEK_END)
        size = fileobj.tell() - start
        fileobj.seek(start)
        return _classify(fileobj, head, size, getattr(fileobj, "name", "<file object>"))

    name = os.fspath(source)
    remote = _fs.is_remote(name)
    if not remote:
        name = _fs.local_path(name)
    elif not storage.exists(name, storage_options=storage_options):
        raise CheckpointNotFoundError(f"{name}: no such file or folder")
    if storage.isdir(name, storage_options=storage_options):
        return _folder_kind(name, storage_options)
    if not remote and _fs.is_special_file(name):
        raise CheckpointFormatError(
            f"{name}: not a regular file (a FIFO, socket or device), so ddpstate does not "
            f"open it; pass the checkpoint file itself, or a file object to ddpstate.load"
        )
    try:
        opened: IO[bytes]
        if remote:
            opened = storage.open_read(name, storage_options=storage_options)
        else:  # opened here, so that a PermissionError reaches the caller as such
            opened = open(name, "rb")  # noqa: SIM115 - closed by the with below
        with opened as f:
            head = f.read(_SNIFF_BYTES)
            if _is_index(name, head):
                return HF_SHARDED
            return _classify(f, head, f.seek(0, os.SEEK_END), name)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{name}: no such file; check the path") from exc


def _is_index(name: str, head: bytes) -> bool:
    return is_index_name(name) and head.lstrip().startswith(b"{")


def _folder_kind(name: str, storage_options: Optional[dict[str, Any]]) -> FormatName:
    """The one place a folder's kind is told, from the names in it."""
    # A URL's checkpoint saved over another lives in the version folder its manifest names.
    committed = storage.committed_folder(name, storage_options=storage_options)
    names = storage.listdir(committed, storage_options=storage_options)
    if ".metadata" in names:
        return DCP
    kind = folder_kind(posixpath.basename(name.replace(os.sep, "/").rstrip("/")), names)
    if kind is not None:
        return cast(FormatName, kind)
    if find_index(name, storage_options) is not None:
        return HF_SHARDED
    raise CheckpointFormatError(
        f"{name}: a folder, not a checkpoint file: no torch.distributed.checkpoint .metadata "
        f"or sharded index in it, and not a CheckpointManager, Accelerate save_state or Hugging "
        f"Face Trainer checkpoint folder; pass a checkpoint file in it"
    )


def _classify(fileobj: IO[bytes], head: bytes, size: int, name: str) -> FormatName:
    kind = sniff_format(head, size)
    if kind == TORCH_ZIP:
        return _zip_kind(fileobj, name)
    if kind is None and len(head) >= 9 and head[8:9] == b"{":
        claimed = int.from_bytes(head[:8], "little")
        if 2 <= claimed <= SAFETENSORS_MAX_HEADER:
            raise CheckpointCorruptError(
                f"{name}: starts like a safetensors file whose {claimed}-byte header is cut "
                f"short ({size} bytes in all), so the file is truncated; re-save or "
                f"re-download it"
            )
    if kind is None:
        raise CheckpointFormatError(
            f"{name}: not a checkpoint ddpstate can read ({_describe(head)}); expected a "
            f"torch.save file, a legacy torch file, safetensors or a torch.distributed.checkpoint "
            f"folder"
        )
    return kind
