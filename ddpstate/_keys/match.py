"""Pairing a state dict's keys with a model's, whatever wrappers either side had."""

from __future__ import annotations

import os
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, cast

from ddpstate._keys.rename import (
    _REPORT_LIMIT,
    _WRAPPER_SEGMENTS,
    _drop_segments,
    _metadata_of,
    _normalize_name,
    _rename_metadata,
)
from ddpstate._keys.wrappers import is_module, wrapper_types
from ddpstate.errors import InvalidArgumentTypeError, KeyMismatchError

if TYPE_CHECKING:
    from torch import nn


#: The last words of a key mismatch report: a caller with other options rewrites them.
STRICT_ADVICE = "pass strict=False to take the keys that match"


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


# A side's canonical form of a key (keep_last) or module path at a matching level,
# and how many wrapper segments it lost.
_Canon = Callable[[int, str, bool], tuple[str, int]]


@dataclass(frozen=True)
class _Side:
    keys: list[str]
    paths: list[str]
    canon: _Canon


def _paths_from_keys(keys: Iterable[str]) -> list[str]:
    # The root, then each key's module path and every path above it, first seen first.
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


def _generic_canon(level: int, name: str, keep_last: bool) -> tuple[str, int]:
    if level == 0:
        return name, 0
    if level == 1:
        return _normalize_name(name, keep_last)
    return _drop_segments(name, keep_last, lambda segments, i: segments[i] in _WRAPPER_SEGMENTS)


def _source_side(state_dict: Mapping[Any, Any] | Iterable[Any]) -> tuple[_Side, list[Any]]:
    keys = list(state_dict)
    metadata = _metadata_of(state_dict) or {}
    names = [k for k in keys if isinstance(k, str)]
    paths = [p for p in metadata if isinstance(p, str)]
    return _Side(names, paths, _generic_canon), [k for k in keys if not isinstance(k, str)]


def _model_side(model: nn.Module) -> _Side:
    wrappers = wrapper_types()
    wrapper_paths = {
        path
        for path, module in model.named_modules(remove_duplicate=False)
        if isinstance(module, wrappers)
    }

    def structural(segments: list[str], i: int) -> bool:
        return segments[i] in _WRAPPER_SEGMENTS and ".".join(segments[:i]) in wrapper_paths

    def canon(level: int, name: str, keep_last: bool) -> tuple[str, int]:
        if level == 1:
            return _drop_segments(name, keep_last, structural)
        return _generic_canon(level, name, keep_last)

    state = model.state_dict()
    return _target_paths(list(state), _metadata_of(state), canon)


def _target_side(target: Any) -> _Side:
    if is_module(target):
        return _model_side(target)
    if isinstance(target, (str, bytes)) or not isinstance(target, Iterable):
        raise InvalidArgumentTypeError(
            f"target must be a model, a state dict or a collection of keys, "
            f"not {type(target).__name__}"
        )
    keys = [k for k in target if isinstance(k, str)]
    return _target_paths(keys, _metadata_of(target), _generic_canon)


def _target_paths(keys: list[str], metadata: Optional[Mapping[str, Any]], canon: _Canon) -> _Side:
    # A target's module paths: its _metadata's, else those its keys imply.
    return _Side(keys, list(metadata) if metadata is not None else _paths_from_keys(keys), canon)


def _common_path(canon: Iterable[str]) -> list[str]:
    # The leading segments every key's module path shares (commonprefix compares
    # any sequences item by item: here, lists of segments).
    return list(os.path.commonprefix([key.split(".")[:-1] for key in canon]))  # noqa: RUF071


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
        found = self.path(side, is_source, key, keep_last=True)
        return None if found is None else found[0]

    def path(
        self, side: _Side, is_source: bool, path: str, keep_last: bool = False
    ) -> Optional[tuple[str, int]]:
        # A key (keep_last) that is the whole leading path names no entry: no image.
        canon, depth = side.canon(self.level, path, keep_last)
        if self.side != ("source" if is_source else "target"):
            return canon, depth
        stripped = _strip_path(canon, self.lead) if canon else None
        if stripped is None or (keep_last and stripped[1]):
            return None
        return stripped[0], depth + stripped[1]


def _pair(source: dict[str, Optional[str]], target: dict[str, Optional[str]]) -> dict[str, str]:
    # One to one only: a canonical name two keys of either side share pairs nothing.
    source_count, target_count = Counter(source.values()), Counter(target.values())
    source_of = {canon: key for key, canon in source.items()}
    return {
        key: source_of[canon]
        for key, canon in target.items()
        if canon is not None and source_count[canon] == target_count[canon] == 1
    }


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
        mapping = _pair(
            {k: attempt.key(src, True, k) for k in src.keys},
            {k: attempt.key(tgt, False, k) for k in tgt.keys},
        )
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


def _tied_keys(model: nn.Module) -> list[list[str]]:
    """Groups of the model's state-dict keys that are one tensor (tied weights).

    A tie is a parameter or buffer reached under several names (HF's
    ``lm_head.weight`` is ``embed_tokens.weight``), or two names over the same
    memory; a module's ``_tied_weights_keys`` given as ``{tied: source}`` (newer
    Hugging Face models) adds its pairs.
    """
    torch = sys.modules["torch"]  # loaded: model is a module
    plain = (torch.Tensor, torch.nn.Parameter)
    groups: dict[Any, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        # Sharded (DTensor) entries are matched elsewhere; meta or empty ones hold no memory.
        if type(value) not in plain or value.is_meta or value.data_ptr() == 0:
            continue
        where = (value.data_ptr(), value.dtype, tuple(value.shape), tuple(value.stride()))
        groups.setdefault(where, []).append(key)
    tied = [keys for keys in groups.values() if len(keys) > 1]
    for path, module in model.named_modules():
        declared = getattr(module, "_tied_weights_keys", None)
        if isinstance(declared, Mapping):
            lead = f"{path}." if path else ""
            tied.extend([f"{lead}{a}", f"{lead}{b}"] for a, b in declared.items())
    return tied


def _with_ties(match: KeyMatch, model: nn.Module) -> KeyMatch:
    """``match`` with each missing key tied to a matched one taken from that one's source.

    A file may store a tied weight once (Hugging Face does); the model's other
    name for it is then present, and loading both names keeps the tie (the
    values are copied into the one shared tensor).
    """
    if not match.missing:
        return match
    mapping = dict(match.mapping)
    for group in _tied_keys(model):
        source = next((mapping[k] for k in group if k in mapping), None)
        if source is not None:
            mapping.update({key: source for key in group if key in match.missing})
    if len(mapping) == len(match.mapping):
        return match
    order = {key: i for i, key in enumerate((*match.mapping, *match.missing))}
    return KeyMatch(
        mapping=dict(sorted(mapping.items(), key=lambda item: order.get(item[0], 0))),
        missing=tuple(k for k in match.missing if k not in mapping),
        unexpected=match.unexpected,
        rule=match.rule,
    )


def _full_match(
    state_dict: Mapping[Any, Any] | Iterable[Any], target: Any
) -> tuple[KeyMatch, _Side, _Side, _Attempt]:
    src, non_str = _source_side(state_dict)
    tgt = _target_side(target)
    return _match_sides(src, non_str, tgt, target)


def _match_sides(
    src: _Side, non_str: list[Any], tgt: _Side, target: Any
) -> tuple[KeyMatch, _Side, _Side, _Attempt]:
    match, attempt = _match(src, tgt)
    if is_module(target):
        match = _with_ties(match, cast("nn.Module", target))
    if non_str:
        match = KeyMatch(match.mapping, match.missing, (*match.unexpected, *non_str), match.rule)
    return match, src, tgt, attempt


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
        InvalidArgumentTypeError: ``target`` is not a model, mapping or collection of
            keys (a ``TypeError``).

    Example:
        >>> import torch
        >>> from ddpstate.keys import match_keys
        >>> net = torch.nn.Linear(2, 2)
        >>> m = match_keys(["module.weight", "module.bias", "module.extra"], net)
        >>> m.mapping, m.unexpected
        ({'weight': 'module.weight', 'bias': 'module.bias'}, ('module.extra',))
    """
    return _full_match(state_dict, target)[0]


def _leads(keys: Sequence[str]) -> list[str]:
    # The one- and two-segment leading paths of the keys, most frequent first.
    counts = Counter(
        ".".join(segments[:n]) + "."
        for segments in (key.split(".") for key in keys)
        for n in (1, 2)
        if len(segments) > n
    )
    return [lead for lead, _ in counts.most_common()]


def prefix_hint(source: Sequence[str], target: Sequence[str]) -> str:
    """Say which leading path one side's keys have and the other's lack, with the fix.

    Args:
        source: The file's keys.
        target: The model's keys.

    Returns:
        A sentence naming the prefix and the call that removes or adds it, or,
        when no prefix explains the difference, one key of each side.

    Example:
        >>> from ddpstate._keys.match import prefix_hint
        >>> hint = prefix_hint(["model.fc.w", "lm_head.w"], ["fc.w"])
        >>> hint.startswith("the file's keys start with 'model.' where the model's do not")
        True
    """
    own, theirs = set(source), set(target)
    best: tuple[int, str] = (0, "")
    # A prefix the file's keys have and the model's lack (strip it), or the other way (add it).
    sides = (
        (source, theirs, "the file's keys", "the model's", "strip it with ddpstate.strip_prefix"),
        (target, own, "the model's keys", "the file's", "add it with ddpstate.add_prefix"),
    )
    for keys, other, these, those, fix in sides:
        for lead in _leads(keys)[:8]:
            hits = sum(k.startswith(lead) and k[len(lead) :] in other for k in keys)
            if hits > best[0]:
                best = (
                    hits,
                    f"{these} start with {lead!r} where {those} do not: {fix}(state_dict, "
                    f"{lead!r})",
                )
    if best[0]:
        return best[1]
    first = next(iter(source), None)
    return (
        f"the file's keys look like {first!r}{_nearest(str(first), list(target))}; check that "
        f"the file belongs to this model, or pass key= to pick the state dict inside it"
    )


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
        f"ddpstate.strip_prefix/add_prefix, or {STRICT_ADVICE}."
    )
    return "\n".join(lines)


def _adapted_metadata(
    src: _Side, tgt: _Side, attempt: _Attempt, metadata: Mapping[str, Any]
) -> OrderedDict[str, Any]:
    # Per canonical module path, the deepest source entry and the deepest target
    # path (a wrapper's root and the real module's land on one path).
    source = _rename_metadata(
        {path: metadata[path] for path in src.paths}, lambda p: attempt.path(src, True, p)
    )
    target = _rename_metadata({p: p for p in tgt.paths}, lambda p: attempt.path(tgt, False, p))
    owner = {path: canon for canon, path in target.items()}
    result: OrderedDict[str, Any] = OrderedDict()
    for path in tgt.paths:
        canon = owner.get(path)
        if canon is not None and canon in source:
            result[path] = source[canon]
    return result


def adapted_if_same(
    state_dict: Mapping[Any, Any], own: Mapping[str, Any]
) -> Optional[OrderedDict[str, Any]]:
    """:func:`adapt_state_dict`'s result when ``state_dict`` has exactly ``own``'s keys, else None.

    The keys as they are pair every key, so nothing is matched key by key: a
    restore of the model's own checkpoint (25,000 keys) skips the matching rules.

    Args:
        state_dict: The source state dict; not modified.
        own: The target model's ``state_dict()``.

    Returns:
        An OrderedDict in ``own``'s key order, its ``_metadata`` the source's
        entries for ``own``'s module paths; None when the keys differ.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(2, 2)
        >>> list(adapted_if_same({"bias": 0, "weight": 1}, net.state_dict()))
        ['weight', 'bias']
        >>> adapted_if_same({"module.weight": 1}, net.state_dict()) is None
        True
    """
    target = _metadata_of(own)
    paths = list(target) if target is not None else _paths_from_keys(own)
    return _same_keys_adapted(state_dict, list(own), paths)


def _same_keys_adapted(
    state_dict: Mapping[Any, Any], keys: list[str], paths: list[str]
) -> Optional[OrderedDict[str, Any]]:
    # adapted_if_same for a target of these keys and module paths.
    # Equal sets of equal size: no key twice on the target side (a list of keys may have it).
    if len(state_dict) != len(keys) or set(keys) != set(state_dict):
        return None
    # Keys in the same order copy at C speed; otherwise the target's order is taken.
    same_order = list(state_dict) == keys
    result: OrderedDict[str, Any] = (
        OrderedDict(state_dict) if same_order else OrderedDict((k, state_dict[k]) for k in keys)
    )
    metadata = _metadata_of(state_dict)
    if metadata is not None:
        # What _adapted_metadata gives for the identity rule: the source's entries (copied)
        # at the target's module paths, in the target's order.
        result._metadata = OrderedDict(  # type: ignore[attr-defined]
            (p, dict(metadata[p]) if isinstance(metadata[p], Mapping) else metadata[p])
            for p in paths
            if isinstance(p, str) and p in metadata
        )
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
    key. A rule that would pair two keys with one is never used. A model's
    tied weights (one tensor under two names, e.g. ``lm_head.weight`` and
    ``embed.weight``) need only one of their names in the source.

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
        InvalidArgumentTypeError: ``target`` is not a model, mapping or collection of
            keys (a ``TypeError``).

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
    # The keys as they are pair every key: nothing to match key by key.
    same = None if non_str else _same_keys_adapted(state_dict, tgt.keys, tgt.paths)
    if same is not None:
        return same
    match, src, tgt, attempt = _match_sides(src, non_str, tgt, target)
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
