"""What the ranks must agree on in ``CheckpointManager.save``'s one round, checked on the writer.

Every rank sends its step, entry names, BatchNorm facts and DCP entries to the
writer, which turns any disagreement into the one error every rank raises
(:func:`check_gathered`, :func:`check_batchnorm`) before anything is written.
:class:`SavePlan` is what one save carries from its checks to its commit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple, Optional

from torch import nn

from ddpstate._checksum import error_text
from ddpstate._collectives import with_message
from ddpstate._manager.entries import Entry
from ddpstate._manager.writer import WRITER_RANK
from ddpstate.batchnorm import (
    stats_checksums,
    sync_batchnorm_stats,
    warn_if_checksums_differ,
    wrapped_unsynced,
)
from ddpstate.dist import Timeout
from ddpstate.errors import CheckpointWriteError, DDPStateError, InvalidArgumentError


class SaveInfo(NamedTuple):
    """What each rank sends the writer in ``save``'s one round (plain pickle, as every message)."""

    step: int
    names: list[str]
    #: This rank's RNG states, pickled: opaque to the checks, unpickled when written.
    rng: bytes
    #: Model entry -> "sync" or its BatchNorm checksums (see :func:`batchnorm_checks`).
    batchnorm: dict[str, Any]
    #: Entry -> kind of the entries written through torch.distributed.checkpoint.
    dcp: dict[str, str]


@dataclass
class SavePlan:
    """What one ``CheckpointManager.save`` writes, worked out before its round (``save._plan``)."""

    step: int
    folder: str
    metrics: dict[str, float]
    #: Entries every rank writes through torch.distributed.checkpoint (entry -> kind).
    dcp_kinds: dict[str, str]
    #: The other entries: the writer's to write.
    rest: dict[str, Any]
    #: Models wrap_ddp prepared with unsynced BatchNorm are averaged before the write.
    sync_first: bool
    info: SaveInfo
    entries: dict[str, Entry] = field(default_factory=dict)
    events: list[Any] = field(default_factory=list)
    #: The writer's refusal or failure before the round, told to every rank in it.
    local_error: Optional[Exception] = None
    refusal: str = ""
    #: Every rank's pickled RNG states, gathered on the writer in the round.
    rng_blobs: list[bytes] = field(default_factory=list)


def check_gathered(
    gathered: list[SaveInfo], step: int, folder: str, local_error: Optional[Exception]
) -> Optional[DDPStateError]:
    """The writer's verdict on the gathered metadata: None, or the error every rank raises."""
    if local_error is not None:
        message = (
            f"saving step {step} to {folder} failed before writing: rank {WRITER_RANK}: "
            f"{error_text(local_error)}; nothing was written"
        )
        if isinstance(local_error, DDPStateError):
            return with_message(local_error, message)
        return CheckpointWriteError(message)
    steps = [g.step for g in gathered]
    if len(set(steps)) > 1:
        return InvalidArgumentError(
            f"CheckpointManager.save: the ranks passed different steps "
            f"({', '.join(f'rank {r}: {s}' for r, s in enumerate(steps))}); every rank must "
            f"save the same step at the same time"
        )
    names = [g.names for g in gathered]
    differing = [r for r, n in enumerate(names) if n != names[0]]
    if differing:
        return InvalidArgumentError(
            f"CheckpointManager.save(step={step}): rank(s) {differing} passed state entries "
            f"{names[differing[0]]} but rank 0 passed {names[0]}; pass the same names on "
            f"every rank"
        )
    return None


def check_dcp_kinds(gathered: list[SaveInfo], step: int) -> Optional[InvalidArgumentError]:
    """The writer: an error when the ranks do not agree on which entries are DCP entries."""
    differing = [r for r, g in enumerate(gathered) if g.dcp != gathered[0].dcp]
    if not differing:
        return None
    r = differing[0]
    return InvalidArgumentError(
        f"CheckpointManager.save(step={step}): rank {r} holds sharded/DCP entries "
        f"{sorted(gathered[r].dcp)} but rank 0 holds {sorted(gathered[0].dcp)}; every rank must "
        f"pass the same kind of model and optimizer (all FSDP2, or none)"
    )


def batchnorm_checks(state: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's BatchNorm facts per model entry, sent in ``save``'s agreement exchange.

    ``"sync"`` for a ``wrap_ddp`` model with unsynced statistics, else its
    :func:`~ddpstate.batchnorm.stats_checksums` (None: nothing to compare).
    Not a collective.
    """
    return {
        name: "sync" if wrapped_unsynced(obj) else stats_checksums(obj)
        for name, obj in state.items()
        if isinstance(obj, nn.Module)
    }


def check_batchnorm(
    state: Mapping[str, Any], folder: str, gathered: list[SaveInfo]
) -> Optional[DDPStateError]:
    """The writer, inside save's round: the ranks must agree on which models to sync.

    For the other models it warns (once per model) when the ranks' BatchNorm
    statistics differ, since the file would hold rank 0's alone.
    """
    for name, obj in state.items():
        if not isinstance(obj, nn.Module):
            continue
        facts = [g.batchnorm.get(name) for g in gathered]
        syncing = [r for r, fact in enumerate(facts) if fact == "sync"]
        if syncing and len(syncing) != len(facts):
            return InvalidArgumentError(
                f"CheckpointManager.save: entry {name!r} was prepared by wrap_ddp with "
                f"unsynced BatchNorm on rank(s) {syncing} but not on the others; prepare "
                f"the model the same way on every rank"
            )
        if not syncing:
            warn_if_checksums_differ(obj, facts, where=f"{folder} (entry {name!r})")
    return None


def sync_batchnorm(state: Mapping[str, Any], given: Timeout) -> None:
    """Every rank, after save's round: average the statistics of unsynced wrap_ddp models."""
    timeout = given.total_seconds() if isinstance(given, timedelta) else given
    for obj in state.values():
        if isinstance(obj, nn.Module) and wrapped_unsynced(obj):
            sync_batchnorm_stats(obj, timeout=timeout)
