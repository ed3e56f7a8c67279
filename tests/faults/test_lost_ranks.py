"""A rank that exits before a collective, and one that arrives after the timeout."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from ddpstate.errors import DDPStateError
from ddpstate.manager import CheckpointManager
from tests.faults import _harness as h


@pytest.mark.slow
@pytest.mark.parametrize("op", h.LOST_RANK_OPS)
def test_lost_and_late_ranks_are_named_within_the_timeout(op: str, tmp_path: Path) -> None:
    """Three gloo ranks, 2 s timeout; rank 1 exits before save/load/restore, rank 2 arrives
    3 s late. Rank 0 raises BarrierTimeoutError naming ranks 1 and 2, the late rank 2 one
    naming rank 1, each within [0.95 x timeout, timeout x 1.1 + 0.3 s]; no rank survives."""
    trial = h.lost_rank_trial(op, tmp_path, timeout=2.0)
    assert not trial.defects, trial.defects
    assert set(trial.verdicts) == {"rank 0", "rank 2"}


# A peer that arrives at a call's first rounds and then hangs inside it: every round after
# the first waits only for what is left of the call's one timeout (_calls.wait_left).

_HUNG_TIMEOUT = 2.0


def _hang(seconds: float) -> Any:
    def stuck(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)  # a stuck read (an NFS server gone): the peer neither fails nor comes
        os._exit(0)

    return stuck


def _hung_peer(rank: int, world: int, op: str, folder: str) -> Any:
    """Rank 1 enters ``op`` and hangs inside it; rank 0 reports how long its call took."""
    from ddpstate._manager import verify_split
    from ddpstate.dist import barrier, gather_and_decide, share_outcome

    if rank == 1:  # restore: past its first rounds, then stuck; rounds: stuck before them
        if op == "restore":
            verify_split.check_share = _hang(_HUNG_TIMEOUT * 1.5)  # type: ignore[assignment]
        else:
            _hang(_HUNG_TIMEOUT * 1.5)()
    start = time.monotonic()
    try:
        if op == "restore":
            CheckpointManager(Path(folder, "run"), timeout=_HUNG_TIMEOUT).restore({"weights": None})
        else:  # gather_and_decide, then its failure shared: the shape restore has
            from ddpstate import _calls

            with _calls.calling("two_rounds()"):
                error: Optional[Exception] = None
                try:
                    gather_and_decide(rank, lambda ranks: None, timeout=_HUNG_TIMEOUT)
                except DDPStateError as exc:
                    error = exc
                share_outcome(error, name="two_rounds", timeout=_HUNG_TIMEOUT)
                barrier(timeout=_HUNG_TIMEOUT)
        return ("returned", time.monotonic() - start, ())
    except DDPStateError as exc:
        return (type(exc).__name__, time.monotonic() - start, tuple(exc.missing_ranks))


@pytest.mark.slow
@pytest.mark.parametrize("op", ["restore", "rounds"])
def test_a_peer_hung_inside_a_call_is_named_within_one_timeout(op: str, tmp_path: Path) -> None:
    """Two gloo ranks, 2 s timeout: rank 1 enters the call (restore: its verification share;
    a call of gather_and_decide, share_outcome and barrier: its first round) and hangs. Rank
    0 names rank 1 within [0.95, 1.1] x timeout + 0.3 s, not once per round (4 s before)."""
    from tests.multiproc import run_ranks

    h.prepare_lost_rank_folder(tmp_path)
    results = run_ranks(_hung_peer, 2, args=(op, str(tmp_path)), expect_failure=True, timeout=60)
    name, elapsed, missing = results[0]
    assert (name, missing) == ("BarrierTimeoutError", (1,)), results[0]
    assert _HUNG_TIMEOUT * 0.95 <= elapsed <= h.timeout_bound(_HUNG_TIMEOUT), elapsed
