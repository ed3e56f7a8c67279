"""The default sampler under DataLoader(num_workers=2): a mid-epoch resume sees exactly the rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader, Dataset

import ddpstate
from ddpstate.errors import DDPStateError


class Numbers(Dataset[int]):
    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> int:
        return index


def _loader(sampler: Any, workers: int = 2, **kwargs: Any) -> DataLoader[int]:
    return DataLoader(Numbers(), batch_size=4, sampler=sampler, num_workers=workers, **kwargs)


def _sampler(**kwargs: Any) -> ddpstate.ResumableDistributedSampler:
    return ddpstate.ResumableDistributedSampler(Numbers(), num_replicas=1, rank=0, **kwargs)


@pytest.mark.parametrize(("workers", "persistent"), [(2, False), (2, True), (0, False)])
def test_the_default_sampler_resumes_mid_epoch_exactly_under_workers(
    workers: int, persistent: bool, tmp_path: Path
) -> None:
    sampler = _sampler()
    loader = _loader(sampler, workers, persistent_workers=persistent)
    seen: list[int] = []
    for step, batch in enumerate(loader):
        seen.extend(batch.tolist())
        if step == 14:  # 60 samples trained on; the workers have fetched more
            assert sampler.state_dict()["position"] == 60
            with ddpstate.CheckpointManager(tmp_path / "run") as manager:
                manager.save(15, {"sampler": sampler})
            break
    resumed = _sampler()
    with ddpstate.CheckpointManager(tmp_path / "run") as manager:
        assert manager.restore({"sampler": resumed}) == 15
    rest = [i for batch in _loader(resumed, workers) for i in batch.tolist()]
    assert len(rest) == 40
    assert seen + rest == list(_sampler())  # nothing skipped, nothing twice, same order


def test_a_finished_pass_under_workers_reports_the_whole_epoch() -> None:
    sampler = _sampler()
    loader = _loader(sampler)
    assert len([b for b in loader]) == 25
    assert sampler.state_dict()["position"] == 100
    sampler.set_epoch(1)
    assert sampler.state_dict()["position"] == 0


def test_an_unordered_loader_is_refused_naming_the_fix(tmp_path: Path) -> None:
    sampler = _sampler()
    for step, _ in enumerate(_loader(sampler, in_order=False)):
        if step == 3:
            with pytest.raises(DDPStateError) as info:
                sampler.state_dict()
            break
    assert "in_order=False" in str(info.value) and "count='consumed'" in str(info.value)


def test_consumed_counting_resumes_exactly_under_two_workers() -> None:
    sampler = _sampler(count="consumed")
    seen: list[int] = []
    for step, batch in enumerate(_loader(sampler)):
        seen.extend(batch.tolist())
        sampler.advance(len(batch))
        if step == 14:
            state = sampler.state_dict()
            break
    resumed = _sampler(count="consumed")
    resumed.load_state_dict(state)
    rest = [i for batch in _loader(resumed) for i in batch.tolist()]
    assert seen + rest == list(_sampler(count="consumed"))


def test_the_loader_counters_the_sampler_reads_exist_in_this_torch() -> None:
    # The position under prefetching workers is read from these private counters; a torch
    # that renames them must fail here (and the sampler raises), never over-count silently.
    from torch.utils.data import dataloader

    from ddpstate.sampler import _LOADER_COUNTERS

    loader = DataLoader(list(range(8)), batch_size=2, num_workers=1)
    it = iter(loader)
    try:
        assert isinstance(it, dataloader._MultiProcessingDataLoaderIter)
        assert all(isinstance(getattr(it, name), int) for name in _LOADER_COUNTERS)
    finally:
        del it
