"""State-dict key conversion between plain, DataParallel, DDP and torch.compile models."""

from __future__ import annotations

import copy
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional, TypeVar, cast, overload

from ddpstate.errors import (
    AmbiguousStateDictError,
    KeyCollisionError,
    KeyMismatchError,
    StateDictNotFoundError,
)

# torch is imported only where a model is handled: key rewriting on files
# (`ddpstate convert`) must stay torch-free to run in the memory of a copy.
if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "KNOWN_PREFIXES",
    "STATE_DICT_NAMES",
    "KeyMatch",
    "OnCollision",
    "adapt_state_dict",
    "add_prefix",
    "detect_prefixes",
    "find_state_dict",
    "match_keys",
    "normalize_keys",
    "replace_state_dict",
    "strip_prefix",
    "unwrap_model",
]

#: Prefixes that lead state-dict keys because of a wrapper, in the order
#: :func:`detect_prefixes` looks for them.
KNOWN_PREFIXES: tuple[str, ...] = (
    # nn.DataParallel and DistributedDataParallel keep the model as `.module`.
    "module.",
    # torch.compile's OptimizedModule keeps the model as `._orig_mod`.
    "_orig_mod.",
    # Lightning checkpoints hold the LightningModule's state, whose model is
    # usually the attribute `model`; a convention, not a torch wrapper.
    "model.",
)

#: Names under which real checkpoints keep the model state dict, in the order
#: :func:`find_state_dict` reports them.
STATE_DICT_NAMES: tuple[str, ...] = (
    "state_dict",  # Lightning, timm, most hand-written trainers
    "model",  # fairseq, DETR, torchvision references, nanoGPT
    "model_state_dict",  # the PyTorch tutorials' "saving a general checkpoint"
    "model_state",  # detectron-style and many research repos
    "module",  # DeepSpeed's model_states files
    "state_dict_ema",  # timm's EMA weights
)

OnCollision = Literal["error", "keep_prefixed", "keep_existing"]

# The submodule names torch's wrappers give the module they wrap.
_DP_SEGMENT = "module"
_COMPILE_SEGMENT = "_orig_mod"
_WRAPPER_SEGMENTS = frozenset({_DP_SEGMENT, _COMPILE_SEGMENT})
# nn.Module._version for DataParallel, DDP and OptimizedModule alike; the
# metadata entry a wrapper contributes when its own state_dict() is taken.
_WRAPPER_METADATA: dict[str, Any] = {"version": 1}
_COLLISION_CHOICES = ("error", "keep_prefixed", "keep_existing")
_REPORT_LIMIT = 5

_D = TypeVar("_D", bound="dict[Any, Any]")
_V = TypeVar("_V")

# A key or module-path renamer: the new name and how many wrapper segments it
# lost (deeper = closer to the real module), or None to drop the entry.
_Renamer = Callable[[str], tuple[str, int]]
_PathRenamer = Callable[[str], Optional[tuple[str, int]]]


# --------------------------------------------------------------------------- unwrap


def _optimized_module_type() -> type | None:
    # torch.compile imports torch._dynamo to build its wrapper, so a process that has not
    # imported it holds no compiled module; importing it here would cost seconds per restart.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def _is_tensor(value: Any) -> bool:
    # A torch.Tensor exists only once torch is imported; the streaming
    # converter's placeholders declare themselves tensor-like instead.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return True
    return getattr(type(value), "_ddpstate_tensor_like", False) is True


def _is_module(value: Any) -> bool:
    # Same reasoning as _is_tensor: no torch imported means no nn.Module.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.nn.Module)


def _wrapper_types() -> tuple[type, ...]:
    from torch import nn

    compiled = _optimized_module_type()
    base: tuple[type, ...] = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    return base if compiled is None else (*base, compiled)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Peel DataParallel, DistributedDataParallel and torch.compile wrappers.

    Wrappers may nest in any order and depth (``compile(DDP(compile(m)))``);
    the innermost plain module is returned. The model itself is not changed.

    Args:
        model: A plain or wrapped module.

    Returns:
        The plain module that holds the parameters.

    Example:
        >>> import torch, ddpstate
        >>> net = torch.nn.Linear(2, 2)
        >>> ddpstate.unwrap_model(torch.nn.DataParallel(net)) is net
        True
    """
    from torch import nn

    compiled = _optimized_module_type()
    wrappers: tuple[type, ...] = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    while True:
        if isinstance(model, wrappers):
            model = cast(nn.Module, model.module)
        elif compiled is not None and isinstance(model, compiled):
            model = cast(nn.Module, model._orig_mod)
        else:
            return model


# --------------------------------------------------------------------------- renaming core


def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not prefix.endswith(".") or prefix == ".":
        raise ValueError(
            f"prefix must be a non-empty module path ending in '.', like 'module.' (got {prefix!r})"
        )
    return prefix


def _check_on_collision(on_collision: str) -> None:
    if on_collision not in _COLLISION_CHOICES:
        raise ValueError(
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
        # Report the less-prefixed key as the existing one, whatever the order.
        first, second = (previous, (key, depth, value))
        existing, renamed = (second, first) if second[1] < first[1] else (first, second)
        if on_collision == "error":
            raise KeyCollisionError(
                f"{what} would give two entries the key {new_key!r}: {existing[0]!r} and "
                f"{renamed[0]!r}. Delete one of them first, or pass "
                f"on_collision='keep_existing' to keep {existing[0]!r} or "
                f"on_collision='keep_prefixed' to keep {renamed[0]!r}",
                keys=(str(existing[0]), str(renamed[0])),
            )
        if on_collision == "keep_existing":
            winner = first if first[1] <= second[1] else second
        else:
            winner = first if first[1] >= second[1] else second
        out[new_key] = winner
    new = _empty_like(state_dict)
    for new_key, (_, _, value) in out.items():
        new[new_key] = value
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


# --------------------------------------------------------------------------- public renamers


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

    ``module.module.x`` becomes ``x``; ``module``, ``Module.y``,
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
        ValueError: ``prefix`` does not end in ``.`` or ``on_collision`` is unknown.

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
    new = _rename(
        state_dict,
        lambda key: _strip_leading(key, prefix),
        on_collision,
        f"stripping {prefix!r}",
    )
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
        ValueError: ``prefix`` does not end in ``.`` or ``on_collision`` is unknown.

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


def _normalize_key(key: str) -> tuple[str, int]:
    segments = key.split(".")
    removed = 0
    while len(segments) > 1 and segments[0] in _WRAPPER_SEGMENTS:
        segments.pop(0)
        removed += 1
    # `_orig_mod` is reserved by torch.compile, so inside a key it is always a
    # wrapper; the last segment is the parameter's own name and stays.
    kept = [s for s in segments[:-1] if s != _COMPILE_SEGMENT]
    removed += len(segments) - 1 - len(kept)
    return ".".join([*kept, segments[-1]]), removed


def _normalize_path(path: str) -> tuple[str, int]:
    if path == "":
        return "", 0
    segments = path.split(".")
    removed = 0
    while segments and segments[0] in _WRAPPER_SEGMENTS:
        segments.pop(0)
        removed += 1
    kept = [s for s in segments if s != _COMPILE_SEGMENT]
    removed += len(segments) - len(kept)
    return ".".join(kept), removed


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
        ValueError: ``on_collision`` is unknown.

    Example:
        >>> import torch
        >>> from ddpstate.keys import normalize_keys
        >>> sd = {"_orig_mod.module.w": torch.zeros(1), "enc._orig_mod.b": torch.zeros(1)}
        >>> list(normalize_keys(sd))
        ['w', 'enc.b']
    """
    _check_on_collision(on_collision)
    new = _rename(state_dict, _normalize_key, on_collision, "removing wrapper prefixes")
    metadata = _metadata_of(state_dict)
    return _with_metadata(
        new, None if metadata is None else _rename_metadata(metadata, _normalize_path)
    )


def detect_prefixes(keys: Iterable[Any]) -> list[str]:
    """Name the known prefixes that lead every string key, outermost first.

    Args:
        keys: State-dict keys (a state dict works too); non-strings are ignored.

    Returns:
        Entries of :data:`KNOWN_PREFIXES` in the order they lead the keys, e.g.
        ``["module.", "_orig_mod."]`` for ``DataParallel(torch.compile(m))``;
        empty for plain keys or when there are no string keys.

    Example:
        >>> from ddpstate.keys import detect_prefixes
        >>> detect_prefixes(["module._orig_mod.fc.weight", "module._orig_mod.fc.bias"])
        ['module.', '_orig_mod.']
    """
    names = [k for k in keys if isinstance(k, str)]
    found: list[str] = []
    while names:
        for prefix in KNOWN_PREFIXES:
            if all(k.startswith(prefix) and len(k) > len(prefix) for k in names):
                found.append(prefix)
                names = [k[len(prefix) :] for k in names]
                break
        else:
            break
    return found


# --------------------------------------------------------------------------- matching


@dataclass(frozen=True)
class KeyMatch:
    """How a source state dict's keys map onto a target's.

    Attributes:
        mapping: Target key -> source key, in the target's key order, for
            every key that matched.
        missing: Target keys no source key matched, in target order.
        unexpected: Source keys that matched no target key, in source order.
        rule: How the keys were matched, in words (for messages and ``inspect``).
    """

    mapping: dict[str, Any]
    missing: tuple[str, ...]
    unexpected: tuple[Any, ...]
    rule: str

    @property
    def complete(self) -> bool:
        """True when every target key matched and no source key was left over."""
        return not self.missing and not self.unexpected


@dataclass(frozen=True)
class _Side:
    keys: list[str]
    paths: list[str]
    canon_key: Callable[[int, str], str]
    canon_path: Callable[[int, str], tuple[str, int]]


def _aggressive_key(key: str) -> str:
    segments = key.split(".")
    kept = [s for s in segments[:-1] if s not in _WRAPPER_SEGMENTS]
    return ".".join([*kept, segments[-1]])


def _aggressive_path(path: str) -> tuple[str, int]:
    if path == "":
        return "", 0
    segments = path.split(".")
    kept = [s for s in segments if s not in _WRAPPER_SEGMENTS]
    return ".".join(kept), len(segments) - len(kept)


def _paths_from_keys(keys: Iterable[str]) -> list[str]:
    paths: dict[str, None] = {"": None}
    for key in keys:
        segments = key.split(".")
        for i in range(1, len(segments)):
            paths.setdefault(".".join(segments[:i]), None)
    return list(paths)


_LEVEL_NAMES = (
    "keys as they are",
    "wrapper segments (module./_orig_mod.) removed",
    "every 'module'/'_orig_mod' segment ignored",
)


def _generic_canon_key(level: int, key: str) -> str:
    if level == 0:
        return key
    return _normalize_key(key)[0] if level == 1 else _aggressive_key(key)


def _generic_canon_path(level: int, path: str) -> tuple[str, int]:
    if level == 0:
        return path, 0
    return _normalize_path(path) if level == 1 else _aggressive_path(path)


def _source_side(state_dict: Mapping[Any, Any] | Iterable[Any]) -> tuple[_Side, list[Any]]:
    keys = list(state_dict)
    names = [k for k in keys if isinstance(k, str)]
    metadata = _metadata_of(state_dict)
    paths = [p for p in metadata if isinstance(p, str)] if metadata is not None else []
    return _Side(names, paths, _generic_canon_key, _generic_canon_path), [
        k for k in keys if not isinstance(k, str)
    ]


def _model_side(model: nn.Module) -> _Side:
    wrappers = _wrapper_types()
    wrapper_paths = {
        path
        for path, module in model.named_modules(remove_duplicate=False)
        if isinstance(module, wrappers)
    }

    def structural(segments: list[str], keep_last: bool) -> tuple[str, int]:
        kept: list[str] = []
        limit = len(segments) - 1 if keep_last else len(segments)
        for i, segment in enumerate(segments):
            if (
                i < limit
                and segment in _WRAPPER_SEGMENTS
                and ".".join(segments[:i]) in wrapper_paths
            ):
                continue
            kept.append(segment)
        return ".".join(kept), len(segments) - len(kept)

    def canon_key(level: int, key: str) -> str:
        if level == 1:
            return structural(key.split("."), keep_last=True)[0]
        return _generic_canon_key(level, key)

    def canon_path(level: int, path: str) -> tuple[str, int]:
        if level == 1:
            return structural(path.split("."), keep_last=False) if path else ("", 0)
        return _generic_canon_path(level, path)

    state = model.state_dict()
    metadata = _metadata_of(state)
    keys = list(state)
    paths = list(metadata) if metadata is not None else _paths_from_keys(keys)
    return _Side(keys, paths, canon_key, canon_path)


def _target_side(target: Any) -> _Side:
    if _is_module(target):
        return _model_side(target)
    if isinstance(target, (str, bytes)) or not isinstance(target, Iterable):
        raise TypeError(
            f"target must be a model, a state dict or a collection of keys, "
            f"not {type(target).__name__}"
        )
    keys = [k for k in target if isinstance(k, str)]
    metadata = _metadata_of(target)
    paths = list(metadata) if metadata is not None else _paths_from_keys(keys)
    return _Side(keys, paths, _generic_canon_key, _generic_canon_path)


def _common_path(canon: Iterable[str]) -> list[str]:
    common: Optional[list[str]] = None
    for key in canon:
        segments = key.split(".")[:-1]
        if common is None:
            common = segments
            continue
        n = 0
        while n < min(len(common), len(segments)) and common[n] == segments[n]:
            n += 1
        common = common[:n]
        if not common:
            break
    return common or []


def _strip_path(path: str, lead: str) -> Optional[tuple[str, int]]:
    if path == lead:
        return "", 1
    if path.startswith(lead + "."):
        return path[len(lead) + 1 :], 0
    return None


@dataclass(frozen=True)
class _Attempt:
    level: int
    side: str  # "" (no alignment), "source" or "target": which side loses `lead`
    lead: str

    def describe(self) -> str:
        text = _LEVEL_NAMES[self.level]
        if self.side == "source":
            text += f", leading {self.lead + '.'!r} removed from the source"
        elif self.side == "target":
            text += f", leading {self.lead + '.'!r} added to the source"
        return text

    def key(self, side: _Side, is_source: bool, key: str) -> Optional[str]:
        canon = side.canon_key(self.level, key)
        if self.side == ("source" if is_source else "target"):
            stripped = _strip_path(canon, self.lead)
            return None if stripped is None or stripped[1] else stripped[0]
        return canon

    def path(self, side: _Side, is_source: bool, path: str) -> Optional[tuple[str, int]]:
        canon, depth = side.canon_path(self.level, path)
        if self.side == ("source" if is_source else "target"):
            stripped = _strip_path(canon, self.lead) if canon else None
            return None if stripped is None else (stripped[0], depth + stripped[1])
        return canon, depth


def _images(side: _Side, attempt: _Attempt, is_source: bool) -> dict[str, Optional[str]]:
    return {k: attempt.key(side, is_source, k) for k in side.keys}


def _pair(source: dict[str, Optional[str]], target: dict[str, Optional[str]]) -> dict[str, str]:
    src_by_canon: dict[str, list[str]] = {}
    for key, canon in source.items():
        if canon is not None:
            src_by_canon.setdefault(canon, []).append(key)
    tgt_count: dict[str, int] = {}
    for canon in target.values():
        if canon is not None:
            tgt_count[canon] = tgt_count.get(canon, 0) + 1
    mapping: dict[str, str] = {}
    for key, canon in target.items():
        if canon is None or tgt_count[canon] != 1:
            continue
        found = src_by_canon.get(canon, [])
        if len(found) == 1:
            mapping[key] = found[0]
    return mapping


def _attempts(src: _Side, tgt: _Side) -> Iterable[_Attempt]:
    for level in range(len(_LEVEL_NAMES)):
        plain = _Attempt(level, "", "")
        yield plain
        # A common leading path on one side only (a framework's `model.`, or a
        # wrapper whose name is also a real submodule's) is tried segment by
        # segment; a match still has to pair every key one to one.
        for side_name, side in (("source", src), ("target", tgt)):
            canon = [plain.key(side, side is src, k) or "" for k in side.keys]
            common = _common_path(canon)
            for n in range(1, len(common) + 1):
                yield _Attempt(level, side_name, ".".join(common[:n]))


def _match(src: _Side, tgt: _Side) -> tuple[KeyMatch, _Attempt]:
    best: Optional[tuple[int, KeyMatch, _Attempt]] = None
    for attempt in _attempts(src, tgt):
        mapping = _pair(_images(src, attempt, True), _images(tgt, attempt, False))
        used = set(mapping.values())
        match = KeyMatch(
            mapping=mapping,
            missing=tuple(k for k in tgt.keys if k not in mapping),
            unexpected=tuple(k for k in src.keys if k not in used),
            rule=attempt.describe(),
        )
        if match.complete:
            return match, attempt
        if best is None or len(mapping) > best[0]:
            best = (len(mapping), match, attempt)
    assert best is not None  # _attempts always yields the identity attempt
    return best[1], best[2]


def match_keys(
    state_dict: Mapping[Any, Any] | Iterable[Any], target: nn.Module | Iterable[Any]
) -> KeyMatch:
    """Pair a state dict's keys with a target's, whatever wrappers either side had.

    Both sides are reduced to wrapper-free names and paired one to one; see
    :func:`adapt_state_dict` for the rules. When no rule pairs every key, the
    result of the rule that paired the most is returned.

    Args:
        state_dict: The source state dict, or just its keys.
        target: A model (plain or wrapped in any way), a state dict, or keys.

    Returns:
        A :class:`KeyMatch`; ``.complete`` tells whether every key paired.

    Raises:
        TypeError: ``target`` is not a model, mapping or collection of keys.

    Example:
        >>> import torch
        >>> from ddpstate.keys import match_keys
        >>> net = torch.nn.Linear(2, 2)
        >>> m = match_keys(["module.weight", "module.bias", "module.extra"], net)
        >>> m.mapping, m.unexpected
        ({'weight': 'module.weight', 'bias': 'module.bias'}, ('module.extra',))
    """
    src, non_str = _source_side(state_dict)
    match, _ = _match(src, _target_side(target))
    if non_str:
        match = KeyMatch(match.mapping, match.missing, (*match.unexpected, *non_str), match.rule)
    return match


def _nearest(name: str, candidates: Sequence[str]) -> str:
    import difflib  # here: only error messages need it (convert's start-up does not)

    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f" (nearest: {close[0]!r})" if close else ""


def _mismatch_message(match: KeyMatch) -> str:
    lines = [
        f"the state dict does not fit the target: {len(match.missing)} missing and "
        f"{len(match.unexpected)} unexpected key(s) (best match: {match.rule})"
    ]
    unexpected_names = [k for k in match.unexpected if isinstance(k, str)]
    for title, keys, pool in (
        ("missing (target expects, source lacks)", match.missing, unexpected_names),
        ("unexpected (source has, target lacks)", match.unexpected, list(match.missing)),
    ):
        if not keys:
            continue
        shown = ", ".join(
            f"{k!r}{_nearest(k, pool) if isinstance(k, str) else ''}" for k in keys[:_REPORT_LIMIT]
        )
        more = f" and {len(keys) - _REPORT_LIMIT} more" if len(keys) > _REPORT_LIMIT else ""
        lines.append(f"  {title}: {shown}{more}")
    lines.append(
        "Check that the checkpoint belongs to this model; rename keys with "
        "ddpstate.strip_prefix/add_prefix, or pass strict=False to take the keys that match."
    )
    return "\n".join(lines)


def _adapted_metadata(
    src: _Side, tgt: _Side, attempt: _Attempt, metadata: Mapping[str, Any]
) -> OrderedDict[str, Any]:
    innermost_src: dict[str, tuple[int, Any]] = {}
    for path in src.paths:
        canon = attempt.path(src, True, path)
        if canon is None:
            continue
        previous = innermost_src.get(canon[0])
        if previous is None or canon[1] > previous[0]:
            innermost_src[canon[0]] = (canon[1], metadata[path])
    innermost_tgt: dict[str, tuple[int, str]] = {}
    for path in tgt.paths:
        canon = attempt.path(tgt, False, path)
        if canon is None:
            continue
        previous = innermost_tgt.get(canon[0])
        if previous is None or canon[1] > previous[0]:
            innermost_tgt[canon[0]] = (canon[1], path)
    owner = {path: canon for canon, (_, path) in innermost_tgt.items()}
    result: OrderedDict[str, Any] = OrderedDict()
    for path in tgt.paths:
        canon_name = owner.get(path)
        if canon_name is not None and canon_name in innermost_src:
            entry = innermost_src[canon_name][1]
            result[path] = dict(entry) if isinstance(entry, Mapping) else entry
    return result


def adapt_state_dict(
    state_dict: Mapping[Any, Any],
    target: nn.Module | Iterable[Any],
    *,
    strict: bool = True,
) -> OrderedDict[str, Any]:
    """Rename a state dict's keys to exactly the ones ``target`` expects.

    Works between any wrappings: plain, DataParallel, DDP, torch.compile, any
    nesting of them, an inner DataParallel (``0.module.weight``) or a compiled
    submodule (``encoder._orig_mod.w``). Keys are matched by structure, one to
    one, trying in turn: the keys as they are; with wrapper segments removed
    (for a model target, exactly the segments its wrappers add); with every
    ``module``/``_orig_mod`` segment ignored. At each step a leading path on one
    side only (``model.`` from Lightning) may be dropped if that pairs every
    key. A rule that would pair two keys with one is never used.

    Values are not copied. ``_metadata`` (module versions that some modules,
    like BatchNorm, read while loading) comes from the source, renamed to the
    target's module paths.

    Args:
        state_dict: The source state dict; not modified.
        target: A model (wrapped or not), a state dict, or a collection of keys.
        strict: When False, return only the entries that matched instead of
            raising; call :func:`match_keys` (or read
            ``model.load_state_dict(...)``'s result) to learn what was missing.

    Returns:
        An OrderedDict whose keys are the target's, in the target's order
        (a subset of them when ``strict=False``).

    Raises:
        KeyMismatchError: Some keys do not pair up and ``strict`` is True; the
            message shows the first few missing and unexpected keys with the
            nearest name on the other side, and ``.missing``/``.unexpected``
            hold them all.
        TypeError: ``target`` is not a model, mapping or collection of keys.

    Example:
        >>> import torch
        >>> from ddpstate.keys import adapt_state_dict
        >>> net = torch.nn.Linear(2, 2)
        >>> saved = torch.nn.DataParallel(torch.nn.Linear(2, 2)).state_dict()
        >>> compiled = torch.compile(net, backend="eager")
        >>> list(adapt_state_dict(saved, compiled))
        ['_orig_mod.weight', '_orig_mod.bias']
    """
    src, non_str = _source_side(state_dict)
    tgt = _target_side(target)
    match, attempt = _match(src, tgt)
    if non_str:
        match = KeyMatch(match.mapping, match.missing, (*match.unexpected, *non_str), match.rule)
    if strict and not match.complete:
        raise KeyMismatchError(
            _mismatch_message(match),
            missing=match.missing,
            unexpected=tuple(k if isinstance(k, str) else repr(k) for k in match.unexpected),
        )
    result: OrderedDict[str, Any] = OrderedDict(
        (key, state_dict[source_key]) for key, source_key in match.mapping.items()
    )
    metadata = _metadata_of(state_dict)
    if metadata is not None:
        result._metadata = _adapted_metadata(src, tgt, attempt, metadata)  # type: ignore[attr-defined]
    return result


# --------------------------------------------------------------------------- containers


def _is_state_dict(obj: Any) -> bool:
    if not isinstance(obj, Mapping):
        return False
    if not all(isinstance(k, str) for k in obj):
        return False
    if any(isinstance(v, Mapping) for v in obj.values()):
        return False
    return len(obj) == 0 or any(_is_tensor(v) for v in obj.values())


def _describe_keys(obj: Any) -> str:
    if isinstance(obj, Mapping):
        names = [repr(k) for k in list(obj)[:10]]
        more = f", ... ({len(obj)} in all)" if len(obj) > 10 else ""
        return f"keys {', '.join(names)}{more}" if names else "no keys"
    if isinstance(obj, (list, tuple)):
        return f"a {type(obj).__name__} of {len(obj)} items"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"


def _dotted(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


def _child(obj: Any, step: Any) -> tuple[bool, Any]:
    if isinstance(obj, Mapping):
        if step in obj:
            return True, obj[step]
        return False, None
    if isinstance(obj, (list, tuple)) and isinstance(step, int) and -len(obj) <= step < len(obj):
        return True, obj[step]
    if isinstance(obj, tuple) and isinstance(step, str) and step in getattr(obj, "_fields", ()):
        return True, getattr(obj, step)
    return False, None


def _resolve_dotted(obj: Any, segments: list[str]) -> Optional[tuple[Any, ...]]:
    if not segments:
        return ()
    # A key may itself contain dots ("model.ema"): prefer the longest one, and
    # backtrack if it leads nowhere.
    for n in range(len(segments), 0, -1):
        name = ".".join(segments[:n])
        steps: list[Any] = [name]
        if name.lstrip("-").isdigit():
            steps.append(int(name))
        for step in steps:
            found, child = _child(obj, step)
            if found:
                rest = _resolve_dotted(child, segments[n:])
                if rest is not None:
                    return (step, *rest)
    return None


def find_state_dict(
    checkpoint: Any, key: Optional[str] = None
) -> tuple[tuple[Any, ...], Mapping[str, Any]]:
    """Locate the model state dict inside a loaded checkpoint.

    With ``key`` (a dotted path such as ``"model.state_dict"``; a number picks
    a list item; ``""`` is the checkpoint itself) exactly that entry is taken.
    Without it, a bare state dict (string keys, some tensor values, no nested
    mappings) is returned as is; otherwise the names in
    :data:`STATE_DICT_NAMES` are looked up at the top level, then one level
    down (``{"model": {"state_dict": ...}}``, under any top-level key); the
    shallowest level with a state dict must have exactly one.

    Args:
        checkpoint: What ``torch.load`` returned.
        key: Dotted path to the state dict, or None to search.

    Returns:
        ``(path, state_dict)``: the tuple of keys leading to it (``()`` for a
        bare state dict) and the state dict itself (not copied).

    Raises:
        StateDictNotFoundError: ``key`` does not exist or holds no mapping, or
            the search found none; the message lists what is there.
        AmbiguousStateDictError: The search found several (a
            ``StateDictNotFoundError`` too); the message names them.

    Example:
        >>> import torch
        >>> from ddpstate.keys import find_state_dict
        >>> ckpt = {"epoch": 3, "model": {"state_dict": {"w": torch.zeros(1)}}}
        >>> find_state_dict(ckpt)[0]
        ('model', 'state_dict')
    """
    if key is not None:
        path = _resolve_dotted(checkpoint, key.split(".")) if key else ()
        if path is None:
            raise StateDictNotFoundError(
                f"the checkpoint has no entry {key!r}; its top level has "
                f"{_describe_keys(checkpoint)}. Pass the dotted path of the model "
                f"state dict, e.g. key='model.state_dict'"
            )
        obj = checkpoint
        for step in path:
            obj = _child(obj, step)[1]
        if not isinstance(obj, Mapping):
            raise StateDictNotFoundError(
                f"checkpoint entry {key!r} holds {_describe_keys(obj)}, not a state dict "
                f"(a mapping of names to tensors); pass the key of the model state dict"
            )
        return path, obj
    if _is_state_dict(checkpoint):
        return (), checkpoint
    if not isinstance(checkpoint, Mapping):
        raise StateDictNotFoundError(
            f"the checkpoint is {_describe_keys(checkpoint)}, not a mapping that holds a "
            f"state dict; if it is a pickled model, load it with weights_only=False "
            f"and use its .state_dict()"
        )
    shallow = [
        (name,)
        for name in STATE_DICT_NAMES
        if name in checkpoint and _is_state_dict(checkpoint[name])
    ]
    deep = [
        (parent, name)
        for parent, value in checkpoint.items()
        if isinstance(value, Mapping) and not _is_state_dict(value)
        for name in STATE_DICT_NAMES
        if name in value and _is_state_dict(value[name])
    ]
    for found in (shallow, deep):
        distinct: dict[int, tuple[Any, ...]] = {}
        for path in found:
            obj = checkpoint
            for step in path:
                obj = obj[step]
            distinct.setdefault(id(obj), path)
        if len(distinct) == 1:
            path = next(iter(distinct.values()))
            obj = checkpoint
            for step in path:
                obj = obj[step]
            return path, obj
        if len(distinct) > 1:
            options = ", ".join(repr(_dotted(p)) for p in distinct.values())
            raise AmbiguousStateDictError(
                f"the checkpoint holds several state dicts ({options}); pass key= with "
                f"the one to use, e.g. key={_dotted(next(iter(distinct.values())))!r}"
            )
    others = [_dotted(path) for path in _tensor_mappings(checkpoint)]
    hint = (
        f"; mappings of tensors found at {', '.join(map(repr, others[:_REPORT_LIMIT]))}: "
        f"pass key= with one of them"
        if others
        else ""
    )
    modules = [repr(k) for k, v in checkpoint.items() if _is_module(v)]
    if modules:
        hint += (
            f"; {', '.join(modules)} hold(s) a pickled nn.Module: load it with "
            f"weights_only=False and call .state_dict()"
        )
    raise StateDictNotFoundError(
        f"no model state dict under the usual names ({', '.join(STATE_DICT_NAMES)}) "
        f"at the top level or one level down; the checkpoint has "
        f"{_describe_keys(checkpoint)}{hint}"
    )


def _tensor_mappings(checkpoint: Mapping[Any, Any]) -> list[tuple[Any, ...]]:
    found: list[tuple[Any, ...]] = []
    for name, value in checkpoint.items():
        if _is_state_dict(value) and value:
            found.append((name,))
        elif isinstance(value, Mapping):
            found.extend((name, inner) for inner, v in value.items() if _is_state_dict(v) and v)
    return found


def _with_item(container: Any, step: Any, value: Any) -> Any:
    if isinstance(container, dict):
        # copy.copy keeps the type and instance attributes (OrderedDict's _metadata).
        new = copy.copy(container)
        new[step] = value
        return new
    if isinstance(container, Mapping):
        replaced = dict(container)
        replaced[step] = value
        return replaced
    if isinstance(container, list):
        items = list(container)
        items[step] = value
        return items
    if isinstance(container, tuple) and hasattr(container, "_fields"):  # a namedtuple
        named: Any = container
        field = step if isinstance(step, str) else named._fields[step]
        return named._replace(**{field: value})
    if isinstance(container, tuple):
        items = list(container)
        items[step] = value
        return tuple(items)
    raise TypeError(f"cannot replace an item of a {type(container).__name__}")


def replace_state_dict(
    checkpoint: Any, path: Sequence[Any], new_state_dict: Mapping[str, Any]
) -> Any:
    """Return a copy of ``checkpoint`` with the state dict at ``path`` replaced.

    Only the containers along ``path`` are copied (keeping their types);
    everything else (epoch, optimizer state, metrics) is the same object as
    before. The input is not modified.

    Args:
        checkpoint: The container :func:`find_state_dict` searched.
        path: The path it returned; ``()`` replaces the whole checkpoint.
        new_state_dict: The state dict to put there.

    Returns:
        The new container (``new_state_dict`` itself when ``path`` is empty).

    Raises:
        StateDictNotFoundError: ``path`` does not lead to an existing entry.

    Example:
        >>> import torch
        >>> from ddpstate.keys import find_state_dict, replace_state_dict, strip_prefix
        >>> ckpt = {"epoch": 3, "model": {"module.w": torch.zeros(1)}}
        >>> path, sd = find_state_dict(ckpt)
        >>> new = replace_state_dict(ckpt, path, strip_prefix(sd))
        >>> new["epoch"], list(new["model"]), list(ckpt["model"])
        (3, ['w'], ['module.w'])
    """
    return _replace_at(checkpoint, tuple(path), 0, new_state_dict)


def _replace_at(container: Any, path: tuple[Any, ...], depth: int, value: Any) -> Any:
    if depth == len(path):
        return value
    step = path[depth]
    found, child = _child(container, step)
    if not found:
        raise StateDictNotFoundError(
            f"cannot replace the state dict at {_dotted(path)!r}: no entry {step!r} in "
            f"{_dotted(path[:depth]) or 'the top level'!r}, which has "
            f"{_describe_keys(container)}; pass the path find_state_dict returned"
        )
    return _with_item(container, step, _replace_at(child, path, depth + 1, value))
