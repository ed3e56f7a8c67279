"""The call-identity protocol with 64 thread-ranks on one real TCPStore: ranks in different
calls (or at different rounds of one) raise the same error on every rank at once, the job's
ranks stay in step afterwards, and a rank gone one call ahead is released too."""

from __future__ import annotations

import time
from typing import Any

import pytest

from ddpstate import _collectives as c
from ddpstate._calls import calling
from ddpstate.errors import InvalidArgumentError
from tests.collectives.test_collectives_threads import WORLD, _groups, _on_ranks, clients  # noqa: F401

SECONDS = 60.0


def _timed(fn: Any) -> Any:
    def run(g: c.StoreGroup) -> Any:
        start = time.monotonic()
        try:
            fn(g)
        except InvalidArgumentError as exc:
            return str(exc), time.monotonic() - start
        return "returned", time.monotonic() - start

    return run


def _all_in_step(groups: list[c.StoreGroup]) -> None:
    assert _on_ranks(groups, lambda g: c.barrier(g, "barrier", SECONDS)) == [None] * WORLD


@pytest.mark.slow
def test_one_rank_in_another_call_is_named_on_every_rank_at_once(
    clients: tuple[Any, list[Any]],  # noqa: F811
) -> None:
    groups = _groups(clients[1])
    decided: list[int] = []

    def calls(g: c.StoreGroup) -> None:
        if g.rank == 63:
            with calling("ddpstate.barrier()"):
                c.barrier(g, "barrier", SECONDS)
            return
        with calling("ddpstate.save('ck.pt')"):
            c.gather_and_decide(g, b"", 0, "ddpstate.save", SECONDS, lambda p: decided.append(1))

    results = _on_ranks(groups, _timed(calls))
    messages = {m for m, _ in results}
    assert len(messages) == 1, "every rank raises the same error"
    message = messages.pop()
    assert "is in ddpstate.save('ck.pt')" in message and "rank 63 in ddpstate.barrier()" in message
    assert max(t for _, t in results) < SECONDS / 4, "released at once, not at the timeout"
    assert decided == [], "the writer never decides for a call the ranks are not all in"
    _all_in_step(groups)


def test_ranks_at_different_rounds_of_one_call_are_told_which(
    clients: tuple[Any, list[Any]],  # noqa: F811
) -> None:
    groups = _groups(clients[1])

    def calls(g: c.StoreGroup) -> None:
        with calling("ddpstate.save('x.pt')"):
            if g.rank == 0:  # two rounds where the others have one
                c.agree(g, "x.pt", "ddpstate.save", SECONDS)
            c.share_outcome(g, None, "ddpstate.save", SECONDS)

    results = _on_ranks(groups, _timed(calls))
    assert len({m for m, _ in results}) == 1
    message = results[0][0]
    assert "rank 0: ddpstate.save('x.pt') (its collective round 1: agree" in message, message
    assert "share_outcome" in message and "skipped a call" in message
    assert max(t for _, t in results) < SECONDS / 4
    _all_in_step(groups)


def test_a_rank_gone_one_call_ahead_is_released_and_the_ranks_are_back_in_step(
    clients: tuple[Any, list[Any]],  # noqa: F811
) -> None:
    groups = _groups(clients[1])

    def calls(g: c.StoreGroup) -> None:
        if g.rank == 0:  # the source does not wait: it goes on to its next call at once
            with calling("ddpstate.broadcast_object(src=0)"):
                c.broadcast(g, b"\x80 x", 0, "broadcast_object", SECONDS)
        with calling("ddpstate.barrier()"):
            c.barrier(g, "barrier", SECONDS)

    results = _on_ranks(groups, _timed(calls))
    assert all(m != "returned" for m, _ in results), results[:2]
    assert all("ddpstate.broadcast_object(src=0)" in m or "stopped" in m for m, _ in results)
    assert max(t for _, t in results) < SECONDS / 4, "nobody waits out the timeout"
    _all_in_step(groups)


def test_matching_calls_cost_what_they_did_before_the_identity_check(
    clients: tuple[Any, list[Any]],  # noqa: F811
) -> None:
    groups = _groups(clients[1])
    for g in groups:
        g.store.ops.clear()

    def calls(g: c.StoreGroup) -> None:
        with calling("ddpstate.save('ck.pt')"):
            c.gather_and_decide(g, b"", 0, "ddpstate.save", SECONDS, lambda p: None)

    assert _on_ranks(groups, _timed(calls)) and True
    per_rank = sorted(sum(g.store.ops.values()) for g in groups)
    # append (with the identity) + add + get of the verdict, whatever the world size.
    assert per_rank[-3] <= 3
