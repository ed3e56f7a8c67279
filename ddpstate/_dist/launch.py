"""Starting the process group when launched by torchrun or srun (SLURM), and on which device."""

from __future__ import annotations

import dataclasses
import os
import re
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ddpstate import _elastic
from ddpstate._dist.ranks import (
    Timeout,
    _env_int,
    _pg_ready,
    get_local_rank,
    get_rank,
    get_world_size,
    resolve_timeout,
)
from ddpstate.errors import InvalidArgumentError


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
    return match.group(1) + (match.group(2) or "").split(",")[0].split("-")[0]


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
        job = _env_int("SLURM_JOB_ID")
        os.environ["MASTER_PORT"] = str(15000 + job % 20000)


def device_for(backend: Optional[str], local_rank: int) -> torch.device:
    """The device a rank computes (and communicates) on for this backend.

    Args:
        backend: The process group's backend, or None before there is one.
        local_rank: This process's rank on its node.

    Returns:
        ``cuda:LOCAL_RANK`` (modulo the GPUs present) for NCCL or no backend when CUDA
        is available, else the CPU.

    Example:
        >>> from ddpstate._dist.launch import device_for
        >>> device_for("gloo", 0)
        device(type='cpu')
    """
    if torch.cuda.is_available() and (backend in (None, "nccl") or backend.startswith("cuda")):
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def _check_given_ranks(
    rank: Optional[int], world_size: Optional[int], init_method: Optional[str]
) -> None:
    """Refuse a half-given or impossible ``rank``/``world_size``, or no way to meet."""
    if (rank is None) != (world_size is None):
        raise InvalidArgumentError(
            f"init_distributed(rank={rank!r}, world_size={world_size!r}): pass both rank= and "
            f"world_size= (inside mp.spawn: init_distributed(rank=rank, world_size=world_size))"
        )
    if rank is None or world_size is None:
        if init_method is not None:
            raise InvalidArgumentError(
                f"init_distributed(init_method={init_method!r}) needs rank= and world_size= too: "
                f"init_distributed(rank=rank, world_size=world_size, init_method=...)"
            )
        return
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise InvalidArgumentError(
            f"init_distributed(world_size={world_size!r}): pass the number of processes, >= 1"
        )
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise InvalidArgumentError(
            f"init_distributed(rank={rank!r}, world_size={world_size}): rank must be in "
            f"0..{world_size - 1} (mp.spawn passes each worker its index as the first argument)"
        )
    if init_method is None and not (
        os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")
    ):
        raise InvalidArgumentError(
            f"init_distributed(rank={rank}, world_size={world_size}): no way to meet the other "
            f"ranks; set MASTER_ADDR and MASTER_PORT before mp.spawn (e.g. "
            f"os.environ['MASTER_ADDR'] = '127.0.0.1'; os.environ['MASTER_PORT'] = '29500'), or "
            f"pass init_method='tcp://host:port'"
        )


def _refuse_unknown_rank() -> None:
    """MASTER_ADDR/MASTER_PORT say "a job", but nothing says which rank this is."""
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        # Running alone here would make every process a 1-rank job claiming rank 0:
        # each would write the same files and wrap_ddp would return the bare model.
        raise InvalidArgumentError(
            f"init_distributed(): MASTER_ADDR={os.environ['MASTER_ADDR']} and "
            f"MASTER_PORT={os.environ['MASTER_PORT']} are set, but not this process's rank "
            f"(no RANK/WORLD_SIZE, no SLURM): every process would run alone as rank 0. Pass "
            f"init_distributed(rank=rank, world_size=world_size) inside mp.spawn, or launch "
            f"with torchrun; for a single process, unset MASTER_ADDR and MASTER_PORT"
        )


def init_distributed(
    *,
    backend: str = "auto",
    timeout: Timeout = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    init_method: Optional[str] = None,
) -> DistContext:
    """Initialise the process group under torchrun, srun or ``mp.spawn``.

    Under torchrun (``RANK``/``WORLD_SIZE`` set) or srun (``SLURM_*`` set),
    initialises ``torch.distributed`` with ``env://`` (NCCL when CUDA is
    available, else gloo), and on CUDA sets this process's device to
    ``cuda:LOCAL_RANK``. Inside ``torch.multiprocessing.spawn`` workers, pass
    ``rank=`` and ``world_size=``: the group meets at ``MASTER_ADDR``/``MASTER_PORT``
    (or ``init_method``), and ``LOCAL_RANK`` defaults to ``rank`` (one node).
    With none of these, initialises nothing and returns the single-process
    context. Calling it again returns the same context.

    Args:
        backend: ``"auto"``, ``"nccl"``, ``"gloo"`` or any backend string torch takes.
        timeout: Process-group timeout (seconds or ``timedelta``); default as
            :func:`default_timeout`.
        rank: This process's rank, for launchers that do not set ``RANK``
            (``mp.spawn`` passes each worker its index); give ``world_size`` too.
        world_size: The number of processes, with ``rank``.
        init_method: Where the ranks meet, e.g. ``"tcp://10.0.0.1:29500"``; default
            ``env://`` (``MASTER_ADDR``/``MASTER_PORT``). Only with ``rank``.

    Returns:
        A frozen :class:`DistContext` with rank, local rank, world size, device
        and backend.

    Raises:
        InvalidArgumentError: ``MASTER_ADDR``/``MASTER_PORT`` are set but no rank
            is known (no ``RANK``/``WORLD_SIZE``, no SLURM, no ``rank=``): every
            process would run alone as rank 0; or ``rank``/``world_size`` is
            half-given or out of range.
        DDPStateError: The launch environment is inconsistent (e.g. srun with no
            way to find the first node).

    Example:
        >>> import ddpstate
        >>> ctx = ddpstate.init_distributed()  # plain `python script.py`
        >>> (ctx.rank, ctx.world_size, ctx.is_distributed)
        (0, 1, False)

        The official DDP tutorial's launcher (the workers are started by ``mp.spawn``)::

            def worker(rank, world_size):
                ctx = ddpstate.init_distributed(rank=rank, world_size=world_size)
                model = ddpstate.wrap_ddp(MyNet())
                ...

            if __name__ == "__main__":
                os.environ["MASTER_ADDR"] = "127.0.0.1"
                os.environ["MASTER_PORT"] = "29500"
                torch.multiprocessing.spawn(worker, args=(2,), nprocs=2)
    """
    _check_given_ranks(rank, world_size, init_method)
    if _pg_ready():
        return _joined(str(dist.get_backend()))
    launcher = "given" if rank is not None else _launched_env() if dist.is_available() else None
    if launcher is None:
        _refuse_unknown_rank()
        return DistContext(0, get_local_rank(), 1, device_for(None, get_local_rank()), None)
    meet: dict[str, Any] = {"init_method": init_method or "env://"}
    if launcher == "given":
        # mp.spawn starts one worker per GPU of this node, numbered from 0: that index is
        # the local rank, which device placement ("auto" = cuda:LOCAL_RANK) and
        # get_local_rank() read from the environment, as under torchrun.
        os.environ.setdefault("LOCAL_RANK", str(rank))
        meet.update(rank=rank, world_size=world_size)
    elif launcher == "slurm":
        _slurm_to_env()
    backend = _chosen_backend(backend, get_local_rank())
    pg_timeout = timedelta(seconds=resolve_timeout(timeout))
    # Under torchrun's shared agent store, each restart attempt gets keys of its own.
    store = None if launcher == "given" else _elastic.attempt_store(pg_timeout)
    if store is not None:
        meet = {"store": store, "rank": get_rank(), "world_size": get_world_size()}
    dist.init_process_group(backend=backend, timeout=pg_timeout, **meet)
    return _joined(backend)


def _joined(backend: str) -> DistContext:
    """The context of this rank of the initialised process group."""
    local_rank = get_local_rank()
    return DistContext(
        get_rank(), local_rank, get_world_size(), device_for(backend, local_rank), backend
    )


def _chosen_backend(backend: str, local_rank: int) -> str:
    """``backend`` with "auto" resolved; on NCCL, this process's GPU made current."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return backend
