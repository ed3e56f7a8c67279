"""Warnings about the caller's call: pointed at the caller's line, said once per job.

Python's ``stacklevel`` counts frames from the ``warnings.warn`` call, so a fixed
number is right for one call path only: ``ddpstate.save`` reaches the tied-tensor
warning through four frames, ``CheckpointManager.save`` through six. Here the
level is found by walking the stack to the first frame outside ddpstate, so the
warning names the line of the user's code that made the call. Torch-free.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Optional

__all__ = ["caller_stacklevel", "warn"]

# ddpstate's own files, and torch's: torch calls ddpstate's module hooks (the
# in-place BatchNorm explanation runs inside loss.backward()), so the user's
# line is the first frame outside both.
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SKIPPED: tuple[str, ...] = (_PACKAGE,)


def _skipped_prefixes() -> tuple[str, ...]:
    torch = sys.modules.get("torch")  # never imported here: torch's frames exist only if it is
    where = getattr(torch, "__file__", None)
    if where is None:
        return _SKIPPED
    return (*_SKIPPED, os.path.dirname(os.path.abspath(where)) + os.sep)


def caller_stacklevel() -> int:
    """The ``stacklevel`` at which the caller's ``warnings.warn`` names the user's line.

    Written once as a frame walk, not with ``warnings.warn(skip_file_prefixes=...)``:
    that argument is Python 3.12+, and ddpstate supports 3.10.

    Returns:
        The level, counted as ``warnings.warn`` counts it from the frame that calls
        :func:`warn` (1 when no frame outside ddpstate and torch is found, e.g. in a
        background thread started by ddpstate).

    Example:
        >>> from ddpstate._warn import caller_stacklevel
        >>> caller_stacklevel() >= 1
        True
    """
    skipped = _skipped_prefixes()
    frame = sys._getframe(1)  # the caller, ddpstate's warn(); level 1 for warnings.warn there
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skipped):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level if frame is not None else 1


def warn(
    message: str,
    category: type[Warning] = UserWarning,
    *,
    rank: Optional[int] = None,
) -> None:
    """Issue a user-facing warning at the user's line, once per job.

    Args:
        message: The warning text (name the file, key or rank, and the fix).
        category: The warning class.
        rank: This process's rank, for a condition every rank sees alike (the same
            file, the same model): only rank 0 says it. None for a condition of
            this rank alone (it says it).

    Example:
        >>> import warnings
        >>> from ddpstate._warn import warn
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn("said by rank 0", rank=0)
        ...     warn("not by rank 1", rank=1)
        >>> [str(w.message) for w in caught]
        ['said by rank 0']
    """
    if rank is not None and rank != 0:
        return
    # This function's own frame is ddpstate's: the walk starts at its caller.
    warnings.warn(message, category, stacklevel=caller_stacklevel())
