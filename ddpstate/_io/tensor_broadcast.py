"""Sending a loaded checkpoint from one rank to all: the structure pickled, the tensors as bytes.

The reader rank replaces each tensor by a small reference, broadcasts that skeleton as an
object, then broadcasts every tensor's bytes with ``torch.distributed.broadcast``; each rank
puts its tensors where its ``map_location`` says.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any, Union

import torch
import torch.distributed as torch_dist

from ddpstate.dist import broadcast_object, get_rank
from ddpstate.location import ResolvedMapLocation, map_nested, place

__all__ = ["broadcast_with_tensors"]


@dataclasses.dataclass(frozen=True)
class _TensorRef:
    """Stands in for a tensor in the structure ``src_rank`` broadcasts."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    location: str


def _split(obj: Any, locations: dict[int, str]) -> tuple[Any, list[_TensorRef], list[torch.Tensor]]:
    """Replace tensors by references; identical views of one tensor share a reference."""
    refs: list[_TensorRef] = []
    tensors: list[torch.Tensor] = []
    seen: dict[Any, _TensorRef] = {}

    def leaf(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        ptr = value.untyped_storage().data_ptr()
        key = (ptr, value.storage_offset(), tuple(value.shape), value.stride(), value.dtype)
        if value.numel() and key in seen:
            return seen[key]
        ref = _TensorRef(len(tensors), value.dtype, tuple(value.shape), locations.get(ptr, "cpu"))
        refs.append(ref)
        tensors.append(value)
        if value.numel():  # empty tensors all have data pointer 0; never tie them
            seen[key] = ref
        return ref

    return map_nested(obj, leaf), refs, tensors


def _comm_device() -> torch.device:
    backend = str(torch_dist.get_backend()).lower()
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_with_tensors(
    obj: Any,
    locations: dict[int, str],
    src_rank: int,
    resolved: ResolvedMapLocation,
    timeout: Union[float, timedelta, None],
) -> Any:
    """Give every rank ``src_rank``'s ``obj``, tensors placed by ``resolved``; a collective.

    Args:
        obj: What ``src_rank`` loaded (ignored on the other ranks).
        locations: On ``src_rank``, storage data pointer -> the device it was saved from.
        src_rank: The rank that holds ``obj``.
        resolved: This rank's resolved ``map_location``.
        timeout: For the skeleton's broadcast.

    Returns:
        ``obj`` rebuilt on this rank; identical views of one tensor stay shared.

    Example:
        >>> import torch, torch.distributed as dist
        >>> # Every rank of a process group calls it; here a group of one, in memory.
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> broadcast_with_tensors({"w": torch.ones(2)}, {}, 0, torch.device("cpu"), None)
        {'w': tensor([1., 1.])}
        >>> dist.destroy_process_group()
    """
    rank = get_rank()
    local_tensors: list[torch.Tensor] = []
    sent: Any = None
    if rank == src_rank:
        skeleton, refs, local_tensors = _split(obj, locations)
        sent = (skeleton, refs)  # one pickle: the refs inside the skeleton are memo references
    skeleton, refs = broadcast_object(sent, src_rank=src_rank, timeout=timeout)
    device = _comm_device()
    placed: dict[int, torch.Tensor] = {}
    for ref in refs:
        if rank == src_rank:
            tensor = local_tensors[ref.index].detach()
        else:
            tensor = torch.empty(ref.shape, dtype=ref.dtype, device=device)
        if tensor.numel():
            # Bytes, not values: every dtype (float8, bool, complex...) travels alike.
            flat = tensor.to(device).contiguous().reshape(-1).view(torch.uint8)
            torch_dist.broadcast(flat, src=src_rank)
            tensor = flat.view(ref.dtype).reshape(ref.shape)
        placed[ref.index] = place(tensor, ref.location, resolved)
    return map_nested(skeleton, lambda v: placed[v.index] if isinstance(v, _TensorRef) else v)
