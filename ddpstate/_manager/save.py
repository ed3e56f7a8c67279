"""``CheckpointManager.save`` as a pipeline: plan, agree, write, commit.

:func:`_plan` checks the arguments and, on the writer, takes the entries
(``snapshot.py``); :func:`_agree` is the one ``gather_and_decide`` round in
which every rank sends its :class:`~ddpstate._manager.agreement.SaveInfo`, the
writer checks the ranks agree (``agreement.py``) and, in the plain synchronous
case, commits the step (``writer.py``) so every rank gets its verdict;
:func:`_write` does the rest after the round: it averages unsynced BatchNorm
statistics, writes sharded entries through ``_dcp/write.py``, starts an async
write, or commits and shares the outcome (:func:`_commit`).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any, Optional

from ddpstate._calls import calling
from ddpstate._gc import gc_paused
from ddpstate._io import savecheck as _savecheck
from ddpstate._manager import dcp_step as _dcp
from ddpstate._manager import optim_state
from ddpstate._manager.agreement import (
    SaveInfo,
    SavePlan,
    batchnorm_checks,
    check_batchnorm,
    check_dcp_kinds,
    check_gathered,
    sync_batchnorm,
)
from ddpstate._manager.entries import (
    check_metrics,
    check_not_sharded,
    check_state,
    check_step,
    rng_states,
    rng_to_wire,
)
from ddpstate._manager.snapshot import Snapshot
from ddpstate._manager.writer import WRITER_RANK, InFlight, Pending, StepWriter
from ddpstate.dist import gather_and_decide, get_rank, is_distributed
from ddpstate.errors import DDPStateError, InvalidArgumentError
from ddpstate.rng import capture_rng_state


def save(
    writer: StepWriter,
    flight: InFlight,
    snapshot: Snapshot,
    *,
    step: int,
    state: Mapping[str, Any],
    metrics: Optional[Mapping[str, Any]],
    rollback: bool,
    restored: Optional[int],
) -> None:
    """Every rank: ``CheckpointManager.save`` once the previous write is done (see its docstring).

    ``restored`` is the step the manager's ``restore`` loaded (rollbacks to it
    or below are allowed); ``snapshot`` holds the async copies' buffers.
    """
    with calling(f"CheckpointManager.save(step={step!r})"):
        plan = _plan(writer, snapshot, step, state, metrics)
        if get_rank() == WRITER_RANK:
            _take_entries(writer, snapshot, plan, rollback, restored)
        _agree(writer, plan, state)
        _write(writer, flight, snapshot, plan, state)


def _plan(
    writer: StepWriter,
    snapshot: Snapshot,
    step: int,
    state: Mapping[str, Any],
    metrics: Optional[Mapping[str, Any]],
) -> SavePlan:
    """Every rank: check the arguments and work out what goes where (not a collective)."""
    step = check_step(step)
    names = check_state(state, "save")
    checked_metrics = check_metrics(metrics)
    keep_best, metric = writer.config.keep_best, writer.config.metric
    if keep_best and metric not in checked_metrics:
        raise InvalidArgumentError(
            f"CheckpointManager.save(step={step}): keep_best={keep_best} ranks "
            f"checkpoints by metric {metric!r}, but metrics= has "
            f"{sorted(checked_metrics) or 'nothing'}; pass metrics={{{metric!r}: value}}"
        )
    folder = writer.checkpoint_path(step)
    # Sharded models and optimizers (every one with writers="all") are written by every
    # rank through torch.distributed.checkpoint (_dcp/write.py); sharded state anywhere else
    # is refused on every rank before anyone writes (rank 0 alone holds only its shards).
    dcp_kinds = _dcp.plan_entries(state, writer.config.writers, folder)
    rest = {k: v for k, v in state.items() if k not in dcp_kinds}
    check_not_sharded(rest, folder)
    batchnorm = batchnorm_checks(state)
    # The RNG states ride as one opaque blob per rank: the writer's checks need only
    # step and names, and it unpickles the states when it writes them.
    rng = pickle.dumps(rng_to_wire(capture_rng_state()))
    return SavePlan(
        step=step,
        folder=folder,
        metrics=checked_metrics,
        dcp_kinds=dcp_kinds,
        rest=rest,
        sync_first=any(fact == "sync" for fact in batchnorm.values()),
        info=SaveInfo(step, sorted(names), rng, batchnorm, dcp_kinds),
    )


def _take_entries(
    writer: StepWriter, snapshot: Snapshot, plan: SavePlan, rollback: bool, restored: Optional[int]
) -> None:
    """The writer: refuse a rollback, or take (async: copy) and check the entries it writes.

    With several ranks a failure is kept in ``plan`` and raised on every rank by the round.
    """
    async_save = writer.config.async_save
    try:
        plan.refusal = writer.rollback_refusal(plan.step, rollback, restored)
        if not plan.refusal:
            plan.entries, plan.events = snapshot.collect(plan.rest, snapshot=async_save)
        optim_state.warn_unpaired(plan.rest, plan.folder)
        for name, entry in plan.entries.items():
            _savecheck.check_tensors(entry.value, f"state[{name!r}]", plan.folder)
    except Exception as exc:
        if not is_distributed():
            raise
        plan.local_error = exc


def _agree(writer: StepWriter, plan: SavePlan, state: Mapping[str, Any]) -> None:
    """Every rank: the one round; the writer keeps every rank's RNG blob in ``plan``.

    The writer checks the ranks agree and, when nothing has to happen after the
    round (synchronous, no BatchNorm to sync, no DCP entries), commits the step
    inside it, so its verdict reaches every rank in the same round.
    """
    causes: list[BaseException] = []
    commits_now = not (writer.config.async_save or plan.sync_first or plan.dcp_kinds)

    def decide(infos: list[SaveInfo]) -> Optional[DDPStateError]:
        error = (
            check_gathered(infos, plan.step, plan.folder, plan.local_error)
            or (InvalidArgumentError(plan.refusal) if plan.refusal else None)
            or check_dcp_kinds(infos, plan.step)
            or check_batchnorm(state, plan.folder, infos)
        )
        if error is not None:
            causes.extend([plan.local_error] if plan.local_error is not None else [])
            return error
        plan.rng_blobs = [i.rng for i in infos]
        return _commit(writer, plan, causes) if commits_now else None

    try:
        gather_and_decide(
            plan.info,
            decide,
            dst=WRITER_RANK,
            name=f"CheckpointManager.save(step={plan.step})",
            timeout=writer.config.timeout,
        )
    except DDPStateError as shared:
        if causes:
            raise shared from causes[0]
        raise


def _commit(
    writer: StepWriter, plan: SavePlan, causes: list[BaseException]
) -> Optional[DDPStateError]:
    """The writer: write and commit the step; None, or the error every rank raises."""
    try:
        # Pickling makes objects per tensor, none in a cycle: with 25,000 tensors the
        # collector's passes were a fifth of a save (issue 42). Only here, on the caller's
        # thread: an async write's thread must not hold off the training loop's collector.
        with gc_paused():
            writer.commit(plan.step, plan.entries, rng_states(plan.rng_blobs), plan.metrics)
    except Exception as exc:
        causes.append(exc)
        return writer.failure_for(plan.step, plan.folder, WRITER_RANK, exc)
    return None


def _write(
    writer: StepWriter,
    flight: InFlight,
    snapshot: Snapshot,
    plan: SavePlan,
    state: Mapping[str, Any],
) -> None:
    """Every rank, after the round: what the round did not do (see the module docstring)."""
    step, folder, is_writer = plan.step, plan.folder, get_rank() == WRITER_RANK
    async_save = writer.config.async_save
    if plan.sync_first:
        # A collective of its own, so it runs only once the round has shown that the
        # ranks agree (step, entries, which models); copies and DCP take the synced values.
        sync_batchnorm(state, writer.config.timeout)
        if is_writer and (async_save or plan.dcp_kinds):
            plan.entries, plan.events = snapshot.collect(plan.rest, snapshot=async_save)
    if plan.dcp_kinds and async_save:  # written on the manager's own group
        flight.pending = Pending(step, folder, shared=True)
        _dcp.start_async_step(writer, flight, plan, state)
    elif plan.dcp_kinds:
        _dcp.save_step(writer, plan, state)
    elif async_save:
        flight.pending = Pending(step, folder)
        if is_writer:
            # The writer's thread commits the step; its error waits in `flight` for the next call.
            flight.start(
                f"ddpstate-checkpoint-writer-step-{step}",
                plan.events,
                lambda: writer.commit(step, plan.entries, rng_states(plan.rng_blobs), plan.metrics),
            )
    else:
        if plan.sync_first:  # not committed in the round: the statistics were synced after it
            causes: list[BaseException] = []
            failure = _commit(writer, plan, causes) if is_writer else None
            writer.share_outcome(step, failure, causes[0] if causes else None)
        writer.check_seen(step, folder)
