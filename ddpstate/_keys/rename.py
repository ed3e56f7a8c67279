"""Renaming state-dict keys and their ``_metadata`` module paths: strip, add, normalize."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Literal, Optional, TypeVar, cast, overload

from ddpstate._warn import warn
from ddpstate.errors import InvalidArgumentError, KeyCollisionError

OnCollision = Literal["error", "keep_prefixed", "keep_existing"]

# The submodule names torch's wrappers give the module they wrap.
_DP_SEGMENT = "module"
_COMPILE_SEGMENT = "_orig_mod"
_WRAPPER_SEGMENTS = frozenset({_DP_SEGMENT, _COMPILE_SEGMENT})
# nn.Module._version for DataParallel, DDP and OptimizedModule alike; the
# metadata entry a wrapper contributes when its own state_dict() is taken.
_WRAPPER_METADATA: dict[str, Any] = {"version": 1}
_COLLISION_CHOICES = ("error", "keep_prefixed", "keep_existing")
# How many keys a message lists before "and N more".
_REPORT_LIMIT = 5

_D = TypeVar("_D", bound="dict[Any, Any]")
_V = TypeVar("_V")

# A key or module-path renamer: the new name and how many wrapper segments it
# lost (deeper = closer to the real module), or None to drop the entry.
_Renamer = Callable[[str], tuple[str, int]]
_PathRenamer = Callable[[str], Optional[tuple[str, int]]]


def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not prefix.endswith(".") or prefix == ".":
        raise InvalidArgumentError(
            f"prefix must be a non-empty module path ending in '.', like 'module.' (got {prefix!r})"
        )
    return prefix


def _check_on_collision(on_collision: str) -> None:
    if on_collision not in _COLLISION_CHOICES:
        raise InvalidArgumentError(
            f"on_collision must be one of {', '.join(map(repr, _COLLISION_CHOICES))} "
            f"(got {on_collision!r})"
        )


def _empty_like(state_dict: Mapping[Any, Any]) -> dict[Any, Any]:
    if type(state_dict) in (dict, OrderedDict):
        return cast("dict[Any, Any]", type(state_dict)())
    if isinstance(state_dict, dict):
        # copy.copy keeps a subclass's extra state (defaultdict's factory, ...)
        # without calling an __init__ that may want arguments.
        new = copy.copy(state_dict)
        new.clear()
        return new
    return {}


def _rename_metadata(metadata: Mapping[str, Any], rename: _PathRenamer) -> OrderedDict[str, Any]:
    # Several paths may land on one (a wrapper's root and the wrapped module's
    # root): the deepest one is the real module's, so it wins; the entry keeps
    # the position of the first path that landed there.
    chosen: dict[str, tuple[int, Any]] = {}
    for path, entry in metadata.items():
        renamed = rename(path) if isinstance(path, str) else (path, 0)
        if renamed is None:
            continue
        new_path, depth = renamed
        previous = chosen.get(new_path)
        if previous is None or depth > previous[0]:
            chosen[new_path] = (depth, entry)
    return OrderedDict(
        (path, dict(entry) if isinstance(entry, Mapping) else entry)
        for path, (_, entry) in chosen.items()
    )


def _rename(
    state_dict: Mapping[Any, Any],
    rename: _Renamer,
    on_collision: str,
    what: str,
) -> dict[Any, Any]:
    # new key -> (source key, wrapper segments removed, value)
    out: dict[Any, tuple[Any, int, Any]] = {}
    for key, value in state_dict.items():
        new_key, depth = rename(key) if isinstance(key, str) else (key, 0)
        previous = out.get(new_key)
        if previous is None:
            out[new_key] = (key, depth, value)
            continue
        current = (key, depth, value)
        # Report the less-prefixed key as the existing one, whatever the order.
        existing, renamed = (current, previous) if depth < previous[1] else (previous, current)
        if on_collision == "error":
            raise KeyCollisionError(
                f"{what} would give two entries the key {new_key!r}: {existing[0]!r} and "
                f"{renamed[0]!r}. Delete one of them first, or pass "
                f"on_collision='keep_existing' to keep {existing[0]!r} or "
                f"on_collision='keep_prefixed' to keep {renamed[0]!r}",
                keys=(str(existing[0]), str(renamed[0])),
            )
        # Between equally prefixed keys the earlier one stays.
        if depth != previous[1]:
            out[new_key] = existing if on_collision == "keep_existing" else renamed
    new = _empty_like(state_dict)
    for new_key, (_, _, value) in out.items():
        new[new_key] = value  # item by item: a dict subclass's __setitem__ runs
    return new


def _with_metadata(new: _D, metadata: Optional[OrderedDict[str, Any]]) -> _D:
    if metadata is not None:
        # Plain dicts cannot carry attributes, but neither can their inputs.
        new._metadata = metadata  # type: ignore[attr-defined]
    return new


def _metadata_of(state_dict: Any) -> Optional[Mapping[str, Any]]:
    metadata = getattr(state_dict, "_metadata", None)
    return metadata if isinstance(metadata, Mapping) else None


def _strip_leading(key: str, prefix: str) -> tuple[str, int]:
    count = 0
    # A key equal to the prefix plus nothing is left alone: it names no entry.
    while key.startswith(prefix) and len(key) > len(prefix):
        key = key[len(prefix) :]
        count += 1
    return key, count


def _warn_deep_strip(prefix: str, levels: int, key: str) -> None:
    # Two wrappers of one kind nest rarely (DataParallel(DataParallel(m))); a second
    # leading `module.` is more often a real submodule of that name, e.g. the
    # averaged model of torch's AveragedModel, which loading then cannot find.
    example = " (AveragedModel's averaged model is one)" if prefix == "module." else ""
    warn(
        f"strip_prefix({prefix!r}) removed {levels} leading {prefix!r} from {key!r} (and "
        f"any key so led): only the outer one is certainly a wrapper's; if the model has a "
        f"real submodule named {prefix[:-1]!r}{example}, strip one level instead: "
        f"{{k[len({prefix!r}):] if k.startswith({prefix!r}) else k: v for k, v in sd.items()}}"
    )


@overload
def strip_prefix(state_dict: _D, prefix: str = ..., *, on_collision: OnCollision = ...) -> _D: ...
@overload
def strip_prefix(
    state_dict: Mapping[Any, _V], prefix: str = ..., *, on_collision: OnCollision = ...
) -> dict[Any, _V]: ...
def strip_prefix(
    state_dict: Mapping[Any, Any],
    prefix: str = "module.",
    *,
    on_collision: OnCollision = "error",
) -> dict[Any, Any]:
    """Remove ``prefix`` from every key it leads, as often as it leads it.

    ``module.module.x`` becomes ``x`` (with a warning: a second ``module.`` may
    be a real submodule's name, as in ``AveragedModel``); ``module``, ``Module.y``,
    ``module_list.0.w`` and ``layer.module.w`` stay as they are. Non-string keys
    are left alone and every value is kept, tensor or not. ``_metadata`` is
    carried over with its module paths renamed the same way; when several
    paths land on one (a wrapper's root entry and the wrapped model's), the
    wrapped model's entry is kept.

    Args:
        state_dict: The state dict; not modified.
        prefix: The prefix to remove, ending in ``.``.
        on_collision: What to do when a renamed key already exists (``x`` and
            ``module.x``): ``"error"`` raises, ``"keep_existing"`` keeps the
            entry that had fewer prefixes, ``"keep_prefixed"`` the one that had
            more. Between equally prefixed keys the earlier one wins.

    Returns:
        A new mapping of the same type (a plain dict for non-dict mappings)
        with the keys in their original order.

    Raises:
        KeyCollisionError: Two entries would share a key and ``on_collision``
            is ``"error"``; ``.keys`` holds both original keys.
        InvalidArgumentError: ``prefix`` does not end in ``.`` or ``on_collision`` is
            unknown (a ``ValueError``).

    Example:
        >>> import torch
        >>> from ddpstate.keys import strip_prefix
        >>> sd = torch.nn.DataParallel(torch.nn.Linear(2, 2)).state_dict()
        >>> list(strip_prefix(sd))
        ['weight', 'bias']
    """
    _check_prefix(prefix)
    _check_on_collision(on_collision)
    stem = prefix[:-1]
    deepest: list[tuple[int, str]] = []

    def strip_key(key: str) -> tuple[str, int]:
        renamed = _strip_leading(key, prefix)
        if renamed[1] > 1 and not deepest:
            deepest.append((renamed[1], key))
        return renamed

    new = _rename(state_dict, strip_key, on_collision, f"stripping {prefix!r}")
    if deepest:
        _warn_deep_strip(prefix, *deepest[0])
    metadata = _metadata_of(state_dict)
    if metadata is None:
        return new
    paths = set(metadata)

    def rename_path(path: str) -> tuple[str, int]:
        rest, depth = _strip_leading(path, prefix)
        if rest == stem:
            return "", depth + 1
        # A wrapper's own entry part-way down the prefix (``module`` when the
        # prefix is ``module._orig_mod.``) is one whose path goes on into the
        # rest of the prefix; otherwise it is a real submodule of that name.
        if rest == "" or (stem.startswith(rest + ".") and path + stem[len(rest) :] in paths):
            return "", depth
        return rest, depth

    return _with_metadata(new, _rename_metadata(metadata, rename_path))


@overload
def add_prefix(state_dict: _D, prefix: str = ..., *, on_collision: OnCollision = ...) -> _D: ...
@overload
def add_prefix(
    state_dict: Mapping[Any, _V], prefix: str = ..., *, on_collision: OnCollision = ...
) -> dict[Any, _V]: ...
def add_prefix(
    state_dict: Mapping[Any, Any],
    prefix: str = "module.",
    *,
    on_collision: OnCollision = "error",
) -> dict[Any, Any]:
    """Put ``prefix`` in front of every string key, as a wrapper's state_dict() does.

    Every string key gets the prefix, even one that already has it, so
    ``add_prefix(sd_of_dp, "module.")`` is the ``DataParallel(DataParallel(m))``
    layout. ``_metadata`` gets the layout the wrapper produces: the old root
    entry moves to ``"module"``, every other path ``p`` to ``"module." + p``,
    and new ``""`` entries (and ``"module"`` for a two-segment prefix like
    ``"module._orig_mod."``) stand for the wrappers; they are only added when
    the input had a root entry. ``strip_prefix(add_prefix(sd, p), p) == sd``
    whenever no key of ``sd`` starts with ``p``.

    Args:
        state_dict: The state dict; not modified.
        prefix: The prefix to add, ending in ``.``.
        on_collision: Accepted for symmetry with :func:`strip_prefix`; adding
            one prefix to every string key cannot make two keys equal.

    Returns:
        A new mapping of the same type (a plain dict for non-dict mappings)
        with the keys in their original order.

    Raises:
        InvalidArgumentError: ``prefix`` does not end in ``.`` or ``on_collision`` is
            unknown (a ``ValueError``).

    Example:
        >>> import torch
        >>> from ddpstate.keys import add_prefix
        >>> list(add_prefix(torch.nn.Linear(2, 2).state_dict(), "_orig_mod."))
        ['_orig_mod.weight', '_orig_mod.bias']
    """
    _check_prefix(prefix)
    _check_on_collision(on_collision)
    stem = prefix[:-1]
    new = _rename(state_dict, lambda key: (prefix + key, 0), on_collision, f"adding {prefix!r}")
    metadata = _metadata_of(state_dict)
    if metadata is None:
        return new
    segments = stem.split(".")
    wrapper_paths = ["", *(".".join(segments[:i]) for i in range(1, len(segments)))]
    renamed: OrderedDict[str, Any] = OrderedDict()
    for path, entry in metadata.items():
        copied = dict(entry) if isinstance(entry, Mapping) else entry
        if path == "":
            for wrapper in wrapper_paths:
                renamed[wrapper] = dict(_WRAPPER_METADATA)
            renamed[stem] = copied
        elif isinstance(path, str):
            renamed[prefix + path] = copied
        else:
            renamed[path] = copied
    return _with_metadata(new, renamed)


def _normalize_name(name: str, keep_last: bool) -> tuple[str, int]:
    """``name`` without leading wrapper segments and any ``_orig_mod``; how many went.

    ``keep_last`` (a key, not a module path) keeps the last segment: the
    parameter's own name.
    """
    segments = name.split(".") if name else []
    last = [segments.pop()] if keep_last and segments else []
    lead = 0
    while lead < len(segments) and segments[lead] in _WRAPPER_SEGMENTS:
        lead += 1
    # `_orig_mod` is reserved by torch.compile, so inside a name it is always a wrapper.
    kept = [s for s in segments[lead:] if s != _COMPILE_SEGMENT]
    return ".".join([*kept, *last]), len(segments) - len(kept)


def _drop_segments(
    name: str, keep_last: bool, drop: Callable[[list[str], int], bool]
) -> tuple[str, int]:
    """``name`` without the segments ``drop(segments, i)`` picks (the last kept when
    ``keep_last``), and how many went."""
    segments = name.split(".")
    limit = len(segments) - 1 if keep_last else len(segments)
    kept = [s for i, s in enumerate(segments) if i >= limit or not drop(segments, i)]
    return ".".join(kept), len(segments) - len(kept)


@overload
def normalize_keys(state_dict: _D, *, on_collision: OnCollision = ...) -> _D: ...
@overload
def normalize_keys(
    state_dict: Mapping[Any, _V], *, on_collision: OnCollision = ...
) -> dict[Any, _V]: ...
def normalize_keys(
    state_dict: Mapping[Any, Any], *, on_collision: OnCollision = "error"
) -> dict[Any, Any]:
    """Remove every segment torch's wrappers add, giving the plain model's keys.

    Leading ``module.`` and ``_orig_mod.`` go in any order and number, and
    ``_orig_mod`` goes wherever it appears inside a key (torch.compile reserves
    that name). An inner ``.module.`` stays: without a target model it may be a
    real submodule; :func:`adapt_state_dict` resolves it against a target.

    Args:
        state_dict: The state dict; not modified.
        on_collision: As for :func:`strip_prefix`; "prefixed" counts the
            wrapper segments a key lost.

    Returns:
        A new mapping of the same type with ``_metadata`` renamed alike.

    Raises:
        KeyCollisionError: Two entries would share a key and ``on_collision``
            is ``"error"``.
        InvalidArgumentError: ``on_collision`` is unknown (a ``ValueError``).

    Example:
        >>> import torch
        >>> from ddpstate.keys import normalize_keys
        >>> sd = {"_orig_mod.module.w": torch.zeros(1), "enc._orig_mod.b": torch.zeros(1)}
        >>> list(normalize_keys(sd))
        ['w', 'enc.b']
    """
    _check_on_collision(on_collision)
    new = _rename(
        state_dict,
        lambda key: _normalize_name(key, True),
        on_collision,
        "removing wrapper prefixes",
    )
    metadata = _metadata_of(state_dict)
    return _with_metadata(
        new,
        None
        if metadata is None
        else _rename_metadata(metadata, lambda p: _normalize_name(p, False)),
    )
