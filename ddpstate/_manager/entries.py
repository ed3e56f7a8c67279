"""What a CheckpointManager's ``state`` entries are: their checks, kinds and RNG wire format.

``save``/``restore`` take ``state`` as entry name -> object; this module checks
names, steps and metrics, tells which kind of object an entry is (model,
stateful object, plain value), and carries each rank's RNG states to the
writer in a form that is cheap to unpickle.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ddpstate._io import savecheck as _savecheck
from ddpstate.errors import InvalidArgumentError

_ENTRY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# What kind of object an entry was saved from; restore() loads by the live object's type.
KIND_MODULE = "module"
KIND_STATEFUL = "stateful"
KIND_VALUE = "value"


@dataclass(frozen=True)
class WireBytes:
    """A byte tensor's contents on their way to the writer (see ``rng_to_wire``)."""

    data: bytes


@dataclass
class Entry:
    kind: str
    value: Any


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgumentError(f"CheckpointManager: step must be an int >= 0, got {step!r}")
    return int(step)


def check_metrics(metrics: Optional[Mapping[str, Any]]) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidArgumentError(
            f"CheckpointManager.save: metrics must be a dict of name -> number, "
            f"got {type(metrics).__name__}"
        )
    out: dict[str, float] = {}
    for key, value in metrics.items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidArgumentError(
                f"CheckpointManager.save: metric {key!r}={value!r} is not a number"
            ) from exc
    return out


def check_state(state: Any, what: str) -> list[str]:
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(
            f"CheckpointManager.{what}: state must be a dict of name -> object, "
            f"got {type(state).__name__}"
        )
    names = list(state)
    for name in names:
        if not isinstance(name, str) or not _ENTRY_NAME_RE.match(name):
            raise InvalidArgumentError(
                f"CheckpointManager.{what}: entry name {name!r} cannot be a file name; use "
                f"letters, digits, '_', '.' and '-', starting with a letter or digit"
            )
    return names


def check_not_sharded(state: Mapping[str, Any], folder: str) -> None:
    """Refuse DTensor/ShardedTensor state on this rank, without calling ``state_dict()``.

    Models are checked through their parameters and buffers, optimizers through
    their state, plain values as they are; other stateful objects are checked on
    the writer once their state dict is taken.
    """
    if not _savecheck.sharded_types():
        return  # torch.distributed.tensor never imported: no DTensor can exist
    for name, obj in state.items():
        what = f"state[{name!r}]"
        if isinstance(obj, nn.Module):
            tensors: Any = {k: v for k, v in obj.named_parameters()}
            tensors.update(obj.named_buffers())
        elif isinstance(obj, torch.optim.Optimizer):
            tensors = obj.state_dict()
        elif has_state_dict(obj):
            continue
        else:
            tensors = obj
        _savecheck.check_tensors(tensors, what, folder, sharded_only=True)


def has_state_dict(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def is_flat_tensor_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    )


def rng_to_wire(state: Any) -> Any:
    """RNG states with each 1-D byte tensor as raw bytes: a torch tensor costs ~0.4 ms to
    unpickle, and the writer unpickles every rank's states at every save."""
    if isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1:
        return WireBytes(state.detach().cpu().numpy().tobytes())
    if isinstance(state, dict):
        return {k: rng_to_wire(v) for k, v in state.items()}
    if isinstance(state, list):
        return [rng_to_wire(v) for v in state]
    return state


def rng_from_wire(state: Any) -> Any:
    if isinstance(state, WireBytes):
        return torch.frombuffer(bytearray(state.data), dtype=torch.uint8)
    if isinstance(state, dict):
        return {k: rng_from_wire(v) for k, v in state.items()}
    if isinstance(state, list):
        return [rng_from_wire(v) for v in state]
    return state


def rng_states(blobs: list[bytes]) -> list[Any]:
    """Every rank's RNG states from the blobs the writer gathered, indexed by rank."""
    # Trusted input: pickled by this job's own ranks in CheckpointManager.save.
    return [rng_from_wire(pickle.loads(blob)) for blob in blobs]
