"""Fitting a state dict into a model: shape checks, skipped entries, what did not match.

Shared by every load path (``checkpoint.load_model_state``, ``CheckpointManager.restore``
and the DCP reader's sharded loads), so a wrong shape is always :class:`ShapeMismatchError`.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ddpstate._collectives import with_message
from ddpstate._keys.match import KeyMatch, adapt_state_dict, prefix_hint
from ddpstate._warn import warn
from ddpstate.dist import get_rank, is_distributed
from ddpstate.errors import KeyMismatchError, ShapeMismatchError

__all__ = [
    "IncompatibleKeys",
    "adapt_named",
    "load_fitting",
    "shape_mismatches",
    "warn_if_little_matched",
]


class IncompatibleKeys(NamedTuple):
    """What :func:`load_model_state` could not match (empty when strict).

    Attributes:
        missing_keys: Keys the model expects that the checkpoint lacks.
        unexpected_keys: Keys the checkpoint has that the model does not expect.
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


def adapt_named(
    state_dict: Mapping[Any, Any],
    model: torch.nn.Module,
    *,
    strict: bool,
    name: str,
    found_at: tuple[Any, ...] = (),
) -> Mapping[str, Any]:
    """``adapt_state_dict(state_dict, model)`` whose ``KeyMismatchError`` names the file.

    Args:
        state_dict: The loaded state dict.
        model: The model it goes into.
        strict: Refuse keys that do not pair up.
        name: The file (or "the given state dict"), for the message.
        found_at: The keys leading to the state dict inside the checkpoint
            (``find_state_dict``'s path; ``()`` for a bare state dict).

    Returns:
        The state dict with the model's keys.

    Raises:
        KeyMismatchError: ``strict`` and the keys do not pair up; the message starts
            with the file and the entry, as :class:`ShapeMismatchError`'s does.
    """
    try:
        return adapt_state_dict(state_dict, model, strict=strict)
    except KeyMismatchError as exc:
        at = "".join(f"[{k!r}]" for k in found_at)
        inside = f" (the state dict at checkpoint{at})" if at else ""
        raise with_message(exc, f"{name}{inside}: {exc}") from exc


def load_fitting(
    model: torch.nn.Module,
    state_dict: Mapping[str, Any],
    *,
    name: str,
    strict: bool,
    ignore_mismatched: bool,
) -> list[str]:
    """``model.load_state_dict`` with shape mismatches named, or skipped and returned.

    ``state_dict``'s keys are already the model's (see ``adapt_state_dict``).
    Every load path (``load_model_state``, ``CheckpointManager.restore``) comes
    through here, so a wrong shape is always :class:`ShapeMismatchError`.
    """
    mismatched = shape_mismatches(
        state_dict,
        model.state_dict(),
        name=name,
        target=type(model).__name__,
        ignore_mismatched=ignore_mismatched,
    )
    if mismatched:
        skip = {k for k, _, _ in mismatched}
        kept: Any = collections.OrderedDict((k, v) for k, v in state_dict.items() if k not in skip)
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:
            kept._metadata = metadata
        state_dict = kept
    try:
        model.load_state_dict(state_dict, strict=strict and not mismatched)
    except RuntimeError as exc:
        raise ShapeMismatchError(
            f"{name} does not fit {type(model).__name__}: {exc}; check that the checkpoint "
            f"was saved from the same architecture"
        ) from exc
    return [k for k, _, _ in mismatched]


def shape_mismatches(
    state_dict: Mapping[str, Any],
    own: Mapping[str, Any],
    *,
    name: str,
    target: str,
    ignore_mismatched: bool,
) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """``(key, saved shape, model shape)`` of each tensor that does not fit ``own``'s.

    Raises :class:`ShapeMismatchError` listing them, or with ``ignore_mismatched``
    warns and returns them for the caller to skip. ``state_dict``'s keys are
    already the model's; ``own`` is the model's state dict (DTensors compare by
    their global shape, so sharded models are checked the same way).
    The warning names the user's line and is said by rank 0 alone (every rank loads alike).
    """
    mismatched = [
        (k, tuple(v.shape), tuple(own[k].shape))
        for k, v in state_dict.items()
        if isinstance(v, torch.Tensor)
        and isinstance(own.get(k), torch.Tensor)
        and v.shape != own[k].shape
    ]
    listing = ", ".join(f"{k!r} (saved {list(a)}, model {list(b)})" for k, a, b in mismatched[:8])
    if len(mismatched) > 8:
        listing += f" and {len(mismatched) - 8} more"
    if mismatched and not ignore_mismatched:
        raise ShapeMismatchError(
            f"{name} does not fit {target}: size mismatch for {len(mismatched)} "
            f"tensor(s): {listing}. Check that it was saved from the same architecture; to "
            f"fine-tune with a resized layer (e.g. a new classifier head), pass "
            f"ignore_mismatched=True to skip these entries and keep the model's own values"
        )
    if mismatched:
        warn(
            f"{name}: skipped {len(mismatched)} entr(y/ies) whose shape differs from "
            f"{target}'s (ignore_mismatched=True); the model keeps its own values "
            f"there: {listing}",
            rank=get_rank() if is_distributed() else None,
        )
    return mismatched


# A non-strict load that pairs fewer than this share of either side's keys is
# almost surely the wrong file or a prefix mismatch, not a deliberate partial load.
_FEW_MATCHED = 0.10


def warn_if_little_matched(match: KeyMatch, source: Mapping[Any, Any], *, name: str) -> None:
    """Warn when a ``strict=False`` load paired (almost) none of the keys, naming the fix.

    Args:
        match: The pairing of the file's keys with the model's.
        source: The file's state dict.
        name: The file, for the message.
    """
    source_keys = [k for k in source if isinstance(k, str)]
    target_keys = [*match.mapping, *match.missing]
    matched = len(match.mapping)
    if not source_keys or not target_keys:
        return
    if matched >= _FEW_MATCHED * len(source_keys) and matched >= _FEW_MATCHED * len(target_keys):
        return
    warn(
        f"{name}: strict=False loaded {matched} of the file's {len(source_keys)} entries into "
        f"a model that expects {len(target_keys)}; {prefix_hint(source_keys, target_keys)}",
        rank=get_rank() if is_distributed() else None,
    )
