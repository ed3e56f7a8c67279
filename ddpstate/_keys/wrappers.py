"""Recognising torch's model wrappers (DataParallel, DDP, torch.compile) and tensors.

torch is looked up in ``sys.modules`` rather than imported where that is enough: key
rewriting on files (``ddpstate convert``) must stay torch-free.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from ddpstate._keys.rename import _drop_segments, _rename, _rename_metadata

if TYPE_CHECKING:
    from torch import nn


def optimized_module_type() -> type | None:
    """torch.compile's wrapper class, or None when nothing compiled can exist yet.

    Returns:
        ``OptimizedModule`` when ``torch._dynamo`` is imported, else None.

    Example:
        >>> from ddpstate._keys.wrappers import optimized_module_type
        >>> optimized_module_type() in (None, optimized_module_type())
        True
    """
    # torch.compile imports torch._dynamo to build its wrapper, so a process that has not
    # imported it holds no compiled module; importing it here would cost seconds per restart.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def is_tensor(value: Any) -> bool:
    """True for a torch.Tensor (False whenever torch is not imported).

    Args:
        value: Anything.

    Returns:
        Whether ``value`` is a tensor.

    Example:
        >>> from ddpstate._keys.wrappers import is_tensor
        >>> is_tensor([1.0])
        False
    """
    # A torch.Tensor exists only once torch is imported.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_module(value: Any) -> bool:
    """True for an ``nn.Module`` (False whenever torch is not imported).

    Args:
        value: Anything.

    Returns:
        Whether ``value`` is a torch module.

    Example:
        >>> from ddpstate._keys.wrappers import is_module
        >>> is_module({"weight": 1})
        False
    """
    # Same reasoning as is_tensor: no torch imported means no nn.Module.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.nn.Module)


def _wrapped_attributes() -> list[tuple[type, str]]:
    # Each wrapper class with the attribute that holds the module it wraps:
    # DataParallel and DDP keep it as `.module`, torch.compile as `._orig_mod`.
    from torch import nn

    pairs: list[tuple[type, str]] = [
        (nn.DataParallel, "module"),
        (nn.parallel.DistributedDataParallel, "module"),
    ]
    compiled = optimized_module_type()
    if compiled is not None:
        pairs.append((compiled, "_orig_mod"))
    return pairs


def wrapper_types() -> tuple[type, ...]:
    """The wrapper classes that can exist in this process (DataParallel, DDP, compile).

    Returns:
        A tuple for ``isinstance``.

    Example:
        >>> import torch
        >>> from ddpstate._keys.wrappers import wrapper_types
        >>> torch.nn.DataParallel in wrapper_types()
        True
    """
    return tuple(kind for kind, _ in _wrapped_attributes())


def wrapper_chain(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` and each module it wraps, outermost first, down to the plain model.

    DataParallel and DDP keep the wrapped model as ``.module``, torch.compile as
    ``._orig_mod``; wrappers may nest in any order and depth.

    Args:
        model: A plain or wrapped module; not changed.

    Returns:
        An iterator over the layers; the last one is the plain model.

    Example:
        >>> import torch
        >>> from ddpstate._keys.wrappers import wrapper_chain
        >>> net = torch.nn.Linear(2, 2)
        >>> [type(m).__name__ for m in wrapper_chain(torch.nn.DataParallel(net))]
        ['DataParallel', 'Linear']
    """
    from torch import nn

    pairs = _wrapped_attributes()
    while True:
        yield model
        attribute = next((name for kind, name in pairs if isinstance(model, kind)), None)
        inner = None if attribute is None else getattr(model, attribute, None)
        if not isinstance(inner, nn.Module):
            return
        model = inner


def unwrapped_state_dict(model: nn.Module, *, keep_vars: bool = False) -> dict[str, Any]:
    """The plain model's state dict: exactly the segments of the wrappers ``model`` holds removed.

    The outer wrappers (DataParallel, DDP, ``torch.compile`` in any nesting) are
    peeled off the live model, and each compiled submodule inside it loses its
    ``_orig_mod`` segment. Only wrapper objects found in the model count: a real
    child named ``module`` (``torch.optim.swa_utils.AveragedModel`` keeps the
    averaged model there) stays in the keys, so the file loads back into it.

    Args:
        model: A plain or wrapped module; not changed.
        keep_vars: Passed to ``state_dict``: the live parameters and buffers, not detached ones.

    Returns:
        The state dict (with ``_metadata``, its module paths renamed alike).

    Example:
        >>> import torch
        >>> from torch.optim.swa_utils import AveragedModel
        >>> from ddpstate._keys.wrappers import unwrapped_state_dict
        >>> ema = AveragedModel(torch.nn.Linear(2, 2))
        >>> list(unwrapped_state_dict(torch.nn.DataParallel(ema)))
        ['n_averaged', 'module.weight', 'module.bias']
    """
    *_, plain = wrapper_chain(model)
    state = plain.state_dict(keep_vars=keep_vars)
    compiled = optimized_module_type()
    inner = (
        set()
        if compiled is None
        else {p for p, m in plain.named_modules(remove_duplicate=False) if isinstance(m, compiled)}
    )
    if not inner:
        return state

    # The segment after a compiled submodule's own path is its `_orig_mod`: drop it.
    def drop(segments: list[str], i: int) -> bool:
        return segments[i] == "_orig_mod" and ".".join(segments[:i]) in inner

    out: Any = _rename(
        state, lambda key: _drop_segments(key, True, drop), "error", "removing wrapper segments"
    )
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        out._metadata = _rename_metadata(metadata, lambda path: _drop_segments(path, False, drop))
    return cast("dict[str, Any]", out)
