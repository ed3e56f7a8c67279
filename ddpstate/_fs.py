"""Telling local paths from fsspec URLs, and opening the filesystem behind a URL."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

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
