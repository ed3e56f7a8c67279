"""One tensor's bytes out of a streamed checkpoint, as a tensor (diff, casts, strided views)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ddpstate._streaming.pickle_scan import StorageRecord, TensorRecord
from ddpstate._streaming.reader import Checkpoint, zip_entry_bytes
from ddpstate.errors import CheckpointFormatError

if TYPE_CHECKING:
    import torch


def storage_bytes(ckpt: Checkpoint, storage: StorageRecord, start: int, length: int) -> bytes:
    """``length`` bytes of a storage from byte ``start`` (inflating a compressed record)."""
    if length <= 0:
        return b""
    if storage.compressed and storage.record_name:
        record = ckpt.zip_records[storage.record_name]
        data = zip_entry_bytes(ckpt.source, record, ckpt.path)
        return data[start : start + length]
    return ckpt.source.read_at(storage.data_offset + start, length)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name``."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"dtype {name!r} is not available in this torch")
    return dtype


def load_tensor(ckpt: Checkpoint, rec: TensorRecord) -> torch.Tensor:
    """Read one tensor's data from the file (just the span of storage it views)."""
    import torch

    dtype = torch_dtype(rec.dtype)
    if rec.numel == 0:
        return torch.empty(rec.shape, dtype=dtype)
    first, last = rec.offset, rec.extent()
    raw = bytearray(
        storage_bytes(ckpt, rec.storage, first * rec.itemsize, (last - first) * rec.itemsize)
    )
    flat = torch.frombuffer(raw, dtype=torch.uint8)
    if ckpt.byteorder != sys.byteorder and rec.itemsize > 1:
        flat = flat.view(-1, rec.itemsize).flip(-1).reshape(-1).clone()
    return flat.view(dtype).as_strided(rec.shape, rec.stride)
