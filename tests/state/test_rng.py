"""capture_rng_state / restore_rng_state: every global generator comes back exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ddpstate.errors import DDPStateError
from ddpstate.rng import capture_rng_state, derived_seed, restore_rng_state, seed_all


def _draw() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(4)


def _same(a: tuple[float, float, torch.Tensor], b: tuple[float, float, torch.Tensor]) -> bool:
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_restore_replays_python_numpy_and_torch() -> None:
    seed_all(123)
    np.random.randn()  # leaves a cached Gaussian, part of NumPy's state
    state = capture_rng_state()
    first = _draw()
    _draw()
    restore_rng_state(state)
    assert _same(_draw(), first)


def test_round_trip_through_torch_save_with_weights_only(tmp_path: object) -> None:
    state = capture_rng_state()
    first = _draw()
    path = f"{tmp_path}/rng.pt"
    torch.save(state, path)
    restore_rng_state(torch.load(path, weights_only=True))
    assert _same(_draw(), first)


def test_capture_is_a_copy_not_a_view() -> None:
    state = capture_rng_state()
    saved_torch = state["torch"].clone()
    torch.rand(100)
    assert torch.equal(state["torch"], saved_torch)


def test_missing_generators_are_left_alone() -> None:
    state = capture_rng_state()
    del state["numpy"]
    np.random.seed(7)
    expected_numpy = np.random.rand()
    np.random.seed(7)
    torch_first = torch.rand(2)
    restore_rng_state(state)
    assert np.random.rand() == expected_numpy
    assert torch.equal(torch.rand(2), torch_first)


def test_damaged_state_names_the_generator_and_changes_nothing() -> None:
    state = capture_rng_state()
    state["numpy"] = {"bit_generator": "MT19937"}  # keys missing
    random.seed(5)
    expected = random.random()
    random.seed(5)
    with pytest.raises(DDPStateError, match="damaged"):
        restore_rng_state(state)
    assert random.random() == expected  # python state was not replaced


def test_invalid_torch_state_is_reported() -> None:
    state = capture_rng_state()
    state["torch"] = torch.zeros(3, dtype=torch.uint8)
    with pytest.raises(DDPStateError, match="'torch'"):
        restore_rng_state(state)


def test_not_a_state_dict() -> None:
    with pytest.raises(DDPStateError, match="capture_rng_state"):
        restore_rng_state({"unrelated": 1})


def test_derived_seed_is_deterministic_and_differs_per_salt() -> None:
    state = capture_rng_state()
    assert derived_seed(state, 3) == derived_seed(state, 3)
    assert derived_seed(state, 3) != derived_seed(state, 4)
    assert 0 <= derived_seed(state, 3) < 2**63


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: per-device CUDA RNG state")
def test_cuda_generators_round_trip() -> None:
    state = capture_rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    first = torch.rand(4, device="cuda")
    restore_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), first)
