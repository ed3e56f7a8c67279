"""``CheckpointManager.save``: one agreement round, then the write (sync, async or sharded).

Every rank sends its step, entry names, RNG states, BatchNorm facts and DCP
entries to the writer in one ``gather_and_decide`` round; the writer checks
the ranks agree (``agreement.py``), writes and commits the step
(``writer.py``, synchronous mode) and every rank gets its verdict. Unsynced
BatchNorm statistics are averaged after the round, sharded entries go
through ``_dcp/write.py``, and async saves snapshot the state
(``snapshot.py``) and write in the background.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any, Optional

from ddpstate._calls import calling
from ddpstate._io import savecheck as _savecheck
from ddpstate._manager import dcp_step as _dcp
from ddpstate._manager import optim_state
from ddpstate._manager.agreement import (
    batchnorm_checks,
    check_batchnorm,
    check_gathered,
    sync_batchnorm,
)
from ddpstate._manager.entries import (
    Entry,
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
        step = check_step(step)
        names = check_state(state, "save")
        checked_metrics = check_metrics(metrics)
        if writer.keep_best and writer.metric not in checked_metrics:
            raise InvalidArgumentError(
                f"CheckpointManager.save(step={step}): keep_best={writer.keep_best} ranks "
                f"checkpoints by metric {writer.metric!r}, but metrics= has "
                f"{sorted(checked_metrics) or 'nothing'}; pass metrics={{{writer.metric!r}: value}}"
            )
        async_save, writers = writer.async_save, writer.writers
        folder = writer.checkpoint_path(step)
        # Sharded models and optimizers (every one with writers="all") are written by every
        # rank through torch.distributed.checkpoint (_dcp/write.py); sharded state anywhere else
        # is refused on every rank before anyone writes (rank 0 alone holds only its shards).
        dcp_kinds = _dcp.plan_entries(state, writers, folder)
        rest = {k: v for k, v in state.items() if k not in dcp_kinds}
        check_not_sharded(rest, folder)
        batchnorm = batchnorm_checks(state)
        is_writer = get_rank() == WRITER_RANK
        entries: dict[str, Entry] = {}
        events: list[Any] = []
        local_error: Optional[Exception] = None
        refusal = ""
        if is_writer:
            try:
                refusal = writer.rollback_refusal(step, rollback, restored)
                if not refusal:
                    entries, events = snapshot.collect(rest, snapshot=async_save)
                optim_state.warn_unpaired(rest, folder)
                for name, entry in entries.items():
                    _savecheck.check_tensors(entry.value, f"state[{name!r}]", folder)
            except Exception as exc:
                if not is_distributed():
                    raise
                local_error = exc
        # One round: per-rank metadata and RNG states go to the writer only; it checks
        # that the ranks agree, writes (synchronous mode), and its verdict reaches
        # every rank.
        # The RNG states ride as one opaque blob per rank: the writer's check needs only
        # step and names, and unpickles the states when it writes them.
        rng = pickle.dumps(rng_to_wire(capture_rng_state()))
        info = {
            "step": step,
            "names": sorted(names),
            "rng": rng,
            "batchnorm": batchnorm,
            "dcp": dcp_kinds,
        }
        # Models wrap_ddp prepared with unsynced BatchNorm are averaged before the write.
        # That is a collective of its own, so it runs only after the round has shown
        # that the ranks agree (step, entries, which models), and the write follows it.
        sync_first = any(fact == "sync" for fact in batchnorm.values())
        rng_blobs: list[bytes] = []
        causes: list[BaseException] = []

        def decide(infos: list[Any]) -> Optional[DDPStateError]:
            error = check_gathered(infos, step, folder, local_error)
            if error is None and refusal:
                error = InvalidArgumentError(refusal)
            if error is None:
                error = _dcp.kinds_disagree(infos, step)
            if error is None:
                error = check_batchnorm(state, folder, infos)
            if error is not None:
                causes.extend([local_error] if local_error is not None else [])
                return error
            rng_blobs.extend(i["rng"] for i in infos)
            if async_save or sync_first or dcp_kinds:
                return None
            try:
                writer.commit(step, entries, rng_states(rng_blobs), checked_metrics)
            except Exception as exc:
                causes.append(exc)
                return writer.failure_for(step, folder, WRITER_RANK, exc)
            return None

        try:
            gather_and_decide(
                info,
                decide,
                dst=WRITER_RANK,
                name=f"CheckpointManager.save(step={step})",
                timeout=writer.timeout,
            )
        except DDPStateError as shared:
            if causes:
                raise shared from causes[0]
            raise
        if dcp_kinds:
            if sync_first:
                sync_batchnorm(state, writer.timeout)
                if is_writer:  # the synced statistics
                    entries, events = snapshot.collect(rest, snapshot=async_save)
            if async_save:  # written on the manager's own group in the background
                flight.pending = Pending(step, folder, shared=True)
                flight.thread = _dcp.start_async_step(
                    writer,
                    flight,
                    step,
                    state,
                    dcp_kinds,
                    entries,
                    events,
                    rng_blobs,
                    checked_metrics,
                )
                return
            _dcp.save_step(writer, step, state, dcp_kinds, entries, rng_blobs, checked_metrics)
            return
        if sync_first:
            sync_batchnorm(state, writer.timeout)
            if is_writer and async_save:
                entries, events = snapshot.collect(state, snapshot=True)  # the synced statistics
            if not async_save:
                failure: Optional[DDPStateError] = None
                cause: Optional[BaseException] = None
                if is_writer:
                    try:
                        writer.commit(step, entries, rng_states(rng_blobs), checked_metrics)
                    except Exception as exc:
                        cause = exc
                        failure = writer.failure_for(step, folder, WRITER_RANK, exc)
                writer.share_outcome(step, folder, failure, cause)
                writer.check_seen(step, folder)
                return
        if async_save:
            flight.pending = Pending(step, folder)
            if is_writer:
                writer.start_async(flight, step, entries, rng_blobs, checked_metrics, events)
            return
        writer.check_seen(step, folder)
