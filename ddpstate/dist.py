"""Who am I in the job, and meeting the other ranks without ever hanging silently.

Rank queries work before (and without) ``init_process_group``: they read the
process group when there is one, else torchrun's ``RANK``/``LOCAL_RANK``/
``WORLD_SIZE``, else SLURM's ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``,
else 0/0/1.

The collectives here (:func:`barrier`, :func:`broadcast_object`,
:func:`all_gather_object`) do not use the process group's backend at all: they
go through its key-value store (the TCPStore torchrun or ``init_process_group``
already set up). Each rank writes one key per collective and waits for the
others' keys with a deadline, so when a rank never arrives, *every* rank that
did arrive raises :class:`~ddpstate.errors.BarrierTimeoutError` naming the
missing ranks, whatever the backend (gloo or NCCL). See docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pickle
import re
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist

from ddpstate import _elastic
from ddpstate.errors import (
    BarrierTimeoutError,
    InvalidArgumentError,
    RankFailedError,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV",
    "DistContext",
    "all_gather_object",
    "barrier",
    "broadcast_object",
    "default_timeout",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed",
    "is_local_main_process",
    "is_main_process",
    "main_process_first",
    "rank_zero_only",
]

#: Environment variable that sets the default collective timeout, in seconds.
TIMEOUT_ENV = "DDPSTATE_TIMEOUT"
#: Default collective timeout in seconds: torch's own default process-group
#: timeout, long enough for a multi-GB save to object storage.
DEFAULT_TIMEOUT = 1800.0

_R = TypeVar("_R")

_REMINDER = (
    "ddpstate's collective functions (barrier, save, load, CheckpointManager.save/restore, "
    "broadcast_object) must be called on every rank, not inside `if rank == 0:`; "
    "a missing rank may also have crashed or be stuck"
)


# --------------------------------------------------------------------------- rank queries


def _env_int(*names: str) -> Optional[int]:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip() != "":
            try:
                return int(value)
            except ValueError:
                raise InvalidArgumentError(
                    f"environment variable {name}={value!r} is not an integer; "
                    f"unset it or set it to this process's {name.lower()}"
                ) from None
    return None


def _pg_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Return this process's global rank.

    Returns:
        The rank from the process group when one is initialised, else from
        ``RANK`` (torchrun), else ``SLURM_PROCID``, else 0.

    Example:
        >>> import ddpstate
        >>> ddpstate.get_rank()  # a plain single process
        0
    """
    if _pg_ready():
        return dist.get_rank()
    value = _env_int("RANK", "SLURM_PROCID")
    return 0 if value is None else value


def get_local_rank() -> int:
    """Return this process's rank on its own node (its GPU index).

    Returns:
        ``LOCAL_RANK`` (torchrun), else ``SLURM_LOCALID``, else 0.

    Example:
        >>> import ddpstate
        >>> ddpstate.get_local_rank()
        0
    """
    value = _env_int("LOCAL_RANK", "SLURM_LOCALID")
    return 0 if value is None else value


def get_world_size() -> int:
    """Return the number of processes in the job.

    Returns:
        The process group's size when one is initialised, else ``WORLD_SIZE``
        (torchrun), else ``SLURM_NTASKS``, else 1.

    Example:
        >>> import ddpstate
        >>> ddpstate.get_world_size()
        1
    """
    if _pg_ready():
        return dist.get_world_size()
    value = _env_int("WORLD_SIZE", "SLURM_NTASKS")
    return 1 if value is None else value


def is_main_process() -> bool:
    """Return True on global rank 0 (the one that writes and prints).

    Example:
        >>> import ddpstate
        >>> ddpstate.is_main_process()
        True
    """
    return get_rank() == 0


def is_local_main_process() -> bool:
    """Return True on local rank 0 of each node (e.g. for per-node downloads).

    Example:
        >>> import ddpstate
        >>> ddpstate.is_local_main_process()
        True
    """
    return get_local_rank() == 0


def is_distributed() -> bool:
    """Return True when a process group is initialised with more than one rank.

    Collectives are no-ops when this is False.

    Example:
        >>> import ddpstate
        >>> ddpstate.is_distributed()
        False
    """
    return _pg_ready() and dist.get_world_size() > 1


def default_timeout() -> float:
    """Return the collective timeout in seconds used when none is passed.

    Returns:
        ``DDPSTATE_TIMEOUT`` when set, else :data:`DEFAULT_TIMEOUT` (1800 s).

    Raises:
        DDPStateError: ``DDPSTATE_TIMEOUT`` is not a positive number.

    Example:
        >>> import ddpstate
        >>> ddpstate.default_timeout() > 0
        True
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InvalidArgumentError(
            f"environment variable {TIMEOUT_ENV}={raw!r} must be a positive number of seconds"
        )
    return value


def _resolve_timeout(timeout: float | timedelta | None) -> float:
    if timeout is None:
        return default_timeout()
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return seconds


# --------------------------------------------------------------------------- store collectives

# Every collective takes the next number from this counter; all ranks call
# collectives in the same order, so the same number names the same call.
_lock = threading.Lock()
_state: dict[str, Any] = {"generation": 0, "store_id": None, "pending": []}


def _default_store() -> Any:
    from torch.distributed import distributed_c10d as c10d

    getter = getattr(c10d, "_get_default_store", None)
    if getter is None:  # pragma: no cover - every supported torch has it
        raise InvalidArgumentError(
            f"this torch ({torch.__version__}) does not expose the process group's store; "
            "ddpstate needs torch >= 2.5"
        )
    return getter()


def _next_prefix(kind: str, store: Any) -> str:
    with _lock:
        # A new process group (tests, or destroy + init) starts numbering again.
        if _state["store_id"] != id(store):
            _state.update(store_id=id(store), generation=0, pending=[])
        gen = _state["generation"]
        _state["generation"] = gen + 1
    return f"ddpstate/{gen}/{kind}"


def _forget_later(key: str) -> None:
    with _lock:
        _state["pending"].append(key)


def _cleanup_before(prefix: str, store: Any) -> None:
    # Once every rank reached this collective, every rank is done with all earlier
    # ones, so the keys this rank wrote for them can go.
    with _lock:
        old = [k for k in _state["pending"] if not k.startswith(prefix + "/")]
        _state["pending"] = [k for k in _state["pending"] if k.startswith(prefix + "/")]
    for key in old:
        with contextlib.suppress(Exception):
            store.delete_key(key)


def _missing(store: Any, keys: list[str]) -> list[int]:
    missing = []
    for rank, key in enumerate(keys):
        try:
            present = store.check([key])
        except Exception:
            present = False
        if not present:
            missing.append(rank)
    return missing


def _timeout_error(
    name: str, missing: list[int], world: int, seconds: float
) -> BarrierTimeoutError:
    who = ", ".join(str(r) for r in missing) if missing else "unknown"
    plural = "s" if len(missing) != 1 else ""
    return BarrierTimeoutError(
        f"rank {get_rank()}: rank{plural} {who} of {world} did not reach {name} within "
        f"{seconds:g} s. {_REMINDER}. If a rank is legitimately slow, pass timeout= or set "
        f"{TIMEOUT_ENV} (seconds).",
        missing_ranks=missing,
        timeout=seconds,
    )


def _wait(store: Any, keys: list[str], name: str, seconds: float) -> None:
    try:
        store.wait(keys, timedelta(seconds=seconds))
    except Exception as exc:  # DistStoreError (timeout) or a lost connection
        missing = _missing(store, keys)
        raise _timeout_error(name, missing, get_world_size(), seconds) from exc


def _exchange(name: str, payload: bytes, timeout: float | timedelta | None) -> list[bytes] | None:
    """All-gather small byte strings through the store; None means nobody sent any."""
    seconds = _resolve_timeout(timeout)
    store = _default_store()
    prefix = _next_prefix("x", store)
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = [f"{prefix}/{r}" for r in range(world)]
    count_key = f"{prefix}/nonempty"
    try:
        if payload:
            store.add(count_key, 1)
        store.set(keys[rank], payload)
    except Exception as exc:
        raise BarrierTimeoutError(
            f"rank {rank}: lost contact with the rendezvous store during {name} "
            f"({type(exc).__name__}: {exc}); the process hosting it (torchrun's agent or "
            f"rank 0) may have died. {_REMINDER}.",
            timeout=seconds,
        ) from exc
    _forget_later(keys[rank])
    _forget_later(count_key)
    _wait(store, keys, f"{name!r}", seconds)
    _cleanup_before(prefix, store)
    if int(store.add(count_key, 0)) == 0:
        return None
    return [store.get(k) for k in keys]


def barrier(*, timeout: float | timedelta | None = None, name: str = "barrier") -> None:
    """Wait until every rank arrives; never hang silently.

    A collective: every rank must call it. A no-op when not distributed.

    Args:
        timeout: Seconds (or a ``timedelta``) to wait for the other ranks.
            Default: ``DDPSTATE_TIMEOUT`` or 1800 s.
        name: What the barrier is for, used in the error message.

    Raises:
        BarrierTimeoutError: Some ranks did not arrive in time; it names them,
            on every rank that did arrive.

    Example:
        >>> import ddpstate
        >>> ddpstate.barrier(timeout=60)  # no-op in a single process
    """
    if not is_distributed():
        return
    _exchange(name, b"", timeout)


def all_gather_object(obj: Any, *, timeout: float | timedelta | None = None) -> list[Any]:
    """Gather one small picklable object from every rank, on every rank.

    A collective. Meant for metadata (outcomes, RNG states, decisions), not
    tensors: values travel through the rendezvous store.

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
    if not is_distributed():
        return [obj]
    gathered = _exchange("all_gather_object", pickle.dumps(obj), timeout)
    assert gathered is not None  # every rank sent a non-empty pickle
    # Trusted input: these bytes come from this job's own ranks, never from a file.
    return [pickle.loads(b) for b in gathered]


def broadcast_object(
    obj: Any = None, src: int = 0, *, timeout: float | timedelta | None = None
) -> Any:
    """Send one small picklable object from rank ``src`` to every rank.

    A collective. Values travel through the rendezvous store, so use it for
    metadata and decisions; use torch collectives for tensors.

    Args:
        obj: The object, read on ``src`` only.
        src: The sending rank.
        timeout: As for :func:`barrier`.

    Returns:
        ``src``'s object, on every rank.

    Raises:
        BarrierTimeoutError: ``src`` did not send within the timeout (named).

    Example:
        >>> import ddpstate
        >>> ddpstate.broadcast_object({"resume_step": 100})
        {'resume_step': 100}
    """
    if not is_distributed():
        return obj
    world = dist.get_world_size()
    if not 0 <= src < world:
        raise InvalidArgumentError(
            f"broadcast_object: src={src} is not a rank of a {world}-rank job"
        )
    seconds = _resolve_timeout(timeout)
    store = _default_store()
    key = _next_prefix("b", store) + "/value"
    if dist.get_rank() == src:
        store.set(key, pickle.dumps(obj))
        _forget_later(key)
        return obj
    try:
        store.wait([key], timedelta(seconds=seconds))
    except Exception as exc:
        raise _timeout_error("broadcast_object", [src], world, seconds) from exc
    return pickle.loads(store.get(key))


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
        if is_main_process():
            return fn(*args, **kwargs)
        return None

    return wrapper


@contextlib.contextmanager
def main_process_first(
    *, local: bool = False, timeout: float | timedelta | None = None
) -> Iterator[None]:
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
    name = "main_process_first"
    if not leader:
        outcomes = _exchange(name, b"", timeout)
        failures = [o.decode() for o in outcomes or [] if o]
        if failures:
            raise RankFailedError(
                f"rank {get_rank()}: the main process failed inside main_process_first "
                f"({'; '.join(failures)}); not running this rank's block"
            )
        yield
        return
    try:
        yield
    except BaseException as exc:
        _exchange(name, f"rank {get_rank()}: {type(exc).__name__}: {exc}".encode(), timeout)
        raise
    _exchange(name, b"", timeout)


# --------------------------------------------------------------------------- initialisation


@dataclasses.dataclass(frozen=True)
class DistContext:
    """Where this process stands in the job, as returned by :func:`init_distributed`.

    Attributes:
        rank: Global rank.
        local_rank: Rank on this node.
        world_size: Number of processes.
        device: This rank's device (``cuda:LOCAL_RANK`` or ``cpu``).
        backend: The process group's backend, or None when not distributed.
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: Optional[str]

    @property
    def is_distributed(self) -> bool:
        """True when a process group with more than one rank is running."""
        return self.backend is not None and self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0


def _first_slurm_host(nodelist: str) -> str:
    # "node[01-04,07],gpu3" -> "node01"; a plain "host" -> "host".
    match = re.match(r"([^\[,]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise InvalidArgumentError(f"cannot read the first host of SLURM nodelist {nodelist!r}")
    base, ranges = match.group(1), match.group(2)
    if not ranges:
        return base
    first = ranges.split(",")[0].split("-")[0]
    return base + first


def _launched_env() -> Optional[str]:
    """Return 'torchrun', 'slurm' or None, and fill torchrun-style variables for SLURM."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "torchrun"
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        # An interactive salloc shell has one task: that is a single process.
        if _env_int("SLURM_NTASKS") == 1 and "SLURM_STEP_ID" not in os.environ:
            return None
        return "slurm"
    return None


def _slurm_to_env() -> None:
    os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
    os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise InvalidArgumentError(
                "launched by srun but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set; "
                "export MASTER_ADDR=<first node's hostname> in the job script"
            )
        os.environ["MASTER_ADDR"] = _first_slurm_host(nodelist)
    if "MASTER_PORT" not in os.environ:
        # A port derived from the job id: the same on every task, different per job.
        job = _env_int("SLURM_JOB_ID") or 0
        os.environ["MASTER_PORT"] = str(15000 + job % 20000)


def _device_for(backend: Optional[str], local_rank: int) -> torch.device:
    if torch.cuda.is_available() and (backend in (None, "nccl") or backend.startswith("cuda")):
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def init_distributed(
    *, backend: str = "auto", timeout: float | timedelta | None = None
) -> DistContext:
    """Initialise the process group when launched by torchrun or srun.

    Under torchrun (``RANK``/``WORLD_SIZE`` set) or srun (``SLURM_*`` set),
    initialises ``torch.distributed`` with ``env://`` (NCCL when CUDA is
    available, else gloo), and on CUDA sets this process's device to
    ``cuda:LOCAL_RANK``. Otherwise initialises nothing and returns the
    single-process context. Calling it again returns the same context.

    Args:
        backend: ``"auto"``, ``"nccl"``, ``"gloo"`` or any backend string torch takes.
        timeout: Process-group timeout (seconds or ``timedelta``); default as
            :func:`default_timeout`.

    Returns:
        A frozen :class:`DistContext` with rank, local rank, world size, device
        and backend.

    Raises:
        DDPStateError: The launch environment is inconsistent (e.g. srun with no
            way to find the first node).

    Example:
        >>> import ddpstate
        >>> ctx = ddpstate.init_distributed()  # plain `python script.py`
        >>> (ctx.rank, ctx.world_size, ctx.is_distributed)
        (0, 1, False)
    """
    local_rank = get_local_rank()
    if _pg_ready():
        used = str(dist.get_backend())
        return DistContext(
            get_rank(), local_rank, get_world_size(), _device_for(used, local_rank), used
        )
    launcher = _launched_env() if dist.is_available() else None
    if launcher is None:
        return DistContext(0, local_rank, 1, _device_for(None, local_rank), None)
    if launcher == "slurm":
        _slurm_to_env()
        local_rank = get_local_rank()
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    pg_timeout = timedelta(seconds=_resolve_timeout(timeout))
    # Under torchrun's shared agent store, each restart attempt gets keys of its own.
    store = _elastic.attempt_store(pg_timeout)
    if store is not None:
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=get_rank(),
            world_size=get_world_size(),
            timeout=pg_timeout,
        )
    else:
        dist.init_process_group(backend=backend, init_method="env://", timeout=pg_timeout)
    return DistContext(
        dist.get_rank(),
        local_rank,
        dist.get_world_size(),
        _device_for(backend, local_rank),
        backend,
    )
