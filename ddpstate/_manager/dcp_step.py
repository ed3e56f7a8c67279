"""The manager's sharded step saves and restores: which entries go through DCP, and their commit.

A :class:`~ddpstate.CheckpointManager` step puts its DCP entries (sharded models
and optimizers, or every model and optimizer with ``writers="all"``) in one
``torch.distributed.checkpoint`` folder below ``dcp/`` of the step folder, written
by every rank (:func:`ddpstate._dcp.write.write_shards`) into the folder rank 0
staged (``StepWriter.prepare_folder``); rank 0 then commits the step through the
ordinary ``StepWriter.commit`` (manifest last). Async saves do the same in a
background thread on the manager's own gloo group (:func:`async_group`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from datetime import timedelta
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from ddpstate import storage
from ddpstate._checksum import error_text
from ddpstate._dcp import write as _dcp_write
from ddpstate._io import savecheck as _savecheck
from ddpstate._io import torch_io as _torch_io
from ddpstate._manager import optim_state
from ddpstate._manager.agreement import SavePlan
from ddpstate._manager.entries import rng_states
from ddpstate._manager.writer import InFlight, StepWriter
from ddpstate._manifest import DCP_SUBDIR, METADATA_NAME
from ddpstate.dist import (
    broadcast_object,
    gather_and_decide,
    get_rank,
    is_distributed,
    resolve_timeout,
)
from ddpstate.errors import (
    CheckpointWriteError,
    DDPStateError,
    InvalidArgumentError,
    ShardedStateError,
)
from ddpstate.storage import StagedFolder

#: Manifest entry kinds of entries stored in the step's DCP checkpoint.
KIND_MODULE = "dcp_module"
KIND_OPTIMIZER = "dcp_optimizer"
KINDS = (KIND_MODULE, KIND_OPTIMIZER)


def _module_is_sharded(module: nn.Module) -> bool:
    sharded = _savecheck.sharded_types()
    return bool(sharded) and any(
        isinstance(t, sharded) for t in [*module.parameters(), *module.buffers()]
    )


def _owner(optimizer: torch.optim.Optimizer, models: Mapping[str, nn.Module]) -> Optional[str]:
    """The entry name of the model whose parameters ``optimizer`` updates."""
    wanted = {id(p) for p in optim_state.params(optimizer)}
    for name, model in models.items():
        if wanted & {id(p) for p in model.parameters()}:
            return name
    return None


def _models(state: Mapping[str, Any]) -> dict[str, nn.Module]:
    return {n: o for n, o in state.items() if isinstance(o, nn.Module)}


def plan_entries(state: Mapping[str, Any], writers: str, where: str) -> dict[str, str]:
    """The entries of a CheckpointManager ``state`` that go through DCP, name -> kind.

    Sharded models (FSDP2/tensor parallel) and their optimizers always do; with
    ``writers="all"`` every model and optimizer does (replicated DDP state split
    across the ranks). Everything else stays with the rank-0 writer.

    Raises:
        InvalidArgumentError: A DCP optimizer's model is not in ``state``.
    """
    models = _models(state)
    chosen = {
        n: KIND_MODULE for n, m in models.items() if writers == "all" or _module_is_sharded(m)
    }
    for name, obj in state.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        owner = _owner(obj, models)
        sharded = _dcp_write.holds_sharded(optim_state.params(obj))
        if owner is None:
            if sharded or writers == "all":
                raise (ShardedStateError if sharded else InvalidArgumentError)(
                    f"CheckpointManager: state[{name!r}] is an optimizer over "
                    f"{'sharded (DTensor) ' if sharded else ''}parameters, saved with "
                    f"torch.distributed.checkpoint, which keys its state by the parameters' "
                    f"names in their model; no model in state owns them. Put the model in the "
                    f"same state dict (e.g. {{'model': model, {name!r}: optimizer}}) ({where})"
                )
            continue
        if owner in chosen:
            chosen[name] = KIND_OPTIMIZER
    return chosen


# ------------------------------------------------------------------------- state dicts


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Sharded stays sharded (each rank writes its part); plain keys (no module./_orig_mod.).
    return StateDictOptions(full_state_dict=False, cpu_offload=False)


def state_dicts(state: Mapping[str, Any], kinds: Mapping[str, str]) -> dict[str, Any]:
    """Every DCP entry's state dict (keys as ``get_state_dict`` names them), on this rank."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    models = _models(state)
    out: dict[str, Any] = {}
    for name, kind in kinds.items():
        if kind == KIND_MODULE:
            out[name] = get_model_state_dict(state[name], options=_options())
        else:
            owner = _owner(state[name], models)
            out[name] = get_optimizer_state_dict(
                models[str(owner)], state[name], options=_options()
            )
    return out


class PlannedLoad(NamedTuple):
    """A step's DCP entries checked by :func:`plan_load`, for :func:`load_entries` to read."""

    folder: str
    state_dicts: dict[str, Any]
    reader: Any
    planner: Any


def plan_load(
    state: Mapping[str, Any],
    kinds: Mapping[str, str],
    step_folder: str,
    ignore_mismatched: bool,
    storage_options: Optional[dict[str, Any]] = None,
) -> PlannedLoad:
    """Refuse a step's DCP entries ``kinds`` that cannot load into the live state; read no shard.

    Restore's first phase (nothing loaded yet): the live objects are of the
    saved kinds, and DCP's own load planner, run on this rank against the
    step's ``.metadata``, finds every live key saved with the live shape. Its
    plan is kept for :func:`load_entries`, which is left reading bytes restore
    already checked.

    Raises:
        InvalidArgumentError: ``ignore_mismatched`` was asked for (DCP entries must
            fit), or a live entry is not the kind of object that was saved.
        CheckpointCorruptError: The metadata cannot be read, or a live key or
            shape is not in it (DCP's planner names the key).
    """
    where = storage.join(step_folder, DCP_SUBDIR)
    if ignore_mismatched:
        raise InvalidArgumentError(
            f"{where}: ignore_mismatched=True is not available for entries saved with "
            f"torch.distributed.checkpoint ({sorted(kinds)}); restore them into models of the "
            f"saved shapes"
        )
    for name, kind in kinds.items():
        want = nn.Module if kind == KIND_MODULE else torch.optim.Optimizer
        if not isinstance(state[name], want):
            raise InvalidArgumentError(
                f"{where}: entry {name!r} was saved from a {want.__name__} (sharded, with "
                f"torch.distributed.checkpoint), but state[{name!r}] is a "
                f"{type(state[name]).__name__}; pass the live {want.__name__}"
            )
        if kind == KIND_OPTIMIZER and _owner(state[name], _models(state)) is None:
            raise InvalidArgumentError(
                f"{where}: entry {name!r} is an optimizer saved with "
                f"torch.distributed.checkpoint, keyed by its model's parameter names; put its "
                f"model in the state passed to restore"
            )
    # With cpu_offload=False the state dicts hold the live tensors: DCP reads into them,
    # as a plain dcp.load does, with no copy of the step in host memory.
    dicts = state_dicts(state, kinds)
    # Torch's own reader, not VerifiedReader: restore's verify pass CRC'd every byte of the
    # step a moment ago, and committed files are never rewritten in place (a re-saved step
    # is staged beside them and swapped in whole), so a second check would catch only
    # another job writing into the same directory at the same moment, which is not
    # supported; a file it deletes fails the read, which restore reports as partly loaded.
    from ddpstate._io import dcp_items  # imports DCP (seconds): restores with DCP entries only

    reader = dcp_items.plain_reader(where, storage_options)
    planner = dcp_items.PlanOnce()
    with _torch_io.dcp_read_errors(where, advice="restore another step"):
        planner.set_up_planner(dicts, reader.read_metadata(), is_coordinator=False)
        planner.create_local_plan()  # raises on a key or shape the step lacks
    return PlannedLoad(where, dicts, reader, planner)


def load_entries(
    state: MutableMapping[str, Any], kinds: Mapping[str, str], planned: PlannedLoad
) -> None:
    """Read a step's DCP entries ``kinds`` straight into the live models and optimizers.

    A collective where a process group exists (DCP's reader): the live objects'
    own layout (sharded or not, any world size) decided what each rank reads.
    Restore's second phase: every byte was CRC'd and :func:`plan_load` passed
    on every rank first, so what can fail here is I/O, midway, with the live
    objects partly loaded (restore says so).

    Raises:
        CheckpointCorruptError: A shard could not be read.
    """
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load

    loaded = planned.state_dicts
    with _torch_io.dcp_read_errors(planned.folder, advice="restore another step"):
        load(loaded, storage_reader=planned.reader, planner=planned.planner)
    models = _models(state)
    for name, kind in kinds.items():
        if kind == KIND_MODULE:
            set_model_state_dict(state[name], loaded[name], options=_options())
        else:
            owner = models[str(_owner(state[name], models))]
            set_optimizer_state_dict(owner, state[name], loaded[name], options=_options())


# ------------------------------------------------------------------------- CheckpointManager


def _prepare(writer: StepWriter, plan: SavePlan, rank: int) -> tuple[str, Optional[StagedFolder]]:
    """Rank 0 stages the step's folder and tells every rank (a collective); raised on all.

    Returns:
        The folder every rank writes into, and on rank 0 the staged folder it commits.
    """
    staged: Optional[StagedFolder] = None
    failure = ""
    if rank == 0:
        try:
            staged = writer.prepare_folder(plan.step)
        except Exception as exc:
            failure = error_text(exc)
    path = None if staged is None else staged.path
    path, failure = broadcast_object((path, failure), src_rank=0, timeout=writer.config.timeout)
    if path is None:
        raise writer.write_failure(plan.step, plan.folder, [(0, failure)])
    return str(path), staged


def save_step(writer: StepWriter, plan: SavePlan, state: Mapping[str, Any]) -> None:
    """Write ``plan``'s DCP entries with every rank into ``<step folder>/dcp/``, then commit.

    A collective, after ``CheckpointManager.save``'s first round has checked the
    ranks agree. Rank 0 prepares the folder and tells every rank; every rank
    writes and checksums its part; rank 0 gathers the outcome and the file
    list, writes the rank-0 entries and the manifest (last), and every rank
    raises the same error if any rank failed.
    """
    rank = get_rank() if is_distributed() else 0
    name = f"CheckpointManager.save(step={plan.step})"
    folder, staged = _prepare(writer, plan, rank)
    info: dict[str, Any] = {}
    cause: Optional[BaseException] = None
    try:
        info["files"] = _dcp_write.write_shards(
            state_dicts(state, plan.dcp_kinds),
            storage.join(folder, DCP_SUBDIR),
            storage_options=writer.storage_options,
        )
    except Exception as exc:
        cause = exc
        info["error"] = _dcp_write.failure_text(exc)
    causes: list[BaseException] = []

    def decide(infos: list[Any]) -> Optional[DDPStateError]:
        assert staged is not None  # decide runs on rank 0, which staged the folder
        return _commit(writer, plan, staged, infos, causes)

    try:
        gather_and_decide(info, decide, dst=0, name=name, timeout=writer.config.timeout)
    except DDPStateError as shared:
        chained = cause or (causes[0] if causes else None)
        if chained is not None:
            raise shared from chained
        raise


def _commit(
    writer: StepWriter,
    plan: SavePlan,
    staged: StagedFolder,
    infos: list[Any],
    causes: list[BaseException],
) -> Optional[DDPStateError]:
    """Rank 0: commit the step every rank wrote its shards for, or return why it failed."""
    step, target = plan.step, plan.folder
    files, failures = _dcp_write.merge_files(infos, DCP_SUBDIR + "/")
    if failures:
        staged.discard(CheckpointWriteError(failures[0][1]))
        return writer.write_failure(step, target, failures)
    written = {
        n: {"file": f"{DCP_SUBDIR}/{METADATA_NAME}", "kind": k} for n, k in plan.dcp_kinds.items()
    }
    try:
        rng = rng_states(plan.rng_blobs)
        writer.commit(
            step, plan.entries, rng, plan.metrics, prepared=staged, written=(files, written)
        )
    except Exception as exc:
        causes.append(exc)
        return writer.write_failure(step, target, [(0, error_text(exc))])
    return None


# ------------------------------------------------------------------------- async saves


def snapshot(state_dict: Any) -> Any:
    """A CPU copy of ``state_dict`` taken now (``DTensor``s stay ``DTensor``s, local shards copied).

    An async save writes the copy in the background while training changes the live tensors.
    """
    if isinstance(state_dict, torch.Tensor):
        # A DTensor's to() copies its local shard and keeps its mesh and placements.
        return state_dict.detach().to("cpu", copy=True)
    if isinstance(state_dict, Mapping):
        return {k: snapshot(v) for k, v in state_dict.items()}
    if isinstance(state_dict, list) or type(state_dict) is tuple:  # (namedtuples: deepcopy)
        return type(state_dict)(snapshot(v) for v in state_dict)
    return copy.deepcopy(state_dict)


def async_group(flight: InFlight, timeout: Any) -> Any:
    """The manager's own gloo group for background DCP writes; created on first use.

    Collective (``new_group``): every rank calls it from the same ``save``. The
    background thread runs DCP's collectives on this group, never on the
    training's, whose collectives the main thread goes on issuing meanwhile.
    None when no process group is initialised (DCP then needs none).
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    if flight.dcp_group is None:
        seconds = resolve_timeout(timeout)
        flight.dcp_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
    return flight.dcp_group


def release_group(flight: InFlight) -> None:
    """Destroy the manager's background-write group (at ``close``)."""
    group = flight.dcp_group
    flight.dcp_group = None
    if group is not None and dist.is_initialized():
        dist.destroy_process_group(group)


def start_async_step(
    writer: StepWriter, flight: InFlight, plan: SavePlan, state: Mapping[str, Any]
) -> None:
    """Snapshot the DCP entries, then write and commit the step in a background thread.

    Called by every rank from ``CheckpointManager.save`` (a collective: rank 0
    prepares the folder and tells every rank, and the group is created on the
    first call). The thread writes this rank's shards with DCP on the manager's
    own gloo group, gathers every rank's outcome to rank 0, which commits the
    step (manifest last) as :func:`save_step` does, and receives rank 0's
    verdict; a failure is left in ``flight.error`` on every rank, for the next
    ``save``/``wait``/``restore``/``close`` to raise.
    """
    rank, step = (get_rank() if is_distributed() else 0), plan.step
    folder, staged = _prepare(writer, plan, rank)
    group = async_group(flight, writer.config.timeout)
    copied = snapshot(state_dicts(state, plan.dcp_kinds))  # before returning: training goes on

    def run() -> None:
        info: dict[str, Any] = {}
        try:
            for event in plan.events:
                event.synchronize()  # the rank-0 entries' CUDA copies
            where = storage.join(folder, DCP_SUBDIR)
            info["files"] = _dcp_write.write_shards(copied, where, group, writer.storage_options)
        except Exception as exc:
            info["error"] = _dcp_write.failure_text(exc)
        if group is None:
            infos: Optional[list[Any]] = [info]
        else:
            infos = [None] * dist.get_world_size(group) if rank == 0 else None
            dist.gather_object(info, infos, dst=0, group=group)
        causes: list[BaseException] = []
        verdict = None
        if rank == 0:
            assert infos is not None and staged is not None
            verdict = _commit(writer, plan, staged, infos, causes)
            if verdict is not None and causes:
                verdict.__cause__ = causes[0]
        text = [None if verdict is None else str(verdict)]
        if group is not None:
            dist.broadcast_object_list(text, src=0, group=group)
        if verdict is None and text[0] is not None:
            verdict = CheckpointWriteError(text[0])
        flight.error = verdict

    def guarded() -> None:
        # KeyboardInterrupt, SystemExit: left in flight.error as they are.
        try:
            run()
        except Exception as exc:  # the group broke (a rank died): raised at the next call
            raise writer.write_failure(step, plan.folder, [(rank, error_text(exc))]) from exc

    flight.start(f"ddpstate-dcp-writer-step-{step}", [], guarded)
