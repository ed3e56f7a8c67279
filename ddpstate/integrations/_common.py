"""What every framework integration shares: choosing the newest checkpoint that verifies."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from ddpstate import _warn
from ddpstate._manifest import verify_checkpoint
from ddpstate.errors import DDPStateError


def newest_verified(candidates: Iterable[str], *, what: str) -> Optional[str]:
    """The first of ``candidates`` (newest first) that passes ``verify_checkpoint``.

    Each one skipped is named in a warning with its first problem, so a resume
    never falls back silently. ``what`` names the caller in the warning.

    Returns:
        The folder, or None when none verifies.
    """
    for folder in candidates:
        try:
            found = verify_checkpoint(folder)
            problem = found.problems[0] if found.problems else None
        except DDPStateError as exc:
            problem = str(exc)
        if problem is None:
            return folder
        _warn.warn(f"{what}: skipping {folder}: {problem}")
    return None
