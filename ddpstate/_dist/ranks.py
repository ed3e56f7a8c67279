"""Who am I in the job: rank, local rank and world size, and the collective timeout.

They work before (and without) ``init_process_group``: they read the process group
when there is one, else torchrun's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, else
SLURM's ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``, else 0/0/1.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from ddpstate import _collectives
from ddpstate._collectives import TIMEOUT_ENV
from ddpstate.errors import InvalidArgumentError

#: Default collective timeout in seconds: torch's own default process-group
#: timeout, long enough for a multi-GB save to object storage.
DEFAULT_TIMEOUT = 1800.0

#: A collective's timeout as every ddpstate function takes it: seconds, a
#: ``timedelta``, or None for :func:`default_timeout`.
Timeout = float | timedelta | None


def _env_int(*names: str, default: int = 0) -> int:
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
    return default


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
    return dist.get_rank() if _pg_ready() else _env_int("RANK", "SLURM_PROCID")


def get_local_rank() -> int:
    """Return this process's rank on its own node (its GPU index).

    Returns:
        ``LOCAL_RANK`` (torchrun), else ``SLURM_LOCALID``, else 0.

    Example:
        >>> import ddpstate
        >>> ddpstate.get_local_rank()
        0
    """
    return _env_int("LOCAL_RANK", "SLURM_LOCALID")


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
    return _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)


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
    return _collectives.seconds_from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT)


def resolve_timeout(timeout: Timeout) -> float:
    """A collective's timeout in seconds: the given one, or :func:`default_timeout`.

    Args:
        timeout: Seconds, a ``timedelta``, or None for the default.

    Returns:
        The timeout in seconds, positive.

    Raises:
        InvalidArgumentError: ``timeout`` is zero or negative.

    Example:
        >>> from datetime import timedelta
        >>> from ddpstate.dist import resolve_timeout
        >>> resolve_timeout(timedelta(minutes=2))
        120.0
    """
    if timeout is None:
        return default_timeout()
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return seconds
