"""The one exception tree every user-caused ddpstate error belongs to.

Catch :class:`DDPStateError` to handle anything ddpstate raises on purpose;
catch a subclass to handle one case. Each message names the file, key or rank
involved and says what to do about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, TypeVar

__all__ = [
    "DDPStateError",
    "CheckpointNotFoundError",
    "CheckpointFormatError",
    "ShardedStateError",
    "CheckpointCorruptError",
    "UnsafeCheckpointError",
    "KeyMismatchError",
    "KeyCollisionError",
    "StateDictNotFoundError",
    "AmbiguousStateDictError",
    "BarrierTimeoutError",
    "CheckpointWriteError",
    "CheckpointExistsError",
    "BatchNormPolicyError",
    "BatchNormBufferSyncError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "DeviceMapError",
    "ShapeMismatchError",
    "DTypeMismatchError",
    "OptimizerStateMismatchError",
    "CheckpointAccessError",
    "RankFailedError",
    "StoreConnectionError",
]


class DDPStateError(Exception):
    """Base class of every error ddpstate raises for a cause the user can fix.

    Attributes:
        argument: The Python argument whose value caused the error or would fix
            it (``"key"``, ``"in_place"``, ``"overwrite"``, ``"weights_only"``), where
            known; the ``ddpstate`` command names its option instead.
    """

    argument: Optional[str] = None


_E = TypeVar("_E", bound=DDPStateError)


def concerning(argument: str, error: _E) -> _E:
    """``error`` marked as concerning the Python argument ``argument``; returns it.

    Example:
        >>> concerning("key", DDPStateError("no entry 'x'")).argument
        'key'
    """
    error.argument = argument
    return error


class CheckpointNotFoundError(DDPStateError, FileNotFoundError):
    """The checkpoint file, folder or URL does not exist.

    Also a :class:`FileNotFoundError`, so existing ``except FileNotFoundError``
    handlers keep working.
    """


class CheckpointFormatError(DDPStateError):
    """The bytes are not a checkpoint format ddpstate reads (or not the one asked for)."""


class ShardedStateError(CheckpointFormatError):
    """The state holds sharded tensors (FSDP2 ``DTensor``, ``ShardedTensor``).

    Each rank holds only its own shards, so writing one rank's state would save
    part of the model as if it were all of it. Save such state with
    ``torch.distributed.checkpoint`` (every rank writes its shards), or gather
    a full state dict first (``torch.distributed.checkpoint.state_dict.get_model_state_dict``
    with ``StateDictOptions(full_state_dict=True, cpu_offload=True)``).
    """


class CheckpointCorruptError(DDPStateError):
    """The file claims a known format but is truncated, damaged or fails verification."""


class UnsafeCheckpointError(DDPStateError):
    """Loading would need arbitrary unpickling, which was not asked for by name.

    Attributes:
        unsafe_globals: The fully qualified names the pickle would import.
    """

    def __init__(self, message: str, unsafe_globals: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.unsafe_globals: tuple[str, ...] = tuple(unsafe_globals)


class KeyMismatchError(DDPStateError, KeyError):
    """State-dict keys do not match what the target expects.

    Attributes:
        missing: Keys the target expects that the source lacks.
        unexpected: Keys the source has that the target does not expect.
    """

    def __init__(
        self,
        message: str,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        self.missing: tuple[str, ...] = tuple(missing)
        self.unexpected: tuple[str, ...] = tuple(unexpected)

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message and wrap it in quotes.
        return str(self.args[0]) if self.args else ""


class KeyCollisionError(KeyMismatchError):
    """Renaming keys would make two entries share one name.

    Attributes:
        keys: The colliding pair ``(existing_key, renamed_from_key)``.
    """

    def __init__(self, message: str, keys: tuple[str, str]) -> None:
        super().__init__(message)
        self.keys = keys


class StateDictNotFoundError(DDPStateError, KeyError):
    """No single model state dict could be located inside a checkpoint container."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class AmbiguousStateDictError(StateDictNotFoundError):
    """A checkpoint holds several model state dicts and no ``key`` says which one is meant."""


class BarrierTimeoutError(DDPStateError, TimeoutError):
    """Some ranks did not reach a collective within the timeout.

    Attributes:
        missing_ranks: The global ranks that did not arrive (empty when unknown).
        timeout: The timeout in seconds that expired.
    """

    def __init__(
        self, message: str, missing_ranks: Sequence[int] = (), timeout: float = 0.0
    ) -> None:
        super().__init__(message)
        self.missing_ranks: tuple[int, ...] = tuple(missing_ranks)
        self.timeout = timeout


class CheckpointWriteError(DDPStateError, OSError):
    """Writing a checkpoint failed; the previous file at the target is untouched."""


class CheckpointExistsError(DDPStateError, FileExistsError):
    """The destination exists and overwriting it was not asked for."""


class BatchNormPolicyError(DDPStateError, ValueError):
    """The BatchNorm policy cannot apply to this model, device or DDP setting."""


class BatchNormBufferSyncError(BatchNormPolicyError, RuntimeError):
    """DDP's in-place BatchNorm buffer sync broke autograd; the message names both fixes.

    Also a :class:`RuntimeError`, so handlers written for torch's original error still match.
    """


class InvalidArgumentError(DDPStateError, ValueError):
    """An argument or environment variable given to ddpstate has a value it cannot use."""


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument given to ddpstate has a type it cannot use (also a ``TypeError``)."""


class DeviceMapError(DDPStateError, ValueError):
    """``map_location`` cannot be understood, or names a device this machine lacks."""


class ShapeMismatchError(DDPStateError, ValueError):
    """A checkpoint's tensors do not fit the model (same keys, different shapes)."""


class DTypeMismatchError(DDPStateError, TypeError):
    """A checkpoint tensor would change dtype on load (float32 into bfloat16, int64 into float32).

    ``CheckpointManager.restore`` refuses any change unless ``allow_dtype_change=True``;
    integer, floating, complex and bool are never converted into one another.
    """


class OptimizerStateMismatchError(KeyMismatchError):
    """Saved optimizer state cannot be matched to the live optimizer's parameters by name.

    Attributes:
        missing: Live parameter names the saved optimizer state has no group for.
        unexpected: Saved parameter names the live optimizer does not hold.
    """


class CheckpointAccessError(DDPStateError, PermissionError):
    """The checkpoint exists but this process may not read it."""


class RankFailedError(DDPStateError):
    """Another rank failed inside a collective block; this rank stops instead of going on."""


class StoreConnectionError(DDPStateError, ConnectionError):
    """A rank lost its connection to the rendezvous store (its host died, or the network).

    Raised at once, not after the collective timeout; the job cannot continue.
    """
