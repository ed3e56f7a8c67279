"""A CheckpointManager's configuration: validated once, frozen, and passed whole to its parts.

``CheckpointManager.__init__`` builds one :class:`ManagerConfig` with
:func:`make_config` (every argument checked there, before any collective) and
hands it by name to the durable writer, the node-local tier, ``save`` and
``restore``; :func:`check_same_on_every_rank` is the one round that checks the
ranks built the same one. :class:`KeepBest` and :class:`NodeLocal` are the
grouped options users pass (public in :mod:`ddpstate.manager`);
:func:`fold_legacy` turns the old flat keywords into them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ddpstate._fs import PathLike
from ddpstate._io import savecheck as _savecheck
from ddpstate._warn import warn
from ddpstate.dist import Timeout, compare_across_ranks, is_distributed
from ddpstate.errors import InvalidArgumentError, InvalidArgumentTypeError
from ddpstate.formats import PT, SAFETENSORS, parse_format

#: ``CheckpointManager(writers=...)``: who writes replicated (DDP) models and optimizers.
WRITERS = ("rank0", "all")


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``count`` best checkpoints by ``metric`` too (``CheckpointManager(best=...)``).

    Rotation keeps them on top of the ``keep_last`` newest ones.

    Args:
        count: How many of the best to keep (an int >= 0).
        metric: The name, among ``save(metrics=...)``, that ranks checkpoints.
        mode: ``"min"`` or ``"max"``: which ``metric`` values are best.

    Example:
        >>> from ddpstate.manager import KeepBest
        >>> KeepBest(2, "loss")
        KeepBest(count=2, metric='loss', mode='min')
    """

    count: int
    metric: str
    mode: str = "min"


@dataclass(frozen=True)
class NodeLocal:
    """The node-local tier (``CheckpointManager(local=...)``), written by ``save_local``.

    See docs/local-tier.md.

    Args:
        directory: A node-local folder (``/dev/shm/ddpstate-<job id>``). Name it
            per job: restore takes the newest step of any tier. It may differ
            between nodes (not between the ranks of one node).
        every: ``save_local`` writes the steps divisible by this (an int >= 1).
        keep: Local steps kept on each node, the newest ones (an int >= 1).

    Example:
        >>> from ddpstate.manager import NodeLocal
        >>> NodeLocal("/dev/shm/ddpstate-42", every=50)
        NodeLocal(directory='/dev/shm/ddpstate-42', every=50, keep=2)
    """

    directory: PathLike
    every: int = 1
    keep: int = 2


#: The old flat keywords of ``CheckpointManager`` -> the grouped option they became.
_LEGACY_BEST = {"keep_best": "count", "metric": "metric", "mode": "mode"}
_LEGACY_LOCAL = {"local_dir": "directory", "local_every": "every", "local_keep": "keep"}


def fold_legacy(
    best: Optional[KeepBest], local: Optional[NodeLocal], legacy: Mapping[str, Any]
) -> tuple[Optional[KeepBest], Optional[NodeLocal]]:
    """``(best, local)`` with ``CheckpointManager``'s old flat keywords folded in.

    Each old keyword still works, with a ``DeprecationWarning`` naming its new spelling.

    Raises:
        InvalidArgumentTypeError: An unknown keyword (also a ``TypeError``, as Python's).
        InvalidArgumentError: An option passed in both its old and its new spelling.
    """
    for name in legacy:
        group, new = ("best", "KeepBest") if name in _LEGACY_BEST else ("local", "NodeLocal")
        if name not in _LEGACY_BEST and name not in _LEGACY_LOCAL:
            raise InvalidArgumentTypeError(
                f"CheckpointManager.__init__() got an unexpected keyword argument {name!r}"
            )
        if (best if group == "best" else local) is not None:
            raise InvalidArgumentError(
                f"CheckpointManager: pass {group}={new}(...) only ({name}= is its old spelling)"
            )
        field = {**_LEGACY_BEST, **_LEGACY_LOCAL}[name]
        warn(
            f"CheckpointManager({name}=...) is deprecated: pass {group}={new}({field}=...)",
            DeprecationWarning,
        )
    old = {_LEGACY_BEST[k]: v for k, v in legacy.items() if k in _LEGACY_BEST}
    if old:
        best = KeepBest(**{"count": 0, "metric": None, **old})
    old = {_LEGACY_LOCAL[k]: v for k, v in legacy.items() if k in _LEGACY_LOCAL}
    if old.get("directory") is not None:  # local_dir=None (or none given): the tier is off
        local = NodeLocal(**old)
    return best, local


@dataclass(frozen=True)
class ManagerConfig:
    """What a :class:`~ddpstate.CheckpointManager` was created with (see its Args), checked."""

    directory: str
    keep_last: Optional[int]
    keep_best: int
    metric: Optional[str]
    mode: str
    async_save: bool
    format: str
    storage_options: Optional[dict[str, Any]]
    timeout: Timeout
    safe_globals: tuple[Any, ...]
    writers: str
    #: The node-local tier's folder (absolute), or None when the tier is off.
    local_dir: Optional[str]
    local_every: int
    local_keep: int


def _int_at_least(value: Any, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


def _positive(name: str, value: Any) -> int:
    if not _int_at_least(value, 1):
        raise InvalidArgumentError(f"CheckpointManager: {name}={value!r} must be an int >= 1")
    return int(value)


def _local_dir(directory: Any) -> Optional[str]:
    if directory is None:
        return None
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise InvalidArgumentError(
            f"CheckpointManager: local_dir={directory!r} must be a local folder, such as "
            f"'/dev/shm/ddpstate-<job id>'"
        )
    if "://" in os.fspath(directory):
        raise InvalidArgumentError(
            f"CheckpointManager: local_dir={directory!r} must be a node-local folder, not a URL"
        )
    return os.path.abspath(os.fspath(directory))


def make_config(
    directory: PathLike, *, keep_last: Any, best: Optional[KeepBest], async_save: bool,
    format: str, storage_options: Optional[dict[str, Any]], timeout: Timeout,
    safe_globals: Sequence[Any], local: Optional[NodeLocal], writers: str,
) -> ManagerConfig:  # fmt: skip
    """Check ``CheckpointManager``'s arguments (not a collective) and freeze them.

    The messages name the options by their old flat keywords (``keep_best=``,
    ``local_every=``...), which are also :class:`ManagerConfig`'s fields.

    Raises:
        InvalidArgumentError: An argument is invalid (the message names it).
    """
    for name, value, kind in (("best", best, KeepBest), ("local", local, NodeLocal)):
        if value is not None and not isinstance(value, kind):
            raise InvalidArgumentTypeError(
                f"CheckpointManager: {name}={value!r} must be a ddpstate.manager."
                f"{kind.__name__}(...) or None"
            )
    if local is not None and local.directory is None:
        raise InvalidArgumentError(
            "CheckpointManager: local=NodeLocal(directory=None) names no folder; pass a "
            "node-local folder such as NodeLocal('/dev/shm/ddpstate-<job id>'), or local=None "
            "for no node-local tier"
        )
    keep_best, metric, mode = (
        (0, None, "min") if best is None else (best.count, best.metric, best.mode)
    )
    local_dir, local_every, local_keep = (
        (None, 1, 2) if local is None else (local.directory, local.every, local.keep)
    )
    if keep_last is not None and not _int_at_least(keep_last, 1):
        raise InvalidArgumentError(
            f"CheckpointManager: keep_last={keep_last!r} must be an int >= 1 (the newest "
            f"checkpoint is always kept) or None to keep every checkpoint"
        )
    if not _int_at_least(keep_best, 0):
        raise InvalidArgumentError(
            f"CheckpointManager: keep_best={keep_best!r} must be an int >= 0"
        )
    if keep_best and not metric:
        raise InvalidArgumentError(
            f"CheckpointManager: keep_best={keep_best} needs metric= (the name of the metric "
            f"passed to save(metrics=...) that ranks checkpoints)"
        )
    if mode not in ("min", "max"):
        raise InvalidArgumentError(f"CheckpointManager: mode={mode!r} must be 'min' or 'max'")
    if writers not in WRITERS:
        raise InvalidArgumentError(
            f"CheckpointManager: writers={writers!r} must be 'rank0' (rank 0 writes models "
            f"and optimizers) or 'all' (every rank writes part, through "
            f"torch.distributed.checkpoint)"
        )
    return ManagerConfig(
        directory=os.fspath(directory),
        keep_last=keep_last,
        keep_best=keep_best,
        metric=metric,
        mode=mode,
        async_save=bool(async_save),
        format=parse_format(format, allowed=(PT, SAFETENSORS), what="CheckpointManager format"),
        storage_options=storage_options,
        timeout=timeout,
        safe_globals=_savecheck.check_safe_globals(safe_globals, "CheckpointManager"),
        writers=writers,
        local_dir=_local_dir(local_dir),
        local_every=_positive("local_every", local_every),
        local_keep=_positive("local_keep", local_keep),
    )


def check_same_on_every_rank(config: ManagerConfig) -> None:
    """Every rank: raise on every rank when some rank built another durable configuration.

    The local tier's folder may differ between nodes; its settings are compared
    by the tier itself.
    """
    if not is_distributed():
        return
    c = config
    durable = (c.directory, c.keep_last, c.keep_best, c.metric, c.mode, c.async_save, c.format)
    gathered = compare_across_ranks(
        (*durable, c.writers), name="CheckpointManager(...)", timeout=c.timeout
    )
    if gathered is not None:
        differing = [r for r, g in enumerate(gathered) if g != gathered[0]]
        raise InvalidArgumentError(
            f"CheckpointManager: rank(s) {differing} were created with different arguments "
            f"than rank 0 ({gathered[differing[0]]!r} vs {gathered[0]!r}); every rank must "
            f"pass the same directory and options (no per-rank timestamps in the path)"
        )
