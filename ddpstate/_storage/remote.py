"""Atomic writes to fsspec URLs: one upload committed at the end, or a temp name renamed.

Which of the two a filesystem gets is decided here (:func:`publish_method`) from what is
known of its backend; a filesystem whose atomic publish is not known is refused rather
than given an ``fs.mv`` that is a copy and a delete on most backends.
"""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Iterator
from typing import IO, Any

from ddpstate._storage.temps import cleanup_after, temp_name_for
from ddpstate.errors import CheckpointWriteError

__all__ = [
    "OBJECT_STORE_PROTOCOLS",
    "RENAME_PROTOCOLS",
    "atomic_write_object_store",
    "atomic_write_rename",
    "protocol_of",
    "publish_method",
    "trust_protocol",
]

#: fsspec protocols whose files are single objects that appear only when the
#: upload completes; writing the target name directly is already atomic there,
#: and their "rename" is a copy, so no temporary name is used.
OBJECT_STORE_PROTOCOLS = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2", "tos", "cos", "obs"}
)

#: fsspec protocols (besides local files) whose ``mv`` is one atomic rename: fsspec's
#: in-memory filesystem moves a dict entry. Everything else (sftp, ftp, smb, webdav,
#: hdfs...) is refused unless :func:`trust_protocol` names it.
RENAME_PROTOCOLS = frozenset({"memory"})

UPLOAD = "upload"
RENAME = "rename"
# Protocols a user vouched for with trust_protocol(): protocol -> UPLOAD or RENAME.
_trusted: dict[str, str] = {}


def trust_protocol(protocol: str, publish: str) -> None:
    """Accept the risk of writing to a filesystem whose atomic publish ddpstate does not know.

    ddpstate writes a file under a name nobody reads and publishes it in one step:
    an upload that appears whole when committed (object stores), or a rename
    (local disks, ``memory://``). For any other fsspec protocol it cannot tell
    whether ``mv`` is an atomic rename or a copy and a delete (which a crash can
    leave half done), so it refuses to write there until you say which holds.

    Args:
        protocol: The fsspec protocol (``"sftp"``, ``"hdfs"``...).
        publish: ``"rename"`` (its ``mv`` is one atomic rename on the backend) or
            ``"upload"`` (``open(..., autocommit=False)`` publishes the file only on
            ``commit()`` and ``discard()`` drops it).

    Raises:
        CheckpointWriteError: ``publish`` is neither.

    Example:
        >>> from ddpstate.storage import trust_protocol
        >>> # POSIX sftp servers rename atomically:
        >>> trust_protocol("sftp", "rename")  # doctest: +SKIP
    """
    if publish not in (UPLOAD, RENAME):
        raise CheckpointWriteError(
            f"trust_protocol({protocol!r}, {publish!r}): publish must be 'rename' or 'upload'"
        )
    _trusted[protocol] = publish


def protocol_of(fs: Any) -> str:
    """An fsspec filesystem's main protocol name (``"s3"``, ``"memory"``...).

    Args:
        fs: An fsspec filesystem.

    Returns:
        Its first protocol.

    Example:
        >>> import fsspec
        >>> from ddpstate._storage.remote import protocol_of
        >>> protocol_of(fsspec.filesystem("memory"))
        'memory'
    """
    proto = fs.protocol
    return proto[0] if isinstance(proto, (tuple, list)) else str(proto)


def publish_method(fs: Any, url: str) -> str:
    """How a new file is published atomically on ``fs``: ``"upload"`` or ``"rename"``.

    Args:
        fs: An fsspec filesystem (not the local one, which ddpstate writes itself).
        url: The URL being written, for the message.

    Returns:
        ``"upload"`` for object stores, ``"rename"`` for filesystems whose ``mv``
        is an atomic rename (``memory``, fsspec's local filesystem and its subclasses).

    Raises:
        CheckpointWriteError: The protocol's atomic publish is not known; the
            message names it and :func:`trust_protocol`, which accepts the risk.

    Example:
        >>> import fsspec
        >>> from ddpstate._storage.remote import publish_method
        >>> publish_method(fsspec.filesystem("memory"), "memory://x")
        'rename'
    """
    from fsspec.implementations.local import LocalFileSystem  # fsspec: URL writes only

    protocol = protocol_of(fs)
    if protocol in OBJECT_STORE_PROTOCOLS:
        return UPLOAD
    if protocol in RENAME_PROTOCOLS or isinstance(fs, LocalFileSystem):
        return RENAME
    if protocol in _trusted:
        return _trusted[protocol]
    raise CheckpointWriteError(
        f"cannot write {url}: ddpstate does not know whether the {protocol!r} filesystem "
        f"publishes a file atomically (its mv may be a copy and a delete, which a crash leaves "
        f"half done). If its rename is atomic, call ddpstate.storage.trust_protocol("
        f"{protocol!r}, 'rename') first (or 'upload' if open(autocommit=False) + commit() "
        f"publishes whole); otherwise write to a local path or an object store"
    )


@contextlib.contextmanager
def atomic_write_object_store(fs: Any, url: str, path: str) -> Iterator[IO[bytes]]:
    """Write one object that appears only when the upload is committed (s3, gs, az...).

    Args:
        fs: The object store's fsspec filesystem.
        url: The URL, for messages.
        path: The object's path inside ``fs``.

    Returns:
        A context manager yielding the upload's file object.

    Raises:
        CheckpointWriteError: The upload could not start or be committed; the
            previous object is untouched.

    Example:
        >>> import fsspec
        >>> # On s3:// the object appears at commit; memory:// has no uploads to hold back.
        >>> url = "memory://doc-remote/ckpt.pt"
        >>> fs, path = fsspec.core.url_to_fs(url)
        >>> with atomic_write_object_store(fs, url, path) as f:
        ...     _ = f.write(b"all or nothing")
        >>> fs.cat(path)
        b'all or nothing'
        >>> fs.rm(path)
    """
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
        # discard() only: close() would flush the truncated data, which a backend that
        # ignores autocommit=False publishes over the good object.
        cleanup_after(exc, f"the partial upload of {url}", lambda: _abort(fileobj))
        raise
    try:
        fileobj.close()
        fileobj.commit()
    except Exception as exc:
        cleanup_after(exc, f"the partial upload of {url}", lambda: _abort(fileobj))
        raise CheckpointWriteError(
            f"uploading {url} failed ({type(exc).__name__}: {exc}); the previous object is "
            f"untouched"
        ) from exc


def _abort(fileobj: Any) -> None:
    """Drop an upload without publishing it, and keep its finaliser from closing it later."""
    try:
        fileobj.discard()
    finally:
        # fsspec closes (flushes) an unclosed file when it is collected: mark it closed.
        fileobj.closed = True


@contextlib.contextmanager
def atomic_write_rename(fs: Any, url: str, path: str) -> Iterator[IO[bytes]]:
    """Write a temp file next to ``path`` on an fsspec filesystem, then rename it there.

    Args:
        fs: The fsspec filesystem (``memory``, ``sftp``...).
        url: The URL, for messages.
        path: The target's path inside ``fs``.

    Returns:
        A context manager yielding the temp file's file object.

    Raises:
        CheckpointWriteError: The temp file could not be made or renamed; the
            previous file is untouched.

    Example:
        >>> import fsspec
        >>> from ddpstate._storage.remote import atomic_write_rename
        >>> fs = fsspec.filesystem("memory")
        >>> with atomic_write_rename(fs, "memory://doc/x.bin", "/doc/x.bin") as f:
        ...     _ = f.write(b"x")
        >>> fs.cat("/doc/x.bin")
        b'x'
    """
    parent, base = posixpath.split(path.rstrip("/"))
    temp = posixpath.join(parent, temp_name_for(base))

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
        cleanup_after(exc, f"the temporary file {temp}", fileobj.close, remove_temp)
        raise
    try:
        fileobj.close()
        fs.mv(temp, path)
    except Exception as exc:
        cleanup_after(exc, f"the temporary file {temp}", remove_temp)
        raise CheckpointWriteError(
            f"finishing {url} failed ({type(exc).__name__}: {exc}); the previous file is untouched"
        ) from exc
