"""Bytes to durable places: atomic, fsynced writes to local paths and fsspec URLs."""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import re
import shutil
import stat
import sys
import threading
import warnings
import zlib
from collections.abc import Iterator
from typing import IO, Any, Optional

from ddpstate import _fs
from ddpstate._fs import PathLike
from ddpstate.errors import CheckpointNotFoundError, CheckpointWriteError, DDPStateError

__all__ = [
    "OBJECT_STORE_PROTOCOLS",
    "TEMP_MARKER",
    "atomic_write",
    "exists",
    "is_temp_name",
    "isdir",
    "join",
    "listdir",
    "makedirs",
    "open_read",
    "remove",
    "replace_folder",
    "retired_original",
    "temp_path_for",
    "write_by_name",
]


#: Marker in every temporary file name: ``.<target name>.ddpstate-tmp-<16 hex digits>``.
#: The leading dot hides it from ``ls`` and glob patterns such as ``*.pt``.
TEMP_MARKER = ".ddpstate-tmp-"
# A replaced checkpoint, renamed aside while its blocks are freed in the background.
_RETIRED_MARKER = ".ddpstate-old-"
_TEMP_RE = re.compile(r"^\..+\.ddpstate-(?:tmp|old)-[0-9a-f]{16}$")
# Freeing a large file's blocks is slow on some filesystems (ext4 mounted with
# `discard` spends ~0.5 s per GiB); below this size it is not worth a thread.
_RETIRE_MIN_BYTES = 32 << 20
_retiring: list[threading.Thread] = []
_retiring_lock = threading.Lock()

#: fsspec protocols whose files are single objects that appear only when the
#: upload completes; writing the target name directly is already atomic there,
#: and their "rename" is a copy, so no temporary name is used.
OBJECT_STORE_PROTOCOLS = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2", "tos", "cos", "obs"}
)

# Big enough that torch.save's many small zip-header writes do not each become a
# system call, small enough to be irrelevant next to a checkpoint.
_WRITE_BUFFER = 1 << 20


def is_temp_name(name: str) -> bool:
    """Tell whether a file name is one of ddpstate's in-progress temporary files.

    Such files are left behind only when a writer is killed mid-write (or just
    after replacing a large checkpoint, whose old copy is freed in the
    background as ``.<target>.ddpstate-old-<random>``); they are never a
    checkpoint and are safe to delete once no save is running.

    Args:
        name: A file name or path (only the last component is looked at).

    Returns:
        True for ``.<target>.ddpstate-tmp-<16 hex digits>`` (and ``-old-``) names.

    Example:
        >>> from ddpstate.storage import is_temp_name
        >>> is_temp_name(".model.pt.ddpstate-tmp-0123456789abcdef")
        True
        >>> is_temp_name("model.pt")
        False
    """
    base = posixpath.basename(os.fspath(name).replace(os.sep, "/").rstrip("/"))
    return bool(_TEMP_RE.match(base))


# os.urandom is what secrets.token_hex draws from; importing secrets (random,
# hmac, base64) would add to every command's start-up.
def _temp_name_for(base: str) -> str:
    return f".{base}{TEMP_MARKER}{os.urandom(8).hex()}"


def _retired_name_for(base: str) -> str:
    return f".{base}{_RETIRED_MARKER}{os.urandom(8).hex()}"


def _protocol(fs: Any) -> str:
    proto = fs.protocol
    return proto[0] if isinstance(proto, (tuple, list)) else str(proto)


def _add_note(exc: BaseException, note: str) -> None:
    # BaseException.add_note exists from Python 3.11 on; older versions lose the note.
    adder = getattr(exc, "add_note", None)
    if adder is not None:
        adder(note)


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


def fsync_dir(folder: str) -> None:
    """Make ``folder``'s entries (created, renamed, removed files) durable (no-op on Windows)."""
    if os.name == "nt":  # Windows cannot open a directory to fsync it.
        return
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems (certain network and FUSE mounts) refuse fsync on a
        # directory; the rename is then as durable as that filesystem makes it.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _cleanup(exc: BaseException, what: str, *steps: Any) -> None:
    # Runs the clean-up steps of a failed write; the original error is what the
    # caller must see, so a failing step is only recorded as a note on it.
    for step in steps:
        try:
            step()
        except Exception as cleanup_exc:
            _add_note(exc, f"cleaning up {what} also failed: {cleanup_exc!r}")


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
    retired = os.path.join(folder, _retired_name_for(base))
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
            warnings.warn(
                f"could not delete the replaced checkpoint {retired} ({exc}); it is safe to "
                f"delete by hand",
                RuntimeWarning,
                stacklevel=1,
            )

    # Not a daemon: the interpreter waits for it at exit, so no copy is left behind.
    thread = threading.Thread(target=unlink, name="ddpstate-free-replaced", daemon=False)
    with _retiring_lock:
        _retiring[:] = [t for t in _retiring if t.is_alive()]
        _retiring.append(thread)
    thread.start()


def _wait_for_freed() -> None:
    """Block until replaced checkpoints being freed in the background are gone."""
    with _retiring_lock:
        pending = list(_retiring)
    for thread in pending:
        thread.join()


def temp_path_for(target: PathLike) -> str:
    """A fresh hidden temporary name next to a local ``target`` (see :func:`is_temp_name`).

    Args:
        target: Local path whose folder gets the temporary name.

    Returns:
        ``<folder>/.<name>.ddpstate-tmp-<16 hex digits>``.

    Example:
        >>> from ddpstate.storage import is_temp_name, temp_path_for
        >>> is_temp_name(temp_path_for("/runs/step_0000000010"))
        True
    """
    folder, base = os.path.split(os.path.abspath(_fs.local_path(os.fspath(target))))
    return os.path.join(folder, _temp_name_for(base))


def retired_original(name: str) -> Optional[str]:
    """The target name a retired copy (``.<name>.ddpstate-old-<hex>``) was taken from.

    Args:
        name: A file or folder name.

    Returns:
        ``<name>``, or None when ``name`` is not a retired copy.

    Example:
        >>> from ddpstate.storage import retired_original
        >>> retired_original(".step_0000000010.ddpstate-old-0123456789abcdef")
        'step_0000000010'
    """
    base = posixpath.basename(name.replace(os.sep, "/").rstrip("/"))
    if not is_temp_name(base) or _RETIRED_MARKER not in base:
        return None
    return base[1 : base.rindex(_RETIRED_MARKER)]


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
    (:func:`retired_original` names its target, so a crash between the two
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
            leftover = os.path.join(parent, _retired_name_for(os.path.basename(old)))
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


def _unlink_missing_ok(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _flock(fd: int, *, wait: bool) -> bool:
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


def _remove_stale_temps(target: str, own: str) -> None:
    """Delete temp files of ``target`` left by writers that were killed mid-write.

    A writer holds an exclusive ``flock`` on its temp file from creation until
    it closes it just before the rename, and the kernel drops the lock when the
    process dies; a temp file of this target that nobody holds locked is stale.
    Best effort: a failure here never fails the save that just succeeded.
    """
    folder, base = os.path.split(target)
    prefix = f".{base}{TEMP_MARKER}"
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        if not name.startswith(prefix) or not _TEMP_RE.match(name) or path == own:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISREG(mode) and _flock(fd, wait=False):
                os.unlink(path)
            elif stat.S_ISDIR(mode) and _flock(fd, wait=False):
                # A write_by_name staging folder (a library's own temp file inside).
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass
        finally:
            os.close(fd)


def _create_locked_temp(
    folder: str, base: str, path: str, *, as_folder: bool = False
) -> tuple[str, int]:
    """Create a fresh temp file (or folder) for ``base`` and hold its ``flock``; (name, fd)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        temp = os.path.join(folder, _temp_name_for(base))
        try:
            # 0o666 lets the umask decide, as for any new file; O_EXCL refuses to
            # follow a planted symlink or reuse someone else's file.
            if as_folder:
                os.mkdir(temp, 0o700)
                fd = os.open(temp, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            else:
                fd = os.open(temp, flags, 0o666)
        except OSError as exc:
            raise CheckpointWriteError(
                f"cannot create a file in {folder} to write {path} ({type(exc).__name__}: "
                f"{exc}); check that the folder exists and is writable"
            ) from exc
        # Held until the file is closed: tells later saves this temp file is not stale.
        _flock(fd, wait=True)
        if os.fstat(fd).st_nlink:
            return temp, fd
        # Another process's save took the new file for a dead writer's in the moment
        # before the lock and deleted it: start again under a new name.
        os.close(fd)


@contextlib.contextmanager
def _atomic_write_local(path: str, fsync: bool) -> Iterator[IO[bytes]]:
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    temp, fd = _create_locked_temp(folder, os.path.basename(target), path)
    try:
        if hasattr(os, "fchmod"):  # not on Windows before Python 3.13
            with contextlib.suppress(FileNotFoundError):
                # Keep a restrictive mode the user gave the previous checkpoint.
                os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
        fileobj = os.fdopen(fd, "wb", buffering=_WRITE_BUFFER)
        # Named like a file opened by path (no second open), so that writers that
        # take a path (safetensors' save_file) can write the temp file.
        setattr(getattr(fileobj, "raw", fileobj), "name", temp)  # noqa: B010
    except BaseException as exc:
        _cleanup(exc, temp, lambda: os.close(fd), lambda: _unlink_missing_ok(temp))
        raise
    try:
        yield fileobj
    except BaseException as exc:
        _cleanup(exc, temp, fileobj.close, lambda: _unlink_missing_ok(temp))
        raise
    retired: Optional[str] = None
    try:
        fileobj.flush()
        if fsync:
            os.fsync(fileobj.fileno())
        fileobj.close()
        retired = _retire(target)
        os.replace(temp, target)
    except BaseException as exc:
        _cleanup(exc, temp, fileobj.close, lambda: _unlink_missing_ok(temp))
        if retired is not None:
            # The target still has its own name; drop only the second one.
            _cleanup(exc, retired, lambda: _unlink_missing_ok(retired))
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
    _remove_stale_temps(target, temp)


@contextlib.contextmanager
def write_by_name(fileobj: IO[bytes]) -> Iterator[str]:
    """A path for a library that writes files by name, committed through ``fileobj``.

    Some writers (``safetensors.torch.save_file``) take a path, write a temp
    file of their own next to it and rename it there, without an fsync. This
    yields a path inside a hidden, locked folder named like ddpstate's temp
    files (so a writer killed mid-write leaves nothing that is listed as a
    checkpoint, and the next save of the target deletes it); afterwards the
    file written there replaces the temp file of ``fileobj`` and ``fileobj``
    is re-bound to it (descriptor, lock and mode), so the fsync and rename
    that :func:`atomic_write` does next commit what the library wrote.

    Args:
        fileobj: The file object from :func:`atomic_write` for a local path,
            with nothing written through it.

    Returns:
        A context manager yielding the path to write.

    Raises:
        CheckpointWriteError: The staging folder cannot be made, or what was
            written there vanished (e.g. another save took it for a dead
            writer's); the target is untouched.

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
    stage, fd = _create_locked_temp(folder, base, temp, as_folder=True)
    try:
        written = os.path.join(stage, base)
        yield written
        try:
            os.replace(written, temp)
        except OSError as exc:
            raise CheckpointWriteError(
                f"the file written at {written} cannot replace {temp} ({type(exc).__name__}: "
                f"{exc}); nothing was replaced; save again"
            ) from exc
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        os.close(fd)
    _adopt_renamed_file(fileobj)


def _adopt_renamed_file(fileobj: IO[bytes]) -> None:
    """Point an :func:`atomic_write` file object at the file now at its temp path."""
    name = str(fileobj.name)
    held = os.fstat(fileobj.fileno())
    try:
        # Read-only is enough for fsync, flock and fchmod, and nothing is written after.
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise CheckpointWriteError(
            f"the file written at {name} is gone ({type(exc).__name__}: {exc}); nothing was "
            f"replaced; save again"
        ) from exc
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return
        # The same lock as the temp file had, so later saves never take it for stale.
        _flock(fd, wait=True)
        if not os.fstat(fd).st_nlink:
            raise CheckpointWriteError(
                f"the file written at {name} was deleted by another save before it was "
                f"committed; nothing was replaced; save again"
            )
        if hasattr(os, "fchmod"):
            os.fchmod(fd, stat.S_IMODE(held.st_mode))  # the mode atomic_write chose, not 0600
        fileobj.flush()
        os.dup2(fd, fileobj.fileno(), inheritable=False)
    finally:
        os.close(fd)
    fileobj.seek(0, os.SEEK_END)


@contextlib.contextmanager
def _atomic_write_object_store(fs: Any, url: str, path: str) -> Iterator[IO[bytes]]:
    # autocommit=False is fsspec's transaction protocol: the upload becomes the
    # object only on commit(), and discard() aborts it (e.g. the S3 multipart upload).
    try:
        fileobj = fs.open(path, "wb", autocommit=False)
    except Exception as exc:
        raise CheckpointWriteError(
            f"cannot start writing {url} ({type(exc).__name__}: {exc}); check the bucket, "
            f"credentials and storage_options"
        ) from exc
    try:
        yield fileobj
    except BaseException as exc:
        _cleanup(exc, f"the partial upload of {url}", fileobj.close, fileobj.discard)
        raise
    try:
        fileobj.close()
        fileobj.commit()
    except Exception as exc:
        _cleanup(exc, f"the partial upload of {url}", fileobj.discard)
        raise CheckpointWriteError(
            f"uploading {url} failed ({type(exc).__name__}: {exc}); the previous object is "
            f"untouched"
        ) from exc


@contextlib.contextmanager
def _atomic_write_rename(fs: Any, url: str, path: str) -> Iterator[IO[bytes]]:
    parent, base = posixpath.split(path.rstrip("/"))
    temp = posixpath.join(parent, _temp_name_for(base))

    def remove_temp() -> None:
        if fs.exists(temp):
            fs.rm(temp)

    try:
        fileobj = fs.open(temp, "wb")
    except Exception as exc:
        raise CheckpointWriteError(
            f"cannot create a temporary file next to {url} ({type(exc).__name__}: {exc}); "
            f"check the folder and storage_options"
        ) from exc
    try:
        yield fileobj
    except BaseException as exc:
        _cleanup(exc, f"the temporary file {temp}", fileobj.close, remove_temp)
        raise
    try:
        fileobj.close()
        fs.mv(temp, path)
    except Exception as exc:
        _cleanup(exc, f"the temporary file {temp}", remove_temp)
        raise CheckpointWriteError(
            f"finishing {url} failed ({type(exc).__name__}: {exc}); the previous file is untouched"
        ) from exc


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
    write, temp files of the same target that no process holds locked (left by
    a writer killed mid-write) are deleted.

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
            flushing, syncing or renaming it failed.

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
    if not _fs.is_remote(text):
        with _atomic_write_local(_fs.local_path(text), fsync) as local_file:
            yield local_file
        return
    fs, inner = _fs.url_to_fs(text, storage_options)
    if _protocol(fs) in OBJECT_STORE_PROTOCOLS:
        manager = _atomic_write_object_store(fs, text, inner)
    else:
        manager = _atomic_write_rename(fs, text, inner)
    with manager as remote_file:
        yield remote_file


def size_and_crc32(f: IO[bytes], chunk_size: int = 8 << 20) -> tuple[int, int]:
    """Read ``f`` to its end: ``(bytes read, CRC-32 of them)``, ``chunk_size`` at a time.

    Example:
        >>> import io
        >>> size_and_crc32(io.BytesIO(b"abc"))
        (3, 891568578)
    """
    size, crc = 0, 0
    while True:
        chunk = f.read(chunk_size)
        if not chunk:
            return size, crc
        size += len(chunk)
        crc = zlib.crc32(chunk, crc)


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
        if not _fs.is_remote(text):
            return open(_fs.local_path(text), "rb")
        fs, inner = _fs.url_to_fs(text, storage_options)
        return fs.open(inner, "rb")  # type: ignore[no-any-return]
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
    text = os.fspath(path)
    if not _fs.is_remote(text):
        return os.path.exists(_fs.local_path(text))
    fs, inner = _fs.url_to_fs(text, storage_options)
    return bool(fs.exists(inner))


def isdir(path: PathLike, *, storage_options: Optional[dict[str, Any]] = None) -> bool:
    """Tell whether a local path or fsspec URL is a folder (a prefix on object stores).

    Example:
        >>> import tempfile
        >>> from ddpstate.storage import isdir
        >>> isdir(tempfile.gettempdir())
        True
    """
    text = os.fspath(path)
    if not _fs.is_remote(text):
        return os.path.isdir(_fs.local_path(text))
    fs, inner = _fs.url_to_fs(text, storage_options)
    return bool(fs.isdir(inner))


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
    if not _fs.is_remote(text):
        local = _fs.local_path(text)
        if folder:
            shutil.rmtree(local)
        else:
            os.unlink(local)
        return
    fs, inner = _fs.url_to_fs(text, storage_options)
    fs.rm(inner, recursive=folder)


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
        if not _fs.is_remote(text):
            names = os.listdir(_fs.local_path(text))
        else:
            fs, inner = _fs.url_to_fs(text, storage_options)
            names = [posixpath.basename(p.rstrip("/")) for p in fs.ls(inner, detail=False)]
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
        if not _fs.is_remote(text):
            os.makedirs(_fs.local_path(text), exist_ok=True)
            return
        fs, inner = _fs.url_to_fs(text, storage_options)
        if _protocol(fs) not in OBJECT_STORE_PROTOCOLS:
            fs.makedirs(inner, exist_ok=True)
    except OSError as exc:
        raise CheckpointWriteError(
            f"cannot create folder {text} ({type(exc).__name__}: {exc}); check permissions"
        ) from exc
