"""Step folders, manifests and their verification: the torch-free half of the manager.

A :class:`~ddpstate.CheckpointManager` step folder is committed by its
``manifest.json`` (written last), which records each file's size and CRC-32
and its own CRC-32. This module knows that layout: step folder names, the
``latest`` pointer, the manifest's bytes, the DCP file names a manifest may
list, and :func:`verify_checkpoint`, which checks all of it. It never imports
torch (``ddpstate verify DIR`` stays torch-free); the writers (manager, local
tier, sharded saves) import it.
"""

from __future__ import annotations

import datetime
import json
import os
import posixpath
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from ddpstate import _checksum, _crc, _fs, storage
from ddpstate._checksum import checksum_hex, error_text
from ddpstate._fs import PathLike
from ddpstate._version import __version__
from ddpstate.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    DDPStateError,
)
from ddpstate.formats import DCP

__all__ = ["CheckpointVerification", "verify_checkpoint"]

STEP_DIGITS = 10
#: The commit marker inside a step folder; written after every other file.
MANIFEST_NAME = "manifest.json"
#: The pointer file naming the most recently committed step folder.
LATEST_NAME = "latest"
# In write errors raised after the step's commit (the folder has changed).
COMMITTED_BUT = "was committed, but"
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

#: The DCP checkpoint's folder inside a CheckpointManager step folder.
DCP_SUBDIR = "dcp"
#: DCP's index of every saved item, written by its coordinator (rank 0) after the shards.
METADATA_NAME = ".metadata"
#: Suffix of the data files DCP's FileSystemWriter writes (``__<rank>_<n>.distcp``).
SHARD_SUFFIX = ".distcp"
#: The ``format`` field of a ``save()`` DCP folder's manifest.
FOLDER_FORMAT = DCP


class StepFolders:
    """A manager directory's step folders: listing, clean-up after crashes, removal, rotation.

    One implementation for the durable tier (:class:`ddpstate._manager.writer.StepWriter`,
    any storage) and the node-local tier (a local folder).
    """

    def __init__(self, directory: str, storage_options: Optional[dict[str, Any]] = None) -> None:
        self.directory = directory
        self.storage_options = storage_options

    def checkpoint_path(self, step: int) -> str:
        """The folder of ``step``'s checkpoint."""
        return storage.join(self.directory, step_name(step))

    def committed_steps(self) -> list[int]:
        """The steps whose manifest exists, sorted (empty when the directory does not exist)."""
        opts = self.storage_options
        if not storage.isdir(self.directory, storage_options=opts):
            return []
        return sorted(
            s
            for s in map(parse_step, storage.listdir(self.directory, storage_options=opts))
            if s is not None
            and storage.exists(
                storage.join(self.checkpoint_path(s), MANIFEST_NAME), storage_options=opts
            )
        )

    def latest_step(self) -> Optional[int]:
        """The highest committed step, or None."""
        found = self.committed_steps()
        return found[-1] if found else None

    def retired_steps(self, names: Optional[list[str]] = None) -> dict[int, str]:
        """Committed steps that only a retired copy holds: ``{step: that copy's folder}``.

        Where two names cannot be swapped in one step, a re-save of step N killed
        between :func:`ddpstate.storage.replace_folder`'s two renames leaves the
        committed step N as ``.step_N.ddpstate-old-<hex>`` and no ``step_N``.
        Restore reads that copy in place as step N (its manifest names the step);
        :meth:`clean_stale` puts it back. One copy per step: the first by name.
        ``names``: the directory's listing with temporary names, when the caller has it.
        """
        kw: dict[str, Any] = {"storage_options": self.storage_options}
        if names is None:
            if not storage.isdir(self.directory, **kw):
                return {}
            names = storage.listdir(self.directory, include_temp=True, **kw)
        found: dict[int, str] = {}
        for name in names:
            original = storage.retired_original(name)
            step = parse_step(original) if original is not None else None
            path = storage.join(self.directory, name)
            if (
                step is not None
                and step not in found
                and original not in names
                and storage.exists(storage.join(path, MANIFEST_NAME), **kw)
            ):
                found[step] = path
        return found

    def clean_stale(self) -> list[int]:
        """Delete what crashed saves left; return the committed steps found.

        Temporary folders and files, and step folders without a manifest, are
        deleted; a re-saved step whose two renames a crash interrupted is put back.
        """
        kw: dict[str, Any] = {"storage_options": self.storage_options}
        found: list[int] = []
        if not storage.isdir(self.directory, **kw):  # an object store's empty prefix
            return found
        names = storage.listdir(self.directory, include_temp=True, **kw)
        retired = self.retired_steps(names)
        for put_back, path in retired.items():
            # A re-save crashed between its two renames: put the old copy back.
            os.rename(path, self.checkpoint_path(put_back))
            found.append(put_back)
        for name in names:
            path = storage.join(self.directory, name)
            if path in retired.values():
                continue
            step = parse_step(name)
            if storage.is_temp_name(name):
                storage.remove(path, recursive=True, missing_ok=True, **kw)
            elif step is not None and storage.isdir(path, **kw):
                if not storage.exists(storage.join(path, MANIFEST_NAME), **kw):
                    storage.remove(path, recursive=True, missing_ok=True, **kw)  # uncommitted
                    continue
                for inner in storage.listdir(path, include_temp=True, **kw):
                    if storage.is_temp_name(inner):
                        storage.remove(storage.join(path, inner), missing_ok=True, **kw)
                found.append(step)
        return sorted(found)

    def remove_step(self, step: int, newest: int, *, folder_too: bool = True) -> None:
        """Uncommit ``step`` (its manifest), then delete its folder (``newest`` is committed).

        Manifest first: a crash midway leaves an uncommitted folder, never a
        committed one with files missing.

        Raises:
            CheckpointWriteError: Deleting failed; says ``newest`` is committed.
        """
        folder = self.checkpoint_path(step)
        try:
            storage.remove(
                storage.join(folder, MANIFEST_NAME),
                storage_options=self.storage_options,
                missing_ok=True,
            )
            if not _fs.is_remote(folder) and os.path.isdir(_fs.local_path(folder)):
                # The unlink must be durable before anything relies on the step being
                # gone: a rollback's newer steps would otherwise come back after a crash.
                storage.fsync_dir(_fs.local_path(folder))
            if folder_too:
                storage.remove(
                    folder, storage_options=self.storage_options, recursive=True, missing_ok=True
                )
        except Exception as exc:
            raise CheckpointWriteError(
                f"step {newest} {COMMITTED_BUT} deleting the old checkpoint {folder} "
                f"failed ({error_text(exc)}); delete it by hand"
            ) from exc

    def rotate(
        self,
        newest: int,
        keep_last: Optional[int],
        keep_best: int = 0,
        score: Optional[Callable[[int], Optional[float]]] = None,
    ) -> list[int]:
        """Remove the committed steps that neither ``keep_last`` nor ``keep_best`` keeps.

        Args:
            newest: The step just committed (always kept).
            keep_last: How many of the highest steps to keep (None: all).
            keep_best: How many of the lowest-scoring steps to keep.
            score: A step's score (lower is better; None: unscored).

        Returns:
            The steps removed.
        """
        committed = self.committed_steps()[::-1]
        keep = {newest}
        keep.update(committed if keep_last is None else committed[:keep_last])
        if keep_best and score is not None:
            scored = [(v, -s, s) for s in committed if (v := score(s)) is not None]
            keep.update(s for _, _, s in sorted(scored)[:keep_best])
        dropped = [s for s in committed if s not in keep]
        for s in dropped:
            self.remove_step(s, newest)
        return dropped


def step_name(step: int) -> str:
    return f"step_{step:0{STEP_DIGITS}d}"


def parse_step(name: str) -> Optional[int]:
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def is_listed_name(name: Any) -> bool:
    """Tell whether a manifest file name is a DCP file: ``.metadata`` or ``dcp/<file>``."""
    if name == METADATA_NAME:
        return True  # a save() DCP folder lists its index by its own name
    if not isinstance(name, str) or not name.startswith(DCP_SUBDIR + "/"):
        return False
    rest = name[len(DCP_SUBDIR) + 1 :]
    return rest == METADATA_NAME or _is_plain_name(rest)


def unlisted_shards(folder: str, files: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The ``.distcp`` and ``.metadata`` files in local ``folder`` that ``files`` does not list."""
    if _fs.is_remote(folder) or not os.path.isdir(_fs.local_path(folder)):
        return []
    return sorted(
        prefix + name
        for name in os.listdir(_fs.local_path(folder))
        if (name.endswith(SHARD_SUFFIX) or name == METADATA_NAME) and prefix + name not in files
    )


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    return json.dumps(manifest, indent=2, sort_keys=True).encode()


def manifest_for(
    step: Optional[int],
    metrics: Mapping[str, Any],
    world_size: int,
    entries: Optional[dict[str, dict[str, str]]],
    files: dict[str, dict[str, Any]],
    format: Optional[str] = None,
) -> bytes:
    """A step's manifest (the commit marker) as written, its own CRC-32 included.

    With ``format`` (a ``save()`` DCP folder, see ``_dcp``, or a :func:`seal_folder` one) it
    has no step, no entries and no RNG file.
    """
    import torch  # only writers get here; verifying stays torch-free

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
    manifest[MANIFEST_CRC_FIELD] = manifest_crc(manifest)
    return manifest_bytes(manifest)


def manifest_crc(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != MANIFEST_CRC_FIELD}
    return checksum_hex(_crc.crc32(manifest_bytes(body)))


def _is_plain_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and bool(name)
        and "/" not in name
        and "\\" not in name
        and not name.startswith(".")
    )


def is_listed(name: Any) -> bool:
    """A file name a manifest may list: a plain name, or one of a DCP checkpoint's files."""
    return _is_plain_name(name) or is_listed_name(name)


def read_manifest(
    folder: str, opts: Optional[dict[str, Any]]
) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """Read and check a step folder's manifest; return (manifest, None) or (None, problem).

    On a URL whose manifest is a pointer, the manifest of the version it names.
    """
    path = storage.join(storage.committed_folder(folder, storage_options=opts), MANIFEST_NAME)
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
        return None, f"its {MANIFEST_NAME} cannot be read ({error_text(exc)})"
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
    if raw != manifest_bytes(manifest):
        return None, (
            f"its {MANIFEST_NAME} is damaged or was edited: its bytes are not the ones ddpstate "
            f"wrote"
        )
    if manifest.get(MANIFEST_CRC_FIELD) != manifest_crc(manifest):
        return None, (
            f"its {MANIFEST_NAME} fails its own checksum ({MANIFEST_CRC_FIELD} "
            f"{manifest.get(MANIFEST_CRC_FIELD)!r}, computed {manifest_crc(manifest)}): it is "
            f"damaged or was edited"
        )
    return manifest, None


def manifest_problems(manifest: dict[str, Any], step: Optional[int]) -> list[str]:
    problems = []
    if step is not None and manifest.get("step") != step:
        problems.append(f"its {MANIFEST_NAME} does not describe step {step}")
    files: dict[str, Any] = manifest["files"]
    readable = checked_files(manifest)
    unreadable = [
        f"its {MANIFEST_NAME} lists {name!r}, which is not a file here"
        for name in files
        if name not in readable
    ]
    if not _is_manager_step(manifest) and step is None:
        return unreadable  # a save() DCP folder, or a framework's folder (seal_folder): files only
    entries = manifest.get("entries")
    if not isinstance(entries, dict):
        return [*problems, f"its {MANIFEST_NAME} has no entries"]
    problems.extend(unreadable)
    for name, entry in entries.items():
        if not isinstance(entry, dict) or entry.get("file") not in files:
            problems.append(f"its {MANIFEST_NAME} gives entry {name!r} no checksummed file")
    if manifest.get("rng_file", RNG_FILE) not in files:
        problems.append(f"its {MANIFEST_NAME} gives the RNG states no checksummed file")
    return problems


@dataclass
class FolderCheck:
    manifest: Optional[dict[str, Any]]
    problems: list[str]
    notes: list[str]
    files: int = 0
    bytes_read: int = 0


def checked_files(manifest: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The manifest's listed files that a check reads, in manifest order.

    The rest (a name that is not a file here, an entry that is not a dict) are
    manifest problems (:func:`manifest_problems`).
    """
    files: dict[str, Any] = manifest["files"]
    return {n: e for n, e in files.items() if is_listed(n) and isinstance(e, dict)}


def dcp_manifest_problems(
    folder: str, manifest: Mapping[str, Any], opts: Optional[dict[str, Any]]
) -> list[str]:
    """``dcp/manifest.json`` missing from a step whose DCP shards ``DurableWriter`` wrote.

    The step's manifest lists the shards (their CRC-32s are checked with every
    file), with ``chunks`` when ``DurableWriter`` wrote them; its own
    ``dcp/manifest.json`` is what makes ``dcp/`` a committed folder that
    ``VerifiedReader`` and ``ddpstate verify`` read checked. Without it the step
    is not whole as committed.
    """
    files: dict[str, Any] = manifest["files"]
    prefix = DCP_SUBDIR + "/"
    written = any(
        isinstance(n, str) and n.startswith(prefix) and isinstance(e, dict) and "chunks" in e
        for n, e in files.items()
    )
    inner = f"{DCP_SUBDIR}/{MANIFEST_NAME}"
    if written and not storage.exists(storage.join(folder, inner), storage_options=opts):
        return [f"{inner} is missing (the shards' checksums)"]
    return []


def check_folder(
    folder: str,
    step: Optional[int],
    opts: Optional[dict[str, Any]],
    workers: Optional[int] = None,
) -> FolderCheck:
    """Check one step folder against its manifest, collecting every problem.

    ``workers`` threads share the checksum pass (None: ``_checksum.check_files``
    picks from the CPU count and the bytes).
    """
    folder = storage.committed_folder(folder, storage_options=opts)  # a URL's version folder
    manifest, problem = read_manifest(folder, opts)
    if manifest is None:
        return FolderCheck(None, [str(problem)], [])
    return _check_files(folder, manifest, step, opts, workers)


def _check_files(
    folder: str,
    manifest: dict[str, Any],
    step: Optional[int],
    opts: Optional[dict[str, Any]],
    workers: Optional[int] = None,
) -> FolderCheck:
    check = FolderCheck(manifest, manifest_problems(manifest, step), [])
    found, check.files, check.bytes_read = _checksum.check_files(
        folder, checked_files(manifest), opts, workers
    )
    check.problems.extend(found)
    check.problems.extend(dcp_manifest_problems(folder, manifest, opts))
    problems, check.notes = check_listing(folder, manifest["files"], opts)
    check.problems.extend(problems)
    if check.problems:
        check.manifest = None
    return check


def check_listing(
    folder: str, files: dict[str, Any], opts: Optional[dict[str, Any]]
) -> tuple[list[str], list[str]]:
    """The problems and the notes of what lies in ``folder`` beside the listed ``files``."""
    problems: list[str] = []
    notes: list[str] = []
    try:
        present = storage.listdir(folder, storage_options=opts, include_temp=True)
    except DDPStateError as exc:
        problems.append(f"the folder cannot be listed ({error_text(exc)})")
        present = []
    for name in present:
        if name in files or name == MANIFEST_NAME:
            continue
        if name == DCP_SUBDIR and any(is_listed_name(f) for f in files):
            for extra in unlisted_shards(storage.join(folder, name), files, name + "/"):
                problems.append(
                    f"{extra} is not listed in {MANIFEST_NAME}: a shard this save did not write "
                    f"(copied in, or left from another save); move it out of the folder"
                )
            continue
        if storage.is_temp_name(name):
            notes.append(
                f"{name} is a temporary file left by an interrupted write (not part of the "
                f"checkpoint; the next save deletes it)"
            )
        elif name.endswith((*PART_SUFFIXES, SHARD_SUFFIX)):
            problems.append(
                f"{name} is not listed in {MANIFEST_NAME}: a checkpoint file this save did not "
                f"write (copied in, or left from another save); move it out of the folder"
            )
        else:
            notes.append(f"{name} is not part of the checkpoint (ignored)")
    return problems, notes


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
    :meth:`CheckpointManager.restore` accepts exactly the step folders this passes.
    A folder whose manifest has a ``format`` (a ``ddpstate.save`` DCP folder, a
    framework integration's checkpoint) is checked by its files, whatever its name.

    A manager directory is good when every committed step folder is good and
    the ``latest`` pointer, if any, is readable and names a committed step;
    uncommitted step folders there, and a ``latest`` naming an older step than
    the newest committed one (a kill between a commit and the pointer update:
    ``restore()`` does not read the pointer), are only noted, and each problem
    is prefixed with its step folder's name.

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
    step = parse_step(name)
    committed = storage.exists(storage.join(text, MANIFEST_NAME), storage_options=opts)
    if step is None and not committed:
        return _verify_directory(text, opts)
    folder = storage.committed_folder(text, storage_options=opts)  # a URL's version folder
    manifest, problem = read_manifest(folder, opts)
    if manifest is None:
        return _verification(text, FolderCheck(None, [str(problem)], []), ())
    if not _is_manager_step(manifest):
        step = None  # a folder of another kind that its user named step_N: not a manager's step
    check = _check_files(folder, manifest, step, opts)
    return _verification(text, check, () if step is None else (step,))


def _is_manager_step(manifest: Mapping[str, Any]) -> bool:
    """Whether a manifest is a CheckpointManager step's, from its own fields.

    A ``save()`` DCP folder's or a :func:`seal_folder` one's has a ``format`` and no step.
    """
    return manifest.get("format") is None


def _verification(path: str, check: FolderCheck, steps: tuple[int, ...]) -> CheckpointVerification:
    return CheckpointVerification(
        path=path,
        problems=tuple(check.problems),
        notes=tuple(check.notes),
        steps=steps,
        files=check.files,
        bytes_read=check.bytes_read,
    )


def _verify_directory(text: str, opts: Optional[dict[str, Any]]) -> CheckpointVerification:
    names = storage.listdir(text, storage_options=opts, include_temp=True)
    step_dirs = sorted(
        (s, n)
        for n in names
        if (s := parse_step(n)) is not None
        and storage.isdir(storage.join(text, n), storage_options=opts)
    )
    retired = StepFolders(text, opts).retired_steps(names)
    # A committed step only a retired copy holds is checked there, named as that step too.
    step_dirs += [(s, posixpath.basename(p)) for s, p in retired.items()]
    if not step_dirs and LATEST_NAME not in names:
        raise CheckpointFormatError(
            f"{text} is not a CheckpointManager folder: it has no {MANIFEST_NAME}, no step_* "
            f"folders and no {LATEST_NAME} pointer"
        )
    total = FolderCheck(None, [], [])  # every step folder's findings, each named by its folder
    committed: list[int] = []
    for s, n in sorted(step_dirs):
        folder = storage.join(text, n)
        if not storage.exists(storage.join(folder, MANIFEST_NAME), storage_options=opts):
            total.notes.append(
                f"{n}: not committed (an interrupted save; the next save deletes it)"
            )
            continue
        committed.append(s)
        check = check_folder(folder, s, opts)
        label = n if s not in retired else f"{step_name(s)}: {n}"
        total.problems.extend(f"{label}: {p}" for p in check.problems)
        total.notes.extend(f"{label}: {p}" for p in check.notes)
        total.files += check.files
        total.bytes_read += check.bytes_read
    for n in names:
        original = storage.retired_original(n)
        if original is not None and storage.join(text, n) in retired.values():
            total.notes.append(
                f"{n} is the committed {original}, retired by a re-save killed between its two "
                f"renames: restore() reads it as {original}, and the next save puts it back "
                f"(do not delete it)"
            )
        elif storage.is_temp_name(n):
            total.notes.append(
                f"{n} is a temporary file left by an interrupted write (the next save deletes it)"
            )
    total.problems.extend(_latest_problems(text, names, committed, total.notes, opts))
    return _verification(text, total, tuple(committed))


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
        return [f"{LATEST_NAME} cannot be read ({error_text(exc)})"]
    content = raw.decode("ascii", errors="replace")
    if not _LATEST_RE.fullmatch(content):
        return [f"{LATEST_NAME} is damaged: {raw!r} is not a step folder name and a newline"]
    pointed = content[:-1]
    step = parse_step(pointed)
    if step not in committed:
        exists = storage.exists(storage.join(text, pointed), storage_options=opts)
        return [
            f"{LATEST_NAME} names {pointed}, which "
            + ("is not committed" if exists else "does not exist")
        ]
    if committed and step != max(committed):
        # A kill between a step's commit and the pointer update leaves this; restore() never
        # reads the pointer (it takes the newest step that verifies): a remark, not damage.
        notes.append(
            f"{LATEST_NAME} names {pointed}, but {step_name(max(committed))} is the newest "
            f"committed step (a save was interrupted between its commit and the pointer update, "
            f"or {LATEST_NAME} was edited); restore() does not read {LATEST_NAME}, and the next "
            f"save rewrites it"
        )
    return []
