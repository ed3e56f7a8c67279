"""ddpstate's temporary and retired file names, and cleaning up after a failed write."""

from __future__ import annotations

import errno
import os
import posixpath
import re
from typing import Any, Optional

from ddpstate import _fs
from ddpstate._fs import PathLike

__all__ = [
    "TEMP_MARKER",
    "cleanup_after",
    "fsync_dir",
    "is_temp_name",
    "retired_name_for",
    "retired_original",
    "temp_name_for",
    "temp_path_for",
]


#: Marker in every temporary file name: ``.<target name>.ddpstate-tmp-<16 hex digits>``.
#: The leading dot hides it from ``ls`` and glob patterns such as ``*.pt``.
TEMP_MARKER = ".ddpstate-tmp-"
# A replaced checkpoint, renamed aside while its blocks are freed in the background.
_RETIRED_MARKER = ".ddpstate-old-"
_TEMP_RE = re.compile(r"^\..+\.ddpstate-(?:tmp|old)-[0-9a-f]{16}$")


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
def temp_name_for(base: str) -> str:
    """A fresh temporary name for a file named ``base`` (``.<base>.ddpstate-tmp-<hex>``).

    Args:
        base: The target's file name.

    Returns:
        A name that :func:`is_temp_name` recognises.

    Example:
        >>> from ddpstate._storage.temps import is_temp_name, temp_name_for
        >>> is_temp_name(temp_name_for("model.pt"))
        True
    """
    return f".{base}{TEMP_MARKER}{os.urandom(8).hex()}"


def retired_name_for(base: str) -> str:
    """A fresh name for a replaced ``base`` kept aside (``.<base>.ddpstate-old-<hex>``).

    Args:
        base: The target's file or folder name.

    Returns:
        A name :func:`retired_original` maps back to ``base``.

    Example:
        >>> from ddpstate._storage.temps import retired_name_for, retired_original
        >>> retired_original(retired_name_for("step_1"))
        'step_1'
    """
    return f".{base}{_RETIRED_MARKER}{os.urandom(8).hex()}"


def _add_note(exc: BaseException, note: str) -> None:
    # BaseException.add_note exists from Python 3.11 on; older versions lose the note.
    adder = getattr(exc, "add_note", None)
    if adder is not None:
        adder(note)


def cleanup_after(exc: BaseException, what: str, *steps: Any) -> None:
    """Run the clean-up ``steps`` of a failed write; a step's failure becomes a note on ``exc``.

    Args:
        exc: The error the write failed with (the one the caller must see).
        what: What is being cleaned up, for the note.
        *steps: Callables run in order, each even if an earlier one failed.

    Example:
        >>> from ddpstate._storage.temps import cleanup_after
        >>> error = OSError("disk full")
        >>> cleanup_after(error, "the temp file", lambda: 1 / 0)
        >>> error.__notes__
        ["cleaning up the temp file also failed: ZeroDivisionError('division by zero')"]
    """
    # Runs the clean-up steps of a failed write; the original error is what the
    # caller must see, so a failing step is only recorded as a note on it.
    for step in steps:
        try:
            step()
        except Exception as cleanup_exc:
            _add_note(exc, f"cleaning up {what} also failed: {cleanup_exc!r}")


def fsync_dir(folder: str) -> None:
    """Make a rename or a new entry in ``folder`` durable (fsync the directory itself).

    Args:
        folder: A local directory.

    Raises:
        OSError: The directory cannot be opened, or fsync failed for a reason other than
            the filesystem not supporting it on directories (then it is skipped).

    Example:
        >>> import tempfile
        >>> from ddpstate.storage import fsync_dir
        >>> fsync_dir(tempfile.mkdtemp())
    """
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
    return os.path.join(folder, temp_name_for(base))


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
