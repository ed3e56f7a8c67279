"""Bytes to durable places: atomic, fsynced writes to local paths and fsspec URLs.

This module chooses the writer and holds the folder swap and the fsspec read/list/remove
calls; the writers live in ``ddpstate._storage`` (``local.py``: locked temp file, fsync,
rename; ``remote.py``: object-store commit or temp name and rename; ``temps.py``: the
temporary names every writer and listing agrees on).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import posixpath
import shutil
import sys
import weakref
from collections.abc import Iterator
from typing import IO, Any, Optional

from ddpstate import _crc, _fs
from ddpstate._fs import PathLike
from ddpstate._storage import versions
from ddpstate._storage.local import (
    atomic_write_local,
    create_locked_temp,
    flock,
    remove_stale_temps,
)
from ddpstate._storage.local import wait_for_freed as wait_for_freed
from ddpstate._storage.local import write_by_name as write_by_name
from ddpstate._storage.remote import OBJECT_STORE_PROTOCOLS as OBJECT_STORE_PROTOCOLS
from ddpstate._storage.remote import (
    UPLOAD,
    atomic_write_object_store,
    atomic_write_rename,
    protocol_of,
    publish_method,
)
from ddpstate._storage.remote import trust_protocol as trust_protocol
from ddpstate._storage.temps import TEMP_MARKER as TEMP_MARKER
from ddpstate._storage.temps import cleanup_after, is_temp_name, retired_name_for
from ddpstate._storage.temps import fsync_dir as fsync_dir
from ddpstate._storage.temps import retired_original as retired_original
from ddpstate._storage.temps import temp_path_for as temp_path_for
from ddpstate._warn import warn
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    DDPStateError,
)

# What users need; the writers' internals (``temp_path_for``, ``retired_original``,
# ``write_by_name``, ``OBJECT_STORE_PROTOCOLS``, ``TEMP_MARKER``...) still import from here.
__all__ = [
    "StagedFolder",
    "atomic_write",
    "committed_folder",
    "exists",
    "isdir",
    "is_temp_name",
    "join",
    "listdir",
    "makedirs",
    "open_read",
    "remove",
    "replace_folder",
    "staged_folder",
    "trust_protocol",
]


def join(base: PathLike, *names: str) -> str:
    """Join path components, with ``/`` for URLs and ``os.path.join`` for local paths.

    Args:
        base: A local folder or an fsspec URL.
        *names: Components to append.

    Returns:
        The joined path as a string.

    Example:
        >>> from ddpstate.storage import join
        >>> join("s3://bucket/run", "step-10.pt")
        's3://bucket/run/step-10.pt'
    """
    text = os.fspath(base)
    if _fs.is_remote(text):
        return posixpath.join(text, *names)
    return os.path.join(text, *names)


# renameat2(2) flag: swap two existing paths in one step (Linux >= 3.15, most
# local filesystems).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _rename_exchange(first: str, second: str) -> bool:
    """Swap two paths atomically; False where the OS or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # here: only folder swaps need it, and it slows every command's start

    function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if function is None:  # glibc before 2.28, or another libc
        return False
    result = function(
        _AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE
    )
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), first, None, second)


def replace_folder(staging: PathLike, target: PathLike) -> None:
    """Put the complete local folder ``staging`` at ``target``, then delete the old ``target``.

    Where Linux can swap the two names in one step (``renameat2`` with
    ``RENAME_EXCHANGE``), no moment exists without a complete ``target``.
    Elsewhere the old folder is first renamed to ``.<name>.ddpstate-old-<hex>``
    (``retired_original`` names its target, so a crash between the two
    renames can be undone), then ``staging`` takes the name. The parent folder
    is fsynced before the old copy is deleted.

    Args:
        staging: A finished folder in the same parent as ``target``.
        target: Where it should be; may exist (it is replaced) or not.

    Raises:
        CheckpointWriteError: A rename failed; ``target`` is then unchanged.

    Example:
        >>> import os, tempfile
        >>> from ddpstate.storage import replace_folder, temp_path_for
        >>> target = os.path.join(tempfile.mkdtemp(), "step_1")
        >>> os.makedirs(target)
        >>> staging = temp_path_for(target)
        >>> os.makedirs(staging); open(os.path.join(staging, "new"), "w").close()
        >>> replace_folder(staging, target); os.listdir(target)
        ['new']
    """
    new = os.path.abspath(_fs.local_path(os.fspath(staging)))
    old = os.path.abspath(_fs.local_path(os.fspath(target)))
    parent = os.path.dirname(old)
    try:
        if not os.path.lexists(old):
            os.rename(new, old)
            fsync_dir(parent)
            return
        if _rename_exchange(new, old):
            leftover = new
        else:
            leftover = os.path.join(parent, retired_name_for(os.path.basename(old)))
            os.rename(old, leftover)
            try:
                os.rename(new, old)
            except OSError:
                os.rename(leftover, old)
                raise
        fsync_dir(parent)
    except OSError as exc:
        raise CheckpointWriteError(
            f"putting the new {old} in place failed ({type(exc).__name__}: {exc}); the previous "
            f"folder is untouched; check permissions and free space"
        ) from exc
    shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def atomic_write(
    path: PathLike, *, storage_options: Optional[dict[str, Any]] = None, fsync: bool = True
) -> Iterator[IO[bytes]]:
    """Open a binary file whose contents replace ``path`` only if the block succeeds.

    Local paths: the data goes to a temporary file in the target's own folder
    (named ``.<name>.ddpstate-tmp-<random>``, see :func:`is_temp_name`), which
    is flushed, fsynced, renamed onto the target with ``os.replace``, and the
    folder is fsynced. Object stores (``s3://``, ``gs://``, ``az://``...): one
    object, which appears only when the upload completes. Other fsspec
    filesystems (``memory://``, ``sftp://``...): a temporary name, then a
    rename. If the block raises, the temporary data is removed and the previous
    file is untouched; the block's exception propagates unchanged. When a large
    local file is replaced, its blocks are freed by a background thread after
    the new file is committed (the interpreter waits for it before exiting).
    A local writer holds a ``flock`` on its temp file; after a successful
    write, temp files and staging folders in the same folder that no process
    holds locked (left by writers killed mid-write) are deleted.

    Args:
        path: Local path (or ``file://`` URL) or any fsspec URL.
        storage_options: Options for the fsspec filesystem (ignored for local paths).
        fsync: Local paths only: ``False`` skips both fsyncs. The rename stays
            atomic, so a crashed *process* still leaves the old or the new
            file, but after a power loss or OS crash the new file may be
            empty or missing. For scratch outputs that can be made again;
            never when the target is the only copy of its data.

    Returns:
        A context manager yielding a writable binary file object.

    Raises:
        CheckpointWriteError: The temporary file could not be created, or
            flushing, syncing or renaming it failed; or the URL's protocol has no
            known atomic publish (the message names :func:`trust_protocol`).

    Example:
        >>> import os, tempfile
        >>> from ddpstate.storage import atomic_write
        >>> path = os.path.join(tempfile.mkdtemp(), "notes.bin")
        >>> with atomic_write(path) as f:
        ...     _ = f.write(b"all or nothing")
        >>> open(path, "rb").read()
        b'all or nothing'
    """
    text = os.fspath(path)
    fs, where = _fs.locate(text, storage_options)
    if fs is None:
        manager = atomic_write_local(where, fsync)
    elif publish_method(fs, text) == UPLOAD:
        manager = atomic_write_object_store(fs, text, where)
    else:
        manager = atomic_write_rename(fs, text, where)
    with manager as fileobj:
        yield fileobj


def size_and_crc32(
    f: IO[bytes], chunk_size: int = 8 << 20, limit: Optional[int] = None
) -> tuple[int, int]:
    """Read ``f`` to its end (or ``limit`` bytes): ``(bytes read, CRC-32 of them)``.

    Args:
        f: A binary file object, read from where it stands.
        chunk_size: Bytes per read.
        limit: Read at most this many bytes (None: to the end).

    Returns:
        The number of bytes read and their CRC-32 (``zlib.crc32``'s value).

    Example:
        >>> import io
        >>> size_and_crc32(io.BytesIO(b"abc"))
        (3, 891568578)
        >>> size_and_crc32(io.BytesIO(b"abcdef"), limit=3)
        (3, 891568578)
    """
    size, crc = 0, 0
    pending: Optional[tuple[Any, int]] = None  # the previous chunk's CRC, on a helper thread
    while limit is None or size < limit:
        chunk = f.read(chunk_size if limit is None else min(chunk_size, limit - size))
        if not chunk:
            break
        size += len(chunk)
        task = _crc.crc32_later(chunk)  # while the next chunk is read
        if pending is not None:
            crc = _crc.crc32_combine(crc, pending[0].result(), pending[1])
        pending = (task, len(chunk))
    if pending is not None:
        crc = _crc.crc32_combine(crc, pending[0].result(), pending[1])
    return size, crc


def open_read(path: PathLike, *, storage_options: Optional[dict[str, Any]] = None) -> IO[bytes]:
    """Open a local file or fsspec URL for binary reading.

    Args:
        path: Local path (or ``file://`` URL) or any fsspec URL.
        storage_options: Options for the fsspec filesystem.

    Returns:
        A readable, seekable binary file object; close it (or use ``with``).

    Raises:
        CheckpointNotFoundError: Nothing exists at ``path``.
        DDPStateError: ``path`` is a folder, or cannot be read.

    Example:
        >>> import os, tempfile
        >>> from ddpstate.storage import open_read
        >>> path = os.path.join(tempfile.mkdtemp(), "x.bin")
        >>> _ = open(path, "wb").write(b"abc")
        >>> with open_read(path) as f:
        ...     f.read()
        b'abc'
    """
    text = os.fspath(path)
    try:
        fs, where = _fs.locate(text, storage_options)
        if fs is None:
            if _fs.is_special_file(where):
                raise CheckpointCorruptError(
                    f"{text}: not a regular file (a FIFO, socket or device), so ddpstate does "
                    f"not open it; a checkpoint holds only regular files: replace it"
                )
            return open(where, "rb")
        if protocol_of(fs) == "memory":
            # fsspec's memory filesystem hands every reader of a path the same file object,
            # so threads reading pieces of one file (check_files) would move each other's
            # position: each reader gets its own view of the bytes instead.
            return io.BytesIO(fs.cat_file(where))
        return fs.open(where, "rb")  # type: ignore[no-any-return]
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{text}: no such file; check the path") from exc
    except IsADirectoryError as exc:
        raise DDPStateError(f"{text} is a folder, not a file") from exc
    except PermissionError as exc:
        raise DDPStateError(f"{text}: permission denied ({exc}); check its permissions") from exc


def exists(path: PathLike, *, storage_options: Optional[dict[str, Any]] = None) -> bool:
    """Tell whether a file or folder exists at a local path or fsspec URL.

    Example:
        >>> from ddpstate.storage import exists
        >>> exists("/definitely/not/here.pt")
        False
    """
    fs, where = _fs.locate(path, storage_options)
    return os.path.exists(where) if fs is None else bool(fs.exists(where))


def isdir(path: PathLike, *, storage_options: Optional[dict[str, Any]] = None) -> bool:
    """Tell whether a local path or fsspec URL is a folder (a prefix on object stores).

    Example:
        >>> import tempfile
        >>> from ddpstate.storage import isdir
        >>> isdir(tempfile.gettempdir())
        True
    """
    fs, where = _fs.locate(path, storage_options)
    return os.path.isdir(where) if fs is None else bool(fs.isdir(where))


def remove(
    path: PathLike,
    *,
    storage_options: Optional[dict[str, Any]] = None,
    recursive: bool = False,
    missing_ok: bool = False,
) -> None:
    """Delete a file, or with ``recursive=True`` a folder and everything in it.

    Args:
        path: Local path or fsspec URL.
        storage_options: Options for the fsspec filesystem.
        recursive: Also delete folders (e.g. a ``torch.distributed.checkpoint`` folder).
        missing_ok: Do nothing when ``path`` does not exist.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist and ``missing_ok`` is False.
        DDPStateError: ``path`` is a folder and ``recursive`` is False.

    Example:
        >>> from ddpstate.storage import remove
        >>> remove("/tmp/ddpstate-doctest-missing.pt", missing_ok=True)
    """
    text = os.fspath(path)
    if not exists(text, storage_options=storage_options):
        if missing_ok:
            return
        raise CheckpointNotFoundError(f"{text}: no such file or folder to remove")
    folder = isdir(text, storage_options=storage_options)
    if folder and not recursive:
        raise DDPStateError(f"{text} is a folder; pass recursive=True to delete it and its files")
    fs, where = _fs.locate(text, storage_options)
    if fs is not None:
        fs.rm(where, recursive=folder)
    elif folder:
        shutil.rmtree(where)
    else:
        os.unlink(where)


def listdir(
    path: PathLike,
    *,
    storage_options: Optional[dict[str, Any]] = None,
    include_temp: bool = False,
) -> list[str]:
    """List the names in a folder, without ddpstate's in-progress temporary files.

    Args:
        path: Local folder or fsspec URL of a folder (prefix).
        storage_options: Options for the fsspec filesystem.
        include_temp: Also list temporary files left by killed writers.

    Returns:
        The sorted entry names (not full paths).

    Raises:
        CheckpointNotFoundError: The folder does not exist.

    Example:
        >>> import tempfile
        >>> from ddpstate.storage import listdir
        >>> listdir(tempfile.mkdtemp())
        []
    """
    text = os.fspath(path)
    try:
        fs, where = _fs.locate(text, storage_options)
        if fs is None:
            names = os.listdir(where)
        else:
            names = [posixpath.basename(p.rstrip("/")) for p in fs.ls(where, detail=False)]
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{text}: no such folder") from exc
    return sorted(n for n in names if n and (include_temp or not is_temp_name(n)))


def makedirs(path: PathLike, *, storage_options: Optional[dict[str, Any]] = None) -> None:
    """Create a folder and its parents if missing (no-op on object stores).

    Object stores have no folders, and creating a missing bucket behind the
    user's back would be wrong, so nothing is done there.

    Raises:
        CheckpointWriteError: The folder cannot be created.

    Example:
        >>> import os, tempfile
        >>> from ddpstate.storage import makedirs
        >>> makedirs(os.path.join(tempfile.mkdtemp(), "a", "b"))
    """
    text = os.fspath(path)
    try:
        fs, where = _fs.locate(text, storage_options)
        if fs is None:
            os.makedirs(where, exist_ok=True)
        elif protocol_of(fs) not in OBJECT_STORE_PROTOCOLS:
            fs.makedirs(where, exist_ok=True)
    except OSError as exc:
        raise CheckpointWriteError(
            f"cannot create folder {text} ({type(exc).__name__}: {exc}); check permissions"
        ) from exc


class StagedFolder:
    """A folder being written that takes ``target``'s place only at :meth:`commit`.

    Made by ``stage_folder`` (or :func:`staged_folder`). ``path`` is the folder to
    write into: locally a fresh hidden ``.<name>.ddpstate-tmp-<hex>`` folder beside
    ``target``, ``flock``-ed while this save runs (or, with ``in_place``, a ``target``
    that does not exist yet); on fsspec URLs ``target`` itself when nothing is
    committed there, else a fresh version folder ``<target>/v-<hex>`` that a pointer
    manifest commits (``ddpstate._storage.versions``). ``expected`` is what stood at
    the manifest when the save began: the commit is a compare-and-swap against it.
    """

    def __init__(
        self,
        target: str,
        path: str,
        *,
        fsync: bool = True,
        storage_options: Optional[dict[str, Any]] = None,
        manifest_name: str = "manifest.json",
        version: Optional[str] = None,
        expected: Optional[str] = None,
        superseded: tuple[str, ...] = (),
        lock_fd: Optional[int] = None,
    ) -> None:
        self.target = target
        self.path = path
        self.fsync = fsync
        self.storage_options = storage_options
        self.manifest_name = manifest_name
        self.version = version
        self.expected = expected
        self.superseded = superseded
        self.committed = False
        # A staging folder dropped without commit or discard (a save whose other rank
        # failed) must not stay locked, which would keep later saves from deleting it.
        self._unlock = None if lock_fd is None else weakref.finalize(self, os.close, lock_fd)

    def commit(self, manifest: Optional[bytes] = None) -> None:
        """Write ``manifest`` (if any) last as ``manifest_name``, then put the folder in place.

        Locally the folder's entries are fsynced first (files other ranks created
        in it included, unless ``fsync=False``), and :func:`replace_folder` swaps
        it in; then the staging folders and temp files beside it that no running
        save holds (left by killed saves of any target there) are deleted. On URLs
        the manifest (or, for a version folder, a pointer naming it) is one atomic
        PUT, then what the previous commit used is deleted. Either way the commit
        fails, and changes nothing,
        if another save committed ``target`` since this one was staged. A failure
        leaves the old ``target`` as it was and the staging folder for :meth:`discard`.

        Raises:
            CheckpointWriteError: Writing the manifest or swapping the folder failed,
                or another save committed ``target`` meanwhile.
        """
        if _fs.is_remote(self.target):
            self._commit_remote(manifest)
        else:
            self._commit_local(manifest)

    def _commit_local(self, manifest: Optional[bytes]) -> None:
        name = join(self.path, self.manifest_name)
        if self.fsync:
            fsync_dir(self.path)
        if manifest is not None and self.path != self.target:
            with atomic_write(name, fsync=self.fsync) as f:
                f.write(manifest)
        with _commit_lock(os.path.dirname(self.target)):
            if _local_identity(self.target, self.manifest_name) != self.expected:
                raise versions.moved_error(self.target)
            if self.path != self.target:
                replace_folder(self.path, self.target)
            elif manifest is not None:  # in place: the manifest is the commit
                with atomic_write(name, fsync=self.fsync) as f:
                    f.write(manifest)
        self.committed = True
        self._release()
        remove_stale_temps(self.target, self.path)

    def _commit_remote(self, manifest: Optional[bytes]) -> None:
        fs, where = _fs.locate(self.target, self.storage_options)
        at = posixpath.join(where, self.manifest_name)
        url = join(self.target, self.manifest_name)
        if self.version is None:
            if manifest is not None:  # else the folder, written in place, is all there is
                versions.publish(fs, url, at, manifest, self.expected)
        else:
            if manifest is not None:
                inner = join(self.path, self.manifest_name)
                with atomic_write(inner, storage_options=self.storage_options) as f:
                    f.write(manifest)
            versions.publish(fs, url, at, versions.pointer_bytes(self.version), self.expected)
        self.committed = True
        self._remove_superseded()

    def _remove_superseded(self) -> None:
        """After a URL commit: delete the previous commit's files and killed saves' versions.

        Also, once the target is versioned, DCP files beside the versions: an earlier
        commit in place whose clean-up a crash cut short.
        """
        opts: dict[str, Any] = {"storage_options": self.storage_options}
        try:
            stale = [
                join(self.target, n)
                for n in listdir(self.target, include_temp=True, **opts)
                if n != self.version and versions.is_stale_name(n, self.version is not None)
            ]
            for path in dict.fromkeys((*self.superseded, *stale)):
                remove(path, recursive=True, missing_ok=True, **opts)
        except Exception as exc:  # the new checkpoint is committed: say so, do not fail it
            warn(
                f"{self.target} was committed, but deleting the files of the checkpoint it "
                f"replaced failed ({type(exc).__name__}: {exc}); the next save deletes them",
                RuntimeWarning,
            )

    def _release(self) -> None:
        if self._unlock is not None:
            self._unlock()  # closes the fd once, dropping the lock

    def discard(self, exc: Optional[BaseException] = None) -> None:
        """Delete the uncommitted folder; a failure to do so becomes a note on ``exc``.

        A folder written in place on a URL is left alone (another save may have
        committed there meanwhile); the next successful save deletes what it left.
        """
        if self.committed:
            return

        def remove_folder() -> None:
            try:
                if self.path != self.target or not _fs.is_remote(self.target):
                    remove(
                        self.path,
                        storage_options=self.storage_options,
                        recursive=True,
                        missing_ok=True,
                    )
            finally:
                self._release()

        if exc is None:
            remove_folder()
        else:
            cleanup_after(exc, f"the unfinished {self.path}", remove_folder)


@contextlib.contextmanager
def _commit_lock(parent: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``parent`` while one save checks and swaps its target.

    Saves to other targets in the same folder wait only for that moment.
    """
    if os.name == "nt":  # Windows cannot open a folder: the check and swap go unlocked
        yield
        return
    fd = os.open(parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        flock(fd, wait=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def _local_identity(target: str, manifest_name: str) -> Optional[str]:
    """What commits ``target`` now (its manifest's inode and times), None if nothing."""
    try:
        info = os.stat(os.path.join(target, manifest_name))
    except (FileNotFoundError, NotADirectoryError):
        return None
    return f"{info.st_ino}:{info.st_mtime_ns}:{info.st_size}"


def committed_folder(
    path: PathLike,
    *,
    storage_options: Optional[dict[str, Any]] = None,
    manifest_name: str = "manifest.json",
) -> str:
    """The folder a committed checkpoint's files are in: ``path``, or the version it points to.

    On fsspec URLs a checkpoint saved over a committed one lives in a version
    folder ``<path>/v-<hex>`` that ``<path>/manifest.json`` (a pointer) names;
    plain torch reads that folder (``dcp.load(state, checkpoint_id=<it>)``).

    Args:
        path: A checkpoint folder (local path or fsspec URL).
        storage_options: Options for the fsspec filesystem.
        manifest_name: The manifest's file name in the folder.

    Returns:
        ``path`` itself (local folders, and URLs committed in place), or its version folder.

    Example:
        >>> from ddpstate.storage import committed_folder
        >>> committed_folder("/runs/ckpt")
        '/runs/ckpt'
    """
    text = os.fspath(path)
    if not _fs.is_remote(text):
        return text
    try:
        with open_read(join(text, manifest_name), storage_options=storage_options) as f:
            head = f.read(257)  # a pointer is one short line: read no more than that
    except DDPStateError:
        return text
    version = versions.pointer_version(head)
    return join(text, version) if version else text


def stage_folder(
    target: PathLike,
    *,
    fsync: bool = True,
    storage_options: Optional[dict[str, Any]] = None,
    manifest_name: str = "manifest.json",
    in_place: bool = False,
) -> StagedFolder:
    """Stage a folder that replaces ``target`` when committed (see :func:`staged_folder`).

    For writers whose commit happens in another call than the staging (rank 0
    stages, every rank writes, rank 0 commits later).

    Args:
        target, fsync, storage_options, manifest_name: As for :func:`staged_folder`.
        in_place: Write a local ``target`` that does not exist yet in place: for
            folders whose manifest, written last, is what commits them (a folder
            without one is uncommitted and cleaned up), such as a manager's steps.

    Returns:
        The :class:`StagedFolder`; call its ``commit`` or, on failure, ``discard``.

    Raises:
        CheckpointWriteError: The staging folder cannot be made, or the URL's
            protocol has no known atomic publish (see :func:`trust_protocol`).
    """
    text = os.fspath(target)
    opts = storage_options
    kw: dict[str, Any] = {"fsync": fsync, "storage_options": opts, "manifest_name": manifest_name}
    if _fs.is_remote(text):
        fs, where = _fs.locate(text, opts)
        publish_method(fs, text)  # refuses a protocol that cannot publish atomically
        expected = versions.identity(fs, posixpath.join(where, manifest_name))
        if expected is None:  # nothing committed here to protect: write in place
            makedirs(text, storage_options=opts)
            return StagedFolder(text, text, **kw)
        version = versions.new_version()
        path = join(text, version)
        makedirs(path, storage_options=opts)
        old = _previous_files(text, opts, manifest_name)
        return StagedFolder(text, path, version=version, expected=expected, superseded=old, **kw)
    text = os.path.abspath(_fs.local_path(text))
    parent, base = os.path.split(text)
    makedirs(parent)
    expected = _local_identity(text, manifest_name)
    if in_place and not os.path.lexists(text):
        makedirs(text)
        return StagedFolder(text, text, expected=expected, **kw)
    # Locked while this save runs, so another save's clean-up of killed saves' folders
    # (remove_stale_temps) leaves it alone.
    path, fd = create_locked_temp(parent, base, text, as_folder=True, folder_mode=0o777)
    return StagedFolder(text, path, expected=expected, lock_fd=fd, **kw)


def _previous_files(
    target: str, opts: Optional[dict[str, Any]], manifest_name: str
) -> tuple[str, ...]:
    """What the commit at URL ``target`` uses: its version folder, or its listed files."""
    try:
        with open_read(join(target, manifest_name), storage_options=opts) as f:
            raw = f.read()
        version = versions.pointer_version(raw)
        if version is not None:
            return (join(target, version),)
        files = json.loads(raw.decode()).get("files")
    except (DDPStateError, ValueError, UnicodeDecodeError, AttributeError):
        return ()  # unreadable: nothing is deleted that might not be ddpstate's
    if not isinstance(files, dict):
        return ()
    # The names are the old manifest's claims: one leaving the folder (an absolute path
    # joins to a local path) is never deleted.
    return tuple(join(target, name) for name in files if _fs.name_problem(name) is None)


@contextlib.contextmanager
def staged_folder(
    target: PathLike,
    *,
    fsync: bool = True,
    storage_options: Optional[dict[str, Any]] = None,
    manifest_name: str = "manifest.json",
) -> Iterator[StagedFolder]:
    """Write a folder that replaces ``target`` whole: stage, write, manifest last, swap.

    The block writes into ``staged.path`` and may call ``staged.commit(manifest)``
    (the manifest is written last, then the folder takes ``target``'s place); a
    block that ends without committing commits with no manifest. If the block
    or the commit raises, the staging folder is deleted and ``target`` is left
    as it was. On fsspec URLs, whose folders cannot be swapped, a folder replacing
    a committed one is written under a fresh version prefix and committed by one
    PUT of a pointer manifest (see :func:`committed_folder`).

    Args:
        target: The folder to create or replace (local path or fsspec URL).
        fsync: Local paths: fsync the manifest and the folders (``False`` for
            scratch copies that a crash of the node may lose).
        storage_options: Options for the fsspec filesystem.
        manifest_name: The manifest's file name in the folder.

    Returns:
        A context manager yielding the :class:`StagedFolder`.

    Raises:
        CheckpointWriteError: The folder cannot be staged, or committing it failed.

    Example:
        >>> import os, tempfile
        >>> from ddpstate.storage import staged_folder
        >>> target = os.path.join(tempfile.mkdtemp(), "step_1")
        >>> with staged_folder(target) as staged:
        ...     _ = open(os.path.join(staged.path, "model.pt"), "wb").write(b"weights")
        ...     staged.commit(b'{"files": ["model.pt"]}')
        >>> sorted(os.listdir(target))
        ['manifest.json', 'model.pt']
    """
    staged = stage_folder(
        target, fsync=fsync, storage_options=storage_options, manifest_name=manifest_name
    )
    try:
        yield staged
        if not staged.committed:
            staged.commit()
    except BaseException as exc:
        staged.discard(exc)
        raise
