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
import torch.distributed as dist
from torch.utils.serialization import config as serialization_config

from tests.versions import resolved_versions

# Every TCPStore client connect makes torch look up the host name of its peer's address
# (::ffff:127.0.0.1 here, for a log line); /etc/hosts has no such entry on this machine, so
# glibc asks the DNS server, which drops some queries: that connect then stalls for the
# resolver's 5 s timeout (about 1 connect in 25; a 64-rank store fixture paid 10 s). One
# second bounds it. RES_OPTIONS is glibc's own override of resolv.conf, read by every rank
# and launcher the tests start; no test is about name resolution.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Name the resolved versions first, even under ``-q`` (CI logs quote them)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"versions: {resolved_versions()}")


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


def _foreign_safe_globals() -> list[str]:
    """The weights-only allowlist entries that did not come from torch itself."""
    names = []
    for entry in torch.serialization.get_safe_globals():
        obj = entry[0] if isinstance(entry, tuple) else entry
        module = getattr(obj, "__module__", None) or ""
        if module != "torch" and not module.startswith("torch."):
            names.append(repr(entry))
    return sorted(names)


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
        # torch registers its own types here on first import (torch.distributed.tensor
        # adds DTensor's), so only entries from outside torch count as a test's leak.
        "torch.serialization.get_safe_globals()": _foreign_safe_globals(),
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
