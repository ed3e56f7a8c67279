"""Starting the process group when launched by torchrun or srun (SLURM), and on which device."""

from __future__ import annotations

import dataclasses
import os
import re
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ddpstate import _elastic
from ddpstate._dist.ranks import (
    _env_int,
    _pg_ready,
    get_local_rank,
    get_rank,
    get_world_size,
    resolve_timeout,
)
from ddpstate.errors import InvalidArgumentError

__all__ = ["DistContext", "device_for", "init_distributed"]


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
            get_rank(), local_rank, get_world_size(), device_for(used, local_rank), used
        )
    launcher = _launched_env() if dist.is_available() else None
    if launcher is None:
        return DistContext(0, local_rank, 1, device_for(None, local_rank), None)
    if launcher == "slurm":
        _slurm_to_env()
        local_rank = get_local_rank()
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    pg_timeout = timedelta(seconds=resolve_timeout(timeout))
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
        device_for(backend, local_rank),
        backend,
    )
