"""The store protocol behind ddpstate's collectives: O(1) store operations per rank per call.

Every function here takes a :class:`StoreGroup` (a store client, this rank, the
world size, the call counter), never the process group, so that a benchmark or
a test can run many ranks as threads in one process, each with its own store
client. ``ddpstate.dist`` builds the public collectives on these.

One call ``g`` of a collective uses at most four keys under ``<prefix>/<g>/``:

* ``log``: one record per arriving rank, appended: its rank, its identity (the
  public call and its key arguments, e.g. ``ddpstate.save('ck.pt')``, and which
  of its rounds; see ``_calls.calling``) and its payload;
* ``n``: a counter; each arriving rank adds 1, so the ``add`` tells the last
  arriver that it is last. The last arriver reads the log, so it alone checks
  that every rank is in the same call (and sees every payload);
* ``done``: set by the last arriver (``d`` and its verdict: a failure flag, an
  agreement); the other ranks wait on this one key with one blocking ``get``;
* ``value``: a broadcast's payload (with the source's identity), a deciding
  rank's verdict, the receivers' verdicts.

So a barrier costs each rank ``append`` + ``add`` + ``get``; the last arriver
reads the log and sets ``done`` instead of the ``get``.

When the ranks are not all in the same call, the last arriver sets ``done``
and ``value`` to :data:`_MISMATCH` (so every rank wakes, whichever key its own
collective waits on; a broadcast's receivers also compare the source's identity
with their own), and every rank reads the log and raises the same
:class:`InvalidArgumentError` naming what each rank called. A rank raising it
then "leaves": it arrives once, mismatched, at its next call, so a rank that
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

# A log record: rank, identity length and payload length, then the identity and payload.
_RECORD = struct.Struct("<iII")
# ``done`` and ``value`` of a call whose ranks are not all in the same call. Every other
# value starts with a letter naming what it is (b"d" done, b"v" a verdict, b"b" a
# broadcast, b"g" the receivers' verdicts), so a reader expecting one sees it is not.
_MISMATCH = b"\x00ddpstate: the ranks are in different calls"
# Error messages travel through the store; keep each one bounded.
MAX_MESSAGE = 8000
_MAX_ATTRS = 64 << 10
# Keys one call may create (deleted by the last arriver of the next counted call).
_SUFFIXES = ("n", "log", "done", "value")


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

    if isinstance(exc, dist.DistNetworkError):  # a DistStoreError's sibling: the host is gone
        return False
    return isinstance(exc, dist.DistStoreError) or "timeout" in str(exc).lower()


def lost_connection(group: StoreGroup, name: str, exc: BaseException) -> StoreConnectionError:
    """The error every rank gets when its store connection breaks during ``name``."""
    return StoreConnectionError(
        f"rank {group.rank}: lost the connection to the rendezvous store during {name!r} "
        f"({_first_line(exc)}). The process hosting the store (torchrun's agent, or rank 0 "
        f"when it called init_process_group) has died or the network failed; the job "
        f"cannot continue. Restart it (it resumes from the last committed checkpoint)."
    )


def _ranks(missing: Sequence[int]) -> str:
    who = ", ".join(str(r) for r in missing) if missing else "unknown"
    return f"rank{'s' if len(missing) != 1 else ''} {who}"


def timeout_error(
    group: StoreGroup, name: str, missing: Sequence[int], seconds: float
) -> BarrierTimeoutError:
    """The error every arriving rank gets when ``missing`` never reached ``name``."""
    return BarrierTimeoutError(
        f"rank {group.rank}: {_ranks(missing)} of {group.world} did not reach {name!r} within "
        f"{seconds:g} s. {REMINDER}. If a rank is legitimately slow, pass timeout= or set "
        f"{TIMEOUT_ENV} (seconds).",
        missing_ranks=list(missing),
        timeout=seconds,
    )


def _still_waiting(
    group: StoreGroup, name: str, missing: Sequence[int], elapsed: float, left: float
) -> str:
    return (
        f"rank {group.rank}: still waiting at {name!r} after {elapsed:.0f} s for "
        f"{_ranks(missing)} of {group.world} (giving up in {left:.0f} s). Was {name!r} called "
        f"under `if rank == 0:`? {REMINDER}. If this call runs on one rank only (a framework hook, "
        f"evaluation on rank 0), pass barrier=False (and src_rank=<that rank> to save/load) "
        f"so it does not wait for the others. ({WARN_AFTER_ENV} sets when this warning starts.)"
    )


# --------------------------------------------------------------------------- records


def record(rank: int, identity: bytes, payload: bytes) -> bytes:
    """One entry of a call's log: this rank, the call it is in, and its payload."""
    return _RECORD.pack(rank, len(identity), len(payload)) + identity + payload


def records(raw: bytes) -> dict[int, tuple[bytes, bytes]]:
    """Parse a call's log into rank -> (identity, payload)."""
    found: dict[int, tuple[bytes, bytes]] = {}
    at = 0
    while at + _RECORD.size <= len(raw):
        rank, known, size = _RECORD.unpack_from(raw, at)
        at += _RECORD.size + known + size
        found[rank] = (raw[at - known - size : at - size], raw[at - size : at])
    return found


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


# --------------------------------------------------------------------------- one call


class _Round:
    """This rank's part in one call ``g``: arrive, then wait for or set the call's keys."""

    def __init__(
        self, group: StoreGroup, name: str, seconds: float, kind: str, identity: str = ""
    ) -> None:
        self.group, self.name, self.seconds = group, name, seconds
        self.start = time.monotonic()
        # The public call's timeout is shared by its rounds: this one waits only for what is left.
        self.left = _calls.wait_left(seconds)
        self.call = group.next_call()
        self.identity = (identity or _calls.identity(name, kind)).encode()
        self.log: Optional[dict[int, tuple[bytes, bytes]]] = None  # read once, when complete

    def op(self, method: str, key: str, *args: Any) -> Any:
        """One store operation on this call's ``key``."""
        return self.group.op(
            self.name, getattr(self.group.store, method), f"{self.call}/{key}", *args
        )

    def arrive(self, payload: bytes) -> bool:
        """Log this rank's record and count it in; True for the last arriver.

        The last arriver reads the log: when the ranks are not all in this call, it
        marks ``done`` and ``value`` (every rank wakes, whichever key it waits on)
        and raises the mismatch error.
        """
        self.op("append", "log", record(self.group.rank, self.identity, payload))
        if int(self.op("add", "n", 1)) != self.group.world:
            return False
        if len({identity for identity, _ in self.entries().values()}) > 1:
            self.op("set", "done", _MISMATCH)
            self.op("set", "value", _MISMATCH)
            self.cleanup()
            raise self.mismatch()
        return True

    def entries(self) -> dict[int, tuple[bytes, bytes]]:
        """The complete log (read once): rank -> (identity, payload)."""
        if self.log is None:
            self.log = records(self.op("get", "log"))
        return self.log

    def payloads(self) -> list[bytes]:
        """Every rank's payload, by rank."""
        entries = self.entries()
        return [entries[rank][1] for rank in range(self.group.world)]

    def absent(self) -> list[int]:
        """The ranks not in the log yet (read afresh: for warnings and timeouts only)."""
        here = records(self.op("get", "log"))
        return [rank for rank in range(self.group.world) if rank not in here]

    def settle(self, payload: bytes, verdict: Callable[[], bytes] = bytes) -> bytes:
        """Arrive with ``payload``; the last arriver sets ``done``, the others read it.

        Returns ``verdict()`` (run on the last arriver only, its answer read by the
        others): every rank gets the same bytes.
        """
        if not self.arrive(payload):
            return self.read("done", b"d")
        told = verdict()
        self.finish("done", b"d" + told)
        return told

    def finish(self, key: str, value: bytes) -> None:
        """Set ``key`` (the last arriver's answer), then delete the previous call's keys."""
        self.op("set", key, value)
        self.cleanup()

    def cleanup(self) -> None:
        # The last arriver of call g: every rank has left call g-1.
        prefix, number = self.call.rsplit("/", 1)
        for suffix in _SUFFIXES if number != "0" else ():
            # Tidying only: a lost store shows up at the next call.
            with contextlib.suppress(Exception):
                self.group.store.delete_key(f"{prefix}/{int(number) - 1}/{suffix}")

    def read(
        self, key: str, tag: bytes, missing: Optional[Callable[[], list[int]]] = None
    ) -> bytes:
        """Wait for ``key``; its value after ``tag``, else (another call's value) the mismatch."""
        raw = self.wait(key, missing or self.absent)
        if raw[:1] != tag:  # the mismatch mark, or another collective's value at this number
            raise self.mismatch()
        return raw[1:]

    def wait(self, key: str, missing: Callable[[], list[int]]) -> bytes:
        """``key``'s value; warn at DDPSTATE_WARN_AFTER and its doublings; raise on timeout.

        ``missing()`` names the ranks being waited for; it runs only when warning or
        timing out, never on the happy path.
        """
        entered = time.monotonic()
        try:
            return self._wait(key, missing)
        finally:
            _calls.waited(time.monotonic() - entered)

    def _wait(self, key: str, missing: Callable[[], list[int]]) -> bytes:
        group, deadline, warn_every = self.group, self.start + self.left, warn_after()
        while True:
            until = min(deadline, self.start + warn_every)
            try:
                return self._get(key, until - time.monotonic())
            except Exception as exc:
                if not _is_timeout(exc):
                    raise lost_connection(group, self.name, exc) from exc
                cause: BaseException = exc
            now = time.monotonic()
            if now >= deadline - 0.001:
                raise timeout_error(group, self.name, missing(), self.seconds) from cause
            absent = missing()
            # Once per job: the lowest rank of those waiting says it, the others stay quiet.
            waiting = sorted(set(range(group.world)) - set(absent))
            if not absent or not waiting or waiting[0] == group.rank:
                warn(_still_waiting(group, self.name, absent, now - self.start, deadline - now))
            warn_every *= 2

    def _get(self, key: str, seconds: float) -> bytes:
        # A get blocks until the key is set, within the client's timeout: one request
        # where wait + get are two. torch's elastic barrier sets the timeout the same way.
        store = self.group.store
        before = store.timeout
        store.set_timeout(timedelta(seconds=max(seconds, 0.001)))
        try:
            return cast(bytes, store.get(f"{self.call}/{key}"))
        finally:
            store.set_timeout(before)

    def mismatch(self) -> InvalidArgumentError:
        """The error of a call whose ranks are in different calls, the same on every rank.

        Waits until every rank has arrived (the last marks ``done``), reads what each
        called, then leaves (see the module docstring).
        """
        if self.log is None:  # not the last arriver: the log is complete once done is set
            self.wait("done", self.absent)
        entries = self.entries()
        calls = {rank: identity.decode(errors="replace") for rank, (identity, _) in entries.items()}
        if LEFT not in calls.values():
            # A rank that met another's leave is one call ahead of it: leaving again
            # would put it ahead once more, where not leaving puts the two back in step.
            _leave(self.group, self.name)
        return mismatch_error(calls)


def _leave(group: StoreGroup, name: str) -> None:
    """Arrive once, mismatched, at this rank's next call: a rank gone ahead to it wakes."""
    left = _Round(group, name, 0.0, "", identity=LEFT)
    with contextlib.suppress(DDPStateError):
        if left.arrive(b""):  # every rank left: nobody waits for this call
            left.cleanup()


# --------------------------------------------------------------------------- collectives


def barrier(group: StoreGroup, name: str, seconds: float) -> None:
    """Wait until every rank arrives (3 store operations per rank; the last: 4 + deletes)."""
    _Round(group, name, seconds, "barrier").settle(b"")


def share_outcome(
    group: StoreGroup, error: Optional[BaseException], name: str, seconds: float
) -> Optional[DDPStateError]:
    """Tell every rank how ``name`` went; return the shared error (None: every rank succeeded).

    The happy path costs the barrier's operations; the failing ranks' records
    are read only when some rank failed.
    """
    call = _Round(group, name, seconds, "share_outcome")
    sent = b"" if error is None else encode_error(as_shareable(error, group, name))
    if call.settle(sent, lambda: b"1" if any(call.payloads()) else b"0") == b"0":
        return None
    log = call.payloads()
    failing = [rank for rank, payload in enumerate(log) if payload]
    shared = decode_error(log[failing[0]])
    if len(failing) > 1:
        others = "; ".join(f"rank {r}: {decode_error(log[r])}"[:500] for r in failing[1:4])
        more = f" (and {len(failing) - 4} more)" if len(failing) > 4 else ""
        shared = with_message(
            shared, f"{shared} [ranks {', '.join(map(str, failing))} failed; {others}{more}]"
        )
    return shared


def gather(
    group: StoreGroup, payload: bytes, dst: Optional[int], name: str, seconds: float
) -> Optional[list[bytes]]:
    """Every rank's payload, on ``dst`` (every rank when ``dst`` is None); None elsewhere.

    Every rank waits for every other (a timeout names the same missing ranks
    everywhere); only the receivers read the log.
    """
    call = _Round(group, name, seconds, "gather")
    call.settle(payload)
    return call.payloads() if dst is None or group.rank == dst else None


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
    call = _Round(group, name, seconds, "gather_and_decide")
    if group.rank != dst:
        if call.arrive(payload):
            call.finish("done", b"d")
        told = call.read("value", b"v", lambda: call.absent() or [dst])
        return decode_error(told) if told else None
    call.settle(payload)
    try:
        error = decide(call.payloads())
    except BaseException as exc:
        call.op("set", "value", b"v" + encode_error(as_shareable(exc, group, name)))
        raise
    call.op("set", "value", b"v" + (b"" if error is None else encode_error(error)))
    return error


def agree(group: StoreGroup, value: Any, name: str, seconds: float) -> Optional[list[Any]]:
    """None when every rank passed an equal ``value``; else every rank's value, on every rank.

    The last arriver compares (it has read the log); the others read one verdict.
    """
    call = _Round(group, name, seconds, "agree")

    def compare() -> bytes:
        first, *rest = call.payloads()
        same = all(p == first for p in rest) or all(_loads(p) == _loads(first) for p in rest)
        return b"1" if same else b"0"

    same = call.settle(pickle.dumps(value), compare) == b"1"
    return None if same else [_loads(p) for p in call.payloads()]


def _loads(payload: bytes) -> Any:
    # Trusted input: these bytes come from this job's own ranks, never from a file.
    return pickle.loads(payload)


def broadcast(
    group: StoreGroup, payload: Optional[bytes], src: int, name: str, seconds: float
) -> bytes:
    """``src``'s payload on every rank (``src`` passes it, the others None).

    ``src`` does not wait for the others: it sets one key and returns. The
    payload carries ``src``'s identity, so a receiver in another call sees it.
    """
    call = _Round(group, name, seconds, "broadcast")
    if payload is not None:  # this rank is src: the payload is set before it counts in
        call.op("set", "value", b"b" + record(src, call.identity, payload))
    if call.arrive(b""):
        call.cleanup()
    if payload is not None:
        return payload
    ((identity, sent),) = records(call.read("value", b"b", lambda: [src])).values()
    if identity != call.identity:
        raise call.mismatch()
    return sent


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
    append their verdict to ``value``; the receiver that counts in last copies
    ``value`` to ``done``. The other ranks wait on ``done``: three store
    operations each, whatever the world size. Returns the verdict of this
    rank's receiver. If ``decide`` raises, that receiver's ranks raise its error
    (rebuilt as by :func:`share_outcome`, a RankFailedError naming it if it is
    not a DDPStateError) and the exception goes on on the receiver.
    """
    call = _Round(group, name, seconds, "gather_to_receivers")
    if call.arrive((b"r" if dst == group.rank else b"-") + payload):
        call.finish("value", b"g")  # all arrived; the receivers append their verdicts to it

    def missing() -> list[int]:
        absent = call.absent()
        if absent:
            return absent
        decided = set(records(call.op("get", "value")[1:]))
        log = records(call.op("get", "log"))
        return sorted(r for r, (_, p) in log.items() if p[:1] == b"r" and r not in decided)

    if dst != group.rank:
        answer = records(call.read("done", b"d", missing)).get(dst)
        if answer is None:
            raise InvalidArgumentError(
                f"{name}: rank {group.rank} named rank {dst} as its receiver, but rank {dst} "
                f"named another rank; every rank's receiver must name itself"
            )
        if answer[1][:1] == b"e":
            raise decode_error(answer[1][1:])
        return answer[1][1:]
    call.read("value", b"g", missing)
    payloads = call.payloads()
    receivers = sum(1 for p in payloads if p[:1] == b"r")
    failure: Optional[BaseException] = None
    try:
        told = b"v" + decide([p[1:] for p in payloads])
    except BaseException as exc:
        told = b"e" + encode_error(as_shareable(exc, group, name))
        failure = exc
    call.op("append", "value", record(group.rank, b"", told))
    if int(call.op("add", "n", 1)) == group.world + receivers:
        # The last receiver copies the verdicts to the key the other ranks wait on.
        call.op("set", "done", b"d" + call.op("get", "value")[1:])
    if failure is not None:
        raise failure
    return told[1:]
