"""Whether every rank sees what one rank wrote or found: storage the ranks do not share.

A checkpoint folder on one node's local disk is written by one rank and
invisible to the ranks of other nodes; a later load then fails on some ranks
only, or a restore calls the intact checkpoint damaged. The checks here are a
``stat`` per rank, compared in one round, so the ranks that cannot see the file
are named on every rank together with the fix.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Optional, Union

from ddpstate import _fs
from ddpstate._calls import who
from ddpstate.dist import gather_and_decide
from ddpstate.errors import CheckpointNotFoundError

#: ``stat``'s answer for a folder (a folder's size says nothing).
FOLDER = -1
# Pauses after each absent answer (the failure path only): about 1.5 s in all.
_RETRIES = (0.1, 0.3, 1.0, 0.0)


def stat(path: str) -> Optional[int]:
    """What this rank sees at a local ``path``: its size, :data:`FOLDER`, or None (absent).

    Remote URLs are shared by every rank by nature; they are not stat'ed (0).
    A file is opened and ``fstat``-ed rather than ``stat``-ed: on NFS, opening
    revalidates the cached attributes (close-to-open consistency), and an
    absent answer is asked again a few times (a cached "no such file" of the
    folder can outlive another node's write by a moment).

    Example:
        >>> import tempfile
        >>> from ddpstate._visibility import FOLDER, stat
        >>> stat(tempfile.mkdtemp()) == FOLDER, stat("/no/such/file")
        (True, None)
    """
    if _fs.is_remote(path):
        return 0
    local = _fs.local_path(path)
    for pause in _RETRIES:
        if os.path.isdir(local):
            return FOLDER
        try:
            fd = os.open(local, os.O_RDONLY)
        except OSError:
            time.sleep(pause)
            continue
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)
    return None


def not_shared(
    path: str, holder: int, seen: Sequence[Optional[int]], verb: str, fix: str
) -> Optional[CheckpointNotFoundError]:
    """None when every rank saw at ``path`` what ``holder`` saw; else the error naming them.

    Args:
        path: The file or folder, as the user named it.
        holder: The rank whose view is right (the writer, or a rank that found it).
        seen: Each rank's :func:`stat`, indexed by rank.
        verb: What ``holder`` did with it ("wrote", "sees").
        fix: The advice that ends the message.

    Returns:
        None, or a :class:`CheckpointNotFoundError` naming the ranks that see
        nothing (or another size) there.

    Example:
        >>> from ddpstate._visibility import not_shared
        >>> error = not_shared("ck.pt", 0, [10, None], "wrote", "use a shared path")
        >>> print(str(error).split(":")[0])
        rank 1 cannot see ck.pt that rank 0 wrote
    """
    want = seen[holder]
    blind = [r for r, s in enumerate(seen) if s is None and want is not None]
    other = [r for r, s in enumerate(seen) if s is not None and s != want]
    if not blind and not other:
        return None

    parts = []
    if blind:
        parts.append(f"{who(blind, ' ...')} cannot see {path} that rank {holder} {verb}")
    if other:
        sizes = ", ".join(f"rank {r}: {_size(seen[r])}" for r in other[:8])
        parts.append(
            f"{who(other, ' ...')} see{'' if len(other) > 1 else 's'} another {path} than "
            f"rank {holder} ({_size(want)}; {sizes})"
        )
    return CheckpointNotFoundError(
        f"{'; '.join(parts)}: the folder is not shared storage between the ranks; {fix}"
    )


def _size(seen: Optional[int]) -> str:
    if seen is None:
        return "nothing"
    return "a folder" if seen == FOLDER else f"{seen} bytes"


def check_seen(
    path: str,
    holder: int,
    verb: str,
    fix: str,
    *,
    name: str,
    timeout: Union[float, timedelta, None],
) -> None:
    """A collective round: every rank stats ``path``; ``holder`` compares; same error everywhere.

    Raises:
        CheckpointNotFoundError: Some rank does not see at ``path`` what
            ``holder`` sees (see :func:`not_shared`), on every rank.
    """
    gather_and_decide(
        stat(path),
        lambda seen: not_shared(path, holder, seen, verb, fix),
        dst=holder,
        name=name,
        timeout=timeout,
    )


def check_written(
    path: str, writer: int, *, name: str, timeout: Union[float, timedelta, None]
) -> None:
    """:func:`check_seen` after ``save``'s writer committed ``path``, with save's advice."""
    check_seen(
        path,
        writer,
        "wrote",
        f"use a shared path; or, to keep the file on rank {writer}'s disk, save with "
        f"barrier=False on every rank and load with src_rank={writer} (one rank reads, "
        f"the others receive)",
        name=name,
        timeout=timeout,
    )
