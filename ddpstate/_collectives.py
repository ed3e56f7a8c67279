"""The store protocol behind ddpstate's collectives: O(1) store operations per rank per call.

Every function here takes a :class:`StoreGroup` (a store client, this rank, the
world size, the call counter), never the process group, so that a benchmark or
a test can run many ranks as threads in one process, each with its own store
client. ``ddpstate.dist`` builds the public collectives on these.

One call ``g`` of a collective uses at most five keys under ``<prefix>/<g>/``:

* ``id``: what the call is. Each arriving rank does one ``compare_set`` of its
  identity (the public call and its key arguments, e.g. ``ddpstate.save('ck.pt')``,
  and which of its rounds; see ``_calls.calling``): the first sets it, and a
  later rank whose identity differs is *mismatched* (another call, or a rank
  that skipped one);
* ``n``: a counter. Each arriving rank adds 1 (a failing rank adds
  ``1 + _FAILED``, a mismatched one ``1 + _MISMATCHED``), so the one ``add``
  tells the last arriver that it is last, how many ranks failed and whether
  the ranks are in the same call;
* ``log``: an append-only record per arrival (rank + payload; a mismatched
  rank's identity instead). It is read only where a payload is needed (a
  gather to one rank, an outcome with failures), on a mismatch, or on a
  timeout, to name the ranks that never arrived;
* ``done``: set by the last arriver (its value: the failure count, or the
  agreement verdict); the other ranks wait on this one key;
* ``value``: a broadcast's payload, set by the source.

When the ranks are not all in the same call, the last arriver sets ``done``
and ``value`` to :data:`_MISMATCH` (so every rank wakes, whichever key its own
collective waits on), and every rank reads ``id`` and ``log`` and raises the
same :class:`InvalidArgumentError` naming what each rank called. A rank raising
it then "leaves": it arrives once, mismatched, at its next call, so a rank that
had gone one call ahead (past a ``broadcast_object`` it was the source of,
which does not wait) is released with the same kind of error instead of
waiting out its timeout.

The last arriver of call ``g`` knows every rank has returned from call ``g-1``
(each has arrived at ``g``), so it deletes ``g-1``'s keys: the store does not grow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pickle
import struct
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Optional, cast

from ddpstate import _calls, errors
from ddpstate._calls import LEFT, mismatch_error
from ddpstate._warn import warn
from ddpstate.errors import (
    BarrierTimeoutError,
    DDPStateError,
    InvalidArgumentError,
    RankFailedError,
    StoreConnectionError,
)

#: Environment variable: seconds a rank waits at a collective before it first warns
#: (naming the missing ranks), then again at each doubling.
WARN_AFTER_ENV = "DDPSTATE_WARN_AFTER"
DEFAULT_WARN_AFTER = 30.0
TIMEOUT_ENV = "DDPSTATE_TIMEOUT"

REMINDER = (
    "ddpstate's collective functions (barrier, save, load, CheckpointManager.save/restore, "
    "broadcast_object) must be called on every rank, not inside `if rank == 0:`; "
    "a missing rank may also have crashed or be stuck"
)

# A failing arrival adds this on top of 1: the counter's low 32 bits count the
# arrivals, the next 16 bits the failures, and one atomic add reports both.
_FAILED = 1 << 32
# A mismatched arrival (its call is not the first arriver's) adds this on top of 1:
# the bits from 48 up count them (the store's counter is a signed 64-bit integer).
_MISMATCHED = 1 << 48
# A log record: rank and payload length, then the payload.
_RECORD = struct.Struct("<iI")
# Set in a record's length: the payload is the rank's identity (a mismatched arrival).
_IDENTITY = 1 << 31
# ``done`` and ``value`` of a call whose ranks are not all in the same call. No other
# value of either key equals it (verdicts start with b"v", broadcasts are pickles).
_MISMATCH = b"\x00ddpstate: the ranks are in different calls"
# Error messages travel through the store; keep each one bounded.
MAX_MESSAGE = 8000
_MAX_ATTRS = 64 << 10
# Keys one call may create (deleted by the last arriver of the next counted call).
_SUFFIXES = ("id", "n", "log", "done", "value")


@dataclasses.dataclass
class StoreGroup:
    """The context of the store collectives: one rank's view of one group.

    Attributes:
        store: A ``torch.distributed.Store`` client (TCPStore, PrefixStore...).
        rank: This rank, ``0 <= rank < world``.
        world: The number of ranks.
        prefix: Key prefix shared by every rank of this group instance.
        calls: Collectives this rank has started; every rank calls them in the
            same order, so the number names the same call on every rank.
    """

    store: Any
    rank: int
    world: int
    prefix: str = "ddpstate"
    calls: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    @classmethod
    def join(cls, store: Any, rank: int, world: int) -> StoreGroup:
        """Open this rank's view of a group: one ``add`` to agree on a fresh key prefix.

        The same store can outlive a process group (destroy and init again with
        one store): a fresh prefix per group instance keeps a new group's
        counters away from an old one's leftovers. Every rank of an instance
        joins once, so the ``world`` joins of instance k draw the numbers
        ``(k-1)*world+1 .. k*world`` from one counter.
        """
        group = cls(store, rank, world)
        drawn = int(group.op("joining the group", store.add, "ddpstate/instances", 1))
        group.prefix = f"ddpstate/{math.ceil(drawn / world)}"
        return group

    def next_call(self) -> str:
        """Return the key prefix of the next collective call."""
        with self.lock:
            number = self.calls
            self.calls += 1
        return f"{self.prefix}/{number}"

    def op(self, name: str, fn: Any, *args: Any) -> Any:
        """Run one store operation; a broken connection becomes StoreConnectionError."""
        try:
            return fn(*args)
        except Exception as exc:
            raise lost_connection(self, name, exc) from exc


# --------------------------------------------------------------------------- settings


def seconds_from_env(name: str, default: float, hint: str = "") -> float:
    """A positive number of seconds from environment variable ``name``, else ``default``."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InvalidArgumentError(
            f"environment variable {name}={raw!r} must be a positive number of seconds{hint}"
        )
    return value


def warn_after() -> float:
    """Seconds a waiting rank waits before it first warns (``DDPSTATE_WARN_AFTER``, 30)."""
    return seconds_from_env(WARN_AFTER_ENV, DEFAULT_WARN_AFTER, " (inf: never warn)")


# --------------------------------------------------------------------------- errors


def _first_line(exc: BaseException) -> str:
    # torch's store errors carry a C++ backtrace after the first line.
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _is_timeout(exc: BaseException) -> bool:
    import torch.distributed as dist

    store_error = getattr(dist, "DistStoreError", None)
    network_error = getattr(dist, "DistNetworkError", None)
    if network_error is not None and isinstance(exc, network_error):
        return False
    if store_error is not None and isinstance(exc, store_error):
        return True
    return "timeout" in str(exc).lower()


def lost_connection(group: StoreGroup, name: str, exc: BaseException) -> StoreConnectionError:
    """The error every rank gets when its store connection breaks during ``name``."""
    return StoreConnectionError(
        f"rank {group.rank}: lost the connection to the rendezvous store during {name!r} "
        f"({_first_line(exc)}). The process hosting the store (torchrun's agent, or rank 0 "
        f"when it called init_process_group) has died or the network failed; the job "
        f"cannot continue. Restart it (it resumes from the last committed checkpoint)."
    )


def timeout_error(
    group: StoreGroup, name: str, missing: Sequence[int], seconds: float
) -> BarrierTimeoutError:
    """The error every arriving rank gets when ``missing`` never reached ``name``."""
    who = ", ".join(str(r) for r in missing) if missing else "unknown"
    plural = "s" if len(missing) != 1 else ""
    return BarrierTimeoutError(
        f"rank {group.rank}: rank{plural} {who} of {group.world} did not reach {name!r} within "
        f"{seconds:g} s. {REMINDER}. If a rank is legitimately slow, pass timeout= or set "
        f"{TIMEOUT_ENV} (seconds).",
        missing_ranks=list(missing),
        timeout=seconds,
    )


def _still_waiting(
    group: StoreGroup, name: str, missing: Sequence[int], elapsed: float, left: float
) -> str:
    who = ", ".join(str(r) for r in missing) if missing else "unknown"
    plural = "s" if len(missing) != 1 else ""
    return (
        f"rank {group.rank}: still waiting at {name!r} after {elapsed:.0f} s for rank{plural} "
        f"{who} of {group.world} (giving up in {left:.0f} s). Was {name!r} called under "
        f"`if rank == 0:`? {REMINDER}. If this call runs on one rank only (a framework hook, "
        f"evaluation on rank 0), pass barrier=False (and src_rank=<that rank> to save/load) "
        f"so it does not wait for the others. ({WARN_AFTER_ENV} sets when this warning starts.)"
    )


# --------------------------------------------------------------------------- records


def record(rank: int, payload: bytes) -> bytes:
    """One entry of a call's log: this rank and its payload."""
    return _RECORD.pack(rank, len(payload)) + payload


def _parse(raw: bytes) -> tuple[dict[int, bytes], dict[int, str]]:
    """A call's log: rank -> payload, and rank -> identity of the mismatched ranks."""
    found: dict[int, bytes] = {}
    identities: dict[int, str] = {}
    at = 0
    while at + _RECORD.size <= len(raw):
        rank, size = _RECORD.unpack_from(raw, at)
        at += _RECORD.size
        length = size & ~_IDENTITY
        if size & _IDENTITY:
            identities[rank] = raw[at : at + length].decode(errors="replace")
        else:
            found[rank] = raw[at : at + length]
        at += length
    return found, identities


def records(raw: bytes) -> dict[int, bytes]:
    """Parse a call's log into rank -> payload."""
    return _parse(raw)[0]


def encode_error(error: DDPStateError) -> bytes:
    """Class name, message and attributes of ``error``, as JSON (never a pickle)."""
    attrs: dict[str, Any] = {}
    for key, value in vars(error).items():
        if key.startswith("_"):
            continue
        value = list(value) if isinstance(value, (tuple, list)) else value
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        attrs[key] = value
    if len(json.dumps(attrs)) > _MAX_ATTRS:
        attrs = {}
    sent = {
        "class": _shared_class(type(error)).__name__,
        "message": str(error)[:MAX_MESSAGE],
        "attrs": attrs,
    }
    return json.dumps(sent).encode()


def _shared_class(cls: type[BaseException]) -> type[DDPStateError]:
    # The nearest class the receiving ranks can rebuild by name: one of ddpstate.errors.
    for base in cls.__mro__:
        if getattr(errors, base.__name__, None) is base and issubclass(base, DDPStateError):
            return cast(type[DDPStateError], base)
    return RankFailedError


def decode_error(raw: bytes) -> DDPStateError:
    """Rebuild the error :func:`encode_error` described: same class, message and attributes."""
    sent = json.loads(raw.decode())
    found = getattr(errors, str(sent.get("class")), None)
    cls = found if isinstance(found, type) and issubclass(found, DDPStateError) else RankFailedError
    return restate(cls, str(sent.get("message", "")), sent.get("attrs") or {})


def restate(cls: type[DDPStateError], message: str, attrs: dict[str, Any]) -> DDPStateError:
    """Build ``cls`` with ``message`` and the given attributes (lists become tuples)."""
    try:
        error = cls(message)
    except TypeError:  # a constructor needing more than the message; attrs fill it in
        error = BaseException.__new__(cls, message)
        error.args = (message,)
    for key, value in attrs.items():
        setattr(error, key, tuple(value) if isinstance(value, list) else value)
    return error


def with_message(error: DDPStateError, message: str) -> DDPStateError:
    """A copy of ``error`` (same class and attributes) with a new message."""
    attrs = {k: v for k, v in vars(error).items() if not k.startswith("_")}
    return restate(type(error), message, attrs)


def as_shareable(error: BaseException, group: StoreGroup, name: str) -> DDPStateError:
    """``error`` itself when other ranks can rebuild it, else a RankFailedError naming it."""
    if isinstance(error, DDPStateError):
        return error
    return RankFailedError(f"{name} failed on rank {group.rank}: {_first_line(error)}")


# --------------------------------------------------------------------------- waiting


def _arrived(group: StoreGroup, log: str) -> set[int]:
    payloads, identities = _parse(group.op("reading who arrived", group.store.get, log))
    return set(payloads) | set(identities)


def _wait(
    group: StoreGroup,
    key: str,
    name: str,
    seconds: float,
    start: float,
    missing: Any,
) -> None:
    """Wait for ``key``; warn at DDPSTATE_WARN_AFTER and its doublings; raise on timeout.

    ``missing()`` names the ranks being waited for; it runs only when warning or
    timing out, never on the happy path.
    """
    deadline = start + seconds
    warn_every = warn_after()
    warn_at = start + warn_every
    while True:
        now = time.monotonic()
        until = min(deadline, warn_at)
        try:
            group.store.wait([key], timedelta(seconds=max(until - now, 0.001)))
            return
        except Exception as exc:
            if not _is_timeout(exc):
                raise lost_connection(group, name, exc) from exc
            cause: BaseException = exc
        now = time.monotonic()
        if now >= deadline - 0.001:
            raise timeout_error(group, name, missing(), seconds) from cause
        absent = missing()
        # Once per job: the lowest rank of those waiting says it, the others stay quiet.
        waiting = sorted(set(range(group.world)) - set(absent))
        if not absent or not waiting or waiting[0] == group.rank:
            warn(_still_waiting(group, name, absent, now - start, deadline - now))
        warn_every *= 2
        warn_at = start + warn_every


def _cleanup(group: StoreGroup, call: str) -> None:
    # Called by the last arriver of `call`: every rank has left the call before it.
    number = int(call.rsplit("/", 1)[1])
    if number == 0:
        return
    old = f"{call.rsplit('/', 1)[0]}/{number - 1}"
    for suffix in _SUFFIXES:
        # Tidying only: a lost store shows up at the next call.
        with contextlib.suppress(Exception):
            group.store.delete_key(f"{old}/{suffix}")


@dataclasses.dataclass(frozen=True)
class _Arrival:
    """What one rank's arrival at a call told it."""

    last: bool  # its add completed the count: every rank has arrived
    failures: int  # failing arrivals counted so far (all of them, for the last)
    mismatched: bool  # its call differs from the first arriver's (or, for the last, any's)


def _arrive(
    group: StoreGroup,
    call: str,
    name: str,
    payload: bytes,
    failed: bool,
    log: bool = True,
    identity: Optional[str] = None,
    first: Optional[bytes] = None,
    kind: str = "",
) -> _Arrival:
    """Check this rank's identity, log its record (``log``), count it (see the module docstring).

    ``first``: the ``id`` this rank's own ``compare_set`` already returned.
    """
    mine = identity if identity is not None else _calls.identity(name, kind)
    if first is None:
        first = group.op(name, group.store.compare_set, f"{call}/id", "", mine)
    own = first != mine.encode()
    if own:
        text = mine.encode()
        group.op(
            name,
            group.store.append,
            f"{call}/log",
            _RECORD.pack(group.rank, len(text) | _IDENTITY) + text,
        )
    elif log:
        group.op(name, group.store.append, f"{call}/log", record(group.rank, payload))
    added = 1 + (_FAILED if failed else 0) + (_MISMATCHED if own else 0)
    total = int(group.op(name, group.store.add, f"{call}/n", added))
    last = total % _FAILED == group.world
    mismatched = own or (last and total >= _MISMATCHED)
    if last and mismatched:
        # Wake every rank, whichever key its own collective waits on.
        group.op(name, group.store.set, f"{call}/done", _MISMATCH)
        group.op(name, group.store.set, f"{call}/value", _MISMATCH)
        _cleanup(group, call)
    return _Arrival(last, (total // _FAILED) % (1 << 16), mismatched)


def _mismatch(
    group: StoreGroup, call: str, name: str, seconds: float, start: float
) -> InvalidArgumentError:
    """The error of a call whose ranks are in different calls, the same on every rank.

    Waits until every rank has arrived (the last sets ``done``), reads what each
    called, then leaves (see the module docstring).
    """

    def missing() -> list[int]:
        here = _arrived(group, f"{call}/log")
        return [r for r in range(group.world) if r not in here]

    _wait(group, f"{call}/done", name, seconds, start, missing)
    first = group.op(name, group.store.get, f"{call}/id").decode(errors="replace")
    _, identities = _parse(group.op(name, group.store.get, f"{call}/log"))
    calls = {r: identities.get(r, first) for r in range(group.world)}
    if LEFT not in calls.values():
        # A rank that met another's leave is one call ahead of it: leaving again
        # would put it ahead once more, where not leaving puts the two back in step.
        _leave(group, name)
    return mismatch_error(calls)


def _leave(group: StoreGroup, name: str) -> None:
    """Arrive once, mismatched, at this rank's next call: a rank gone ahead to it wakes."""
    call = group.next_call()
    with contextlib.suppress(DDPStateError):
        _arrive(group, call, name, b"", False, identity=LEFT)


def _check_value(
    group: StoreGroup, call: str, name: str, raw: bytes, seconds: float, start: float
) -> bytes:
    """``raw`` (a ``done`` or ``value`` read), unless it says the ranks are in different calls."""
    if raw == _MISMATCH:
        raise _mismatch(group, call, name, seconds, start)
    return raw


def _finish(group: StoreGroup, call: str, name: str, verdict: bytes) -> None:
    group.op(name, group.store.set, f"{call}/done", verdict)
    _cleanup(group, call)


def _await_all(group: StoreGroup, call: str, name: str, seconds: float, start: float) -> None:
    def missing() -> list[int]:
        here = _arrived(group, f"{call}/log")
        return [r for r in range(group.world) if r not in here]

    _wait(group, f"{call}/done", name, seconds, start, missing)


# --------------------------------------------------------------------------- collectives


def barrier(group: StoreGroup, name: str, seconds: float) -> None:
    """Wait until every rank arrives (5 store operations per rank, +2 for the last)."""
    start = time.monotonic()
    call = group.next_call()
    arrival = _arrive(group, call, name, b"", False, kind="barrier")
    if arrival.mismatched:
        raise _mismatch(group, call, name, seconds, start)
    if arrival.last:
        _finish(group, call, name, b"0")
        return
    _await_all(group, call, name, seconds, start)
    _check_value(group, call, name, group.op(name, group.store.get, f"{call}/done"), seconds, start)


def share_outcome(
    group: StoreGroup, error: Optional[BaseException], name: str, seconds: float
) -> Optional[DDPStateError]:
    """Tell every rank how ``name`` went; return the shared error (None: every rank succeeded).

    The happy path costs the barrier's operations; the failing ranks' records
    are read only when some rank failed.
    """
    start = time.monotonic()
    call = group.next_call()
    payload = b"" if error is None else encode_error(as_shareable(error, group, name))
    arrival = _arrive(group, call, name, payload, error is not None, kind="share_outcome")
    if arrival.mismatched:
        raise _mismatch(group, call, name, seconds, start)
    failures = arrival.failures
    if arrival.last:
        _finish(group, call, name, str(failures).encode())
    else:
        _await_all(group, call, name, seconds, start)
        done = group.op(name, group.store.get, f"{call}/done")
        failures = int(_check_value(group, call, name, done, seconds, start))
    if not failures:
        return None
    log = records(group.op(name, group.store.get, f"{call}/log"))
    failed = sorted(r for r, p in log.items() if p)
    shared = decode_error(log[failed[0]])
    if len(failed) > 1:
        others = "; ".join(f"rank {r}: {decode_error(log[r])}"[:500] for r in failed[1:4])
        more = f" (and {len(failed) - 4} more)" if len(failed) > 4 else ""
        shared = restate(
            type(shared),
            f"{shared} [ranks {', '.join(map(str, failed))} failed; {others}{more}]",
            {k: v for k, v in vars(shared).items() if not k.startswith("_")},
        )
    return shared


def gather(
    group: StoreGroup, payload: bytes, dst: Optional[int], name: str, seconds: float
) -> Optional[list[bytes]]:
    """Every rank's payload, on ``dst`` (every rank when ``dst`` is None); None elsewhere.

    Every rank waits for every other (a timeout names the same missing ranks
    everywhere); only the receivers read the log.
    """
    start = time.monotonic()
    call = group.next_call()
    arrival = _arrive(group, call, name, payload, False, kind="gather")
    if arrival.mismatched:
        raise _mismatch(group, call, name, seconds, start)
    if arrival.last:
        _finish(group, call, name, b"0")
    else:
        _await_all(group, call, name, seconds, start)
    if dst is not None and group.rank != dst:
        if not arrival.last:
            done = group.op(name, group.store.get, f"{call}/done")
            _check_value(group, call, name, done, seconds, start)
        return None
    log, identities = _parse(group.op(name, group.store.get, f"{call}/log"))
    if identities:
        raise _mismatch(group, call, name, seconds, start)
    return [log[r] for r in range(group.world)]


def gather_and_decide(
    group: StoreGroup,
    payload: bytes,
    dst: int,
    name: str,
    seconds: float,
    decide: Callable[[list[bytes]], Optional[DDPStateError]],
) -> Optional[DDPStateError]:
    """One round: every rank's payload to ``dst``, ``dst``'s verdict to every rank.

    ``dst`` waits until all have arrived, reads the log, runs ``decide`` on the
    payloads (it may do work, such as writing a checkpoint, before answering)
    and sets the verdict; the others wait on that one key. Returns the shared
    error (None: success). If ``decide`` raises, the others are told (as a
    RankFailedError naming it) and the exception goes on on ``dst``. When the
    ranks are not all in this call, ``decide`` never runs.
    """
    start = time.monotonic()
    call = group.next_call()
    arrival = _arrive(group, call, name, payload, False, kind="gather_and_decide")
    if arrival.mismatched:
        raise _mismatch(group, call, name, seconds, start)
    if arrival.last:
        _finish(group, call, name, b"0")
    verdict_key = f"{call}/value"
    if group.rank == dst:
        if not arrival.last:
            _await_all(group, call, name, seconds, start)
        log, identities = _parse(group.op(name, group.store.get, f"{call}/log"))
        if identities:
            raise _mismatch(group, call, name, seconds, start)
        try:
            error = decide([log[r] for r in range(group.world)])
        except BaseException as exc:
            told = encode_error(as_shareable(exc, group, name))
            group.op(name, group.store.set, verdict_key, b"v" + told)
            raise
        told = b"" if error is None else encode_error(error)
        group.op(name, group.store.set, verdict_key, b"v" + told)
        return error

    def missing() -> list[int]:
        here = _arrived(group, f"{call}/log")
        return [r for r in range(group.world) if r not in here] or [dst]

    _wait(group, verdict_key, name, seconds, start, missing)
    raw = group.op(name, group.store.get, verdict_key)
    if raw[:1] != b"v":  # the mismatch mark, or another call's payload (then a mark follows)
        raise _mismatch(group, call, name, seconds, start)
    return decode_error(raw[1:]) if raw[1:] else None


def agree(group: StoreGroup, value: Any, name: str, seconds: float) -> Optional[list[Any]]:
    """None when every rank passed an equal ``value``; else every rank's value, on every rank.

    The last arriver compares (one read of the log); the others read one verdict.
    """
    start = time.monotonic()
    call = group.next_call()
    payload = pickle.dumps(value)
    arrival = _arrive(group, call, name, payload, False, kind="agree")
    if arrival.mismatched:
        raise _mismatch(group, call, name, seconds, start)
    if arrival.last:
        payloads = list(records(group.op(name, group.store.get, f"{call}/log")).values())
        same = all(p == payloads[0] for p in payloads) or all(
            _loads(p) == _loads(payloads[0]) for p in payloads
        )
        _finish(group, call, name, b"1" if same else b"0")
    else:
        _await_all(group, call, name, seconds, start)
        done = group.op(name, group.store.get, f"{call}/done")
        same = _check_value(group, call, name, done, seconds, start) == b"1"
    if same:
        return None
    log = records(group.op(name, group.store.get, f"{call}/log"))
    return [_loads(log[r]) for r in range(group.world)]


def _loads(payload: bytes) -> Any:
    # Trusted input: these bytes come from this job's own ranks, never from a file.
    return pickle.loads(payload)


def broadcast(
    group: StoreGroup, payload: Optional[bytes], src: int, name: str, seconds: float
) -> bytes:
    """``src``'s payload on every rank (``src`` passes it, the others None).

    ``src`` does not wait for the others: it sets one key and returns. Ranks
    log nothing (no payload to gather) unless their call is not the first
    arriver's.
    """
    start = time.monotonic()
    call = group.next_call()
    key = f"{call}/value"
    mine = _calls.identity(name, "broadcast")
    first: Optional[bytes] = None
    if payload is not None:  # this rank is src: the payload is set before it counts in
        first = group.op(name, group.store.compare_set, f"{call}/id", "", mine)
        if first == mine.encode():
            group.op(name, group.store.set, key, payload)
    arrival = _arrive(group, call, name, b"", False, log=False, identity=mine, first=first)
    if arrival.mismatched:
        raise _mismatch(group, call, name, seconds, start)
    if arrival.last:
        _cleanup(group, call)
    if payload is not None:
        return payload
    _wait(group, key, name, seconds, start, lambda: [src])
    raw = cast(bytes, group.op(name, group.store.get, key))
    return _check_value(group, call, name, raw, seconds, start)


def gather_to_receivers(
    group: StoreGroup,
    payload: bytes,
    dst: int,
    name: str,
    seconds: float,
    decide: Callable[[list[bytes]], bytes],
) -> bytes:
    """One round: every rank's payload to each receiver, each receiver's verdict to its ranks.

    Each rank names its receiver ``dst``; a rank whose ``dst`` is itself is a
    receiver (such as each node's local rank 0). Every rank logs its payload
    and counts itself in; the last arriver marks ``value``. The receivers wait
    for that mark, read the log, run ``decide`` on every rank's payload and
    append their verdict to ``value``; the receiver that counts in last sets
    ``done``. The other ranks wait on ``done`` and read ``value`` (one record
    per receiver): five store operations each (with the identity check), whatever the world size.
    Returns the verdict of this rank's receiver. If ``decide`` raises, that
    receiver's ranks raise its error (rebuilt as by :func:`share_outcome`, a
    RankFailedError naming it if it is not a DDPStateError) and the exception
    goes on on the receiver.
    """
    start = time.monotonic()
    call = group.next_call()
    receiver = dst == group.rank
    arrival = _arrive(
        group, call, name, (b"r" if receiver else b"-") + payload, False, kind="gather_to_receivers"
    )
    if arrival.mismatched:
        raise _mismatch(group, call, name, seconds, start)
    verdicts = f"{call}/value"
    if arrival.last:
        # A rank -1 record marks "all arrived"; the receivers append theirs after it.
        group.op(name, group.store.set, verdicts, record(-1, b""))
        _cleanup(group, call)

    def missing() -> list[int]:
        here = _arrived(group, f"{call}/log")
        absent = [r for r in range(group.world) if r not in here]
        if absent:
            return absent
        decided = set(records(group.op(name, group.store.get, verdicts)))
        log = records(group.op(name, group.store.get, f"{call}/log"))
        return sorted(r for r, p in log.items() if p[:1] == b"r" and r not in decided)

    if receiver:
        _wait(group, verdicts, name, seconds, start, missing)
        log, identities = _parse(group.op(name, group.store.get, f"{call}/log"))
        if identities or len(log) < group.world:  # woken by a mismatch (or its first steps)
            raise _mismatch(group, call, name, seconds, start)
        receivers = sum(1 for p in log.values() if p[:1] == b"r")
        try:
            told = b"v" + decide([log[r][1:] for r in range(group.world)])
            failure: Optional[BaseException] = None
        except BaseException as exc:
            told = b"e" + encode_error(as_shareable(exc, group, name))
            failure = exc
        group.op(name, group.store.append, verdicts, record(group.rank, told))
        total = int(group.op(name, group.store.add, f"{call}/n", 1))
        if total % _FAILED == group.world + receivers:
            group.op(name, group.store.set, f"{call}/done", b"0")
        if failure is not None:
            raise failure
        return told[1:]
    _wait(group, f"{call}/done", name, seconds, start, missing)
    raw = _check_value(group, call, name, group.op(name, group.store.get, verdicts), seconds, start)
    answer = records(raw).get(dst)
    if answer is None:
        raise InvalidArgumentError(
            f"{name}: rank {group.rank} named rank {dst} as its receiver, but rank {dst} "
            f"named another rank; every rank's receiver must name itself"
        )
    if answer[:1] == b"e":
        raise decode_error(answer[1:])
    return answer[1:]
