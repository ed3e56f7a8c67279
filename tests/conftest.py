"""Shared fixtures: every test starts and ends with a clean environment.

Two autouse fixtures keep tests independent of their order:

- ``_clean_environment`` hides the launcher variables of the outer shell and puts
  ``os.environ`` back as it was (tests change it through ``monkeypatch.setenv``);
- ``_global_state_guard`` fails the test that leaves process-wide state of torch
  or Python changed (torch's serialization config, default dtype, thread counts,
  determinism flags, the weights-only allowlist, signal handlers, the working
  folder, the file-size limit). Such a leak once made 65 later tests fail on a
  fresh install while each file passed alone.
"""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed.tensor
from torch.utils.serialization import config as serialization_config

# torch.distributed.tensor and torch._dynamo add classes to torch's weights_only list
# when first imported; imported here, so that a test importing them (DCP and
# torch.compile do) is not taken for one that leaks global state.

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


_GUARDED_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGXFSZ")
    if hasattr(signal, name)
)


def _global_state() -> dict[str, Any]:
    """Process-wide settings a test could leave changed for every test after it."""
    return {
        "torch.utils.serialization.config": serialization_config.get_config_copy(),
        "torch.get_default_dtype()": torch.get_default_dtype(),
        "torch.get_num_threads()": torch.get_num_threads(),
        "torch.are_deterministic_algorithms_enabled()": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "torch.backends.cudnn flags": (
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
        ),
        # A set inside torch: its iteration order is not state (torch's own
        # safe_globals context re-adds the entries and may reorder them).
        "torch.serialization.get_safe_globals()": sorted(
            repr(g) for g in torch.serialization.get_safe_globals()
        ),
        "signal handlers": {sig: signal.getsignal(sig) for sig in _GUARDED_SIGNALS},
        "os.getcwd()": os.getcwd(),
        "RLIMIT_FSIZE": resource.getrlimit(resource.RLIMIT_FSIZE),
    }


@pytest.fixture(autouse=True)
def _global_state_guard() -> Iterator[None]:
    """Fail the test that leaves torch's or the process's global settings changed."""
    before = _global_state()
    yield
    after = _global_state()
    changed = sorted(name for name in before if before[name] != after[name])
    if changed:
        details = "; ".join(f"{n}: {before[n]!r} -> {after[n]!r}" for n in changed)
        pytest.fail(
            f"this test left global state changed ({details}); restore it in the test "
            "(torch config: config.patch(...); environment: monkeypatch.setenv)",
            pytrace=False,
        )
