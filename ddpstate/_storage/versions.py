"""Folders on fsspec URLs: each save under a fresh version prefix, committed by one small PUT.

An object store cannot swap two folders, so a folder that replaces a committed one is
written to ``<target>/v-<16 hex digits>/`` (its own ``manifest.json`` included) and
committed by replacing ``<target>/manifest.json`` with a pointer naming that version,
one small atomic PUT. The PUT is a compare-and-swap: it succeeds only if the manifest
is still the one the save saw when it started, so of two overlapping saves the second
to commit fails instead of publishing over the first. Readers follow the pointer
(:func:`pointer_version`); plain torch reads the version prefix the pointer names.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

from ddpstate._storage.remote import (
    UPLOAD,
    atomic_write_object_store,
    atomic_write_rename,
    protocol_of,
    publish_method,
)
from ddpstate._storage.temps import is_temp_name
from ddpstate.errors import CheckpointWriteError

__all__ = [
    "VERSION_FIELD",
    "identity",
    "is_stale_name",
    "is_version_name",
    "moved_error",
    "new_version",
    "pointer_bytes",
    "pointer_version",
    "publish",
]

#: The one key of a pointer manifest: the version folder that holds the checkpoint.
VERSION_FIELD = "committed_version"
_VERSION_RE = re.compile(r"^v-[0-9a-f]{16}$")
# fsspec's S3 filesystem passes these conditions to PutObject (conditional writes).
_S3_PROTOCOLS = ("s3", "s3a")


def new_version() -> str:
    """A fresh version folder name, ``v-<16 hex digits>``.

    Example:
        >>> from ddpstate._storage.versions import is_version_name, new_version
        >>> is_version_name(new_version())
        True
    """
    return f"v-{os.urandom(8).hex()}"


def is_version_name(name: str) -> bool:
    """Tell whether ``name`` is a version folder's name.

    Example:
        >>> from ddpstate._storage.versions import is_version_name
        >>> is_version_name("v-0123456789abcdef"), is_version_name("model.pt")
        (True, False)
    """
    return bool(_VERSION_RE.match(name))


def is_stale_name(name: str, versioned: bool) -> bool:
    """Tell whether an entry beside a just-committed checkpoint is a dead save's leftover.

    Args:
        name: An entry of the target folder.
        versioned: The commit is a version folder, so nothing lies beside it but the
            pointer: DCP's files and temporary files there are left by an earlier save.

    Returns:
        True for other version folders, and with ``versioned`` for ``.metadata``,
        ``*.distcp`` and ddpstate's temporary names.

    Example:
        >>> from ddpstate._storage.versions import is_stale_name
        >>> is_stale_name("v-0123456789abcdef", False), is_stale_name(".metadata", True)
        (True, True)
    """
    if is_version_name(name):
        return True
    dcp_file = name.startswith(".metadata") or name.endswith(".distcp")
    return versioned and (dcp_file or is_temp_name(name))


def pointer_bytes(version: str) -> bytes:
    """The pointer manifest that commits ``version``.

    Example:
        >>> from ddpstate._storage.versions import pointer_bytes
        >>> pointer_bytes("v-0123456789abcdef")
        b'{"committed_version": "v-0123456789abcdef"}'
    """
    return json.dumps({VERSION_FIELD: version}).encode()


def pointer_version(raw: bytes) -> Optional[str]:
    """The version a pointer manifest names; None when ``raw`` is not a pointer.

    Example:
        >>> from ddpstate._storage.versions import pointer_version
        >>> pointer_version(b'{"committed_version": "v-0123456789abcdef"}')
        'v-0123456789abcdef'
        >>> pointer_version(b'{"files": {}}') is None
        True
    """
    if len(raw) > 256:  # a pointer is one short line; a manifest is not parsed twice
        return None
    try:
        parsed = json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(parsed, dict) or list(parsed) != [VERSION_FIELD]:
        return None
    version = parsed[VERSION_FIELD]
    return version if isinstance(version, str) and is_version_name(version) else None


def identity(fs: Any, path: str) -> Optional[str]:
    """What stands at ``path`` now (an ETag, or size and times), None if nothing.

    Args:
        fs: An fsspec filesystem.
        path: The object's path inside ``fs``.

    Returns:
        A string that changes whenever the object is replaced, or None.
    """
    fs.invalidate_cache(path)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return str(etag)
    return repr([info.get(k) for k in ("size", "mtime", "created", "generation", "md5Hash")])


def moved_error(url: str, exc: Optional[BaseException] = None) -> CheckpointWriteError:
    """The error of a save whose target another save committed while it was in flight."""
    return CheckpointWriteError(
        f"{url} was committed by another save while this one was in flight (two saves to one "
        f"checkpoint at once: an un-awaited async save, or a job still running); this save "
        f"committed nothing and the other one stands. Give each save its own checkpoint_id, "
        f"or wait for the previous save before starting the next"
        + (f" ({type(exc).__name__}: {exc})" if exc is not None else "")
    )


def publish(fs: Any, url: str, path: str, data: bytes, expected: Optional[str]) -> None:
    """Put ``data`` at ``path`` in one atomic step, only if ``expected`` still stands there.

    On S3 the check is the PUT's own condition (``If-Match`` the ETag seen at
    the start, ``If-None-Match: *`` when there was nothing); elsewhere what
    stands there is compared just before the write.

    Args:
        fs: The fsspec filesystem.
        url: The object's URL, for messages.
        path: The object's path inside ``fs``.
        data: The new content (a manifest or a pointer: small).
        expected: :func:`identity` when the save started.

    Raises:
        CheckpointWriteError: Another save replaced ``path`` meanwhile, or the write failed.
    """
    if protocol_of(fs) in _S3_PROTOCOLS:
        condition = {"mode": "create"} if expected is None else {"IfMatch": expected}
        try:
            fs.pipe_file(path, data, **condition)
        except Exception as exc:
            if identity(fs, path) != expected:
                raise moved_error(url, exc) from exc
            raise CheckpointWriteError(
                f"writing {url} failed ({type(exc).__name__}: {exc}); the previous commit stands"
            ) from exc
        fs.invalidate_cache(path)
        return
    if identity(fs, path) != expected:
        raise moved_error(url)
    write = atomic_write_object_store if publish_method(fs, url) == UPLOAD else atomic_write_rename
    with write(fs, url, path) as f:
        f.write(data)
