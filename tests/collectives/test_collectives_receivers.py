"""The per-node gather (``gather_to_receivers``) on 64 thread ranks, each with its own client of
one real TCPStore: answers per node, shared failures, missing ranks named, O(1) store operations
for the ranks that are not receivers."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from ddpstate import _collectives as c
from ddpstate.dist import gather_to_receivers
from ddpstate.errors import BarrierTimeoutError, RankFailedError, UnsafeCheckpointError
from tests.collectives.test_collectives_threads import WORLD, _groups, _on_ranks, _ops, clients

__all__ = ["clients"]  # the shared store fixture, used by name below

NODE = 8  # 8 "nodes" of 8 ranks: ranks 0, 8, 16... receive


def _receiver(rank: int) -> int:
    return rank - rank % NODE


def _summarise(receiver: int, payloads: list[bytes]) -> bytes:
    assert payloads == [b"rng%d" % r for r in range(WORLD)], "a receiver sees every rank's payload"
    return pickle.dumps((receiver, len(payloads)))


def test_each_rank_gets_its_receivers_answer_in_three_store_operations(
    clients: tuple[Any, list[Any]],
) -> None:
    server, stores = clients
    groups = _groups(stores)

    def call(g: c.StoreGroup) -> Any:
        dst = _receiver(g.rank)
        answer = c.gather_to_receivers(
            g, b"rng%d" % g.rank, dst, "save_local", 30, lambda p: _summarise(g.rank, p)
        )
        return pickle.loads(answer)

    for round_ in range(3):
        _ops(groups)
        got = _on_ranks(groups, call)
        assert got == [(_receiver(r), WORLD) for r in range(WORLD)]
        per_rank = _ops(groups)
        others = [n for r, n in enumerate(per_rank) if r % NODE]
        # append (with the call's identity) + add + get of done (the receivers' answers),
        # whatever the world; the last arriver reads the log, marks the arrival and deletes
        # the last call's keys instead.
        assert sorted(others)[-2] == 3, per_rank
        assert max(others) <= 3 + 2 + len(c._SUFFIXES)
        # The keys of finished calls are deleted: the store does not grow with the calls.
        _on_ranks(groups, lambda g: c.barrier(g, "after", 30))
        if round_ == 0:
            keys_after_first = server.num_keys()
        else:
            assert server.num_keys() == keys_after_first


def test_a_failing_receiver_fails_its_own_ranks_only(clients: tuple[Any, list[Any]]) -> None:
    _, stores = clients
    groups = _groups(stores)

    def decide(rank: int, payloads: list[bytes]) -> bytes:
        if rank == 16:
            raise UnsafeCheckpointError("rank 16: x.pt needs os.system", ["os.system"])
        if rank == 40:
            raise OSError("No space left on device")
        return b"ok"

    got = _on_ranks(
        groups,
        lambda g: c.gather_to_receivers(
            g, b"x", _receiver(g.rank), "save_local", 30, lambda p: decide(g.rank, p)
        ),
    )
    for rank, result in enumerate(got):
        node = _receiver(rank)
        if node == 16:
            assert isinstance(result, UnsafeCheckpointError), (rank, result)
            assert result.unsafe_globals == ("os.system",)
        elif node == 40:
            if rank == 40:
                assert isinstance(result, OSError)  # the receiver's own exception goes on
            else:
                assert isinstance(result, RankFailedError), (rank, result)
                assert "save_local failed on rank 40: OSError: No space left" in str(result)
        else:
            assert result == b"ok", (rank, result)


@pytest.mark.slow
def test_a_missing_rank_is_named_on_receivers_and_the_others(
    clients: tuple[Any, list[Any]],
) -> None:
    _, stores = clients
    groups = _groups(stores)

    def call(g: c.StoreGroup) -> Any:
        try:
            c.gather_to_receivers(g, b"x", _receiver(g.rank), "save_local", 2, lambda p: b"")
        except BarrierTimeoutError as exc:
            return list(exc.missing_ranks)
        return "returned"

    got = _on_ranks(groups, call, skip=(13,))
    assert [g for r, g in enumerate(got) if r != 13] == [[13]] * (WORLD - 1)


def test_a_rank_naming_a_rank_that_is_no_receiver_is_told(
    clients: tuple[Any, list[Any]],
) -> None:
    _, stores = clients
    groups = _groups(stores)
    got = _on_ranks(
        groups,
        lambda g: c.gather_to_receivers(
            g, b"x", 1 if g.rank == 63 else _receiver(g.rank), "save_local", 30, lambda p: b"a"
        ),
    )
    assert isinstance(got[63], c.InvalidArgumentError)
    assert "rank 63 named rank 1 as its receiver" in str(got[63])
    assert got[:63] == [b"a"] * 63


def test_not_distributed_calls_decide_with_this_rank_only() -> None:
    assert gather_to_receivers(5, lambda objs: [*objs, 6], dst=0, name="x") == [5, 6]
