"""Atomic writes to fsspec URLs: one upload committed at the end, or a temp name renamed."""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Iterator
from typing import IO, Any

from ddpstate._storage.temps import cleanup_after, temp_name_for
from ddpstate.errors import CheckpointWriteError

__all__ = [
    "OBJECT_STORE_PROTOCOLS",
    "atomic_write_object_store",
    "atomic_write_rename",
    "protocol_of",
]

#: fsspec protocols whose files are single objects that appear only when the
#: upload completes; writing the target name directly is already atomic there,
#: and their "rename" is a copy, so no temporary name is used.
OBJECT_STORE_PROTOCOLS = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2", "tos", "cos", "obs"}
)


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
        cleanup_after(exc, f"the partial upload of {url}", fileobj.close, fileobj.discard)
        raise
    try:
        fileobj.close()
        fileobj.commit()
    except Exception as exc:
        cleanup_after(exc, f"the partial upload of {url}", fileobj.discard)
        raise CheckpointWriteError(
            f"uploading {url} failed ({type(exc).__name__}: {exc}); the previous object is "
            f"untouched"
        ) from exc


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
