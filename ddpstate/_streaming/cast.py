"""``convert --dtype``: floating tensors re-typed while streaming, one tensor in memory at a time.

A cast tensor gets a storage of its own holding exactly its elements (a view
of a larger storage is cut out); views that were the very same tensor (tied
weights) keep sharing one. Integer and bool tensors (``num_batches_tracked``,
masks) and tensors already of the target dtype pass through as they are.
"""

from __future__ import annotations

import collections
import dataclasses
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Optional

from ddpstate._streaming.pickle_scan import StorageRecord, TensorRecord
from ddpstate._streaming.reader import contiguous_tensor
from ddpstate.errors import CheckpointFormatError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

    from ddpstate._streaming.stream import Sink

# ``convert --dtype``'s short names, and the dtype each stands for (torch's own names
# work too).
_SHORT_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# The dtypes that count as floating; what torch.is_floating_point says of them.
_FLOATING = frozenset(
    {
        "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
        "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    }
)  # fmt: skip


def target_dtype(name: str) -> str:
    """The dtype ``name`` (``"bf16"``, ``"fp16"``, ``"fp32"`` or torch's name) stands for.

    Raises:
        InvalidArgumentError: An unknown name (also a ``ValueError``).
    """
    found = _SHORT_NAMES.get(str(name).lower(), str(name).lower())
    if found not in _SHORT_NAMES.values():
        raise InvalidArgumentError(
            f"dtype must be one of bf16, fp16, fp32 (or bfloat16, float16, float32), got {name!r}"
        )
    return found


class Casts:
    """Which tensors of a tree are cast, their new records, and how to write their bytes.

    Args:
        tensors: The records to consider (each at most once is enough).
        dtype: The target dtype's torch name (see :func:`target_dtype`).
        load: Reads one source tensor (the streaming engine's own reader).
        where: The source, for messages.

    Raises:
        CheckpointFormatError: A tensor to cast carries conjugate/negative bits.
    """

    def __init__(
        self,
        tensors: Iterable[Any],
        dtype: str,
        load: Callable[[TensorRecord], torch.Tensor],
        where: str,
    ) -> None:
        self.dtype = dtype
        self._load = load
        self.replace: dict[int, TensorRecord] = {}
        self._origin: dict[int, TensorRecord] = {}
        shared: dict[tuple[Any, ...], StorageRecord] = {}
        for rec in tensors:
            if not isinstance(rec, TensorRecord) or id(rec) in self.replace:
                continue
            if rec.dtype not in _FLOATING or rec.dtype == dtype:
                continue
            if rec.metadata:
                raise CheckpointFormatError(
                    f"{where}: a tensor to cast has its conjugate/negative bit set; resolve it "
                    f"in torch before casting"
                )
            identity = (id(rec.storage), rec.offset, rec.shape, rec.stride, rec.dtype)
            fresh = contiguous_tensor(f"cast-{len(self._origin)}", dtype, rec.shape)
            storage = shared.get(identity) if rec.numel else None
            if storage is None:
                storage = fresh.storage
                self._origin[id(storage)] = rec
                if rec.numel:
                    shared[identity] = storage
            self.replace[id(rec)] = dataclasses.replace(
                rec,
                storage=storage,
                offset=0,
                stride=fresh.stride,
                dtype=dtype,
                rebuild=fresh.rebuild,
            )

    @property
    def count(self) -> int:
        """How many tensor records are cast."""
        return len(self.replace)

    def record(self, value: Any) -> Any:
        """The record to write in place of ``value`` (``value`` itself when not cast)."""
        return self.replace.get(id(value), value) if isinstance(value, TensorRecord) else value

    def state_dict(self, sd: Mapping[Any, Any]) -> Mapping[Any, Any]:
        """``sd`` with cast records, ``_metadata`` kept."""
        if not self.replace:
            return sd
        new: collections.OrderedDict[Any, Any] = collections.OrderedDict(
            (k, self.record(v)) for k, v in sd.items()
        )
        metadata = getattr(sd, "_metadata", None)
        if metadata is not None:
            new._metadata = metadata  # type: ignore[attr-defined]
        return new

    def write(self, sink: Sink, storage: StorageRecord) -> Optional[int]:
        """Write a cast storage's bytes and return their CRC-32; None when it is not one."""
        source = self._origin.get(id(storage))
        if source is None:
            return None
        import torch

        cast = self._load(source).to(getattr(torch, self.dtype)).contiguous()
        data = cast.reshape(-1).view(torch.uint8).numpy().tobytes()
        sink.write(data)
        if sink.progress is not None:
            sink.progress.update(source.nbytes)
        return zlib.crc32(data)
