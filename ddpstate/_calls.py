"""What a collective call is: the public call each store round belongs to, torch-free.

Every store collective (``_collectives.py``) carries its caller's identity: the
public call and its key arguments (``ddpstate.save('ck.pt')``,
``CheckpointManager.save(step=3)``), set by :func:`calling` in the public
function's body (a contextvar, so the outermost public call names the rounds of
the calls inside it; a ``with`` block, not a decorator, whose frame would shift
the stacklevel of the warnings raised inside), and which of that call's rounds
it is. Ranks whose identities differ at the same call number are in different
calls: :func:`mismatch_error` names what each called, in the user's words.

The call also owns the deadline: its rounds share one timeout (:func:`wait_left`,
:func:`waited`), so a call of several rounds (restore: verify, share the outcome,
broadcast the choice) names a missing rank within its timeout, not within one
timeout per round. Only time spent waiting for other ranks counts; a rank's own
work between rounds (reading gigabytes) does not.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator
from typing import Optional

from ddpstate.errors import InvalidArgumentError

#: The identity a rank arrives with at its next call after raising a mismatch.
LEFT = "(nothing: it stopped after a collective error at its previous call)"
# Identities travel through the store; keep each one bounded.
_MAX_IDENTITY = 400


@dataclasses.dataclass
class _Call:
    """The public call the collectives of this context belong to, and its rounds so far."""

    text: str
    rounds: int = 0
    waited: float = 0.0  # seconds this rank's rounds of the call have waited for the others


# A contextvar, not a global: each thread (a test's thread-ranks, a background writer)
# has its own, and a public call made inside another keeps the outer one's name.
_CALL: contextvars.ContextVar[Optional[_Call]] = contextvars.ContextVar(
    "ddpstate_call", default=None
)


@contextlib.contextmanager
def calling(text: str) -> Iterator[None]:
    """Name the public call (``"ddpstate.save('ck.pt')"``) of the collectives in the block.

    Each collective round inside identifies as this call and its round number,
    so ranks in different calls are told what each rank called. Inside another
    named call it changes nothing: the outermost public call names the rounds.
    """
    if _CALL.get() is not None:
        yield
        return
    token = _CALL.set(_Call(text[:_MAX_IDENTITY]))
    try:
        yield
    finally:
        _CALL.reset(token)


def wait_left(seconds: float) -> float:
    """How long a round of the current call may still wait: ``seconds`` less what it waited.

    Outside a named call each round has the whole ``seconds``.

    Example:
        >>> from ddpstate._calls import calling, wait_left, waited
        >>> with calling("ddpstate.barrier()"):
        ...     waited(4.0)
        ...     wait_left(10.0)
        6.0
    """
    call = _CALL.get()
    return seconds if call is None else max(0.0, seconds - call.waited)


def waited(seconds: float) -> None:
    """Count ``seconds`` one round spent waiting against the current call's timeout."""
    call = _CALL.get()
    if call is not None:
        call.waited += seconds


def restore_call(step: object) -> str:
    """How ``CheckpointManager.restore(step=)`` reads in a call's identity.

    Example:
        >>> from ddpstate._calls import restore_call
        >>> restore_call(None), restore_call(3)
        ('CheckpointManager.restore()', 'CheckpointManager.restore(step=3)')
    """
    return "CheckpointManager.restore()" if step is None else f"CheckpointManager.restore({step=})"


def path_text(path: object) -> str:
    """``path`` as a call's identity shows it: its repr, or what it is when not a path.

    Example:
        >>> from ddpstate._calls import path_text
        >>> path_text("ck.pt"), path_text({"w": 1})
        ("'ck.pt'", '<dict>')
    """
    if isinstance(path, (str, os.PathLike)):
        return repr(os.fspath(path))
    return f"<{type(path).__name__}>"


def identity(name: str, kind: str) -> str:
    """This round's identity: the public call, its round number, the round's name and kind.

    ``kind`` is the store collective (``barrier``, ``agree``...): ranks in the
    same public call but at different rounds of it differ there.
    """
    call = _CALL.get()
    if call is None:
        return f"{name[:_MAX_IDENTITY]}\x1f1\x1f{name[:_MAX_IDENTITY]}\x1f{kind}"
    call.rounds += 1
    return f"{call.text}\x1f{call.rounds}\x1f{name[:_MAX_IDENTITY]}\x1f{kind}"


def _shown(identity: str, detailed: bool = False) -> str:
    """How a rank's call reads in a message (``detailed``: with its round, name and kind)."""
    text, rounds, name, kind = [*identity.split("\x1f"), "", "", ""][:4]
    if rounds in ("", "1") and not detailed:
        return text
    return f"{text} (its collective round {rounds or 1}: {kind} {name!r})"


def who(ranks: list[int], more: str = " (+{} more)") -> str:
    """``rank 3`` or ``ranks 0, 1``: the first eight, then ``more`` with the count left.

    Example:
        >>> from ddpstate._calls import who
        >>> who([3]), who(list(range(10)))
        ('rank 3', 'ranks 0, 1, 2, 3, 4, 5, 6, 7 (+2 more)')
    """
    listed = ", ".join(map(str, ranks[:8])) + (
        more.format(len(ranks) - 8) if len(ranks) > 8 else ""
    )
    return f"rank{'s' if len(ranks) > 1 else ''} {listed}"


def mismatch_error(calls: dict[int, str]) -> InvalidArgumentError:
    """The error naming what each rank called (rank -> identity), when they differ.

    Example:
        >>> from ddpstate._calls import mismatch_error
        >>> error = mismatch_error({0: "ddpstate.save('ck.pt')", 1: "ddpstate.barrier()"})
        >>> print(str(error).split(": ", 1)[1].split(". ")[0])
        rank 0 is in ddpstate.save('ck.pt'), rank 1 in ddpstate.barrier()
    """
    # The short form unless two different identities would read the same.
    detailed = len({_shown(c) for c in calls.values()}) < len(set(calls.values()))
    by_call: dict[str, list[int]] = {}
    for rank in sorted(calls):
        by_call.setdefault(_shown(calls[rank], detailed), []).append(rank)

    groups = list(by_call.items())[:6]
    functions = {c.split("(", 1)[0] for c in by_call if c != LEFT}  # the names, not arguments
    if len(functions) == 1 and LEFT not in by_call:
        listing = ", ".join(f"{who(ranks)}: {c}" for c, ranks in groups)
        return InvalidArgumentError(
            f"{functions.pop()} is a collective, but the ranks are at different calls of it "
            f"({listing}). Either a rank skipped a call (e.g. under `if rank == 0:`), so the "
            f"ranks are a call apart: call it on every rank; or the ranks passed different "
            f"arguments: pass the same ones on every rank (only the writer or reader rank "
            f"touches the file; to write or read one file per rank, pass barrier=False on "
            f"every rank)"
        )
    (c0, r0), *rest = groups
    listing = f"{who(r0)} is in {c0}" + "".join(f", {who(r)} in {c}" for c, r in rest)
    return InvalidArgumentError(
        f"the ranks are in different collective calls: {listing}. A call was skipped on some "
        f"rank, e.g. under `if rank == 0:`; call it on every rank, or pass barrier=False "
        f"(ddpstate.save/load) for code that runs on one rank"
    )
