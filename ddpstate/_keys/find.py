"""Finding the model state dict inside a loaded checkpoint, and putting a new one there."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from ddpstate._keys.rename import _REPORT_LIMIT
from ddpstate._keys.wrappers import is_module, is_tensor
from ddpstate.errors import (
    AmbiguousStateDictError,
    InvalidArgumentTypeError,
    StateDictNotFoundError,
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


def _is_state_dict(obj: Any) -> bool:
    # String keys, no nested mappings, and some tensor (or nothing at all).
    return (
        isinstance(obj, Mapping)
        and all(isinstance(k, str) for k in obj)
        and not any(isinstance(v, Mapping) for v in obj.values())
        and (len(obj) == 0 or any(is_tensor(v) for v in obj.values()))
    )


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


def _at(obj: Any, path: Sequence[Any]) -> Any:
    # The entry at a path that leads somewhere (as _resolve_dotted or a search found it).
    for step in path:
        obj = _child(obj, step)[1]
    return obj


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
        obj = _at(checkpoint, path)
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
            distinct.setdefault(id(_at(checkpoint, path)), path)
        if len(distinct) == 1:
            path = next(iter(distinct.values()))
            return path, _at(checkpoint, path)
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
    modules = [repr(k) for k, v in checkpoint.items() if is_module(v)]
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
        return {**container, step: value}
    if isinstance(container, tuple) and hasattr(container, "_fields"):  # a namedtuple
        named: Any = container
        field = step if isinstance(step, str) else named._fields[step]
        return named._replace(**{field: value})
    if isinstance(container, (list, tuple)):
        items = list(container)
        items[step] = value
        return tuple(items) if isinstance(container, tuple) else items
    raise InvalidArgumentTypeError(f"cannot replace an item of a {type(container).__name__}")


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
