"""Fitting a state dict into a model: shape checks, skipped entries, what did not match.

Shared by every load path (``checkpoint.load_model_state``, ``CheckpointManager.restore``
and the DCP reader's sharded loads), so a wrong shape is always :class:`ShapeMismatchError`.
"""

from __future__ import annotations

import collections
import functools
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Optional

import torch

from ddpstate._collectives import with_message
from ddpstate._keys.match import KeyMatch, adapt_state_dict, prefix_hint
from ddpstate._warn import warn
from ddpstate.dist import get_rank, is_distributed
from ddpstate.errors import DTypeMismatchError, KeyMismatchError, ShapeMismatchError

__all__ = [
    "DTypePolicy",
    "IncompatibleKeys",
    "Pairs",
    "adapt_named",
    "check_dtypes",
    "copy_pairs",
    "incompatible_keys",
    "load_fitting",
    "plain_pairs",
    "shape_mismatches",
    "warn_if_little_matched",
]

#: What a load does with a tensor of another dtype of the same kind (float32 into
#: bfloat16): "refuse" (CheckpointManager.restore), "allow" (restore's opt-in) or
#: "warn" (load_model_state: cast, one warning). Kind changes are always refused.
DTypePolicy = Literal["refuse", "allow", "warn"]

_MODULE = torch.nn.Module
# The tensor types whose copy_ is torch's own (a subclass may intercept it).
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_ABSENT = object()
# What a module overrides to save or load its state its own way.
_OVERRIDES = frozenset(
    (
        "_load_from_state_dict",
        "_save_to_state_dict",
        "set_extra_state",
        "get_extra_state",
        "state_dict",
    )
)
# What a saved tensor must share with its live one for a plain copy.
_COMPARED = tuple(operator.attrgetter(a) for a in ("shape", "dtype", "device"))
_IS_META = operator.attrgetter("is_meta")
#: ``(live tensor, saved tensor)`` per key of a load that is one copy per tensor.
Pairs = list[tuple[torch.Tensor, torch.Tensor]]


class IncompatibleKeys(NamedTuple):
    """What :func:`load_model_state` could not match (empty when strict).

    Attributes:
        missing_keys: Keys the model expects that the checkpoint lacks.
        unexpected_keys: Keys the checkpoint has that the model does not expect.
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


def incompatible_keys(strict: bool, skipped: list[str], match: KeyMatch) -> IncompatibleKeys:
    """What a load reports: the skipped keys, and with ``strict=False`` what did not pair."""
    if strict:
        return IncompatibleKeys(skipped, [])
    return IncompatibleKeys(
        [*skipped, *(k for k in match.missing if isinstance(k, str))],
        [k if isinstance(k, str) else repr(k) for k in match.unexpected],
    )


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
    dtypes: DTypePolicy = "warn",
    own: Optional[Mapping[str, Any]] = None,
) -> list[str]:
    """``model.load_state_dict`` with shape mismatches named, or skipped and returned.

    ``state_dict``'s keys are already the model's (see ``adapt_state_dict``).
    Every load path (``load_model_state``, ``CheckpointManager.restore``) comes
    through here, so a wrong shape is always :class:`ShapeMismatchError`.
    ``dtypes`` says what a tensor of another dtype does (see :func:`check_dtypes`).
    ``own``: the model's ``state_dict()`` when the caller already took it (one per
    restore: with 25,000 tensors each call costs as much as the checks).
    """
    # The usual case (each key one plain tensor of the saved shape and dtype): nothing to
    # name or skip, so one pass decides and copies (see plain_pairs).
    plain = plain_pairs(model, state_dict) if strict else None
    if plain is not None and copy_pairs(plain):
        return []
    own = model.state_dict() if own is None else own
    target = type(model).__name__
    mismatched = shape_mismatches(
        state_dict, own, name=name, target=target, ignore_mismatched=ignore_mismatched
    )
    if mismatched:
        skip = {k for k, _, _ in mismatched}
        kept: Any = collections.OrderedDict((k, v) for k, v in state_dict.items() if k not in skip)
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:
            kept._metadata = metadata
        state_dict = kept
    check_dtypes(state_dict, own, name=name, target=target, policy=dtypes)
    try:
        model.load_state_dict(state_dict, strict=strict and not mismatched)
    except RuntimeError as exc:
        raise ShapeMismatchError(
            f"{name} does not fit {target}: {exc}; check that the checkpoint "
            f"was saved from the same architecture"
        ) from exc
    return [k for k, _, _ in mismatched]


def _plain(module: torch.nn.Module, classes: dict[type, bool]) -> bool:
    """True when ``module`` saves and loads its state with ``nn.Module``'s own code.

    No override (BatchNorm's ``_load_from_state_dict``, an extra state, a custom
    ``state_dict``) and no state-dict hook: its ``state_dict()`` keys are then
    its parameters and persistent buffers, and loading one is ``copy_``.
    ``classes`` remembers each class's answer (a model repeats a few classes).
    """
    cls = type(module)
    plain = classes.get(cls)
    if plain is None:
        plain = classes[cls] = all(getattr(cls, m, None) is getattr(_MODULE, m) for m in _OVERRIDES)
    return (
        plain
        and _OVERRIDES.isdisjoint(module.__dict__)
        and not module._load_state_dict_pre_hooks
        and not module._load_state_dict_post_hooks
        and not module._state_dict_hooks
        and not module._state_dict_pre_hooks
    )


def plain_pairs(model: torch.nn.Module, state_dict: Mapping[str, Any]) -> Optional[Pairs]:
    """``(live tensor, saved tensor)`` per key when a strict load is one copy per tensor.

    ``load_state_dict`` builds a filtered dict per submodule (quadratic in the
    depth, a third of a restore of 25,000 tensors). When every module saves and
    loads with ``nn.Module``'s own code and ``state_dict``'s keys are exactly
    the model's, each naming one distinct plain tensor of the saved shape, dtype
    and device, a strict ``load_state_dict`` is ``param.copy_(saved)`` under
    ``no_grad`` per key (:func:`copy_pairs`), and there is nothing to adapt,
    refuse or skip. Anything else (a hook, an override such as BatchNorm's, a
    tensor subclass, a meta or lazy parameter, ``swap_tensors``, a missing or
    extra key, a tied tensor, another dtype) gives None: the caller adapts,
    checks and runs ``load_state_dict``.

    Args:
        model: The live model.
        state_dict: The saved state dict.

    Returns:
        The pairs in ``load_state_dict``'s order, or None.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> len(plain_pairs(net, {k: v.clone() for k, v in net.state_dict().items()}))
        2
        >>> plain_pairs(net, {"weight": torch.zeros(2, 2)}) is None
        True
    """
    if type(model).load_state_dict is not _MODULE.load_state_dict:
        return None
    if torch.__future__.get_swap_module_params_on_conversion():
        return None
    pairs: Pairs = []
    classes: dict[type, bool] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if not _plain(module, classes):
            return None
        lead = f"{prefix}." if prefix else ""
        live = list(module._parameters.items())
        if module._buffers:
            skip = module._non_persistent_buffers_set
            live.extend((k, v) for k, v in module._buffers.items() if k not in skip)
        for name, tensor in live:
            if tensor is None:
                continue
            saved = state_dict.get(lead + name, _ABSENT)
            if type(saved) is not torch.Tensor or type(tensor) not in _PLAIN:
                return None
            pairs.append((tensor, saved))
    if len(pairs) != len(state_dict) or len({id(t) for t, _ in pairs}) != len(pairs):
        return None  # a key no tensor has, or one tensor under two keys (ties)
    live_tensors, saved_tensors = [t for t, _ in pairs], [s for _, s in pairs]
    # Whole lists compared at C speed: no Python frame per tensor.
    for get in _COMPARED:
        if list(map(get, live_tensors)) != list(map(get, saved_tensors)):
            return None
    if any(map(_IS_META, live_tensors)):
        return None
    return pairs


def copy_pairs(pairs: Pairs) -> bool:
    """Copy each saved tensor into its live one as ``load_state_dict`` does; False: failed.

    A copy that fails returns False: the caller's ``load_state_dict`` then copies
    all again and reports the failure in its own words.

    Args:
        pairs: What :func:`plain_pairs` returned.

    Returns:
        True when every tensor was copied.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> copy_pairs(plain_pairs(net, {"weight": torch.ones(2, 2), "bias": torch.ones(2)}))
        True
        >>> net.bias.tolist()
        [1.0, 1.0]
    """
    try:
        with torch.no_grad():
            for tensor, saved in pairs:
                tensor.copy_(saved)
    except Exception:
        return False
    return True


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
        (k, tuple(v.shape), tuple(o.shape))
        for k, v, o in _tensor_pairs(state_dict, own)
        if v.shape != o.shape
    ]
    listing = _listing(mismatched, list)
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
            rank=_said_by(),
        )
    return mismatched


def _tensor_pairs(
    state_dict: Mapping[str, Any], own: Mapping[str, Any]
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(key, saved tensor, model tensor)`` for each key both hold a tensor under."""
    for k, v in state_dict.items():
        o = own.get(k)
        if isinstance(v, torch.Tensor) and isinstance(o, torch.Tensor):
            yield k, v, o


def _said_by() -> Optional[int]:
    """The rank a load's warning names: every rank loads alike, so rank 0 alone says it."""
    return get_rank() if is_distributed() else None


def _listing(found: Sequence[tuple[str, Any, Any]], show: Callable[[Any], Any]) -> str:
    """``'key' (saved A, model B)`` for the first 8 of ``found``, then how many more."""
    text = ", ".join(f"{k!r} (saved {show(a)}, model {show(b)})" for k, a, b in found[:8])
    return text + (f" and {len(found) - 8} more" if len(found) > 8 else "")


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_dtypes(
    state_dict: Mapping[str, Any],
    own: Mapping[str, Any],
    *,
    name: str,
    target: str,
    policy: DTypePolicy,
) -> list[tuple[str, torch.dtype, torch.dtype]]:
    """Refuse, allow or warn about the tensors whose dtype differs from ``own``'s.

    ``load_state_dict`` would cast them silently (``copy_``). A change of kind
    (integer, floating, complex, bool into another) is always
    :class:`DTypeMismatchError`; within a kind ``policy`` decides: ``"refuse"``
    raises naming each key and both dtypes, ``"warn"`` warns once with the count
    and the dtype pairs, ``"allow"`` says nothing. Tensors of another shape are
    left to :func:`shape_mismatches`. Returns ``(key, saved dtype, model dtype)``
    of each change.
    """
    changes = [
        (k, v.dtype, o.dtype)
        for k, v, o in _tensor_pairs(state_dict, own)
        if v.shape == o.shape and v.dtype != o.dtype
    ]
    listing = functools.partial(_listing, show=_dtype_name)
    crossed = [c for c in changes if _kind(c[1]) != _kind(c[2])]
    if crossed:
        raise DTypeMismatchError(
            f"{name} does not fit {target}: {len(crossed)} tensor(s) would change kind of "
            f"dtype: {listing(crossed)}. ddpstate never converts between integer, floating, "
            f"complex and bool tensors; check that the checkpoint was saved from this model, "
            f"or convert those entries yourself before loading"
        )
    if not changes or policy == "allow":
        return changes
    if policy == "refuse":
        raise DTypeMismatchError(
            f"{name} does not fit {target}: {len(changes)} tensor(s) would change dtype: "
            f"{listing(changes)}. Cast the model to the saved dtype before restoring "
            f"(e.g. model.to(torch.float32)), or pass allow_dtype_change=True to cast the "
            f"saved values to the model's dtypes"
        )
    pairs = collections.Counter(f"{_dtype_name(a)} -> {_dtype_name(b)}" for _, a, b in changes)
    warn(
        f"{name}: cast {len(changes)} tensor(s) to {target}'s dtypes: "
        + ", ".join(f"{pair} ({n})" for pair, n in pairs.most_common())
        + f" (e.g. {listing(changes[:1])}); cast the model to the saved dtype first to load "
        f"the values as saved",
        rank=_said_by(),
    )
    return changes


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
        rank=_said_by(),
    )
