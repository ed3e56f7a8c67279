"""What every framework integration shares: the newest checkpoint that verifies."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

from ddpstate import storage
from ddpstate._manifest import MANIFEST_NAME, verify_checkpoint
from ddpstate._warn import warn
from ddpstate.convert import verify_file
from ddpstate.dist import get_rank
from ddpstate.errors import DDPStateError


def missing_framework(module: str, extra: str) -> ImportError:
    """The error for an integration whose framework is not installed."""
    return ImportError(
        f"ddpstate.integrations.{extra} needs {module}, which is not installed; "
        f'pip install "ddpstate[{extra}]"'
    )


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
            # Integrity only: the pickle is scanned, never run, so unsafe globals are no problem.
            problems = verify_file(path, weights_only=False, storage_options=opts).problems
    except DDPStateError as exc:
        return str(exc)
    return "; ".join(problems) or None


def newest_verified(
    candidates: Iterable[str], *, what: str, storage_options: Optional[dict[str, Any]] = None
) -> Optional[str]:
    """The first of ``candidates`` (newest first) that verifies; each one skipped is named.

    A folder verifies when its ddpstate ``manifest.json`` is present and every file it
    lists has its recorded size and CRC-32 (:func:`ddpstate.manager.verify_checkpoint`);
    a file when :func:`ddpstate.convert.verify_file` finds it whole (every record's
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
