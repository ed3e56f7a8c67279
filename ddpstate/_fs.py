"""Telling local paths from fsspec URLs, opening the filesystem behind a URL, confining names."""

from __future__ import annotations

import os
import re
import stat
from typing import Any, Optional, Union

from ddpstate.errors import CheckpointCorruptError

PathLike = Union[str, "os.PathLike[str]"]


def is_remote(path: PathLike) -> bool:
    """True for fsspec URLs (``s3://``, ``memory://``...); ``file://`` counts as local."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def local_path(path: PathLike) -> str:
    """The local filesystem path of a plain path or a ``file://`` URL."""
    text = os.fspath(path)
    return text[len("file://") :] if text.startswith("file://") else text


def url_to_fs(url: str, storage_options: Optional[dict[str, Any]] = None) -> tuple[Any, str]:
    """Return ``(filesystem, path inside it)`` for an fsspec URL.

    fsspec is imported here only, so local-only users never pay for it.
    """
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs, path


def locate(path: PathLike, storage_options: Optional[dict[str, Any]] = None) -> tuple[Any, str]:
    """``(None, local path)`` for a local path; ``(filesystem, path inside it)`` for a URL."""
    text = os.fspath(path)
    if not is_remote(text):
        return None, local_path(text)
    return url_to_fs(text, storage_options)


# A drive ("C:") or a scheme ("s3://"): a name with a colon is never one of a checkpoint's files.
_NOT_RELATIVE = re.compile(r"^[/\\]|:")
_KINDS = (
    (stat.S_ISFIFO, "a FIFO (opening it would wait for a writer forever)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


def name_problem(name: object) -> Optional[str]:
    """Why ``name``, a file name a checkpoint gives, could leave its folder (None: it cannot).

    Only the text is looked at: an absolute path, a ``..`` part, a drive or URL
    scheme, a backslash or NUL byte is refused (:func:`confined_file` also
    follows symlinks).

    Example:
        >>> from ddpstate._fs import name_problem
        >>> name_problem("__0_0.distcp") is None, name_problem("../x.distcp")
        (True, "has a '..' part, which leaves the folder")
    """
    if not isinstance(name, str) or not name:
        return "is not a file name"
    if "\x00" in name or "\\" in name:
        return "holds a NUL byte or a backslash, which no checkpoint file name does"
    if _NOT_RELATIVE.search(name) or os.path.isabs(name):
        return "is an absolute path, a drive or a URL, not a name inside the folder"
    if ".." in name.split("/"):
        return "has a '..' part, which leaves the folder"
    return None


def is_special_file(path: str) -> bool:
    """Whether a local path is a FIFO, socket or device: opening one blocks until a
    writer comes, or reads forever, so no reader opens it.

    Example:
        >>> from ddpstate._fs import is_special_file
        >>> is_special_file("/dev/null"), is_special_file("/")
        (True, False)
    """
    return os.path.exists(path) and not (os.path.isfile(path) or os.path.isdir(path))


def _hub_blob(base: str, real: str) -> bool:
    """Whether ``real`` is a blob of the Hugging Face Hub cache repository ``base`` lies in.

    The Hub's cache keeps each file once, in ``<repo>/blobs/``, and links it from
    every ``<repo>/snapshots/<revision>/`` that has it: a sharded model loaded from
    the cache is all symlinks leading out of its folder, into that one place.
    """
    at = base
    while os.path.dirname(at) != at:
        if os.path.basename(os.path.dirname(at)) == "snapshots":
            repo = os.path.dirname(os.path.dirname(at))
            return os.path.dirname(real) == os.path.join(repo, "blobs")
        at = os.path.dirname(at)
    return False


def confined_file(folder: PathLike, name: object, *, checkpoint: str, entry: str) -> str:
    """Resolve a name a checkpoint gives to a regular file inside its folder, or refuse it.

    Paths inside a checkpoint (a DCP ``.metadata`` item's ``relative_path``, a
    manifest's files, a Hugging Face index's shards) are claims of the file, so
    they are checked before anything is opened: the name must pass
    :func:`name_problem`; on local disk it must also, with symlinks followed,
    stay inside the folder (or, in a Hugging Face Hub cache snapshot, lead to
    its repository's ``blobs/``) and be a regular file (a FIFO would block the
    reader, a device would read forever). On an fsspec URL the name is checked
    as text only (object stores have no symlinks or FIFOs).

    Args:
        folder: The checkpoint's folder (local path or fsspec URL).
        name: The name the checkpoint gives, relative to ``folder``.
        checkpoint: How to name the checkpoint in the message.
        entry: What gave the name (``".metadata item 'w'"``), for the message.

    Returns:
        The file's path (``folder`` joined with ``name``). A name that passes
        but names nothing yet is returned too: the caller's open reports it missing.

    Raises:
        CheckpointCorruptError: The name reaches outside ``folder`` or is not a
            regular file; the message names the checkpoint, the entry and the path.

    Example:
        >>> import tempfile
        >>> from ddpstate._fs import confined_file
        >>> folder = tempfile.mkdtemp()
        >>> confined_file(folder, "/etc/passwd", checkpoint=folder, entry="item 'w'")
        Traceback (most recent call last):
        ...
        ddpstate.errors.CheckpointCorruptError: ...item 'w' names '/etc/passwd'...
    """
    text = os.fspath(folder)
    remote = is_remote(text)
    why = name_problem(name)
    path = f"{text.rstrip('/')}/{name}" if remote else os.path.join(local_path(text), str(name))
    if why is None and not remote:
        base = os.path.realpath(local_path(text))
        real = os.path.realpath(path)
        if os.path.commonpath([base, real]) != base and not _hub_blob(base, real):
            why = f"is a symlink that leads outside the folder (to {real})"
        else:
            try:
                mode = os.stat(real).st_mode
            except OSError:
                return path  # missing or unreadable: the caller's open says which
            if not stat.S_ISREG(mode):
                kind = next((what for test, what in _KINDS if test(mode)), "something else")
                why = f"is {kind}, not a regular file"
    if why is not None:
        raise CheckpointCorruptError(
            f"{checkpoint}: {entry} names {name!r} ({path}), which {why}. A checkpoint's files "
            f"lie inside its folder, so it is damaged or was made to read other files: do not "
            f"load it; re-save it or obtain it again"
        )
    return path
