"""Reading torch.distributed.checkpoint folders: safe metadata, a data-free skeleton, sharded loads.

The ``.metadata`` pickle is read once, through ``_io.torch_io``'s unpickler that
allows only DCP's metadata classes; everything here (key matching, ``inspect``,
``verify``, loading into an FSDP2 model) works from that parsed object.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, NamedTuple, Optional, Union

import torch

from ddpstate import storage
from ddpstate._io import torch_io as _torch_io
from ddpstate._io.model_state import IncompatibleKeys, incompatible_keys, shape_mismatches
from ddpstate.dist import share_outcome
from ddpstate.errors import CheckpointCorruptError
from ddpstate.keys import KeyMatch, adapt_state_dict, find_state_dict, match_keys

__all__ = [
    "BytesEntry",
    "flat_names",
    "is_sharded_model",
    "load_full_into_sharded",
    "load_sharded_model_state",
    "read_metadata",
    "skeleton",
]

#: The metadata file every DCP folder has (torch's ``_metadata_fn``).
METADATA_FILE = ".metadata"


class BytesEntry:
    """Stands for a non-tensor value in a skeleton: DCP stores it as pickled bytes."""

    __slots__ = ("fqn",)

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn

    def __repr__(self) -> str:
        return f"BytesEntry({self.fqn!r})"


def read_metadata(path: str, *, name: str, storage_options: Optional[dict[str, Any]] = None) -> Any:
    """Read and safely unpickle a DCP folder's ``.metadata``.

    Args:
        path: The folder (local path or fsspec URL).
        name: How to name it in messages.
        storage_options: fsspec options for a URL.

    Returns:
        torch's ``Metadata`` object (``state_dict_metadata``, ``planner_data``,
        ``storage_data``).

    Raises:
        CheckpointNotFoundError: The folder has no ``.metadata``.
        CheckpointCorruptError: The metadata is damaged.
        UnsafeCheckpointError: The metadata names a class DCP's metadata never uses.
    """
    with storage.open_read(storage.join(path, METADATA_FILE), storage_options=storage_options) as f:
        data = f.read()
    return _torch_io.check_dcp_metadata(data, name)


def flat_names(metadata: Any) -> dict[tuple[Any, ...], str]:
    """Each saved value's path in the nested checkpoint -> its flat DCP name (FQN).

    ``dcp.save`` flattens nested dicts and lists to dotted names and records
    the original path of each in ``planner_data``; without that record (a
    custom planner) every name is its own one-element path.
    """
    mappings = metadata.planner_data
    names: dict[tuple[Any, ...], str] = {}
    for fqn in metadata.state_dict_metadata:
        path = mappings.get(fqn) if isinstance(mappings, Mapping) else None
        names[tuple(path) if isinstance(path, (tuple, list)) and path else (fqn,)] = fqn
    return names


def _set_path(root: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = root
    for step, after in itertools.pairwise(path):
        if isinstance(node, list):
            node.extend([None] * (step + 1 - len(node)))
            if node[step] is None:
                node[step] = [] if isinstance(after, int) else {}
            node = node[step]
        else:
            node = node.setdefault(step, [] if isinstance(after, int) else {})
    last = path[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


def skeleton(metadata: Any) -> dict[Any, Any]:
    """The checkpoint as it was saved, nested, with no data read.

    Tensors are ``meta`` tensors of the saved (global) shape and dtype, so
    :mod:`ddpstate.keys` finds and matches the model state dict as it does in a
    loaded checkpoint; other values are :class:`BytesEntry` placeholders.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    root: dict[Any, Any] = {}
    for path, fqn in flat_names(metadata).items():
        entry = metadata.state_dict_metadata[fqn]
        if isinstance(entry, TensorStorageMetadata):
            value: Any = torch.empty(tuple(entry.size), dtype=entry.properties.dtype, device="meta")
        else:
            value = BytesEntry(fqn)
        try:
            _set_path(root, path, value)
        except (TypeError, IndexError, AttributeError):
            root[fqn] = value  # a path this sketch cannot rebuild: keep the flat name
    return root


def is_sharded_model(model: torch.nn.Module) -> bool:
    """True when the model holds DTensor parameters or buffers (FSDP2, tensor parallel)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(t, DTensor) for t in (*model.parameters(), *model.buffers()))


class _Plan(NamedTuple):
    into: dict[str, Any]  # DCP name -> the model's own (sharded) tensor to fill
    loaded: dict[str, Any]  # the model's key -> the same tensor, for set_model_state_dict
    skipped: list[str]  # shape mismatches ignore_mismatched skipped
    match: KeyMatch


def _fit(
    model: torch.nn.Module,
    saved: Mapping[str, Any],
    own: Mapping[str, Any],
    *,
    name: str,
    strict: bool,
    ignore_mismatched: bool,
) -> tuple[dict[str, Any], list[str], KeyMatch]:
    """``saved`` adapted to the model's keys, the keys whose shapes are skipped, the match."""
    adapted = adapt_state_dict(saved, own, strict=strict)
    skipped = [
        k
        for k, _, _ in shape_mismatches(
            adapted, own, name=name, target=type(model).__name__,
            ignore_mismatched=ignore_mismatched,
        )
    ]  # fmt: skip
    return adapted, skipped, match_keys(saved, own)


def _plan(
    model: torch.nn.Module,
    path: str,
    *,
    strict: bool,
    key: Optional[str],
    ignore_mismatched: bool,
    storage_options: Optional[dict[str, Any]],
) -> _Plan:
    """Match the folder's keys and shapes with the model's, from the metadata alone."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    metadata = read_metadata(path, name=path, storage_options=storage_options)
    sd_path, saved = find_state_dict(skeleton(metadata), key)
    own = get_model_state_dict(model)
    adapted, skipped, match = _fit(
        model, saved, own, name=path, strict=strict, ignore_mismatched=ignore_mismatched
    )
    names = flat_names(metadata)
    into: dict[str, Any] = {}
    loaded: dict[str, Any] = {}
    for own_key, saved_key in match.mapping.items():
        fqn = names.get((*sd_path, saved_key))
        if own_key in skipped or own_key not in adapted or fqn is None:
            continue
        if isinstance(adapted[own_key], torch.Tensor):
            into[fqn] = loaded[own_key] = own[own_key]
    return _Plan(into, loaded, skipped, match)


def load_sharded_model_state(
    model: torch.nn.Module,
    path: str,
    *,
    strict: bool,
    key: Optional[str],
    ignore_mismatched: bool,
    storage_options: Optional[dict[str, Any]] = None,
    timeout: Union[float, timedelta, None] = None,
) -> IncompatibleKeys:
    """Load a DCP folder into a sharded (FSDP2/DTensor) model on every rank, resharding.

    A collective: every rank of the model's process group must call it. The
    folder's keys are matched to the model's (``ddpstate.keys`` rules, from the
    metadata alone) and the outcome shared, so a mismatch raises the same
    error on every rank before any data moves; then each rank reads only the
    pieces of its own shards (``dcp.load`` into the model's DTensors, whatever
    the saving world size), and ``set_model_state_dict`` puts them in the model.

    Args:
        model: The sharded model (FSDP2 ``fully_shard``, or DTensor parameters).
        path: The DCP folder (local path or fsspec URL).
        strict, key, ignore_mismatched: As for :func:`ddpstate.load_model_state`.
        storage_options: fsspec options for a URL.
        timeout: Seconds to wait for the other ranks' outcome of the matching.

    Returns:
        ``IncompatibleKeys(missing_keys, unexpected_keys)``.

    Raises:
        KeyMismatchError, ShapeMismatchError, StateDictNotFoundError: On every rank.
        CheckpointCorruptError: The metadata or a shard file is damaged or missing.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    plan: Optional[_Plan] = None
    error: Optional[Exception] = None
    try:
        plan = _plan(
            model, path, strict=strict, key=key, ignore_mismatched=ignore_mismatched,
            storage_options=storage_options,
        )  # fmt: skip
    except Exception as exc:
        error = exc
    share_outcome(error, name="ddpstate.load_model_state", timeout=timeout)
    if plan is None:  # pragma: no cover - share_outcome raised this rank's error
        raise CheckpointCorruptError(f"{path}: could not be matched with the model")
    with _torch_io.dcp_read_errors(
        path, into=f" into {type(model).__name__}'s shards", advice=f"run `ddpstate verify {path}`"
    ):
        dcp_load(plan.into, storage_reader=_torch_io.dcp_reader(path, storage_options))
    set_model_state_dict(model, plan.loaded, options=StateDictOptions(strict=False))
    return incompatible_keys(strict, plan.skipped, plan.match)


def load_full_into_sharded(
    model: torch.nn.Module,
    state_dict: Mapping[str, Any],
    *,
    name: str,
    strict: bool,
    ignore_mismatched: bool,
) -> IncompatibleKeys:
    """Load a whole (unsharded) state dict, present on every rank, into a sharded model.

    A collective (every rank of the model's process group). ``model.load_state_dict``
    would copy whole tensors into shards and fail (or worse); instead the keys are
    adapted to ``get_model_state_dict``'s, whole shapes compared, and
    ``set_model_state_dict(full_state_dict=True)`` cuts each rank's shard.

    Args:
        model: The sharded model.
        state_dict: The whole state dict (e.g. a ``.pt`` file's).
        name: How to name the source in messages.
        strict, ignore_mismatched: As for :func:`ddpstate.load_model_state`.

    Returns:
        ``IncompatibleKeys(missing_keys, unexpected_keys)``.

    Raises:
        KeyMismatchError, ShapeMismatchError: The state dict does not fit the model.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    own = get_model_state_dict(model)
    adapted, skipped, match = _fit(
        model, state_dict, own, name=name, strict=strict, ignore_mismatched=ignore_mismatched
    )
    loaded = {k: v for k, v in adapted.items() if k not in skipped}
    set_model_state_dict(
        model, loaded, options=StateDictOptions(full_state_dict=True, strict=False)
    )
    return incompatible_keys(strict, skipped, match)
