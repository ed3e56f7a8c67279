"""Who am I in the job, and meeting the other ranks without ever hanging silently.

Rank queries work before (and without) ``init_process_group``: they read the
process group when there is one, else torchrun's ``RANK``/``LOCAL_RANK``/
``WORLD_SIZE``, else SLURM's ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``,
else 0/0/1.

The collectives here (:func:`barrier`, :func:`share_outcome`,
:func:`gather_object`, :func:`gather_and_decide`, :func:`broadcast_object`,
:func:`all_gather_object`, :func:`compare_across_ranks`) do not use the process
group's backend: they go through its key-value store (the TCPStore torchrun or
``init_process_group`` already set up), with a constant number of store
operations per rank (an atomic counter and one "done" key; see
``ddpstate._collectives``). When a rank
never arrives, *every* rank that did arrive raises
:class:`~ddpstate.errors.BarrierTimeoutError` naming the missing ranks, whatever
the backend (gloo or NCCL); a lost store connection raises
:class:`~ddpstate.errors.StoreConnectionError` at once. The per-step stop check
(:func:`all_reduce_flag`) uses the backend instead. See docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist

from ddpstate import _calls, _collectives
from ddpstate._collectives import REMINDER as _REMINDER
from ddpstate._collectives import TIMEOUT_ENV, WARN_AFTER_ENV
from ddpstate._dist.launch import DistContext, device_for, init_distributed
from ddpstate._dist.ranks import (
    DEFAULT_TIMEOUT,
    Timeout,
    default_timeout,
    get_local_rank,
    get_rank,
    get_world_size,
    is_distributed,
    is_local_main_process,
    is_main_process,
    resolve_timeout,
)
from ddpstate._warn import warn
from ddpstate.errors import DDPStateError, InvalidArgumentError, RankFailedError

__all__ = [
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV",
    "WARN_AFTER_ENV",
    "DistContext",
    "Timeout",
    "all_gather_object",
    "all_reduce_flag",
    "barrier",
    "broadcast_object",
    "compare_across_ranks",
    "default_timeout",
    "gather_and_decide",
    "gather_object",
    "gather_to_receivers",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed",
    "is_local_main_process",
    "is_main_process",
    "main_process_first",
    "rank_zero_only",
    "resolve_timeout",
    "share_outcome",
]

_R = TypeVar("_R")


def _check_rank(name: str, arg: str, rank: int) -> None:
    world = dist.get_world_size()
    if not 0 <= rank < world:
        raise InvalidArgumentError(f"{name}: {arg}={rank} is not a rank of a {world}-rank job")


# --------------------------------------------------------------------------- store collectives

# This process's view of the current process group's store (see _collectives.StoreGroup).
# It holds the store itself, so a later group's store can never be mistaken for it.
_lock = threading.Lock()
_current: list[_collectives.StoreGroup] = []


def _default_store() -> Any:
    # Private, but the only way to the process group's store; every torch >= 2.5 has it.
    return dist.distributed_c10d._get_default_store()


def _group() -> _collectives.StoreGroup:
    """The store collectives' context for the current process group."""
    key = (_default_store(), dist.get_rank(), dist.get_world_size())
    with _lock:
        if _current and (_current[0].store, _current[0].rank, _current[0].world) == key:
            return _current[0]
    group = _collectives.StoreGroup.join(*key)
    with _lock:
        _current[:] = [group]
    return group


def barrier(*, timeout: Timeout = None, name: str = "barrier") -> None:
    """Wait until every rank arrives; never hang silently.

    A collective: every rank must call it. A no-op when not distributed. A
    rank still waiting after ``DDPSTATE_WARN_AFTER`` seconds (30 by default,
    then at each doubling) warns, naming the ranks it waits for.

    Args:
        timeout: Seconds (or a ``timedelta``) to wait for the other ranks.
            Default: ``DDPSTATE_TIMEOUT`` or 1800 s.
        name: What the barrier is for, used in the error message.

    Raises:
        BarrierTimeoutError: Some ranks did not arrive in time; it names them,
            on every rank that did arrive.
        StoreConnectionError: The rendezvous store's host died (raised at once).

    Example:
        >>> import ddpstate
        >>> ddpstate.barrier(timeout=60)  # no-op in a single process
    """
    with _calls.calling(
        "ddpstate.barrier()" if name == "barrier" else f"ddpstate.barrier({name=})"
    ):
        if not is_distributed():
            return
        _collectives.barrier(_group(), name, resolve_timeout(timeout))


def share_outcome(
    error: Optional[BaseException],
    *,
    name: str,
    timeout: Timeout = None,
) -> None:
    """Tell every rank how an operation went; raise the same error on every rank if one failed.

    A collective: every rank passes its own outcome (None for success). When
    any rank failed, every rank raises the error of the lowest failing rank,
    rebuilt with the same class, message and attributes (e.g.
    ``UnsafeCheckpointError.unsafe_globals``); when several failed, the message
    names them all. A rank that failed itself chains its own error as the
    cause. An error that is not a :class:`DDPStateError` travels as a
    :class:`RankFailedError` naming its type and rank. A no-op that just
    re-raises ``error`` when not distributed.

    Args:
        error: This rank's failure, or None.
        name: The operation, used in timeout and failure messages.
        timeout: As for :func:`barrier`.

    Raises:
        DDPStateError: Some rank failed (the shared error, on every rank).
        BarrierTimeoutError: Some ranks did not arrive in time (named).
        StoreConnectionError: The rendezvous store's host died.

    Example:
        >>> from ddpstate.dist import share_outcome
        >>> share_outcome(None, name="my step")  # every rank succeeded: returns
    """
    with _calls.calling(f"ddpstate.share_outcome({name=})"):
        if not is_distributed():
            if error is not None:
                raise error
            return
        shared = _collectives.share_outcome(_group(), error, name, resolve_timeout(timeout))
        if shared is not None:
            raise shared from error


def all_gather_object(obj: Any, *, timeout: Timeout = None) -> list[Any]:
    """Gather one small picklable object from every rank, on every rank.

    A collective. Meant for small metadata: values travel through the
    rendezvous store and every rank reads all of them (N payloads per rank);
    prefer :func:`gather_object` when one rank needs them.

    Args:
        obj: This rank's object.
        timeout: As for :func:`barrier`.

    Returns:
        The list of every rank's object, indexed by rank.

    Raises:
        BarrierTimeoutError: Some ranks did not arrive in time (named).

    Example:
        >>> import ddpstate
        >>> ddpstate.all_gather_object({"step": 3})
        [{'step': 3}]
    """
    with _calls.calling("ddpstate.all_gather_object()"):
        gathered = _gather(obj, None, "all_gather_object", timeout)
    assert gathered is not None
    return gathered


def gather_object(
    obj: Any,
    dst: int = 0,
    *,
    timeout: Timeout = None,
    name: str = "gather_object",
) -> Optional[list[Any]]:
    """Gather one small picklable object from every rank on rank ``dst`` only.

    A collective: every rank waits until all have arrived (so a missing rank is
    named on every rank), but only ``dst`` reads the payloads.

    Args:
        obj: This rank's object.
        dst: The receiving rank.
        timeout: As for :func:`barrier`.
        name: What the gather is for, used in the error message.

    Returns:
        On ``dst``, every rank's object indexed by rank; None elsewhere.

    Raises:
        BarrierTimeoutError: Some ranks did not arrive in time (named).

    Example:
        >>> from ddpstate.dist import gather_object
        >>> gather_object("rank 0's note")
        ["rank 0's note"]
    """
    with _calls.calling("ddpstate.gather_object()"):
        return _gather(obj, dst, name, timeout)


def _gather(obj: Any, dst: Optional[int], name: str, timeout: Timeout) -> Optional[list[Any]]:
    """Every rank's ``obj`` on ``dst`` (on every rank when ``dst`` is None), None elsewhere."""
    if not is_distributed():
        return [obj]
    if dst is not None:
        _check_rank("gather_object", "dst", dst)
    gathered = _collectives.gather(_group(), pickle.dumps(obj), dst, name, resolve_timeout(timeout))
    # Trusted input: these bytes come from this job's own ranks, never from a file.
    return None if gathered is None else [pickle.loads(b) for b in gathered]


def gather_and_decide(
    obj: Any,
    decide: Callable[[list[Any]], Optional[DDPStateError]],
    *,
    dst: int = 0,
    name: str = "gather_and_decide",
    timeout: Timeout = None,
) -> None:
    """Gather one object per rank on ``dst``, let ``dst`` decide, raise its verdict everywhere.

    A collective in one round: every rank sends its object and waits for
    ``dst``'s verdict; ``dst`` waits for all, calls ``decide`` with every
    rank's object (indexed by rank), which may do work before answering (e.g.
    write a checkpoint), and returns None or the error every rank raises
    (rebuilt as by :func:`share_outcome`). The other ranks' wait includes
    ``decide``'s time.

    Args:
        obj: This rank's small picklable object.
        decide: Called on ``dst`` only.
        dst: The deciding rank.
        name: The operation, used in timeout and failure messages.
        timeout: As for :func:`barrier`.

    Raises:
        DDPStateError: The error ``decide`` returned, on every rank.
        BarrierTimeoutError: Some ranks did not arrive in time (named).

    Example:
        >>> from ddpstate.dist import gather_and_decide
        >>> gather_and_decide({"step": 3}, lambda infos: None, name="check steps")
    """
    with _calls.calling(f"ddpstate.gather_and_decide({name=})"):

        def on_dst(payloads: list[bytes]) -> Optional[DDPStateError]:
            # Trusted input: these bytes come from this job's own ranks, never from a file.
            return decide([pickle.loads(b) for b in payloads])

        if not is_distributed():
            error = decide([obj])
        else:
            _check_rank(name, "dst", dst)
            group = _group()
            error = _collectives.gather_and_decide(
                group, pickle.dumps(obj), dst, name, resolve_timeout(timeout), on_dst
            )
        if error is not None:
            raise error


def gather_to_receivers(
    obj: Any,
    decide: Callable[[list[Any]], Any],
    *,
    dst: int,
    name: str,
    timeout: Timeout = None,
) -> Any:
    """Gather one object per rank on each receiver; each rank gets its receiver's answer.

    A collective in one round, for several receivers at once (e.g. each node's
    local rank 0): every rank names its receiver ``dst``, and a rank with
    ``dst == rank`` is a receiver. Each receiver calls ``decide`` with every
    rank's object (indexed by rank) and its small picklable answer goes to the
    ranks that named it. A rank that is not a receiver costs three store
    operations and never reads the other ranks' objects.

    Args:
        obj: This rank's small picklable object.
        decide: Called on the receivers only.
        dst: This rank's receiver (its own rank for a receiver).
        name: The operation, used in timeout and failure messages.
        timeout: As for :func:`barrier`.

    Returns:
        The answer of this rank's receiver.

    Raises:
        DDPStateError: ``decide`` raised on this rank's receiver (its error, or a
            RankFailedError naming it), on the ranks that named that receiver.
        InvalidArgumentError: ``dst`` is not a rank, or not a receiver.
        BarrierTimeoutError: Some ranks did not arrive in time (named).

    Example:
        >>> from ddpstate.dist import gather_to_receivers
        >>> gather_to_receivers(3, sum, dst=0, name="sum on each node")
        3
    """
    with _calls.calling(f"ddpstate.gather_to_receivers({name=})"):
        if not is_distributed():
            return decide([obj])
        _check_rank(name, "dst", dst)

        def on_receiver(payloads: list[bytes]) -> bytes:
            # Trusted input: these bytes come from this job's own ranks, never from a file.
            return pickle.dumps(decide([pickle.loads(b) for b in payloads]))

        raw = _collectives.gather_to_receivers(
            _group(), pickle.dumps(obj), dst, name, resolve_timeout(timeout), on_receiver
        )
        # Trusted input: the answer of this job's own receiver rank.
        return pickle.loads(raw)


def compare_across_ranks(value: Any, *, name: str, timeout: Timeout = None) -> Optional[list[Any]]:
    """Check that every rank passed an equal ``value``; every rank gets the same answer.

    A collective. One rank compares; the others read one verdict, so the
    values travel to every rank only when they differ (to name them).

    Args:
        value: This rank's small picklable value (a path, a config tuple...).
        name: What is compared, used in the error message.
        timeout: As for :func:`barrier`.

    Returns:
        None when all values are equal, else every rank's value, indexed by rank.

    Raises:
        BarrierTimeoutError: Some ranks did not arrive in time (named).

    Example:
        >>> from ddpstate.dist import compare_across_ranks
        >>> compare_across_ranks("run/ckpt.pt", name="save path") is None
        True
    """
    with _calls.calling(f"ddpstate.compare_across_ranks({name=})"):
        if not is_distributed():
            return None
        return _collectives.agree(_group(), value, name, resolve_timeout(timeout))


def broadcast_object(
    obj: Any = None, src_rank: int = 0, *, timeout: Timeout = None, src: Optional[int] = None
) -> Any:
    """Send one small picklable object from rank ``src_rank`` to every rank.

    A collective. Values travel through the rendezvous store, so use it for
    metadata and decisions; use torch collectives for tensors. ``src_rank``
    writes one key and returns; the others read that key.

    Args:
        obj: The object, read on ``src_rank`` only.
        src_rank: The sending rank (the name ``ddpstate.load`` uses too).
        timeout: As for :func:`barrier`.
        src: Deprecated keyword spelling of ``src_rank``.

    Returns:
        ``src_rank``'s object, on every rank.

    Raises:
        BarrierTimeoutError: ``src_rank`` did not send within the timeout (named).
        InvalidArgumentError: ``src_rank`` is not a rank, or ``src=`` and
            ``src_rank=`` name different ranks.

    Example:
        >>> import ddpstate
        >>> ddpstate.broadcast_object({"resume_step": 100})
        {'resume_step': 100}
    """
    if src is not None:
        if src_rank not in (0, src):
            raise InvalidArgumentError(
                f"broadcast_object(src={src}, src_rank={src_rank}): pass src_rank= only"
            )
        warn("broadcast_object(src=) is deprecated; pass src_rank=", DeprecationWarning)
        src_rank = src
    with _calls.calling(f"ddpstate.broadcast_object({src_rank=})"):
        if not is_distributed():
            return obj
        _check_rank("broadcast_object", "src_rank", src_rank)
        group = _group()
        payload = pickle.dumps(obj) if group.rank == src_rank else None
        raw = _collectives.broadcast(
            group, payload, src_rank, "broadcast_object", resolve_timeout(timeout)
        )
        # Trusted input: these bytes come from this job's own rank src_rank, never a file.
        return obj if payload is not None else pickle.loads(raw)


_flag_buffer: list[tuple[Any, torch.Tensor]] = []


def all_reduce_flag(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on any rank; a collective on the backend.

    One ``all_reduce`` (MAX) of a one-element tensor on the backend's device
    (gloo: CPU; NCCL: ``cuda:LOCAL_RANK``), no store traffic: cheap enough for
    every training step. It waits as long as the process group's own timeout.

    Args:
        flag: This rank's flag.

    Returns:
        Whether any rank's flag is True (``flag`` itself when not distributed).

    Raises:
        RankFailedError: The all-reduce failed (a rank crashed or the group broke).

    Example:
        >>> from ddpstate.dist import all_reduce_flag
        >>> all_reduce_flag(False)
        False
    """
    # A per-step call: the process group's device and a one-element buffer are
    # looked up once per group (a fresh tensor per call costs the backend more
    # than the all-reduce of one element).
    world = dist.GroupMember.WORLD if dist.is_available() else None
    if _flag_buffer and _flag_buffer[0][0] is world:
        tensor = _flag_buffer[0][1]
    else:
        if not is_distributed():
            return flag
        device = device_for(str(dist.get_backend()), get_local_rank())
        tensor = torch.zeros(1, dtype=torch.int32, device=device)
        _flag_buffer[:] = [(world, tensor)]
    tensor.fill_(1 if flag else 0)
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    except Exception as exc:
        raise RankFailedError(
            f"rank {dist.get_rank()}: the all-reduce of the stop flag failed "
            f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}); "
            f"a rank has likely crashed or left the process group. {_REMINDER}"
        ) from exc
    return bool(tensor.item())


def rank_zero_only(fn: Callable[..., _R]) -> Callable[..., Optional[_R]]:
    """Decorate a function so it runs on global rank 0 only (None elsewhere).

    Not a collective: the other ranks return at once. Use it for printing and
    logging, never around ddpstate's collective functions.

    Example:
        >>> import ddpstate
        >>> @ddpstate.rank_zero_only
        ... def log(msg): print(msg)
        >>> log("hello")
        hello
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Optional[_R]:
        return fn(*args, **kwargs) if is_main_process() else None

    return wrapper


@contextlib.contextmanager
def main_process_first(*, local: bool = False, timeout: Timeout = None) -> Iterator[None]:
    """Run the block on the main process first, then on every other rank.

    For work whose result the others reuse (preprocessing, writing a cache).
    A collective. If the main process's block raises, the other ranks raise a
    :class:`DDPStateError` naming it instead of running their block.

    Args:
        local: Leaders are each node's local rank 0 instead of global rank 0.
        timeout: How long the others wait for the leaders (as :func:`barrier`).

    Raises:
        BarrierTimeoutError: A leader did not finish within the timeout.
        DDPStateError: A leader's block raised.

    Example:
        >>> import ddpstate
        >>> with ddpstate.main_process_first():
        ...     data = list(range(3))  # e.g. build a cache once
    """
    leader = is_local_main_process() if local else is_main_process()
    if not is_distributed():
        yield
        return
    name, call = "main_process_first", "ddpstate.main_process_first()"
    if leader:
        try:
            yield
        except BaseException as exc:
            told = RankFailedError(
                f"rank {get_rank()}: the main process failed inside main_process_first "
                f"({type(exc).__name__}: {exc}); not running this rank's block"
            )
            # Tell the waiting ranks, then raise this rank's own error, not the shared one.
            with contextlib.suppress(DDPStateError), _calls.calling(call):
                share_outcome(told, name=name, timeout=timeout)
            raise
    # The leaders after their block, the others before theirs.
    with _calls.calling(call):
        share_outcome(None, name=name, timeout=timeout)
    if not leader:
        yield
