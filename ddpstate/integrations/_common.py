"""What the framework integrations share: sealing a folder a framework wrote, and resuming.

``seal_folder``/``synced_files`` make a flat folder another program wrote durable
and verifiable (every file fsynced and CRC-32'd, the folder fsynced, a manifest with
a ``format`` and no step written last); ``newest_verified`` is the first candidate
that verifies; ``remove_checkpoint`` deletes one manifest first. Torch-free.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from ddpstate import _fs, _manifest, storage
from ddpstate._checksum import checksum_hex, error_text
from ddpstate._convert.verify import verify_records
from ddpstate._fs import PathLike
from ddpstate._manifest import MANIFEST_NAME, verify_checkpoint
from ddpstate._warn import warn
from ddpstate.dist import get_rank
from ddpstate.errors import CheckpointFormatError, CheckpointWriteError, DDPStateError


def missing_framework(module: str, extra: str) -> ImportError:
    """The error for an integration whose framework is not installed: both install lines."""
    return ImportError(
        f"ddpstate.integrations.{extra} needs {module}, which is not installed; from a "
        f'checkout of ddpstate: pip install -e ".[{extra}]"; once ddpstate is on PyPI: '
        f'pip install "ddpstate[{extra}]"'
    )


def numbered(
    folder: str, pattern: re.Pattern[str], storage_options: Optional[dict[str, Any]] = None
) -> list[tuple[int, str]]:
    """``(number, path)`` of each folder in ``folder`` whose name ``pattern`` matches, oldest first.

    The number is what the pattern's group 1 matched; no folder means no entries. Only
    folders count, as the frameworks' own choosers take them (the Trainer's
    ``get_last_checkpoint`` skips a file named ``checkpoint-9``; resuming from one fails).
    """
    opts = storage_options
    if not storage.isdir(folder, storage_options=opts):
        return []
    names = storage.listdir(folder, storage_options=opts)
    found = sorted((int(m.group(1)), name) for name in names if (m := pattern.match(name)))
    paths = [(n, storage.join(folder, name)) for n, name in found]
    return [(n, path) for n, path in paths if storage.isdir(path, storage_options=opts)]


def modified_time(path: str, storage_options: Optional[dict[str, Any]] = None) -> float:
    """When ``path`` (local or fsspec URL) was last modified, in seconds; 0.0 where unknown.

    Filesystems that keep no times (``NotImplementedError``) give 0.0, so that another key
    (a step in the name, the name) orders their files.
    """
    if not _fs.is_remote(path):
        return os.stat(_fs.local_path(path)).st_mtime
    fs, inner = _fs.url_to_fs(path, storage_options)
    try:
        return float(fs.modified(inner).timestamp())
    except NotImplementedError:
        return 0.0


def _problem(path: str, opts: Optional[dict[str, Any]]) -> Optional[str]:
    """Why ``path`` cannot be resumed from, or None when it verifies."""
    try:
        if storage.isdir(path, storage_options=opts):
            if not storage.exists(storage.join(path, MANIFEST_NAME), storage_options=opts):
                return (
                    f"it has no {MANIFEST_NAME}, so it was never committed (a save interrupted "
                    f"before its commit, or a folder written without ddpstate)"
                )
            problems = verify_checkpoint(path, storage_options=opts).problems
        else:
            # Integrity only: the records against their CRC-32s, the pickle never unpickled
            # (a framework's checkpoint holds objects beyond weights-only).
            problems = verify_records(path, storage_options=opts).problems
    except DDPStateError as exc:
        return str(exc)
    return "; ".join(problems) or None


def newest_verified(
    candidates: Iterable[str], *, what: str, storage_options: Optional[dict[str, Any]] = None
) -> Optional[str]:
    """The first of ``candidates`` (newest first) that verifies; each one skipped is named.

    A folder verifies when its ddpstate ``manifest.json`` is present and every file it
    lists has its recorded size and CRC-32 (:func:`ddpstate.manager.verify_checkpoint`);
    a file when :func:`ddpstate._convert.verify.verify_records` finds it whole (every record's
    CRC-32). Each candidate that does not is named in a warning (on rank 0) with the
    reason, and the next one is tried. Every byte of the candidates checked is read.

    Args:
        candidates: Paths (local or fsspec URLs), newest first.
        what: What they are, for the warnings (``"Lightning checkpoint"``).
        storage_options: fsspec options for URLs.

    Returns:
        The newest candidate that verifies, or None when none does (or there are none).

    Example:
        >>> import os, tempfile, warnings, torch
        >>> folder = tempfile.mkdtemp()
        >>> good, bad = os.path.join(folder, "a.pt"), os.path.join(folder, "b.pt")
        >>> torch.save({"w": torch.ones(2)}, good)
        >>> _ = open(bad, "wb").write(open(good, "rb").read()[:50])
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     newest_verified([bad, good], what="checkpoint") == good
        True
        >>> "b.pt" in str(caught[0].message)
        True
    """
    for path in candidates:
        problem = _problem(path, storage_options)
        if problem is None:
            return path
        warn(f"skipping the {what} {path}: {problem}; trying an older one", rank=get_rank())
    return None


def remove_checkpoint(path: str, *, storage_options: Optional[dict[str, Any]] = None) -> None:
    """Delete a checkpoint folder, its manifest first.

    A kill midway leaves a folder without a manifest (uncommitted, skipped by
    :func:`newest_verified` as never committed), never a committed one with files missing.

    Args:
        path: The folder (local or fsspec URL); nothing happens when it is gone.
        storage_options: fsspec options for URLs.

    Raises:
        DDPStateError: Deleting failed (the folder may then be left uncommitted).

    Example:
        >>> import os, tempfile
        >>> from ddpstate.integrations._common import remove_checkpoint, seal_folder
        >>> folder = tempfile.mkdtemp()
        >>> _ = open(os.path.join(folder, "weights.bin"), "wb").write(b"abc")
        >>> _ = seal_folder(folder, format="example")
        >>> remove_checkpoint(folder)
        >>> os.path.exists(folder)
        False
    """
    opts = storage_options
    if not _fs.is_remote(path) and os.path.islink(_fs.local_path(path)):
        # A link to a checkpoint folder (made by hand) goes alone: its manifest is the folder's
        # it names, which another name keeps (or rotation keeps) committed.
        os.unlink(_fs.local_path(path))
        return
    storage.remove(storage.join(path, MANIFEST_NAME), storage_options=opts, missing_ok=True)
    storage.remove(path, storage_options=opts, recursive=True, missing_ok=True)


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _size_and_crc(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        return storage.size_and_crc32(f)


def seal_folder(folder: PathLike, *, format: str, world_size: int = 1) -> dict[str, Any]:
    """Make a local folder another program wrote durable and verifiable in place.

    Every file is read once (its size and CRC-32) and fsynced, then the folder, and a
    ``manifest.json`` listing them is written last (atomically, fsynced): the folder
    then passes :func:`~ddpstate.verify_checkpoint` (and ``ddpstate verify``) until a byte of
    it changes. A previous manifest is replaced. Not a collective: call it once per
    copy of the folder, after every file in it is written.

    Args:
        folder: A local folder of files (e.g. a Hugging Face ``checkpoint-N``).
        format: What wrote it, recorded as the manifest's ``format``.
        world_size: The number of ranks of the run, recorded in the manifest.

    Returns:
        The manifest's ``files``: ``{name: {"size": ..., "crc32": ...}}``.

    Raises:
        CheckpointNotFoundError: ``folder`` does not exist.
        CheckpointFormatError: It holds a sub-folder (only flat folders are sealed).
        CheckpointWriteError: Reading, syncing or writing failed.

    Example:
        >>> import os, tempfile
        >>> from ddpstate._manifest import verify_checkpoint
        >>> from ddpstate.integrations._common import seal_folder
        >>> folder = tempfile.mkdtemp()
        >>> _ = open(os.path.join(folder, "weights.bin"), "wb").write(b"abc")
        >>> seal_folder(folder, format="example")
        {'weights.bin': {'size': 3, 'crc32': '352441c2'}}
        >>> verify_checkpoint(folder).ok
        True
    """
    text = os.path.abspath(_fs.local_path(os.fspath(folder)))
    files = synced_files(text)
    with storage.atomic_write(os.path.join(text, MANIFEST_NAME)) as f:
        f.write(_manifest.manifest_for(None, {}, world_size, None, files, format))
    return files


def synced_files(text: str) -> dict[str, dict[str, Any]]:
    """Each file of the flat local folder ``text`` but a manifest: fsynced, its size and CRC-32.

    The folder is fsynced too. The manifest's ``files`` for :func:`seal_folder` and for a
    folder staged for :meth:`ddpstate.storage.StagedFolder.commit`.

    Raises:
        CheckpointFormatError: It holds a sub-folder.
        CheckpointWriteError: Reading or syncing failed.
    """
    names = [n for n in storage.listdir(text) if n != MANIFEST_NAME]  # no temporary files
    for name in names:
        if os.path.isdir(os.path.join(text, name)):
            raise CheckpointFormatError(
                f"{os.path.join(text, name)} is a folder: ddpstate seals flat folders of files "
                f"only; move it out of {text}, or save without it"
            )
    try:
        # The disk's write-back (fsync) and the CPU's CRC-32 of the cached bytes overlap.
        with ThreadPoolExecutor(max_workers=8) as pool:
            synced = [pool.submit(_fsync_file, os.path.join(text, n)) for n in names]
            sums = list(pool.map(_size_and_crc, [os.path.join(text, n) for n in names]))
            for done in synced:
                done.result()
        storage.fsync_dir(text)
    except OSError as exc:
        raise CheckpointWriteError(
            f"sealing {text} failed ({error_text(exc)}); it has no new {MANIFEST_NAME}"
        ) from exc
    return {
        n: {"size": size, "crc32": checksum_hex(crc)}
        for n, (size, crc) in zip(names, sums, strict=True)
    }
