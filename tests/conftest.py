"""Shared fixtures: every test starts and ends with a clean environment."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

_RANK_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_STEP_ID",
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_STEP_NODELIST",
    "GROUP_RANK",
    "DDPSTATE_TIMEOUT",
)


@pytest.fixture(autouse=True)
def _clean_environment() -> Iterator[None]:
    """Hide launcher variables of the outer shell, and restore os.environ afterwards."""
    saved = dict(os.environ)
    for name in _RANK_VARS:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
