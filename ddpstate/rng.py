"""Capturing and restoring every random-number generator a training step draws from."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddpstate.errors import DDPStateError

__all__ = ["capture_rng_state", "restore_rng_state"]

# Keys of the dict capture_rng_state returns; each names one generator.
#: Python's ``random`` module state (``random.getstate()``).
PYTHON_KEY = "python"
#: NumPy's global (legacy) generator, as plain ints so ``weights_only`` loads it.
NUMPY_KEY = "numpy"
#: torch's CPU generator state (a uint8 tensor).
TORCH_KEY = "torch"
#: One uint8 tensor per visible CUDA device (absent without CUDA).
CUDA_KEY = "cuda"


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def capture_rng_state() -> dict[str, Any]:
    """Return a copy of this process's random-number generator states.

    Covers Python's ``random``, NumPy's global generator (when NumPy is
    importable), torch's CPU generator and, when CUDA is available, the
    generator of every visible CUDA device. The result holds only plain Python
    values and CPU tensors, so ``torch.load(..., weights_only=True)`` reads it
    back. Generators you created yourself (``torch.Generator()``,
    ``numpy.random.default_rng()``) are not global and not included.

    Returns:
        A dict with keys ``"python"``, ``"torch"``, and ``"numpy"`` / ``"cuda"``
        where present.

    Example:
        >>> import torch, ddpstate
        >>> state = ddpstate.capture_rng_state()
        >>> a = torch.rand(2)
        >>> ddpstate.restore_rng_state(state)
        >>> torch.equal(torch.rand(2), a)
        True
    """
    state: dict[str, Any] = {
        PYTHON_KEY: random.getstate(),
        TORCH_KEY: torch.get_rng_state(),
    }
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        state[NUMPY_KEY] = {
            "bit_generator": str(name),
            # An ndarray would need numpy globals allow-listed to load with weights_only.
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    if torch.cuda.is_available():
        state[CUDA_KEY] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return state


def _as_tuple(value: Any) -> Any:
    # weights_only loading and JSON round trips may turn tuples into lists.
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Set this process's random-number generators from :func:`capture_rng_state`'s result.

    Generators missing from ``state`` are left as they are (e.g. NumPy when it
    was not installed at capture time, CUDA when the state came from a CPU
    machine). With fewer CUDA devices than were captured, the first ones are
    set; extra devices keep their state.

    Args:
        state: A dict returned by :func:`capture_rng_state` (possibly after a
            round trip through ``torch.save``/``torch.load``).

    Raises:
        DDPStateError: ``state`` is not such a dict or a value is damaged; the
            message names the generator.

    Example:
        >>> import random, ddpstate
        >>> state = ddpstate.capture_rng_state()
        >>> first = random.random()
        >>> ddpstate.restore_rng_state(state)
        >>> random.random() == first
        True
    """
    if not isinstance(state, Mapping) or not ({PYTHON_KEY, TORCH_KEY} & set(state)):
        raise DDPStateError(
            f"restore_rng_state: expected the dict capture_rng_state() returns (keys "
            f"{PYTHON_KEY!r}, {TORCH_KEY!r}, ...), got {type(state).__name__}"
        )
    # Validate and convert everything first so a bad entry changes no generator.
    setters: list[tuple[str, Callable[[], object]]] = []
    try:
        if PYTHON_KEY in state:
            python = _as_tuple(state[PYTHON_KEY])
            setters.append((PYTHON_KEY, lambda: random.setstate(python)))
        if TORCH_KEY in state:
            cpu = torch.as_tensor(state[TORCH_KEY], dtype=torch.uint8)
            setters.append((TORCH_KEY, lambda: torch.set_rng_state(cpu)))
        if CUDA_KEY in state:
            cuda = [torch.as_tensor(s, dtype=torch.uint8) for s in state[CUDA_KEY]]
            setters.append((CUDA_KEY, lambda: _set_cuda_states(cuda)))
        np = _numpy()
        if NUMPY_KEY in state and np is not None:
            saved = state[NUMPY_KEY]
            legacy = (
                str(saved["bit_generator"]),
                np.asarray(saved["keys"], dtype=np.uint32),
                int(saved["pos"]),
                int(saved["has_gauss"]),
                float(saved["gauss"]),
            )
            setters.append((NUMPY_KEY, lambda: np.random.set_state(legacy)))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise DDPStateError(
            f"restore_rng_state: the saved RNG state is damaged ({type(exc).__name__}: {exc}); "
            "it must come from capture_rng_state()"
        ) from exc
    for key, apply in setters:
        try:
            apply()
        except (TypeError, ValueError, RuntimeError) as exc:
            raise DDPStateError(
                f"restore_rng_state: the saved {key!r} generator state is not valid here "
                f"({type(exc).__name__}: {exc}); it must come from capture_rng_state()"
            ) from exc


def _set_cuda_states(states: list[torch.Tensor]) -> None:
    # With fewer devices than were captured the first ones are set; without CUDA, none.
    if torch.cuda.is_available():
        for index, device_state in enumerate(states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, index)


def derived_seed(state: Mapping[str, Any], salt: int) -> int:
    """A 63-bit seed that depends on a saved RNG state and a salt (e.g. a rank).

    Args:
        state: What :func:`capture_rng_state` returned.
        salt: Makes the seed differ between callers sharing ``state`` (a rank).

    Returns:
        A seed in ``[0, 2**63)``, the same for the same state and salt.

    Example:
        >>> from ddpstate.rng import capture_rng_state, derived_seed
        >>> state = capture_rng_state()
        >>> derived_seed(state, 0) == derived_seed(state, 0) != derived_seed(state, 1)
        True
    """
    digest = hashlib.sha256()
    torch_state = state.get(TORCH_KEY)
    if isinstance(torch_state, torch.Tensor):
        digest.update(torch_state.numpy().tobytes())
    else:
        digest.update(repr(state.get(PYTHON_KEY)).encode())
    digest.update(salt.to_bytes(8, "little", signed=True))
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def seed_all(seed: int) -> None:
    """Seed every generator capture_rng_state covers from one integer.

    Args:
        seed: The seed (numpy takes it modulo ``2**32``).

    Example:
        >>> import random
        >>> from ddpstate.rng import capture_rng_state, restore_rng_state, seed_all
        >>> saved = capture_rng_state()
        >>> seed_all(7); first = random.random()
        >>> seed_all(7); first == random.random()
        True
        >>> restore_rng_state(saved)
    """
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)
