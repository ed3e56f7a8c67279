"""Recognising torch's model wrappers (DataParallel, DDP, torch.compile) and tensors.

torch is looked up in ``sys.modules`` rather than imported where that is enough: key
rewriting on files (``ddpstate convert``) must stay torch-free.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = ["is_module", "is_tensor", "optimized_module_type", "wrapper_chain", "wrapper_types"]


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
    """True for a torch.Tensor or a streaming placeholder that stands for one.

    Args:
        value: Anything.

    Returns:
        Whether ``value`` is tensor-like.

    Example:
        >>> from ddpstate._keys.wrappers import is_tensor
        >>> is_tensor([1.0])
        False
    """
    # A torch.Tensor exists only once torch is imported; the streaming
    # converter's placeholders declare themselves tensor-like instead.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return True
    return getattr(type(value), "_ddpstate_tensor_like", False) is True


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
