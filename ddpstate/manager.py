"""Training-state checkpoints over time: rotation, verified auto-resume, async saves, preemption.

On disk, a :class:`CheckpointManager` folder looks like this::

    <directory>/
        latest                      # "step_0000001200\\n", replaced atomically after each commit
        step_0000001100/
        step_0000001200/
            model.pt                # one file per entry of `state` (`.safetensors` for models
            optimizer.pt            #   with format="safetensors")
            _rng.pt                 # every rank's RNG states, and the world size
            dcp/                    # sharded models/optimizers (or all, writers="all"):
                .metadata           #   one torch.distributed.checkpoint, every rank's
                __0_0.distcp ...    #   files listed in the manifest (see _dcp.py)
            manifest.json           # written last: the commit marker

A step folder without ``manifest.json`` is an unfinished save and never counts
as a checkpoint; the next save deletes it, along with any temporary file left
by a killed writer. The manifest records each file's size and CRC-32, the step,
the metrics, the world size, the ddpstate and torch versions and the time, and
its own CRC-32; :func:`verify_checkpoint` (``ddpstate verify``) checks all of it.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
import pickle
import posixpath
import re
import signal
import threading
import time
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType, TracebackType
from typing import IO, Any, Optional, Union

import torch
from torch import nn

from ddpstate import _fs, checkpoint, storage
from ddpstate._collectives import with_message
from ddpstate._dcp import write as _dcp
from ddpstate._fs import PathLike
from ddpstate._io import model_state
from ddpstate._io import savecheck as _savecheck
from ddpstate._io.safetensors_io import write_safetensors
from ddpstate._manager import local_tier as _local_tier
from ddpstate._manager import verify_split as _verify_split
from ddpstate._version import __version__
from ddpstate.dist import (
    all_reduce_flag,
    barrier,
    broadcast_object,
    compare_across_ranks,
    gather_and_decide,
    get_rank,
    get_world_size,
    is_distributed,
    share_outcome,
)
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    DDPStateError,
    InvalidArgumentError,
    KeyMismatchError,
)
from ddpstate.formats import PT, SAFETENSORS, parse_format
from ddpstate.keys import adapt_state_dict, normalize_keys, unwrap_model
from ddpstate.rng import capture_rng_state, derived_seed, restore_rng_state, seed_all

__all__ = ["CheckpointManager", "CheckpointVerification", "verify_checkpoint"]


Timeout = Union[float, timedelta, None]

#: Step folders are ``step_`` + the step zero-padded to this many digits (more if needed).
STEP_DIGITS = 10
#: The commit marker inside a step folder; written after every other file.
MANIFEST_NAME = "manifest.json"
#: The pointer file naming the most recently committed step folder.
LATEST_NAME = "latest"
# In write errors raised after the step's commit (the folder has changed).
_COMMITTED_BUT = "was committed, but"
#: Every rank's RNG states; entry names cannot start with "_", so it never collides.
RNG_FILE = "_rng.pt"
#: Bumped when the manifest layout changes incompatibly.
MANIFEST_VERSION = 1

#: The manifest's own CRC-32 (over the manifest without this field), so that a
#: damaged manifest is caught even where it still parses.
MANIFEST_CRC_FIELD = "manifest_crc32"
#: Suffixes of checkpoint files: such a file in a step folder that the manifest
#: does not list fails verification (the manager never writes one); other
#: unlisted files are only noted.
PART_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")

_STEP_RE = re.compile(r"^step_(\d+)$")
_LATEST_RE = re.compile(r"step_\d+\n")
_ENTRY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_READ_CHUNK = 8 << 20
_WRITER_RANK = 0

# What kind of object an entry was saved from; restore() loads by the live object's type.
_KIND_MODULE = "module"
_KIND_STATEFUL = "stateful"
_KIND_VALUE = "value"


@dataclass
class _Pending:
    step: int
    folder: str
    shared: bool = False  # its writer threads already agreed on the error (DCP, every rank)


@dataclass(frozen=True)
class _WireBytes:
    """A byte tensor's contents on their way to the writer (see ``_rng_to_wire``)."""

    data: bytes


@dataclass
class _Entry:
    kind: str
    value: Any


class _ChecksumWriter:
    """A write-only file wrapper that counts bytes and computes CRC-32 on the way through."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.size = 0
        self.crc = 0
        # torch.save's C++ writer replaces an exception from write() with its own
        # "unexpected pos" error; the real cause (disk full...) is kept here.
        self.error: Optional[BaseException] = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self._raw.write(view)
        except BaseException as exc:
            self.error = exc
            raise
        count = view.nbytes if written is None else int(written)
        self.crc = zlib.crc32(view[:count], self.crc)
        self.size += count
        return count

    def flush(self) -> None:
        self._raw.flush()


def _checksum_hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def _step_name(step: int) -> str:
    return f"step_{step:0{STEP_DIGITS}d}"


def _parse_step(name: str) -> Optional[int]:
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgumentError(f"CheckpointManager: step must be an int >= 0, got {step!r}")
    return int(step)


def _check_metrics(metrics: Optional[Mapping[str, Any]]) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidArgumentError(
            f"CheckpointManager.save: metrics must be a dict of name -> number, "
            f"got {type(metrics).__name__}"
        )
    out: dict[str, float] = {}
    for key, value in metrics.items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidArgumentError(
                f"CheckpointManager.save: metric {key!r}={value!r} is not a number"
            ) from exc
    return out


def _check_state(state: Any, what: str) -> list[str]:
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(
            f"CheckpointManager.{what}: state must be a dict of name -> object, "
            f"got {type(state).__name__}"
        )
    names = list(state)
    for name in names:
        if not isinstance(name, str) or not _ENTRY_NAME_RE.match(name):
            raise InvalidArgumentError(
                f"CheckpointManager.{what}: entry name {name!r} cannot be a file name; use "
                f"letters, digits, '_', '.' and '-', starting with a letter or digit"
            )
    return names


def _check_not_sharded(state: Mapping[str, Any], folder: str) -> None:
    """Refuse DTensor/ShardedTensor state on this rank, without calling ``state_dict()``.

    Models are checked through their parameters and buffers, optimizers through
    their state, plain values as they are; other stateful objects are checked on
    the writer once their state dict is taken.
    """
    if not _savecheck.sharded_types():
        return  # torch.distributed.tensor never imported: no DTensor can exist
    for name, obj in state.items():
        what = f"state[{name!r}]"
        if isinstance(obj, nn.Module):
            tensors: Any = {k: v for k, v in obj.named_parameters()}
            tensors.update(obj.named_buffers())
        elif isinstance(obj, torch.optim.Optimizer):
            tensors = obj.state_dict()
        elif _has_state_dict(obj):
            continue
        else:
            tensors = obj
        _savecheck.check_tensors(tensors, what, folder, sharded_only=True)


def _has_state_dict(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _is_flat_tensor_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    )


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _rng_to_wire(state: Any) -> Any:
    """RNG states with each 1-D byte tensor as raw bytes: a torch tensor costs ~0.4 ms to
    unpickle, and the writer unpickles every rank's states at every save."""
    if isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1:
        return _WireBytes(state.detach().cpu().numpy().tobytes())
    if isinstance(state, dict):
        return {k: _rng_to_wire(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_rng_to_wire(v) for v in state]
    return state


def _rng_from_wire(state: Any) -> Any:
    if isinstance(state, _WireBytes):
        return torch.frombuffer(bytearray(state.data), dtype=torch.uint8)
    if isinstance(state, dict):
        return {k: _rng_from_wire(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_rng_from_wire(v) for v in state]
    return state


def _rng_states(blobs: list[bytes]) -> list[Any]:
    """Every rank's RNG states from the blobs the writer gathered, indexed by rank."""
    # Trusted input: pickled by this job's own ranks in CheckpointManager.save.
    return [_rng_from_wire(pickle.loads(blob)) for blob in blobs]


def _manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    return json.dumps(manifest, indent=2, sort_keys=True).encode()


def _manifest_for(
    step: Optional[int],
    metrics: Mapping[str, Any],
    world_size: int,
    entries: Optional[dict[str, dict[str, str]]],
    files: dict[str, dict[str, Any]],
    format: Optional[str] = None,
) -> bytes:
    """A step's manifest (the commit marker) as written, its own CRC-32 included.

    With ``format`` (a ``save()`` DCP folder, see ``_dcp``) it has no entries and no RNG file.
    """
    now = time.time()
    manifest: dict[str, Any] = {
        "manifest_version": MANIFEST_VERSION,
        "step": step,
        "metrics": dict(metrics),
        "world_size": world_size,
        "ddpstate_version": __version__,
        "torch_version": torch.__version__,
        "created": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(),
        "created_unix": now,
        "checksum": "crc32",
        "entries": entries,
        "rng_file": RNG_FILE,
        "files": files,
    }
    if format is not None:
        manifest["format"] = format
        del manifest["entries"], manifest["rng_file"], manifest["step"]
    manifest[MANIFEST_CRC_FIELD] = _manifest_crc(manifest)
    return _manifest_bytes(manifest)


def _manifest_crc(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != MANIFEST_CRC_FIELD}
    return _checksum_hex(zlib.crc32(_manifest_bytes(body)))


def _is_plain_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and bool(name)
        and "/" not in name
        and "\\" not in name
        and not name.startswith(".")
    )


def _is_listed(name: Any) -> bool:
    """A file name a manifest may list: a plain name, or one of a DCP checkpoint's files."""
    return _is_plain_name(name) or _dcp.is_listed_name(name)


def _read_manifest(
    folder: str, opts: Optional[dict[str, Any]]
) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """Read and check a step folder's manifest; return (manifest, None) or (None, problem)."""
    path = storage.join(folder, MANIFEST_NAME)
    if not storage.exists(path, storage_options=opts):
        return None, (
            f"it has no {MANIFEST_NAME}, so it is not committed (an interrupted save: killed, "
            f"crashed or still running)"
        )
    try:
        with storage.open_read(path, storage_options=opts) as f:
            raw = f.read()
        manifest = json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError, OSError, DDPStateError) as exc:
        return None, f"its {MANIFEST_NAME} cannot be read ({_error_text(exc)})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None, f"its {MANIFEST_NAME} is not a ddpstate manifest"
    version = manifest.get("manifest_version", 0)
    if not isinstance(version, int) or version > MANIFEST_VERSION:
        return None, (
            f"its {MANIFEST_NAME} has version {version!r}, newer than this ddpstate "
            f"{__version__} reads; upgrade ddpstate"
        )
    # Byte-exact: a damaged byte that leaves the JSON valid and equal in value
    # (whitespace) is caught here, one that changes a value by the CRC below.
    if raw != _manifest_bytes(manifest):
        return None, (
            f"its {MANIFEST_NAME} is damaged or was edited: its bytes are not the ones ddpstate "
            f"wrote"
        )
    if manifest.get(MANIFEST_CRC_FIELD) != _manifest_crc(manifest):
        return None, (
            f"its {MANIFEST_NAME} fails its own checksum ({MANIFEST_CRC_FIELD} "
            f"{manifest.get(MANIFEST_CRC_FIELD)!r}, computed {_manifest_crc(manifest)}): it is "
            f"damaged or was edited"
        )
    return manifest, None


def _manifest_problems(manifest: dict[str, Any], step: Optional[int]) -> list[str]:
    problems = []
    if step is not None and manifest.get("step") != step:
        problems.append(f"its {MANIFEST_NAME} does not describe step {step}")
    if manifest.get("format") == _dcp.FOLDER_FORMAT and step is None:
        return [  # a save() DCP folder: files only
            f"its {MANIFEST_NAME} lists {name!r}, which is not a file here"
            for name, expected in manifest["files"].items()
            if not _is_listed(name) or not isinstance(expected, dict)
        ]
    entries = manifest.get("entries")
    if not isinstance(entries, dict):
        return [*problems, f"its {MANIFEST_NAME} has no entries"]
    files: dict[str, Any] = manifest["files"]
    for filename, expected in files.items():
        if not _is_listed(filename) or not isinstance(expected, dict):
            problems.append(f"its {MANIFEST_NAME} lists {filename!r}, which is not a file here")
    for name, entry in entries.items():
        if not isinstance(entry, dict) or entry.get("file") not in files:
            problems.append(f"its {MANIFEST_NAME} gives entry {name!r} no checksummed file")
    if manifest.get("rng_file", RNG_FILE) not in files:
        problems.append(f"its {MANIFEST_NAME} gives the RNG states no checksummed file")
    return problems


@dataclass
class _FolderCheck:
    manifest: Optional[dict[str, Any]]
    problems: list[str]
    notes: list[str]
    files: int = 0
    bytes_read: int = 0


def _check_file(
    path: str,
    filename: str,
    expected: dict[str, Any],
    check: _FolderCheck,
    opts: Optional[dict[str, Any]],
) -> None:
    try:
        with storage.open_read(path, storage_options=opts) as f:
            size, crc = storage.size_and_crc32(f, _READ_CHUNK)
    except CheckpointNotFoundError:
        check.problems.append(f"{filename} is missing")
        return
    except (OSError, DDPStateError) as exc:
        check.problems.append(f"{filename} cannot be read ({_error_text(exc)})")
        return
    check.files += 1
    check.bytes_read += size
    want = expected.get("size")
    if size != want:
        how = "truncated" if isinstance(want, int) and size < want else "the wrong size"
        check.problems.append(f"{filename} is {how}: {size} bytes, the manifest says {want}")
    elif _checksum_hex(crc) != expected.get("crc32"):
        check.problems.append(
            f"{filename} fails its checksum (CRC-32 {_checksum_hex(crc)}, the manifest says "
            f"{expected.get('crc32')}): its bytes are damaged"
        )


def _check_folder(folder: str, step: Optional[int], opts: Optional[dict[str, Any]]) -> _FolderCheck:
    """Check one step folder against its manifest, collecting every problem."""
    manifest, problem = _read_manifest(folder, opts)
    if manifest is None:
        return _FolderCheck(None, [str(problem)], [])
    check = _FolderCheck(manifest, _manifest_problems(manifest, step), [])
    files: dict[str, Any] = manifest["files"]
    for filename, expected in files.items():
        if _is_listed(filename) and isinstance(expected, dict):
            _check_file(storage.join(folder, filename), filename, expected, check, opts)
    _check_listing(folder, files, check, opts)
    if check.problems:
        check.manifest = None
    return check


def _check_listing(
    folder: str, files: dict[str, Any], check: _FolderCheck, opts: Optional[dict[str, Any]]
) -> None:
    """Add the problems and notes of what lies in ``folder`` beside the listed ``files``."""
    try:
        present = storage.listdir(folder, storage_options=opts, include_temp=True)
    except DDPStateError as exc:
        check.problems.append(f"the folder cannot be listed ({_error_text(exc)})")
        present = []
    for name in present:
        if name in files or name == MANIFEST_NAME:
            continue
        if name == _dcp.DCP_SUBDIR and any(_dcp.is_listed_name(f) for f in files):
            for extra in _dcp.unlisted_shards(storage.join(folder, name), files, name + "/"):
                check.problems.append(
                    f"{extra} is not listed in {MANIFEST_NAME}: a shard this save did not write "
                    f"(copied in, or left from another save); move it out of the folder"
                )
            continue
        if storage.is_temp_name(name):
            check.notes.append(
                f"{name} is a temporary file left by an interrupted write (not part of the "
                f"checkpoint; the next save deletes it)"
            )
        elif name.endswith((*PART_SUFFIXES, _dcp.SHARD_SUFFIX)):
            check.problems.append(
                f"{name} is not listed in {MANIFEST_NAME}: a checkpoint file this save did not "
                f"write (copied in, or left from another save); move it out of the folder"
            )
        else:
            check.notes.append(f"{name} is not part of the checkpoint (ignored)")


@dataclass(frozen=True)
class CheckpointVerification:
    """What :func:`verify_checkpoint` found in a step folder or a manager directory.

    Attributes:
        path: The folder checked.
        problems: What is wrong, one line each naming the file; empty when good.
        notes: Remarks that are not failures (temporary files left by an
            interrupted write, uncommitted step folders in a directory).
        steps: The committed steps checked, whether or not they verified.
        files: Files read and compared with their manifest.
        bytes_read: Bytes read to compare them.
    """

    path: str
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()
    steps: tuple[int, ...] = ()
    files: int = 0
    bytes_read: int = 0

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems


def verify_checkpoint(
    path: PathLike, *, storage_options: Optional[dict[str, Any]] = None
) -> CheckpointVerification:
    """Check a CheckpointManager step folder, or a whole manager directory, and list every problem.

    A step folder (``<directory>/step_NNNNNNNNNN``) is good when its
    ``manifest.json`` (the commit marker) is present, byte for byte what
    ddpstate wrote (the manifest carries its own CRC-32), and describes this
    step; every file it lists exists with the recorded size and CRC-32; and
    no unlisted checkpoint file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``,
    ``.safetensors``) lies beside them. Temporary files of interrupted writes
    and other unlisted files are noted, not failures. A folder without a
    manifest is "not committed (an interrupted save)": a failure here.
    :meth:`CheckpointManager.restore` accepts exactly the folders this passes.

    A manager directory is good when every committed step folder is good and
    the ``latest`` pointer names the newest committed step; uncommitted step
    folders there are only noted (the next save deletes them), and each
    problem is prefixed with its step folder's name.

    Not a collective; reads every byte of every file once.

    Args:
        path: A step folder or a manager directory (local or fsspec URL).
        storage_options: fsspec options for URLs.

    Returns:
        A :class:`CheckpointVerification`; ``.ok`` is the verdict and
        ``.problems`` says what is wrong.

    Raises:
        CheckpointNotFoundError: Nothing exists at ``path``.
        CheckpointFormatError: ``path`` is a file, or a folder with no
            manifest, no ``step_*`` folders and no ``latest`` pointer.

    Example:
        >>> import tempfile, torch, ddpstate
        >>> from ddpstate.manager import verify_checkpoint
        >>> manager = ddpstate.CheckpointManager(tempfile.mkdtemp())
        >>> manager.save(1, {"model": torch.nn.Linear(2, 2)})
        >>> verify_checkpoint(manager.checkpoint_path(1)).ok
        True
        >>> verify_checkpoint(manager.directory).steps
        (1,)
    """
    text = os.fspath(path)
    opts = storage_options
    if not storage.exists(text, storage_options=opts):
        raise CheckpointNotFoundError(f"{text}: no such folder")
    if not storage.isdir(text, storage_options=opts):
        raise CheckpointFormatError(
            f"{text} is a file, not a CheckpointManager folder; pass a step folder or the "
            f"manager's directory (`ddpstate verify` checks single files too)"
        )
    name = posixpath.basename(text.replace(os.sep, "/").rstrip("/"))
    step = _parse_step(name)
    if step is not None or storage.exists(storage.join(text, MANIFEST_NAME), storage_options=opts):
        check = _check_folder(text, step, opts)
        committed = storage.exists(storage.join(text, MANIFEST_NAME), storage_options=opts)
        found = (step,) if committed and step is not None else ()
        return CheckpointVerification(
            path=text,
            problems=tuple(check.problems),
            notes=tuple(check.notes),
            steps=found,
            files=check.files,
            bytes_read=check.bytes_read,
        )
    return _verify_directory(text, opts)


def _verify_directory(text: str, opts: Optional[dict[str, Any]]) -> CheckpointVerification:
    names = storage.listdir(text, storage_options=opts, include_temp=True)
    step_dirs = sorted(
        (s, n)
        for n in names
        if (s := _parse_step(n)) is not None
        and storage.isdir(storage.join(text, n), storage_options=opts)
    )
    if not step_dirs and LATEST_NAME not in names:
        raise CheckpointFormatError(
            f"{text} is not a CheckpointManager folder: it has no {MANIFEST_NAME}, no step_* "
            f"folders and no {LATEST_NAME} pointer"
        )
    problems: list[str] = []
    notes: list[str] = []
    committed: list[int] = []
    files = read = 0
    for s, n in step_dirs:
        folder = storage.join(text, n)
        if not storage.exists(storage.join(folder, MANIFEST_NAME), storage_options=opts):
            notes.append(f"{n}: not committed (an interrupted save; the next save deletes it)")
            continue
        committed.append(s)
        check = _check_folder(folder, s, opts)
        problems.extend(f"{n}: {p}" for p in check.problems)
        notes.extend(f"{n}: {p}" for p in check.notes)
        files += check.files
        read += check.bytes_read
    for n in names:
        if storage.is_temp_name(n):
            notes.append(
                f"{n} is a temporary file left by an interrupted write (the next save deletes it)"
            )
    problems.extend(_latest_problems(text, names, committed, notes, opts))
    return CheckpointVerification(
        path=text,
        problems=tuple(problems),
        notes=tuple(notes),
        steps=tuple(committed),
        files=files,
        bytes_read=read,
    )


def _latest_problems(
    text: str,
    names: list[str],
    committed: list[int],
    notes: list[str],
    opts: Optional[dict[str, Any]],
) -> list[str]:
    if LATEST_NAME not in names:
        if committed:
            notes.append(
                f"{LATEST_NAME} is missing (restore() does not need it; the next save writes it)"
            )
        return []
    try:
        with storage.open_read(storage.join(text, LATEST_NAME), storage_options=opts) as f:
            raw = f.read(256)
    except (OSError, DDPStateError) as exc:
        return [f"{LATEST_NAME} cannot be read ({_error_text(exc)})"]
    content = raw.decode("ascii", errors="replace")
    if not _LATEST_RE.fullmatch(content):
        return [f"{LATEST_NAME} is damaged: {raw!r} is not a step folder name and a newline"]
    pointed = content[:-1]
    step = _parse_step(pointed)
    if step not in committed:
        exists = storage.exists(storage.join(text, pointed), storage_options=opts)
        return [
            f"{LATEST_NAME} names {pointed}, which "
            + ("is not committed" if exists else "does not exist")
        ]
    if committed and step != max(committed):
        return [
            f"{LATEST_NAME} names {pointed}, but {_step_name(max(committed))} is the newest "
            f"committed step (a save was interrupted between its commit and the pointer update, "
            f"or {LATEST_NAME} was edited); restore() takes the newest step that verifies, and "
            f"the next save rewrites {LATEST_NAME}"
        ]
    return []


def _without_skipped(value: Any, optimizer: Any, skipped: set[int], where: str) -> Any:
    """``value`` (an optimizer state dict) less the state of the ``skipped`` parameters.

    Saved optimizer state is keyed by parameter position in ``param_groups``, so
    positions are matched against the live optimizer's parameters; those start
    afresh (as new parameters do) and a warning names how many.
    """
    if not isinstance(value, Mapping) or not isinstance(value.get("state"), Mapping):
        return value
    positions: set[Any] = set()
    index = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) in skipped:
                positions.add(index)
            index += 1
    dropped = [k for k in value["state"] if k in positions]
    if not dropped:
        return value
    warnings.warn(
        f"{where}: dropped the saved optimizer state of {len(dropped)} parameter(s) skipped "
        f"by ignore_mismatched=True (they start with fresh optimizer state)",
        UserWarning,
        stacklevel=4,
    )
    kept = dict(value)
    kept["state"] = {k: v for k, v in value["state"].items() if k not in positions}
    return kept


class CheckpointManager:
    """Save training state every few steps, keep a few, and resume from the newest good one.

    A collective object: create it, and call :meth:`save`, :meth:`restore`,
    :meth:`wait`, :meth:`should_stop` and :meth:`close`, on every rank, in the
    same order, with the same arguments. Rank 0 writes; every rank gets the
    same outcome (a failed write raises the same error on every rank).

    ``state`` maps entry names (file names: letters, digits, ``_ . -``) to
    objects with ``state_dict()``/``load_state_dict()`` -- model, optimizer,
    LR scheduler, GradScaler, :class:`~ddpstate.ResumableDistributedSampler`,
    your own -- or to plain values (numbers, strings, tensors, lists and dicts
    of them). Models are saved unwrapped (DDP, DataParallel, ``torch.compile``)
    with plain keys and load back into whatever wrapping the live model has.
    Except for the RNG states, which are gathered from every rank, the state
    is taken from rank 0, so it must be the same on every rank (as it is under
    DDP). Plain values must be loadable with ``weights_only=True``: numbers,
    strings, tensors, containers, numpy values, paths, ``datetime`` values,
    ``argparse.Namespace``, or your own types listed in ``safe_globals``;
    anything else is refused by ``save`` before anything is written.

    Sharded models (FSDP2 ``fully_shard``, tensor parallel: ``DTensor``
    parameters) and their optimizers are saved with
    ``torch.distributed.checkpoint``: every rank writes its own shards into
    ``step_<n>/dcp/``, and the manifest lists those files too, so the commit,
    verification and fallback are the same; :meth:`restore` reshards them to
    the live model's layout (another world size, FSDP2, DDP or a plain model).
    The optimizer's model must be in the same ``state``. With
    ``async_save=True`` each rank copies its shards to CPU in ``save`` and
    writes them in the background on a gloo group of the manager's own
    (created at the first such save, destroyed at :meth:`close`). Sharded
    tensors elsewhere (in a plain value) are refused with
    :class:`~ddpstate.ShardedStateError`.

    Checkpoints live in ``<directory>/step_<step>/`` (see the module
    docstring). Rotation runs only after the new checkpoint is committed: it
    keeps the ``keep_last`` highest steps plus the ``keep_best`` best by
    ``metric``, and deletes the rest. Saving a step that already exists
    replaces it (its manifest is removed first, so a crash midway leaves it
    uncommitted, never mixed). Saving a step lower than existing ones is a
    rollback when :meth:`restore` loaded that step or a lower one, or with
    ``save(..., rollback=True)`` (refused otherwise: the higher steps may be an
    earlier run's): once it is committed it becomes ``latest`` and the higher
    steps are deleted, so ``restore``, ``steps()`` and ``ddpstate verify`` agree.

    ``restore`` verifies the newest checkpoint's files against its manifest on
    rank 0 (sizes and CRC-32, as :func:`verify_checkpoint`), falls back to
    older ones with a warning that says what was wrong, broadcasts the
    choice, and loads it on every rank.

    With ``async_save=True``, ``save`` copies every tensor into CPU memory kept
    between saves (pinned for CUDA tensors), starts the write in a background
    thread, and returns. At most one write is in flight: the next
    :meth:`save`, :meth:`wait`, :meth:`restore` or :meth:`close` waits for it
    and raises its error, on every rank. The copy costs as much CPU memory as
    the state.

    With ``handle_signals=True``, SIGTERM and SIGUSR1 (SLURM's pre-timeout
    signal) no longer kill the process; they make :meth:`should_stop` return
    True, on every rank at the same call. The previous handlers come back at
    :meth:`close`.

    Args:
        directory: Local folder or fsspec URL holding the step folders; on
            several nodes it must be shared storage that every rank can read.
        keep_last: Keep this many checkpoints with the highest steps (>= 1),
            or None to keep all.
        keep_best: Also keep this many with the best ``metric``.
        metric: Name of the metric (from ``save(metrics=...)``) ranking
            checkpoints for ``keep_best``.
        mode: ``"min"`` or ``"max"``: which ``metric`` values are best.
        async_save: Write in a background thread after a snapshot.
        format: ``"pt"`` (torch.save files) or ``"safetensors"`` (models as
            safetensors, the other entries as torch.save files).
        storage_options: fsspec options for URLs.
        handle_signals: Install the SIGTERM/SIGUSR1 handler (main thread only).
        timeout: Seconds (or ``timedelta``) a rank waits for the others in each
            collective; default ``DDPSTATE_TIMEOUT`` or 1800 s. Non-writing ranks
            wait this long for a synchronous write, too.
        safe_globals: Your own data-only types (an ``Enum``, a dataclass...) that
            plain values may hold. ``save`` refuses, before writing, any value
            that ``weights_only`` loading could not restore, naming its path;
            types listed here pass that check and are allowed at ``restore``.
            Needed only beyond the everyday ones: numpy scalars and numeric
            arrays, ``pathlib`` paths, ``datetime`` values, ``argparse.Namespace``,
            ``OrderedDict`` and ``defaultdict``. Pass the same list on every rank.
        local_dir: A node-local folder (``/dev/shm/ddpstate-<job id>``) for the
            fast tier written by :meth:`save_local`; None (default) turns it
            off. Name it per job: restore takes the newest step of any tier.
            It may differ between nodes (not between the ranks of one node).
        local_every: :meth:`save_local` writes the steps divisible by this.
        local_keep: Local steps kept on each node (the newest ones).
        writers: ``"rank0"`` (default): rank 0 writes replicated (DDP) models
            and optimizers; ``"all"``: every rank writes a part of them through
            ``torch.distributed.checkpoint`` (its planner splits the tensors by
            size). On one node it ties or loses to ``"rank0"`` (the ranks share
            CPUs and disk; see the README's DCP table); it can pay off where each
            rank has its own write bandwidth. Sharded state always uses every rank.

    Raises:
        DDPStateError: An argument is invalid, the ranks passed different
            arguments, or ``handle_signals=True`` outside the main thread.

    Example:
        >>> import tempfile, torch, ddpstate
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with ddpstate.CheckpointManager(tempfile.mkdtemp(), keep_last=2) as manager:
        ...     start = manager.restore({"model": model, "optimizer": opt})  # None: fresh run
        ...     for step in range(1, 4):
        ...         manager.save(step, {"model": model, "optimizer": opt})
        ...     manager.steps()
        [2, 3]
    """

    def __init__(
        self,
        directory: PathLike,
        *,
        keep_last: Optional[int] = 3,
        keep_best: int = 0,
        metric: Optional[str] = None,
        mode: str = "min",
        async_save: bool = False,
        format: str = "pt",
        storage_options: Optional[dict[str, Any]] = None,
        handle_signals: bool = False,
        timeout: Timeout = None,
        safe_globals: Sequence[Any] = (),
        local_dir: Optional[PathLike] = None,
        local_every: int = 1,
        local_keep: int = 2,
        writers: str = "rank0",
    ) -> None:
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise InvalidArgumentError(
                f"CheckpointManager: keep_last={keep_last!r} must be an int >= 1 (the newest "
                f"checkpoint is always kept) or None to keep every checkpoint"
            )
        if isinstance(keep_best, bool) or not isinstance(keep_best, int) or keep_best < 0:
            raise InvalidArgumentError(
                f"CheckpointManager: keep_best={keep_best!r} must be an int >= 0"
            )
        if keep_best and not metric:
            raise InvalidArgumentError(
                f"CheckpointManager: keep_best={keep_best} needs metric= (the name of the metric "
                f"passed to save(metrics=...) that ranks checkpoints)"
            )
        if mode not in ("min", "max"):
            raise InvalidArgumentError(f"CheckpointManager: mode={mode!r} must be 'min' or 'max'")
        if writers not in _dcp.WRITERS:
            raise InvalidArgumentError(
                f"CheckpointManager: writers={writers!r} must be 'rank0' (rank 0 writes models "
                f"and optimizers) or 'all' (every rank writes part, through "
                f"torch.distributed.checkpoint)"
            )
        format = parse_format(format, allowed=(PT, SAFETENSORS), what="CheckpointManager format")
        self.directory = os.fspath(directory)
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.metric = metric
        self.mode = mode
        self.async_save = bool(async_save)
        self.format = format
        self.writers = writers
        self.storage_options = storage_options
        self.timeout = timeout
        self.safe_globals: tuple[Any, ...] = _savecheck.check_safe_globals(
            safe_globals, "CheckpointManager"
        )
        self._closed = False
        self._pending: Optional[_Pending] = None
        self._dcp_group: Any = None  # background DCP writes' gloo group (_dcp.async_group)
        self._thread: Optional[threading.Thread] = None
        self._thread_error: Optional[BaseException] = None
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._metrics_cache: dict[int, dict[str, float]] = {}
        self._warned_newer = False
        # The step restore() loaded: saving it or a higher step rolls back the steps above.
        self._restored_step: Optional[int] = None
        self._stop_requested = False
        self._stop_signal: Optional[int] = None
        self._previous_handlers: dict[int, Any] = {}
        self._check_same_config()
        # The node-local tier (see _local_tier.py): off unless local_dir is given.
        self._local: Optional[_local_tier.LocalTier] = None
        self.restored_from: Optional[_local_tier.RestoreSource] = None
        if local_dir is not None:
            self._local = _local_tier.LocalTier(local_dir, local_every, local_keep, timeout)
        if handle_signals:
            self._install_signal_handlers()

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self.directory!r}, keep_last={self.keep_last}, "
            f"keep_best={self.keep_best}, metric={self.metric!r}, mode={self.mode!r}, "
            f"async_save={self.async_save}, format={self.format!r})"
        )

    # ------------------------------------------------------------------ public API

    def checkpoint_path(self, step: int) -> str:
        """Return the folder of ``step``'s checkpoint (whether or not it exists).

        Args:
            step: The training step.

        Returns:
            ``<directory>/step_<zero-padded step>``.

        Example:
            >>> import ddpstate
            >>> ddpstate.CheckpointManager("/tmp/run").checkpoint_path(42)
            '/tmp/run/step_0000000042'
        """
        return storage.join(self.directory, _step_name(_check_step(step)))

    def steps(self) -> list[int]:
        """Return the committed steps (their manifest exists), oldest first.

        Not a collective: this is this process's view of the folder (without
        verifying checksums). An async save still in flight is not listed.

        Returns:
            Sorted step numbers; empty when the folder does not exist.

        Example:
            >>> import tempfile, ddpstate
            >>> ddpstate.CheckpointManager(tempfile.mkdtemp()).steps()
            []
        """
        return sorted(self._committed_steps())

    def latest_step(self) -> Optional[int]:
        """Return the highest committed step, or None when there is none.

        Not a collective (see :meth:`steps`); :meth:`restore` is what all ranks
        agree on.

        Example:
            >>> import tempfile, ddpstate
            >>> ddpstate.CheckpointManager(tempfile.mkdtemp()).latest_step() is None
            True
        """
        found = self._committed_steps()
        return max(found) if found else None

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Optional[Mapping[str, Any]] = None,
        rollback: bool = False,
    ) -> None:
        """Save a checkpoint of ``state`` (plus every rank's RNG states) for ``step``.

        A collective. Synchronous mode returns once the checkpoint is committed
        and rotation is done; async mode returns after the snapshot. A step
        lower than committed ones is a rollback (it becomes the latest and the
        higher steps are deleted once it is committed) when this manager's
        :meth:`restore` loaded that step or a lower one, or with
        ``rollback=True``; otherwise it is refused, since the higher steps may
        be another run's in a reused folder. Models ``wrap_ddp``
        prepared with unsynced BatchNorm get their running statistics averaged
        across ranks first (:func:`~ddpstate.sync_batchnorm_stats`).

        Args:
            step: The training step (an int >= 0; names the folder).
            state: Entry name -> object with ``state_dict()`` or plain value.
            metrics: Name -> number, stored in the manifest; ``metric`` must be
                among them when ``keep_best`` is used.
            rollback: Allow deleting committed steps higher than ``step``
                without having restored ``step`` or a lower one.

        Raises:
            CheckpointWriteError: This write failed (synchronous mode), or the
                previous async write failed (raised before saving anything);
                the checkpoints committed before are untouched.
            InvalidArgumentError: ``step`` is below committed steps that are
                not a rollback (see above); nothing is written or deleted.
            DDPStateError: Invalid arguments, or the ranks passed different
                steps or entry names; a value ``restore`` could not load (named
                by its path, with the ``safe_globals`` way out) or a meta tensor,
                before anything is committed.
            ShardedStateError: A plain value holds FSDP2/tensor-parallel state
                (``DTensor``), or a sharded optimizer's model is not in ``state``;
                on every rank, before anything is written.
            BarrierTimeoutError: A rank did not reach the save in time.

        Example:
            >>> import tempfile, torch, ddpstate
            >>> manager = ddpstate.CheckpointManager(tempfile.mkdtemp())
            >>> model = torch.nn.Linear(2, 2)
            >>> manager.save(10, {"model": model, "epoch": 1}, metrics={"loss": 0.5})
            >>> manager.latest_step()
            10
        """
        self._check_open("save")
        self._finish_pending()
        step = _check_step(step)
        names = _check_state(state, "save")
        checked_metrics = _check_metrics(metrics)
        if self.keep_best and self.metric not in checked_metrics:
            raise InvalidArgumentError(
                f"CheckpointManager.save(step={step}): keep_best={self.keep_best} ranks "
                f"checkpoints by metric {self.metric!r}, but metrics= has "
                f"{sorted(checked_metrics) or 'nothing'}; pass metrics={{{self.metric!r}: value}}"
            )
        folder = self.checkpoint_path(step)
        # Sharded models and optimizers (every one with writers="all") are written by every
        # rank through torch.distributed.checkpoint (_dcp.py); sharded state anywhere else
        # is refused on every rank before anyone writes (rank 0 alone holds only its shards).
        dcp_kinds = _dcp.plan_entries(state, self.writers, folder)
        rest = {k: v for k, v in state.items() if k not in dcp_kinds}
        _check_not_sharded(rest, folder)
        batchnorm = self._batchnorm_checks(state)
        writer = get_rank() == _WRITER_RANK
        entries: dict[str, _Entry] = {}
        events: list[Any] = []
        local_error: Optional[Exception] = None
        refusal = ""
        if writer:
            try:
                refusal = self._rollback_refusal(step, rollback)
                if not refusal:
                    entries, events = self._collect(rest, snapshot=self.async_save)
                for name, entry in entries.items():
                    _savecheck.check_tensors(entry.value, f"state[{name!r}]", folder)
            except Exception as exc:
                if not is_distributed():
                    raise
                local_error = exc
        # One round: per-rank metadata and RNG states go to the writer only; it checks
        # that the ranks agree, writes (synchronous mode), and its verdict reaches
        # every rank.
        # The RNG states ride as one opaque blob per rank: the writer's check needs only
        # step and names, and unpickles the states when it writes them.
        rng = pickle.dumps(_rng_to_wire(capture_rng_state()))
        info = {
            "step": step,
            "names": sorted(names),
            "rng": rng,
            "batchnorm": batchnorm,
            "dcp": dcp_kinds,
        }
        # Models wrap_ddp prepared with unsynced BatchNorm are averaged before the write.
        # That is a collective of its own, so it runs only after the round has shown
        # that the ranks agree (step, entries, which models), and the write follows it.
        sync_first = any(fact == "sync" for fact in batchnorm.values())
        rng_blobs: list[bytes] = []
        causes: list[BaseException] = []

        def decide(infos: list[Any]) -> Optional[DDPStateError]:
            error = self._check_gathered(infos, step, folder, local_error)
            if error is None and refusal:
                error = InvalidArgumentError(refusal)
            if error is None:
                error = _dcp.kinds_disagree(infos, step)
            if error is None:
                error = self._check_batchnorm(state, folder, infos)
            if error is not None:
                causes.extend([local_error] if local_error is not None else [])
                return error
            rng_blobs.extend(i["rng"] for i in infos)
            if self.async_save or sync_first or dcp_kinds:
                return None
            try:
                self._write(step, entries, _rng_states(rng_blobs), checked_metrics)
            except Exception as exc:
                causes.append(exc)
                return self._write_failure(step, folder, [(_WRITER_RANK, _error_text(exc))])
            return None

        try:
            gather_and_decide(
                info,
                decide,
                dst=_WRITER_RANK,
                name=f"CheckpointManager.save(step={step})",
                timeout=self.timeout,
            )
        except DDPStateError as shared:
            if causes:
                raise shared from causes[0]
            raise
        if dcp_kinds:
            if sync_first:
                self._sync_batchnorm(state)
                if writer:  # the synced statistics
                    entries, events = self._collect(rest, snapshot=self.async_save)
            if self.async_save:  # written on the manager's own group in the background
                self._pending = _Pending(step, folder, shared=True)
                self._thread = _dcp.start_async_step(
                    self, step, state, dcp_kinds, entries, events, rng_blobs, checked_metrics
                )
                return
            _dcp.save_step(self, step, state, dcp_kinds, entries, rng_blobs, checked_metrics)
            return
        if sync_first:
            self._sync_batchnorm(state)
            if writer and self.async_save:
                entries, events = self._collect(state, snapshot=True)  # the synced statistics
            if not self.async_save:
                failure: Optional[DDPStateError] = None
                cause: Optional[BaseException] = None
                if writer:
                    try:
                        self._write(step, entries, _rng_states(rng_blobs), checked_metrics)
                    except Exception as exc:
                        cause = exc
                        failure = self._write_failure(
                            step, folder, [(_WRITER_RANK, _error_text(exc))]
                        )
                self._share_outcome(step, folder, failure, cause)
                return
        if self.async_save:
            self._pending = _Pending(step, folder)
            if writer:
                self._thread_error = None
                self._thread = threading.Thread(
                    target=self._write_in_thread,
                    args=(step, entries, rng_blobs, checked_metrics, events),
                    name=f"ddpstate-checkpoint-writer-step-{step}",
                    # Not a daemon: an interpreter exiting normally still finishes the write.
                    daemon=False,
                )
                self._thread.start()

    # ------------------------------------------------------------------ node-local tier

    def save_local(self, step: int, state: Mapping[str, Any]) -> bool:
        """Save ``state`` to the node-local tier when ``step`` is a multiple of ``local_every``.

        Meant to be called every step: other steps return at once, with no
        collective. On a due step it is a collective of one round (the ranks'
        RNG states travel through the store to each node's writer, which tells
        its node whether the write started): each node's local rank 0 copies the state
        into CPU memory kept between saves and writes it to ``local_dir`` in a
        background thread (manifest last, as durable steps), keeping the
        newest ``local_keep`` steps. It never raises for a failed local write
        (out of space, a folder that cannot be made, any write error): it
        warns once, skips that step on that node, and training goes on; the
        durable checkpoints are never touched. :meth:`save` stays the durable
        save, on your own schedule.

        Args:
            step: The training step (an int >= 0), the same on every rank.
            state: As for :meth:`save`.

        Returns:
            True when this rank's node started a local write for ``step``
            (the same on every rank of the node).

        Raises:
            DDPStateError: The manager has no ``local_dir``, or invalid arguments.

        Example:
            >>> import tempfile, torch, ddpstate
            >>> manager = ddpstate.CheckpointManager(
            ...     tempfile.mkdtemp(), local_dir=tempfile.mkdtemp(), local_every=2
            ... )
            >>> model = torch.nn.Linear(2, 2)
            >>> [manager.save_local(s, {"model": model}) for s in (1, 2)]
            [False, True]
            >>> manager.restore({"model": model}), str(manager.restored_from.tier)
            (2, 'local')
        """
        self._check_open("save_local")
        if self._local is None:
            raise InvalidArgumentError(
                "CheckpointManager.save_local: this manager has no node-local tier; pass "
                "local_dir='/dev/shm/ddpstate-<job id>' (and local_every=K) to CheckpointManager"
            )
        step = _check_step(step)
        _check_state(state, "save_local")
        return self._local.save(self, step, state)

    @property
    def local_skipped(self) -> list[tuple[int, str]]:
        """The local steps this rank's node skipped and why (empty without a node-local tier).

        On the node's writer (local rank 0) every skip, as soon as it is known;
        on its other ranks, those the writer knew at the last due save_local (a
        background write's failure is known at the next due save).
        """
        return [] if self._local is None else list(self._local.skipped)

    def clear_local(self) -> None:
        """Delete the node-local tier's folder on every node (for a fresh start).

        A collective: waits for the local write in flight, lets each node's
        local rank 0 delete ``local_dir``, then meets the other ranks. The
        durable checkpoints are untouched. :meth:`close` leaves the local tier
        in place for a restart; this is how it goes away. A no-op without a
        ``local_dir``.

        Example:
            >>> import os, tempfile, torch, ddpstate
            >>> local = os.path.join(tempfile.mkdtemp(), "shm")
            >>> manager = ddpstate.CheckpointManager(tempfile.mkdtemp(), local_dir=local)
            >>> manager.save_local(1, {"w": torch.ones(2)})
            True
            >>> manager.clear_local(); os.path.exists(local)
            False
        """
        self._check_open("clear_local")
        if self._local is None:
            return
        self._local.clear()
        if is_distributed():
            barrier(timeout=self.timeout, name="CheckpointManager.clear_local")

    def wait(self) -> None:
        """Wait for the async writes in flight; raise a failed durable write's error on every rank.

        A local-tier write (:meth:`save_local`) is waited for too; its failure is only a warning.

        A collective (a no-op on every rank when nothing is in flight).

        Raises:
            CheckpointWriteError: The background write failed.

        Example:
            >>> import tempfile, torch, ddpstate
            >>> manager = ddpstate.CheckpointManager(tempfile.mkdtemp(), async_save=True)
            >>> manager.save(1, {"w": torch.ones(2)})
            >>> manager.wait()
            >>> manager.steps()
            [1]
        """
        self._check_open("wait")
        if self._local is not None:
            self._local.wait()  # never raises for the local tier: a failure is a warning
        self._finish_pending()

    def restore(
        self,
        state: MutableMapping[str, Any],
        *,
        step: Optional[int] = None,
        map_location: Any = "auto",
        strict: bool = True,
        ignore_mismatched: bool = False,
    ) -> Optional[int]:
        """Load the newest valid checkpoint (or ``step``'s) into ``state``; return its step.

        A collective. Rank 0 verifies the candidates newest first, exactly as
        :func:`verify_checkpoint` does (manifest present and intact, every
        file's size and CRC-32, no unlisted checkpoint file), warns about each
        one it skips and why, and broadcasts its choice; every rank then loads
        that checkpoint. With several ranks, rank 0 reads the manifest and
        every rank checks a share of the files (balanced by size). Objects
        with ``load_state_dict`` are loaded in place (models through
        :func:`ddpstate.keys.adapt_state_dict`, so any wrapping works); plain
        values are written back into ``state`` (the dict is updated in place,
        as ``torch.distributed.checkpoint.load`` does). Each rank restores its
        own RNG states.

        With a ``local_dir`` and no ``step``, the node-local tier answers first:
        each node's local rank 0 verifies its newest local step, and the ranks
        restore the newest local step any node holds (a node that lacks it
        receives it from one that has it, over the process group), unless the
        durable tier has a newer committed step or no node has a complete
        local step. :attr:`restored_from` says, on each rank, which tier and
        step it came from.

        If the world size changed since the save, a warning says so and ranks
        ``r < saved world size`` restore rank ``r``'s saved RNG states, while
        each rank ``r >=`` the saved world size restores rank ``r % saved``'s
        states and then re-seeds all generators from a hash of them and ``r``
        (so no two ranks draw the same numbers).

        Args:
            state: Entry name -> live object (or placeholder for a plain value).
            step: Restore exactly this step (no fallback) instead of the newest.
            map_location: Where tensors load (as :func:`ddpstate.load`);
                ``"auto"`` is this rank's device.
            strict: Raise when ``state`` and the checkpoint have different entries.
            ignore_mismatched: In models, skip tensors whose shape differs from
                the live model's (it keeps its own values there), e.g. a classifier
                head resized for fine-tuning; a warning names them. Optimizers in
                ``state`` drop their saved state for those parameters (another
                warning), so the first step after restore works.

        Returns:
            The restored step, or None when the folder has no checkpoint yet.

        Raises:
            CheckpointNotFoundError: ``step`` was given and has no checkpoint.
            CheckpointCorruptError: ``step`` was given and fails verification,
                or checkpoints exist but none verifies.
            KeyMismatchError: ``strict`` and the entries differ, or a model's
                keys do not match.
            ShapeMismatchError: A model's tensors have other shapes than the
                live model's (the same error ``load_model_state`` raises).
            UnsafeCheckpointError: A value needs a type not allowed by ``safe_globals``.
            DDPStateError: Loading an entry failed on some rank (named).

        Example:
            >>> import tempfile, torch, ddpstate
            >>> manager = ddpstate.CheckpointManager(tempfile.mkdtemp())
            >>> model = torch.nn.Linear(2, 2)
            >>> manager.save(5, {"model": model, "epoch": 3})
            >>> state = {"model": torch.nn.Linear(2, 2), "epoch": 0}
            >>> manager.restore(state), state["epoch"]
            (5, 3)
        """
        self._check_open("restore")
        self._finish_pending()
        names = _check_state(state, "restore")
        if step is not None:
            step = _check_step(step)
        # The node-local tier answers first when it holds a step at least as new as the durable
        # (a collective: every rank gets the same answer).
        local = self._local.choose(self) if self._local is not None and step is None else None
        choice: Optional[tuple[int, dict[str, Any]]] = None
        if local is not None and local[0].step is not None:
            choice = (local[0].step, local[1])
        choose_error: Optional[Exception] = None
        # Several ranks: each checksums a share of the candidate's files (_verify_split).
        split = local is None and is_distributed() and get_world_size() > 1
        if local is None and get_rank() == 0:
            try:
                choice = self._choose(step, split)
            except Exception as exc:
                if not is_distributed():
                    raise
                choose_error = exc
            finally:
                if split:
                    _verify_split.finish(self.timeout)
        elif split:
            _verify_split.follow(self.storage_options, self.timeout)
        if local is None:
            share_outcome(choose_error, name="CheckpointManager.restore", timeout=self.timeout)
            choice = broadcast_object(choice, src=0, timeout=self.timeout)
        if choice is None:
            self.restored_from = _local_tier.RestoreSource(None, "none")
            return None
        chosen_step, manifest = choice
        folder = self.checkpoint_path(chosen_step) if local is None else str(local[0].path)
        saved_entries: dict[str, Any] = manifest["entries"]
        missing = [n for n in names if n not in saved_entries]
        unexpected = [n for n in saved_entries if n not in names]
        if strict and (missing or unexpected):
            raise KeyMismatchError(
                f"CheckpointManager.restore: {folder} has entries {sorted(saved_entries)}, but "
                f"state has {sorted(names)} (missing from the checkpoint: {missing}; not in "
                f"state: {unexpected}); pass strict=False to restore the common entries",
                missing=missing,
                unexpected=unexpected,
            )
        error: Optional[Exception] = None
        try:
            # The local tier is node-local memory: map it instead of copying (see _load_into).
            self._load_into(
                state, folder, manifest, map_location, ignore_mismatched, mmap=local is not None
            )
        except Exception as exc:
            if not is_distributed():
                raise
            error = exc
        self._share_restore_outcome(chosen_step, error)
        durable = _local_tier.RestoreSource(chosen_step, "durable", folder)
        self.restored_from = local[0] if local is not None else durable
        self._restored_step = int(chosen_step)
        return int(chosen_step)

    def should_stop(self) -> bool:
        """Tell whether any rank received SIGTERM/SIGUSR1 (with ``handle_signals=True``).

        A collective: every rank gets the same answer at the same call, so all
        of them save at the same step and leave the loop together. Once True,
        it stays True. Cheap enough for every step: one ``all_reduce`` of a
        one-element tensor on the backend's device (gloo: CPU; NCCL: this
        rank's GPU), no store traffic; it waits as long as the process group's
        own timeout.

        Returns:
            True when some rank was asked to stop.

        Example:
            >>> import tempfile, ddpstate
            >>> ddpstate.CheckpointManager(tempfile.mkdtemp()).should_stop()
            False
        """
        self._check_open("should_stop")
        # Return the agreed answer, not the flag: a signal landing after the all-reduce
        # must not make this rank alone stop now (it is seen at the next call).
        stop = all_reduce_flag(self._stop_requested)
        if stop:
            self._stop_requested = True
        return stop

    def close(self) -> None:
        """Finish the async write in flight, restore signal handlers, free the snapshot buffers.

        A collective when a write is in flight. Calling it again does nothing.

        Raises:
            CheckpointWriteError: The last background write failed (on every rank).

        Example:
            >>> import tempfile, ddpstate
            >>> manager = ddpstate.CheckpointManager(tempfile.mkdtemp())
            >>> manager.close()
        """
        if self._closed:
            return
        try:
            self._finish_pending()
        finally:
            self._release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if exc_type is None:
            self.close()
            return
        # The block failed, possibly on this rank only: no collective (it could hang
        # on ranks that went on), but the write in flight still completes.
        if self._thread is not None:
            self._thread.join()
            if self._thread_error is not None and exc is not None:
                note = getattr(exc, "add_note", None)
                if note is not None:
                    note(f"the async checkpoint write also failed: {self._thread_error!r}")
        self._pending = None
        self._release()

    # ------------------------------------------------------------------ lifecycle helpers

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise InvalidArgumentError(
                f"CheckpointManager.{what}: the manager for {self.directory} is closed"
            )

    def _release(self) -> None:
        self._closed = True
        _dcp.release_group(self)
        if self._local is not None:
            self._local.close()
        self._thread = None
        self._buffers.clear()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _check_same_config(self) -> None:
        if not is_distributed():
            return
        config = (
            self.directory,
            self.keep_last,
            self.keep_best,
            self.metric,
            self.mode,
            self.async_save,
            self.format,
            self.writers,
        )
        gathered = compare_across_ranks(config, name="CheckpointManager(...)", timeout=self.timeout)
        if gathered is not None:
            differing = [r for r, c in enumerate(gathered) if c != gathered[0]]
            raise InvalidArgumentError(
                f"CheckpointManager: rank(s) {differing} were created with different arguments "
                f"than rank 0 ({gathered[differing[0]]!r} vs {gathered[0]!r}); every rank must "
                f"pass the same directory and options (no per-rank timestamps in the path)"
            )

    # ------------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError(
                "CheckpointManager(handle_signals=True) must be created in the main thread: "
                "Python delivers signals only there"
            )
        for name in ("SIGTERM", "SIGUSR1"):
            signum = getattr(signal, name, None)
            if signum is not None:
                self._previous_handlers[int(signum)] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        # Only a flag: the loop saves at the next should_stop(), at a step boundary.
        self._stop_requested = True
        self._stop_signal = signum

    # ------------------------------------------------------------------ snapshot

    def _collect(
        self, state: Mapping[str, Any], *, snapshot: bool
    ) -> tuple[dict[str, _Entry], list[Any]]:
        """Turn ``state`` into what gets written; with ``snapshot`` every tensor is copied.

        Returns the entries and the CUDA events the writer must wait on before
        reading the copies.
        """
        entries: dict[str, _Entry] = {}
        for name, obj in state.items():
            if isinstance(obj, nn.Module):
                entry = _Entry(_KIND_MODULE, normalize_keys(unwrap_model(obj).state_dict()))
            elif _has_state_dict(obj):
                entry = _Entry(_KIND_STATEFUL, obj.state_dict())
            else:
                entry = _Entry(_KIND_VALUE, obj)
            entries[name] = entry
        if not snapshot:
            return entries, []
        used: set[tuple[Any, ...]] = set()
        memo: dict[int, Any] = {}
        events: list[Any] = []
        copied = {
            name: _Entry(e.kind, self._copy(e.value, (name,), used, memo, events))
            for name, e in entries.items()
        }
        for key in [k for k in self._buffers if k not in used]:
            del self._buffers[key]
        return copied, events

    def _copy(
        self,
        obj: Any,
        path: tuple[Any, ...],
        used: set[tuple[Any, ...]],
        memo: dict[int, Any],
        events: list[Any],
    ) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) in memo:  # tied tensors stay tied in the snapshot
                return memo[id(obj)]
            copied = self._copy_tensor(obj, path, used, events)
            memo[id(obj)] = copied
            return copied
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
        events: list[Any],
    ) -> torch.Tensor:
        t = tensor.detach()
        if t.layout != torch.strided or t.is_quantized or t.device.type not in ("cpu", "cuda"):
            return t.to("cpu", copy=True)
        on_cuda = t.device.type == "cuda"
        buffer = self._buffers.get(path)
        if (
            buffer is None
            or buffer.shape != t.shape
            or buffer.dtype != t.dtype
            or (on_cuda and not buffer.is_pinned())
        ):
            buffer = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=on_cuda)
            self._buffers[path] = buffer
        used.add(path)
        # The copy is queued on the training stream, so later kernels that change
        # the tensor run after it; the writer thread waits on the event before reading.
        buffer.copy_(t, non_blocking=on_cuda)
        if on_cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(t.device))
            events.append(event)
        return buffer

    # ------------------------------------------------------------------ writing (rank 0)

    def _write_in_thread(
        self,
        step: int,
        entries: dict[str, _Entry],
        rng_blobs: list[bytes],
        metrics: dict[str, float],
        events: list[Any],
    ) -> None:
        try:
            for event in events:
                event.synchronize()
            self._write(step, entries, _rng_states(rng_blobs), metrics)
        except BaseException as exc:
            self._thread_error = exc

    def _write(
        self,
        step: int,
        entries: dict[str, _Entry],
        rng_states: list[Any],
        metrics: dict[str, float],
        prepared: Optional[str] = None,
        written: Optional[tuple[dict[str, dict[str, Any]], dict[str, dict[str, str]]]] = None,
    ) -> None:
        """Write and commit a step; ``prepared`` and ``written`` come from a DCP save (_dcp.py):
        the folder every rank wrote into, and the (files, entries) they wrote there."""
        opts = self.storage_options
        target = self.checkpoint_path(step)
        folder = self._prepare_folder(step) if prepared is None else prepared
        try:
            files: dict[str, dict[str, Any]] = dict(written[0]) if written else {}
            manifest_entries: dict[str, dict[str, str]] = dict(written[1]) if written else {}
            for name, entry in entries.items():
                as_safetensors = (
                    self.format == SAFETENSORS
                    and entry.kind == _KIND_MODULE
                    and _is_flat_tensor_dict(entry.value)
                )
                filename = name + (".safetensors" if as_safetensors else ".pt")
                files[filename] = self._write_file(
                    storage.join(folder, filename), entry.value, as_safetensors, f"state[{name!r}]"
                )
                manifest_entries[name] = {"file": filename, "kind": entry.kind}
            rng_payload = {"world_size": len(rng_states), "ranks": rng_states}
            files[RNG_FILE] = self._write_file(
                storage.join(folder, RNG_FILE), rng_payload, False, "RNG states"
            )
            data = _manifest_for(step, metrics, len(rng_states), manifest_entries, files)
            with storage.atomic_write(
                storage.join(folder, MANIFEST_NAME), storage_options=opts
            ) as f:
                f.write(data)
            if folder != target:
                storage.replace_folder(folder, target)
        except BaseException as exc:
            self._discard(folder, exc)
            raise
        self._metrics_cache[step] = metrics
        # A save of an older step is a rollback (save() checked it is one): now that it
        # is committed, `latest` names it, then the newer steps are uncommitted (oldest
        # first, so restore() takes either the old newest or this step, never one in
        # between). `latest` first: if writing it fails, nothing was uncommitted yet.
        newer = sorted(s for s in self._committed_steps() if s > step)
        latest = storage.join(self.directory, LATEST_NAME)
        try:
            with storage.atomic_write(latest, storage_options=opts) as f:
                f.write((_step_name(step) + "\n").encode())
        except Exception as exc:
            kept = f"; steps {newer} are still committed, so restore() takes step {max(newer)}"
            raise CheckpointWriteError(
                f"step {step} {_COMMITTED_BUT} writing {latest} failed ({_error_text(exc)})"
                + (kept if newer else "")
            ) from exc
        for s in newer:
            self._uncommit(s, step)
        for s in newer:
            self._delete_step(s, step)
        self._rotate(step)

    def _prepare_folder(self, step: int) -> str:
        """Rank 0: clean up crashed saves and create the folder ``step`` is written into."""
        opts = self.storage_options
        storage.makedirs(self.directory, storage_options=opts)
        self._clean_stale(step)
        target = self.checkpoint_path(step)
        folder = target
        if storage.exists(target, storage_options=opts):
            if not storage.isdir(target, storage_options=opts):
                raise CheckpointWriteError(
                    f"{target} exists and is not a folder, so step {step} cannot be saved there; "
                    f"move that file away (ddpstate never deletes files it did not write)"
                )
            if _fs.is_remote(target):
                # Object stores cannot swap folders: uncommit the old copy first.
                storage.remove(
                    storage.join(target, MANIFEST_NAME), storage_options=opts, missing_ok=True
                )
                storage.remove(target, storage_options=opts, recursive=True)
            else:
                # Re-saving a step: write beside it, then swap, so the old copy stays
                # committed until the new one is.
                folder = storage.temp_path_for(target)
        storage.makedirs(folder, storage_options=opts)
        return folder

    def _discard(self, folder: str, exc: BaseException) -> None:
        """Delete the uncommitted folder of a failed save (the next save would anyway)."""
        try:
            storage.remove(
                folder, storage_options=self.storage_options, recursive=True, missing_ok=True
            )
        except Exception as cleanup_exc:
            note = getattr(exc, "add_note", None)
            if note is not None:
                note(f"removing the unfinished {folder} also failed: {cleanup_exc!r}")

    def _write_file(self, path: str, obj: Any, as_safetensors: bool, what: str) -> dict[str, Any]:
        with storage.atomic_write(path, storage_options=self.storage_options) as raw:
            writer = _ChecksumWriter(raw)
            try:
                if as_safetensors:
                    write_safetensors(writer, obj, name=path)  # type: ignore[arg-type]
                else:
                    _savecheck.save_torch(
                        obj,
                        writer,  # type: ignore[arg-type]
                        what=what,
                        where=path,
                        extra=self.safe_globals,
                    )
            except Exception as exc:
                if writer.error is not None and writer.error is not exc:
                    raise writer.error from exc
                raise
        return {"size": writer.size, "crc32": _checksum_hex(writer.crc)}

    def _clean_stale(self, step: int) -> None:
        """Delete temporary files and uncommitted step folders left by crashed saves."""
        opts = self.storage_options
        kw: dict[str, Any] = {"storage_options": opts}
        for name in storage.listdir(self.directory, storage_options=opts, include_temp=True):
            path = storage.join(self.directory, name)
            if storage.is_temp_name(name):
                original = storage.retired_original(name)
                if (
                    original is not None
                    and _parse_step(original) is not None
                    and not storage.exists(storage.join(self.directory, original), **kw)
                    and storage.exists(storage.join(path, MANIFEST_NAME), **kw)
                ):
                    # A re-save crashed between its two renames: put the old copy back.
                    os.rename(path, storage.join(self.directory, original))
                    continue
                storage.remove(path, storage_options=opts, recursive=True, missing_ok=True)
                continue
            found = _parse_step(name)
            if found is None or not storage.isdir(path, storage_options=opts):
                continue
            if not storage.exists(storage.join(path, MANIFEST_NAME), storage_options=opts):
                storage.remove(path, storage_options=opts, recursive=True, missing_ok=True)
                continue
            for inner in storage.listdir(path, storage_options=opts, include_temp=True):
                if storage.is_temp_name(inner):
                    storage.remove(storage.join(path, inner), storage_options=opts, missing_ok=True)
            if found > step and not self._warned_newer:
                self._warned_newer = True
                warnings.warn(
                    f"CheckpointManager: saving step {step}, but {path} (a higher step) already "
                    f"exists: this save is a rollback. Once step {step} is committed, it becomes "
                    f"latest and every higher step is deleted",
                    UserWarning,
                    stacklevel=4,
                )

    def _rotate(self, newest: int) -> None:
        committed = sorted(self._committed_steps(), reverse=True)
        keep = {newest}
        keep.update(committed if self.keep_last is None else committed[: self.keep_last])
        if self.keep_best:
            scored = []
            for s in committed:
                value = self._metrics_for(s).get(str(self.metric))
                if value is not None and not math.isnan(value):
                    scored.append((value if self.mode == "min" else -value, -s, s))
            keep.update(s for _, _, s in sorted(scored)[: self.keep_best])
        for s in committed:
            if s in keep:
                continue
            # Manifest first: a crash midway leaves an uncommitted folder, never a
            # committed one with files missing.
            self._uncommit(s, newest)
            self._delete_step(s, newest)

    def _rollback_refusal(self, step: int, rollback: bool) -> str:
        """Rank 0: why saving ``step`` must not delete the higher committed steps, or ""."""
        higher = sorted(s for s in self._committed_steps() if s > step)
        restored = self._restored_step
        if not higher or rollback or (restored is not None and restored <= step):
            return ""
        came = "never restored" if restored is None else f"restored step {restored}"
        return (
            f"CheckpointManager.save(step={step}): {self.directory} already has committed steps "
            f"{higher} above it, and this manager {came}, so they may be another run's (a "
            f"reused folder). Saving step {step} would roll back: delete them. To roll back on "
            f"purpose, pass save({step}, ..., rollback=True) or restore(step=N) with N <= "
            f"{step} first; otherwise save into another folder or continue above step "
            f"{higher[-1]}. Nothing was written or deleted"
        )

    def _batchnorm_checks(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's BatchNorm facts per model entry, sent in ``save``'s agreement exchange.

        ``"sync"`` for a ``wrap_ddp`` model with unsynced statistics, else its
        :func:`~ddpstate.batchnorm.stats_checksums` (None: nothing to compare).
        Not a collective.
        """
        from ddpstate.batchnorm import stats_checksums, wrapped_unsynced

        return {
            name: "sync" if wrapped_unsynced(obj) else stats_checksums(obj)
            for name, obj in state.items()
            if isinstance(obj, nn.Module)
        }

    def _check_batchnorm(
        self, state: Mapping[str, Any], folder: str, gathered: list[Any]
    ) -> Optional[DDPStateError]:
        """The writer, inside save's round: the ranks must agree on which models to sync.

        For the other models it warns (once per model) when the ranks' BatchNorm
        statistics differ, since the file would hold rank 0's alone.
        """
        from ddpstate.batchnorm import warn_if_checksums_differ

        for name, obj in state.items():
            if not isinstance(obj, nn.Module):
                continue
            facts = [g["batchnorm"].get(name) for g in gathered]
            syncing = [r for r, fact in enumerate(facts) if fact == "sync"]
            if syncing and len(syncing) != len(facts):
                return InvalidArgumentError(
                    f"CheckpointManager.save: entry {name!r} was prepared by wrap_ddp with "
                    f"unsynced BatchNorm on rank(s) {syncing} but not on the others; prepare "
                    f"the model the same way on every rank"
                )
            if not syncing:
                warn_if_checksums_differ(obj, facts, where=f"{folder} (entry {name!r})")
        return None

    def _sync_batchnorm(self, state: Mapping[str, Any]) -> None:
        """Every rank, after save's round: average the statistics of unsynced wrap_ddp models."""
        from ddpstate.batchnorm import sync_batchnorm_stats, wrapped_unsynced

        given = self.timeout
        timeout = given.total_seconds() if isinstance(given, timedelta) else given
        for obj in state.values():
            if isinstance(obj, nn.Module) and wrapped_unsynced(obj):
                sync_batchnorm_stats(obj, timeout=timeout)

    def _uncommit(self, step: int, newest: int) -> None:
        folder = self.checkpoint_path(step)
        try:
            storage.remove(
                storage.join(folder, MANIFEST_NAME),
                storage_options=self.storage_options,
                missing_ok=True,
            )
        except Exception as exc:
            raise CheckpointWriteError(
                f"step {newest} {_COMMITTED_BUT} deleting the old checkpoint {folder} "
                f"failed ({_error_text(exc)}); delete it by hand"
            ) from exc

    def _delete_step(self, step: int, newest: int) -> None:
        folder = self.checkpoint_path(step)
        try:
            storage.remove(
                folder, storage_options=self.storage_options, recursive=True, missing_ok=True
            )
        except Exception as exc:
            raise CheckpointWriteError(
                f"step {newest} {_COMMITTED_BUT} deleting the old checkpoint {folder} "
                f"failed ({_error_text(exc)}); delete it by hand"
            ) from exc
        self._metrics_cache.pop(step, None)

    def _metrics_for(self, step: int) -> dict[str, float]:
        if step not in self._metrics_cache:
            manifest, _ = self._read_manifest(self.checkpoint_path(step))
            raw = manifest.get("metrics", {}) if manifest else {}
            self._metrics_cache[step] = {
                str(k): float(v) for k, v in raw.items() if isinstance(v, (int, float))
            }
        return self._metrics_cache[step]

    # ------------------------------------------------------------------ outcomes

    def _check_gathered(
        self, gathered: list[Any], step: int, folder: str, local_error: Optional[Exception]
    ) -> Optional[DDPStateError]:
        """The writer's verdict on the gathered metadata: None, or the error every rank raises."""
        if local_error is not None:
            message = (
                f"saving step {step} to {folder} failed before writing: rank {_WRITER_RANK}: "
                f"{_error_text(local_error)}; nothing was written"
            )
            if isinstance(local_error, DDPStateError):
                return with_message(local_error, message)
            return CheckpointWriteError(message)
        steps = [g["step"] for g in gathered]
        if len(set(steps)) > 1:
            return InvalidArgumentError(
                f"CheckpointManager.save: the ranks passed different steps "
                f"({', '.join(f'rank {r}: {s}' for r, s in enumerate(steps))}); every rank must "
                f"save the same step at the same time"
            )
        names = [g["names"] for g in gathered]
        differing = [r for r, n in enumerate(names) if n != names[0]]
        if differing:
            return InvalidArgumentError(
                f"CheckpointManager.save(step={step}): rank(s) {differing} passed state entries "
                f"{names[differing[0]]} but rank 0 passed {names[0]}; pass the same names on "
                f"every rank"
            )
        return None

    def _write_failure(
        self, step: int, folder: str, failures: list[tuple[int, str]]
    ) -> CheckpointWriteError:
        detail = "; ".join(f"rank {r}: {m}" for r, m in failures)
        if any(_COMMITTED_BUT in m for _, m in failures):
            # The step itself was committed and a later part failed: the folder changed.
            outcome = (
                f"run `ddpstate verify {self.directory}` to see what is committed; restore() "
                f"takes the newest committed step that verifies"
            )
        else:
            outcome = "the checkpoints committed before it are untouched"
        return CheckpointWriteError(
            f"saving step {step} to {folder} failed ({detail}); {outcome}. Check free space, "
            f"permissions and that {self.directory} is a writable folder"
        )

    def _share_outcome(
        self,
        step: int,
        folder: str,
        error: Optional[DDPStateError],
        cause: Optional[BaseException] = None,
    ) -> None:
        """Raise ``error`` (the writer's) on every rank, or return on every rank."""
        if not is_distributed():
            if error is not None:
                raise error from cause
            return
        try:
            share_outcome(error, name=f"CheckpointManager.save(step={step})", timeout=self.timeout)
        except DDPStateError as shared:
            if cause is not None and shared.__cause__ is error:
                raise shared from cause
            raise

    def _finish_pending(self) -> None:
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        error: Optional[BaseException] = None
        if self._thread is not None:
            self._thread.join()
            error = self._thread_error
            self._thread = None
            self._thread_error = None
        if error is not None and not isinstance(error, Exception):
            raise error  # KeyboardInterrupt or SystemExit inside the writer
        failure = (
            None
            if error is None
            else error
            if pending.shared and isinstance(error, DDPStateError)
            else self._write_failure(pending.step, pending.folder, [(0, _error_text(error))])
        )
        self._share_outcome(pending.step, pending.folder, failure, error)

    def _share_restore_outcome(self, step: int, error: Optional[Exception]) -> None:
        if error is None:
            shared: Optional[DDPStateError] = None
        else:
            text = f"restoring step {step} failed on rank {get_rank()}: {error}"
            shared = (
                with_message(error, text)
                if isinstance(error, DDPStateError)
                else DDPStateError(f"{text} ({type(error).__name__})")
            )
        try:
            share_outcome(
                shared, name=f"CheckpointManager.restore(step={step})", timeout=self.timeout
            )
        except DDPStateError as raised:
            if error is not None:
                raise raised from error
            raise

    # ------------------------------------------------------------------ reading

    def _committed_steps(self) -> list[int]:
        opts = self.storage_options
        if not storage.isdir(self.directory, storage_options=opts):
            return []
        found = []
        for name in storage.listdir(self.directory, storage_options=opts):
            s = _parse_step(name)
            if s is not None and storage.exists(
                storage.join(self.directory, name, MANIFEST_NAME), storage_options=opts
            ):
                found.append(s)
        return found

    def _read_manifest(self, folder: str) -> tuple[Optional[dict[str, Any]], Optional[str]]:
        return _read_manifest(folder, self.storage_options)

    def _verify(
        self, folder: str, step: int, split: bool = False
    ) -> tuple[Optional[dict[str, Any]], Optional[str]]:
        """Check a step folder as :func:`verify_checkpoint` does; return (manifest, problems).

        With ``split`` (rank 0 of several), every rank checksums a share of the files.
        """
        if split:
            return _verify_split.verify(folder, step, self.storage_options, self.timeout)
        check = _check_folder(folder, step, self.storage_options)
        if check.manifest is None:
            return None, "; ".join(check.problems)
        return check.manifest, None

    def _choose(
        self, step: Optional[int], split: bool = False
    ) -> Optional[tuple[int, dict[str, Any]]]:
        """Rank 0: pick the checkpoint to restore (see :meth:`restore`).

        ``split``: the other ranks help verify (see :meth:`_verify`).
        """
        opts = self.storage_options
        if step is not None:
            folder = self.checkpoint_path(step)
            if not storage.exists(folder, storage_options=opts):
                raise CheckpointNotFoundError(
                    f"{folder}: no checkpoint for step {step}; committed steps in "
                    f"{self.directory}: {self.steps()}"
                )
            manifest, problem = self._verify(folder, step, split)
            if manifest is None:
                raise CheckpointCorruptError(
                    f"{folder}: cannot restore step {step}: {problem}. Restore another step, or "
                    f"pass step=None to take the newest valid checkpoint"
                )
            return step, manifest
        if not storage.isdir(self.directory, storage_options=opts):
            return None
        candidates = sorted(
            (
                s
                for s in map(_parse_step, storage.listdir(self.directory, storage_options=opts))
                if s is not None
            ),
            reverse=True,
        )
        skipped: list[tuple[str, str]] = []
        committed_bad = 0
        for s in candidates:
            folder = self.checkpoint_path(s)
            if not storage.isdir(folder, storage_options=opts):
                continue
            manifest, problem = self._verify(folder, s, split)
            if manifest is not None:
                for bad_folder, why in skipped:
                    warnings.warn(
                        f"CheckpointManager.restore: skipping {bad_folder}: {why}; restoring "
                        f"step {s} instead",
                        UserWarning,
                        stacklevel=3,
                    )
                return s, manifest
            skipped.append((folder, str(problem)))
            if storage.exists(storage.join(folder, MANIFEST_NAME), storage_options=opts):
                committed_bad += 1
        if committed_bad:
            listing = "; ".join(f"{f}: {why}" for f, why in skipped)
            raise CheckpointCorruptError(
                f"CheckpointManager.restore: {self.directory} has checkpoints, but none verifies "
                f"({listing}). Move the folder away to start fresh, or repair the files"
            )
        for bad_folder, why in skipped:
            warnings.warn(
                f"CheckpointManager.restore: ignoring {bad_folder}: {why}; no checkpoint to "
                f"restore",
                UserWarning,
                stacklevel=3,
            )
        return None

    def _load_into(
        self,
        state: MutableMapping[str, Any],
        folder: str,
        manifest: dict[str, Any],
        map_location: Any,
        ignore_mismatched: bool = False,
        mmap: bool = False,
    ) -> None:
        opts = self.storage_options
        saved_entries: dict[str, Any] = manifest["entries"]
        # Entries in the step's DCP checkpoint load first, on every rank together.
        dcp_kinds = {
            n: saved_entries[n]["kind"]
            for n in state
            if n in saved_entries and saved_entries[n].get("kind") in _dcp.KINDS
        }
        if dcp_kinds:
            _dcp.restore_entries(state, dcp_kinds, folder, ignore_mismatched)
        loaded: dict[str, Any] = {}
        for name in state:
            if name in saved_entries and name not in dcp_kinds:
                path = storage.join(folder, saved_entries[name]["file"])
                # No mmap on the durable tier: a later rotation deletes these files, and on
                # a shared filesystem another node's mapped pages could then vanish (SIGBUS).
                # A local file unlinked on this node keeps its pages while mapped.
                loaded[name] = checkpoint.load(
                    path,
                    map_location=map_location,
                    mmap=mmap,
                    barrier=False,
                    storage_options=opts,
                    safe_globals=self.safe_globals,
                )
        rng = checkpoint.load(
            storage.join(folder, str(manifest.get("rng_file", RNG_FILE))),
            map_location="cpu",
            mmap=False,
            barrier=False,
            storage_options=opts,
        )
        # Parameters ignore_mismatched skipped: optimizers must not get their old
        # per-parameter state (it has the old shape), so models load first.
        skipped: set[int] = set()
        in_order = sorted(loaded, key=lambda n: not isinstance(state[n], nn.Module))
        for name in in_order:
            value = loaded[name]
            target = state[name]
            file = storage.join(folder, saved_entries[name]["file"])
            if isinstance(target, nn.Module):
                if not isinstance(value, Mapping):
                    raise InvalidArgumentError(
                        f"{file}: entry {name!r} holds a {type(value).__name__}, not a state "
                        f"dict, so it cannot be loaded into {type(target).__name__}"
                    )
                adapted = adapt_state_dict(value, target)
                keys = model_state.load_fitting(
                    target,
                    adapted,
                    name=f"{file} (entry {name!r})",
                    strict=True,
                    ignore_mismatched=ignore_mismatched,
                )
                params = dict(target.named_parameters())
                skipped.update(id(params[k]) for k in keys if k in params)
            elif _has_state_dict(target):
                if skipped and isinstance(target, torch.optim.Optimizer):
                    value = _without_skipped(value, target, skipped, f"{file} (entry {name!r})")
                try:
                    target.load_state_dict(value)
                except DDPStateError:
                    raise
                except Exception as exc:
                    raise InvalidArgumentError(
                        f"{file}: restoring {name!r} into {type(target).__name__} failed "
                        f"({_error_text(exc)}); was it saved from the same kind of object?"
                    ) from exc
            else:
                state[name] = value
        self._restore_rng(rng, manifest)

    def _restore_rng(self, rng: Any, manifest: dict[str, Any]) -> None:
        states = rng.get("ranks") if isinstance(rng, dict) else None
        if not isinstance(states, list) or not states:
            raise CheckpointCorruptError(
                f"{RNG_FILE} of step {manifest.get('step')} has no RNG states"
            )
        saved_world, rank, world = len(states), get_rank(), get_world_size()
        if saved_world == world:
            restore_rng_state(states[rank])
            return
        if rank == 0:
            warnings.warn(
                f"CheckpointManager.restore: step {manifest.get('step')} was saved by "
                f"{saved_world} ranks and is restored by {world}: ranks below {saved_world} "
                f"restore their own saved RNG states; a rank r >= {saved_world} restores rank "
                f"r % {saved_world}'s and re-seeds every generator from it and r",
                UserWarning,
                stacklevel=4,
            )
        base = states[rank % saved_world]
        restore_rng_state(base)
        if rank >= saved_world:
            seed_all(derived_seed(base, rank))
