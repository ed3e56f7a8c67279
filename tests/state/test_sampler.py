"""ResumableDistributedSampler: resuming yields exactly the rest of the interrupted epoch."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from ddpstate.errors import DDPStateError
from ddpstate.sampler import ResumableDistributedSampler


def _full(n: int, replicas: int, rank: int, epoch: int = 0, **kw: object) -> list[int]:
    parent: DistributedSampler[int] = DistributedSampler(
        range(n), num_replicas=replicas, rank=rank, **kw
    )
    parent.set_epoch(epoch)
    return list(parent)


@pytest.mark.parametrize(
    ("n", "replicas", "shuffle", "drop_last"),
    [(10, 1, True, False), (11, 2, True, False), (11, 3, False, True), (7, 4, True, True)],
)
def test_without_resume_it_is_the_parent_sampler(
    n: int, replicas: int, shuffle: bool, drop_last: bool
) -> None:
    for rank in range(replicas):
        sampler = ResumableDistributedSampler(
            range(n), replicas, rank, shuffle=shuffle, seed=3, drop_last=drop_last
        )
        sampler.set_epoch(2)
        expected = _full(n, replicas, rank, 2, shuffle=shuffle, seed=3, drop_last=drop_last)
        assert list(sampler) == expected
        assert len(sampler) == len(expected)


@pytest.mark.parametrize("taken", [0, 1, 4, 6])
def test_resume_yields_exactly_the_rest_on_every_rank(taken: int) -> None:
    for rank in range(2):
        sampler = ResumableDistributedSampler(range(13), 2, rank, seed=1)
        sampler.set_epoch(5)
        it = iter(sampler)
        head = list(itertools.islice(it, taken))
        state = sampler.state_dict()
        assert (state["epoch"], state["position"]) == (5, taken)
        resumed = ResumableDistributedSampler(range(13), 2, rank, seed=1)
        resumed.load_state_dict(state)
        assert len(resumed) == 7 - taken
        rest = list(resumed)
        assert rest == list(it)
        assert head + rest == _full(13, 2, rank, 5, seed=1)


def test_dataloader_position_counts_whole_batches() -> None:
    sampler = ResumableDistributedSampler(range(40), 2, 0, seed=0)
    loader = DataLoader(range(40), batch_size=4, sampler=sampler)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(3)]
    assert sampler.state_dict()["position"] == 12
    resumed = ResumableDistributedSampler(range(40), 2, 0, seed=0)
    resumed.load_state_dict(sampler.state_dict())
    rest = [b.tolist() for b in DataLoader(range(40), batch_size=4, sampler=resumed)]
    assert rest == [b.tolist() for b in it]
    assert [i for batch in seen + rest for i in batch] == _full(40, 2, 0)


def test_workers_prefetch_so_consumed_mode_counts_what_the_loop_used() -> None:
    yielded = ResumableDistributedSampler(range(64), 1, 0)
    consumed = ResumableDistributedSampler(range(64), 1, 0, count="consumed")
    positions = {}
    for name, sampler in (("yielded", yielded), ("consumed", consumed)):
        loader = DataLoader(range(64), batch_size=4, sampler=sampler, num_workers=2)
        it = iter(loader)
        for _ in range(2):
            batch = next(it)
            if sampler.count == "consumed":
                sampler.advance(len(batch))
        positions[name] = sampler.state_dict()["position"]
        del it
    # Two workers prefetch 2 batches each, handed out ahead of what the loop used; the
    # default mode counts only the batches the loader gave the loop.
    assert positions["yielded"] == 8
    assert positions["consumed"] == 8
    resumed = ResumableDistributedSampler(range(64), 1, 0)
    resumed.load_state_dict(consumed.state_dict())
    assert list(resumed) == _full(64, 1, 0)[8:]


def test_set_epoch_same_epoch_keeps_place_new_epoch_starts_over() -> None:
    sampler = ResumableDistributedSampler(range(10), 1, 0)
    sampler.load_state_dict({"epoch": 3, "position": 4})
    sampler.set_epoch(3)  # the usual loop calls this first after a resume
    assert list(sampler) == _full(10, 1, 0, 3)[4:]
    sampler.set_epoch(4)
    assert sampler.state_dict()["position"] == 0
    assert list(sampler) == _full(10, 1, 0, 4)


def test_epoch_saved_at_its_end_resumes_as_empty_then_next_epoch_is_full() -> None:
    sampler = ResumableDistributedSampler(range(6), 2, 1)
    list(sampler)
    state = sampler.state_dict()
    assert state["position"] == 3
    resumed = ResumableDistributedSampler(range(6), 2, 1)
    resumed.load_state_dict(state)
    seen = []
    for epoch in range(resumed.epoch, 2):
        resumed.set_epoch(epoch)
        seen.append(list(resumed))
    assert seen == [[], _full(6, 2, 1, 1)]


def test_a_second_pass_without_set_epoch_repeats_the_epoch_like_the_parent() -> None:
    sampler = ResumableDistributedSampler(range(8), 2, 0)
    sampler.load_state_dict({"epoch": 0, "position": 2})
    assert list(sampler) == _full(8, 2, 0)[2:]
    assert list(sampler) == _full(8, 2, 0)


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (4, 1)])
def test_world_size_change_covers_the_rest_of_the_permutation_once(old: int, new: int) -> None:
    n, taken = 24, 3
    consumed: list[int] = []
    state = None
    for rank in range(old):
        sampler = ResumableDistributedSampler(range(n), old, rank, seed=9)
        sampler.set_epoch(1)
        consumed += list(itertools.islice(iter(sampler), taken))
        state = sampler.state_dict()
    rest: list[int] = []
    for rank in range(new):
        resumed = ResumableDistributedSampler(range(n), new, rank, seed=9)
        resumed.load_state_dict(state or {})
        rest += list(resumed)
    assert set(consumed).isdisjoint(rest)  # nothing already consumed comes back
    assert set(consumed) | set(rest) == set(range(n))  # nothing is skipped
    left = n - taken * old
    assert len(rest) == -(-left // new) * new  # only padding (as the parent pads) repeats
    later = ResumableDistributedSampler(range(n), new, 0, seed=9)
    later.load_state_dict(state or {})
    later.set_epoch(2)
    assert list(later) == _full(n, new, 0, 2, seed=9)


@pytest.mark.slow
def test_world_size_change_then_save_again_keeps_counting() -> None:
    n = 22  # 6 consumed by 2 ranks, 16 left: divides by 4, so nothing is padded
    first = ResumableDistributedSampler(range(n), 2, 0, seed=4)
    consumed = list(itertools.islice(iter(first), 3))
    second = ResumableDistributedSampler(range(n), 2, 1, seed=4)
    consumed += list(itertools.islice(iter(second), 3))
    moved = [ResumableDistributedSampler(range(n), 4, r, seed=4) for r in range(4)]
    its = []
    for s in moved:
        s.load_state_dict(first.state_dict())
        its.append(iter(s))
        consumed += list(itertools.islice(its[-1], 1))
    again = [ResumableDistributedSampler(range(n), 4, r, seed=4) for r in range(4)]
    for s in again:
        s.load_state_dict(moved[0].state_dict())
        consumed += list(s)
    assert Counter(consumed) == Counter(range(n))


def test_padding_case_world_change_has_no_missing_sample() -> None:
    n = 11
    head = []
    state = None
    for rank in range(2):
        sampler = ResumableDistributedSampler(range(n), 2, rank)
        head += list(itertools.islice(iter(sampler), 2))
        state = sampler.state_dict()
    rest = []
    for rank in range(3):
        resumed = ResumableDistributedSampler(range(n), 3, rank)
        resumed.load_state_dict(state or {})
        rest += list(resumed)
    assert set(head + rest) == set(range(n))
    assert len(rest) == 9  # 7 left, padded to a multiple of 3


def test_mismatched_settings_are_refused_with_the_fix() -> None:
    sampler = ResumableDistributedSampler(range(10), 1, 0, seed=1)
    other = ResumableDistributedSampler(range(10), 1, 0, seed=2)
    with pytest.raises(DDPStateError, match="seed=1"):
        other.load_state_dict(sampler.state_dict())
    shorter = ResumableDistributedSampler(range(9), 1, 0, seed=1)
    with pytest.raises(DDPStateError, match="dataset_len=10"):
        shorter.load_state_dict(sampler.state_dict())
    with pytest.raises(DDPStateError, match="past the end"):
        sampler.load_state_dict({"epoch": 0, "position": 11})
    with pytest.raises(DDPStateError, match="'epoch'"):
        sampler.load_state_dict({"position": 1})


def test_advance_is_checked() -> None:
    yielded = ResumableDistributedSampler(range(4), 1, 0)
    with pytest.raises(DDPStateError, match="count='consumed'"):
        yielded.advance(1)
    consumed = ResumableDistributedSampler(range(4), 1, 0, count="consumed")
    iter(consumed)
    consumed.advance(4)
    with pytest.raises(DDPStateError, match="only 4"):
        consumed.advance(1)
    with pytest.raises(DDPStateError, match="count="):
        ResumableDistributedSampler(range(4), 1, 0, count="batches")


def test_defaults_without_process_group() -> None:
    sampler = ResumableDistributedSampler(range(5))
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    assert sorted(sampler) == list(range(5))


def test_state_round_trips_through_weights_only_load(tmp_path: object) -> None:
    sampler = ResumableDistributedSampler(range(10), 2, 1)
    next(iter(sampler))
    path = f"{tmp_path}/s.pt"
    torch.save(sampler.state_dict(), path)
    assert torch.load(path, weights_only=True) == sampler.state_dict()
