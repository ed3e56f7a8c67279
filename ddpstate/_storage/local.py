"""Atomic, durable writes of one local file: a locked temp file, fsync, rename, fsync.

A replaced large file is renamed aside and its blocks freed by a background thread,
off the caller's critical path; temp files left by writers killed mid-write are found
by their free ``flock`` and deleted after the next successful write in their folder,
with the second name of a replaced file a killed writer left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from typing import IO, Optional

from ddpstate._storage.temps import (
    _TEMP_RE,
    TEMP_MARKER,
    cleanup_after,
    fsync_dir,
    retired_name_for,
    retired_original,
    temp_name_for,
)
from ddpstate._warn import warn
from ddpstate.errors import CheckpointWriteError, InvalidArgumentError

__all__ = [
    "atomic_write_local",
    "create_locked_temp",
    "flock",
    "remove_stale_temps",
    "wait_for_freed",
    "write_by_name",
]

# Freeing a large file's blocks is slow on some filesystems (ext4 mounted with
# `discard` spends ~0.5 s per GiB); below this size it is not worth a thread.
_RETIRE_MIN_BYTES = 32 << 20
_retiring: list[threading.Thread] = []
_retiring_lock = threading.Lock()

# Big enough that torch.save's many small zip-header writes do not each become a
# system call, small enough to be irrelevant next to a checkpoint.
_WRITE_BUFFER = 1 << 20


def _retire(target: str) -> Optional[str]:
    """Give a large previous file a second, hidden name, so replacing it frees nothing.

    The blocks are then freed by :func:`_free_later` after the new file is
    committed, off the caller's critical path. Returns None (plain replace) for
    small or missing targets, symlinks, and filesystems without hard links.
    """
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_size < _RETIRE_MIN_BYTES or info.st_nlink != 1:
        return None
    folder, base = os.path.split(target)
    retired = os.path.join(folder, retired_name_for(base))
    try:
        os.link(target, retired)
    except OSError:
        return None
    return retired


def _free_later(retired: str) -> None:
    def unlink() -> None:
        try:
            os.unlink(retired)
        except FileNotFoundError:
            pass
        except OSError as exc:
            warn(
                f"could not delete the replaced checkpoint {retired} ({exc}); it is safe to "
                f"delete by hand",
                RuntimeWarning,
            )

    # Not a daemon: the interpreter waits for it at exit, so no copy is left behind.
    thread = threading.Thread(target=unlink, name="ddpstate-free-replaced", daemon=False)
    with _retiring_lock:
        _retiring[:] = [t for t in _retiring if t.is_alive()]
        _retiring.append(thread)
    thread.start()


def wait_for_freed() -> None:
    """Block until replaced checkpoints being freed in the background are gone.

    Example:
        >>> from ddpstate.storage import wait_for_freed
        >>> wait_for_freed()
    """
    with _retiring_lock:
        pending = list(_retiring)
    for thread in pending:
        thread.join()


def _unlink_missing_ok(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def flock(fd: int, *, wait: bool) -> bool:
    """Take an exclusive ``flock`` on ``fd``; False where another process holds it.

    Also False where locks are unavailable (Windows, filesystems without
    ``flock``), so a temp file is then never judged stale.
    """
    try:
        import fcntl
    except ImportError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        return False
    return True


def remove_stale_temps(target: str, own: str, own_retired: Optional[str] = None) -> None:
    """Delete what writers killed mid-write left in ``target``'s folder, for any of its targets.

    A writer holds an exclusive ``flock`` on its temp file, or on its staging
    folder (``create_locked_temp``: ``stage_folder``'s, ``write_by_name``'s), from
    creation until its commit, and the kernel drops the lock when the process dies;
    a temp file or folder that nobody holds locked is stale, whichever file of the
    folder it was for. So a killed save is cleaned up by the next save in its folder,
    not only by the next save of its own target: an Accelerate ``checkpoint_3`` killed
    mid-write goes with the commit of ``checkpoint_4``. Retired copies
    (:func:`_free_retired`) go too, but ``own_retired``, this write's own, already
    being freed. Best effort: a failure here never fails the save that just succeeded.
    """
    folder = os.path.dirname(target)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        original = retired_original(name)
        if original is not None:
            if path != own_retired:
                _free_retired(path, os.path.join(folder, original))
            continue
        if TEMP_MARKER not in name or not _TEMP_RE.match(name) or path == own:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISREG(mode) and flock(fd, wait=False):
                os.unlink(path)
            elif stat.S_ISDIR(mode) and flock(fd, wait=False):
                # A killed save's staging folder (every ddpstate writer locks its own).
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass
        finally:
            os.close(fd)


def _free_retired(path: str, original: str) -> None:
    """Free a retired copy (of a file or a folder) in the folder that a crash left behind.

    A writer killed between :func:`_retire`'s link and its rename leaves a second
    name of the old file, a full copy once that target is replaced again. It is
    never the only copy of a checkpoint (the target keeps its name throughout), so
    it is always safe to drop; a live writer's one only makes its replace free the
    blocks itself. A retired folder (``replace_folder`` killed between its two
    renames) is the only copy of the old checkpoint while ``original`` is missing,
    so it is kept then (a manager puts it back); once a save committed ``original``
    again it is outdated and goes.
    """
    with contextlib.suppress(OSError):
        mode = os.lstat(path).st_mode
        if stat.S_ISREG(mode):
            _free_later(path)
        elif stat.S_ISDIR(mode) and os.path.isdir(original):
            shutil.rmtree(path, ignore_errors=True)


def create_locked_temp(
    folder: str, base: str, path: str, *, as_folder: bool = False, folder_mode: int = 0o700
) -> tuple[str, int]:
    """Create a fresh temp file (or folder) for ``base`` and hold its ``flock``; (name, fd).

    The fd holding the lock is read-only (a file's writer opens its own): the lock then
    outlives the writer's close until the rename, and the kernel sees the file closed
    after writing before it gets its final name.
    ``folder_mode``: a staging folder that becomes the checkpoint takes 0o777 (the umask
    decides, as for any new folder); a private scratch folder keeps 0o700.
    """
    flags = os.O_RDONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        temp = os.path.join(folder, temp_name_for(base))
        try:
            # 0o666 lets the umask decide, as for any new file; O_EXCL refuses to
            # follow a planted symlink or reuse someone else's file.
            if as_folder:
                os.mkdir(temp, folder_mode)
                fd = os.open(temp, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            else:
                fd = os.open(temp, flags, 0o666)
        except OSError as exc:
            raise CheckpointWriteError(
                f"cannot create a file in {folder} to write {path} ({type(exc).__name__}: "
                f"{exc}); check that the folder exists and is writable"
            ) from exc
        # Held until the file is closed: tells later saves this temp file is not stale.
        flock(fd, wait=True)
        if os.fstat(fd).st_nlink:
            return temp, fd
        # Another process's save took the new file for a dead writer's in the moment
        # before the lock and deleted it: start again under a new name.
        os.close(fd)


def _close_open(fd: int) -> None:
    """Close ``fd`` if it was opened (not -1)."""
    if fd >= 0:
        os.close(fd)


@contextlib.contextmanager
def atomic_write_local(path: str, fsync: bool) -> Iterator[IO[bytes]]:
    """:func:`ddpstate.storage.atomic_write` for a local path (see there).

    Args:
        path: The local target.
        fsync: Sync the file and its folder (False: atomic, not durable).

    Returns:
        A context manager yielding the temp file, committed when the block succeeds.

    Raises:
        CheckpointWriteError: Creating, syncing or renaming the temp file failed.
        InvalidArgumentError: ``path`` is a folder.

    Example:
        >>> import os, tempfile
        >>> from ddpstate._storage.local import atomic_write_local
        >>> path = os.path.join(tempfile.mkdtemp(), "x.bin")
        >>> with atomic_write_local(path, fsync=False) as f:
        ...     _ = f.write(b"x")
        >>> os.listdir(os.path.dirname(path))
        ['x.bin']
    """
    target = os.path.abspath(path)
    if os.path.isdir(target):
        # The final rename would fail with IsADirectoryError after the whole file was
        # written, and read as a write failure ("check free space and permissions").
        raise InvalidArgumentError(
            f"{path} is a folder; save needs a file path such as {os.path.join(path, 'model.pt')}"
        )
    folder = os.path.dirname(target)
    temp, lock = create_locked_temp(folder, os.path.basename(target), path)
    fd = -1
    try:
        # The file is ours (created under O_EXCL and locked since): nobody renames or
        # deletes a locked temp file, so its name still leads to it.
        fd = os.open(temp, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0))
        if hasattr(os, "fchmod"):  # not on Windows before Python 3.13
            with contextlib.suppress(FileNotFoundError):
                # Keep a restrictive mode the user gave the previous checkpoint.
                os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
        fileobj = os.fdopen(fd, "wb", buffering=_WRITE_BUFFER)
        # Named like a file opened by path (no second open): write_by_name and
        # messages find the temp file by it.
        setattr(getattr(fileobj, "raw", fileobj), "name", temp)  # noqa: B010
    except BaseException as exc:
        os.close(lock)  # first: Windows deletes no file that is open
        cleanup_after(exc, temp, lambda: _close_open(fd), lambda: _unlink_missing_ok(temp))
        raise
    try:
        yield fileobj
    except BaseException as exc:
        os.close(lock)
        cleanup_after(exc, temp, fileobj.close, lambda: _unlink_missing_ok(temp))
        raise
    retired: Optional[str] = None
    try:
        # The read-only lock fd stays open from the writer's close to the rename, else
        # another save's clean-up may take the closed temp file for a killed save's and
        # delete it. (Windows has neither flock nor a rename of an open file.)
        try:
            fileobj.flush()
            if fsync:
                os.fsync(fileobj.fileno())
            fileobj.close()
            if os.name == "nt":
                os.close(lock)
                lock = -1
            retired = _retire(target)
            os.replace(temp, target)
        finally:
            _close_open(lock)
    except BaseException as exc:
        cleanup_after(exc, temp, fileobj.close, lambda: _unlink_missing_ok(temp))
        if retired is not None:
            # The target still has its own name; drop only the second one.
            cleanup_after(exc, retired, lambda: _unlink_missing_ok(retired))
        if isinstance(exc, OSError):
            raise CheckpointWriteError(
                f"writing {path} failed ({type(exc).__name__}: {exc}); the previous file is "
                f"untouched; check free space and permissions"
            ) from exc
        raise
    try:
        if fsync:
            fsync_dir(folder)
    except OSError as exc:
        raise CheckpointWriteError(
            f"{path} was written and renamed into place, but syncing its folder failed "
            f"({type(exc).__name__}: {exc}); the new file may not survive a power loss"
        ) from exc
    finally:
        if retired is not None and os.path.exists(retired):
            _free_later(retired)
    remove_stale_temps(target, temp, retired)


@contextlib.contextmanager
def write_by_name(fileobj: IO[bytes]) -> Iterator[str]:
    """A path for a library that writes files by name, committed through ``fileobj``.

    Some writers take a path, not a file object, and write a temp file of their
    own there. This yields a path inside a hidden, locked folder named like
    ddpstate's temp files (so a writer killed mid-write leaves nothing that is
    listed as a checkpoint, and the next save of the target deletes it);
    afterwards what was written there is copied into ``fileobj``, so the fsync
    and rename that :func:`atomic_write` does next commit it.

    Args:
        fileobj: The file object from :func:`atomic_write` for a local path.

    Returns:
        A context manager yielding the path to write.

    Raises:
        CheckpointWriteError: The staging folder cannot be made, or nothing
            was written at the path; the target is untouched.

    Example:
        >>> import os, tempfile
        >>> from ddpstate.storage import atomic_write, write_by_name
        >>> path = os.path.join(tempfile.mkdtemp(), "x.bin")
        >>> with atomic_write(path) as f, write_by_name(f) as name:
        ...     with open(name, "wb") as other:
        ...         _ = other.write(b"written by name")
        >>> open(path, "rb").read(), os.listdir(os.path.dirname(path))
        (b'written by name', ['x.bin'])
    """
    temp = str(fileobj.name)
    folder, temp_base = os.path.split(temp)
    base = temp_base[1 : temp_base.rindex(TEMP_MARKER)]
    stage, fd = create_locked_temp(folder, base, temp, as_folder=True)
    try:
        written = os.path.join(stage, base)
        yield written
        try:
            with open(written, "rb") as src:
                shutil.copyfileobj(src, fileobj, _WRITE_BUFFER)
        except FileNotFoundError as exc:
            raise CheckpointWriteError(
                f"nothing was written at {written} ({exc}); nothing was replaced; save again"
            ) from exc
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        os.close(fd)
