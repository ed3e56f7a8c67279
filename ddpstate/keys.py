"""State-dict key conversion between plain, DataParallel, DDP and torch.compile models.

The public face of ``ddpstate._keys``: renaming (``strip_prefix``, ``add_prefix``,
``normalize_keys``) lives in ``_keys/rename.py``, matching a state dict to a model
(``match_keys``, ``adapt_state_dict``) in ``_keys/match.py``, finding the state dict in
a checkpoint in ``_keys/find.py``, and recognising wrappers in ``_keys/wrappers.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ddpstate._keys.find import STATE_DICT_NAMES, find_state_dict, replace_state_dict
from ddpstate._keys.match import KeyMatch, adapt_state_dict, match_keys
from ddpstate._keys.rename import OnCollision, add_prefix, normalize_keys, strip_prefix
from ddpstate._keys.wrappers import wrapper_chain

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
    *_, plain = wrapper_chain(model)
    return plain


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
