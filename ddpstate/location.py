"""Where loaded tensors go: turning ``map_location`` (``"auto"`` included) into devices."""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import torch

from ddpstate.dist import get_local_rank
from ddpstate.errors import DeviceMapError

__all__ = ["MapLocation", "ResolvedMapLocation", "resolve_map_location"]

#: What ``load(map_location=...)`` accepts: ``"auto"``, a device, a device string
#: or index, a ``{saved: target}`` dict, a ``torch.load``-style callable, or None.
MapLocation = Union[
    None,
    str,
    int,
    torch.device,
    Mapping[str, Union[str, torch.device]],
    Callable[[torch.UntypedStorage, str], Any],
]
#: What :func:`resolve_map_location` returns; ``torch.load`` takes all of these.
ResolvedMapLocation = Union[
    None, torch.device, dict[str, str], Callable[[torch.UntypedStorage, str], Any]
]


def _auto_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def _as_device(value: Union[str, int, torch.device], what: str) -> torch.device:
    try:
        if isinstance(value, int):
            # torch.device(int) means "the current accelerator"; torch.load means CUDA.
            return torch.device("cuda", value)
        return torch.device(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DeviceMapError(
            f"map_location {what}{value!r} is not a device; use 'auto', 'cpu', 'cuda:N', a "
            f"dict such as {{'cuda:0': 'cpu'}} or a callable"
        ) from exc


def resolve_map_location(map_location: MapLocation = "auto") -> ResolvedMapLocation:
    """Turn a ``map_location`` argument into something ``torch.load`` accepts.

    ``"auto"`` means this rank's own device: ``cuda:LOCAL_RANK`` when CUDA is
    available, else the CPU. Any tensor saved on any ``cuda:N`` then loads on a
    CPU-only machine, and no rank ever lands on another rank's GPU.

    Args:
        map_location: ``"auto"``; a ``torch.device``, device string (``"cpu"``,
            ``"cuda:1"``) or CUDA index; a dict from saved location to target
            (``{"cuda:0": "cuda:1"}``, locations not in it stay where they were
            saved); a callable ``(storage, location) -> storage`` as for
            ``torch.load``; or None to keep every tensor where it was saved.

    Returns:
        A ``torch.device``, a ``dict[str, str]``, the callable, or None.

    Raises:
        DDPStateError: A string, index or dict entry is not a device.

    Example:
        >>> from ddpstate.location import resolve_map_location
        >>> resolve_map_location("cpu")
        device(type='cpu')
        >>> resolve_map_location({"cuda:7": "cpu"})
        {'cuda:7': 'cpu'}
    """
    if map_location is None:
        return None
    if isinstance(map_location, str) and map_location == "auto":
        return _auto_device()
    if isinstance(map_location, (str, int, torch.device)) and not isinstance(map_location, bool):
        return _as_device(map_location, "")
    if isinstance(map_location, Mapping):
        resolved: dict[str, str] = {}
        for source, target in map_location.items():
            if not isinstance(source, str):
                raise DeviceMapError(
                    f"map_location dict key {source!r} must be a saved location string such as "
                    f"'cuda:0' or 'cpu'"
                )
            if isinstance(target, str) and target == "auto":
                resolved[source] = str(_auto_device())
            else:
                resolved[source] = str(_as_device(target, f"entry {source!r} -> "))
        return resolved
    if callable(map_location):
        return map_location
    raise DeviceMapError(
        f"map_location {map_location!r} is not understood; use 'auto', 'cpu', 'cuda:N', a dict "
        f"such as {{'cuda:0': 'cpu'}}, a callable or None"
    )


def require_reachable(resolved: ResolvedMapLocation, name: str) -> None:
    """Refuse a CUDA ``map_location`` where there is no CUDA, before reading anything.

    Args:
        resolved: What :func:`resolve_map_location` returned.
        name: The file, for the message.

    Raises:
        DeviceMapError: ``resolved`` is a CUDA device and CUDA is not available.

    Example:
        >>> import torch
        >>> from ddpstate.location import require_reachable
        >>> require_reachable(torch.device("cpu"), "ckpt.pt")
    """
    cuda = isinstance(resolved, torch.device) and resolved.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise DeviceMapError(
            f"{name}: map_location={str(resolved)!r} asks for a CUDA device, but CUDA is not "
            f"available on this machine (torch.cuda.is_available() is False); load with "
            f"map_location='auto' (this rank's device) or 'cpu'"
        )


def target_device(saved: str, resolved: ResolvedMapLocation) -> Optional[torch.device]:
    """The device a tensor saved at ``saved`` goes to; None when a callable decides.

    Args:
        saved: The device it was saved from (``"cuda:1"``, ``"cpu"``...).
        resolved: What :func:`resolve_map_location` returned.

    Returns:
        The target device, or None for a ``map_location`` callable.

    Example:
        >>> import torch
        >>> from ddpstate.location import target_device
        >>> target_device("cpu", {"cpu": "cuda:1"})
        device(type='cuda', index=1)
    """
    if resolved is None:
        return torch.device(saved)
    if isinstance(resolved, torch.device):
        return resolved
    if isinstance(resolved, dict):
        return torch.device(resolved.get(saved, saved))
    return None


def place(tensor: torch.Tensor, saved: str, resolved: ResolvedMapLocation) -> torch.Tensor:
    """Move one tensor as ``torch.load(map_location=resolved)`` would have.

    Args:
        tensor: The tensor as read.
        saved: The device it was saved from (``"cuda:1"``, ``"cpu"``...).
        resolved: What :func:`resolve_map_location` returned.

    Returns:
        The tensor on its device (the same object when it is already there).

    Raises:
        DeviceMapError: A ``map_location`` callable returned no storage.

    Example:
        >>> import torch
        >>> from ddpstate.location import place
        >>> place(torch.zeros(1), "cuda:0", torch.device("cpu")).device
        device(type='cpu')
    """
    device = target_device(saved, resolved)
    if device is not None:
        return tensor if tensor.device == device else tensor.to(device)
    assert callable(resolved)
    storage = resolved(tensor.untyped_storage(), saved)
    if storage is None:  # torch.load's rule: None means "where it was saved"
        return place(tensor, saved, None)
    if isinstance(storage, torch.TypedStorage):
        storage = storage.untyped()  # type: ignore[no-untyped-call]
    if not isinstance(storage, torch.UntypedStorage):
        raise DeviceMapError(
            f"the map_location callable returned {type(storage).__name__}; it must return a "
            f"storage (e.g. storage.cuda(1)) or None"
        )
    placed = torch.empty(0, dtype=tensor.dtype, device=storage.device)
    return placed.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())


def map_nested(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """Rebuild nested dicts, lists and tuples with ``leaf`` applied to everything else.

    OrderedDicts stay OrderedDicts and keep ``_metadata`` (module versions that
    ``load_state_dict`` reads); namedtuples keep their type. Inputs are not modified.

    Args:
        obj: The nested containers.
        leaf: Applied to every value that is not a dict, list or tuple.

    Returns:
        The rebuilt containers.

    Example:
        >>> from ddpstate.location import map_nested
        >>> map_nested({"a": [1, (2, 3)]}, lambda v: v * 10)
        {'a': [10, (20, 30)]}
    """

    def visit(value: Any) -> Any:
        if isinstance(value, collections.OrderedDict):
            out = collections.OrderedDict((k, visit(v)) for k, v in value.items())
            if getattr(value, "_metadata", None) is not None:
                out._metadata = value._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(value, dict):
            return {k: visit(v) for k, v in value.items()}
        if isinstance(value, list):
            return [visit(v) for v in value]
        if type(value) is tuple:
            return tuple(visit(v) for v in value)
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(visit(v) for v in value))
        return leaf(value)

    return visit(obj)


def place_all(obj: Any, saved: str, resolved: ResolvedMapLocation) -> Any:
    """Place every tensor in nested containers; tensors shared by object stay shared.

    Args:
        obj: Nested containers holding tensors.
        saved: The device they were read to.
        resolved: What :func:`resolve_map_location` returned.

    Returns:
        ``obj`` rebuilt with every tensor placed (``obj`` itself when nothing moves).

    Raises:
        DeviceMapError: As for :func:`place`.

    Example:
        >>> import torch
        >>> from ddpstate.location import place_all
        >>> w = torch.zeros(1)
        >>> out = place_all({"a": w, "b": w}, "cuda:0", torch.device("cpu"))
        >>> out["a"] is out["b"]
        True
    """
    if saved == "cpu" and (
        resolved is None or (isinstance(resolved, torch.device) and resolved.type == "cpu")
    ):
        return obj
    memo: dict[int, torch.Tensor] = {}

    def leaf(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in memo:
            memo[id(value)] = place(value, saved, resolved)
        return memo[id(value)]

    return map_nested(obj, leaf)
