"""``CheckpointManager.restore``: choosing a step (newest that verifies), loading it, RNG states.

Rank 0 verifies the candidates newest first (with every rank's help, see
``verify_split.py``) and broadcasts its choice, unless the node-local tier
(``local_tier.py``) answers first; every rank then loads the chosen step's
entries into the live objects and restores its own RNG states. Every byte of
the step, its DCP shards included, is CRC'd before anything is loaded, so a
damaged step leaves the live state as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, MutableMapping
from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from ddpstate import _fs, checkpoint, storage
from ddpstate._calls import calling, restore_call
from ddpstate._checksum import error_text
from ddpstate._collectives import with_message
from ddpstate._gc import gc_paused
from ddpstate._io import model_state
from ddpstate._keys.match import STRICT_ADVICE, adapted_if_same
from ddpstate._manager import dcp_step as _dcp
from ddpstate._manager import optim_state
from ddpstate._manager import verify_split as _verify_split
from ddpstate._manager.entries import check_state, check_step, has_state_dict
from ddpstate._manager.local_tier import LocalTier, RestoreSource
from ddpstate._manager.writer import StepWriter
from ddpstate._manifest import MANIFEST_NAME, RNG_FILE, check_folder, parse_step
from ddpstate._warn import warn
from ddpstate.dist import (
    Timeout,
    broadcast_object,
    gather_and_decide,
    get_rank,
    get_world_size,
    is_distributed,
    share_outcome,
)
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DDPStateError,
    InvalidArgumentError,
    KeyMismatchError,
)
from ddpstate.keys import adapt_state_dict
from ddpstate.rng import derived_seed, restore_rng_state, seed_all


class Choice(NamedTuple):
    """The durable step every rank restores, its manifest and folder, as rank 0 broadcasts them.

    ``folder`` is ``step_N``, or the retired copy that holds step N (see
    ``StepFolders.retired_steps``), read in place.
    """

    step: int
    manifest: dict[str, Any]
    folder: str


def _verify(
    writer: StepWriter, folder: str, step: int, split: bool = False
) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """Check a step folder as :func:`verify_checkpoint` does; return (manifest, problems).

    With ``split`` (rank 0 of several), every rank checksums a share of the files.
    """
    opts = writer.config.storage_options
    if split:
        return _verify_split.verify(folder, step, opts, writer.config.timeout)
    check = check_folder(folder, step, opts)
    if check.manifest is None:
        return None, "; ".join(check.problems)
    return check.manifest, None


def choose(
    writer: StepWriter, step: Optional[int], split: bool = False, below: Optional[int] = None
) -> Optional[Choice]:
    """Rank 0: pick the checkpoint to restore (see :meth:`restore`).

    ``split``: the other ranks help verify (see :func:`_verify`). ``below``: only
    steps before it (a newer one failed while it loaded).
    """
    opts = writer.config.storage_options
    if step is not None:
        folder = writer.checkpoint_path(step)
        if not storage.exists(folder, storage_options=opts):
            folder = writer.retired_steps().get(step, "")
        if not folder:
            raise CheckpointNotFoundError(
                f"{writer.checkpoint_path(step)}: no checkpoint for step {step}; committed "
                f"steps in {writer.config.directory}: {sorted(writer.committed_steps())}"
            )
        manifest, problem = _verify(writer, folder, step, split)
        if manifest is None:
            raise CheckpointCorruptError(
                f"{folder}: cannot restore step {step}: {problem}. Restore another step, or "
                f"pass step=None to take the newest valid checkpoint"
            )
        _note_retired(writer, step, folder)
        return Choice(step, manifest, folder)
    if not storage.isdir(writer.config.directory, storage_options=opts):
        return None
    listed = storage.listdir(writer.config.directory, storage_options=opts, include_temp=True)
    folders = {s: writer.checkpoint_path(s) for s in map(parse_step, listed) if s is not None}
    folders.update(writer.retired_steps(listed))
    candidates = sorted((s for s in folders if below is None or s < below), reverse=True)
    skipped: list[tuple[str, str]] = []
    committed_bad = 0
    for s in candidates:
        folder = folders[s]
        if not storage.isdir(folder, storage_options=opts):
            continue
        manifest, problem = _verify(writer, folder, s, split)
        if manifest is not None:
            for bad_folder, why in skipped:
                warn(
                    f"CheckpointManager.restore: skipping {bad_folder}: {why}; restoring "
                    f"step {s} instead",
                    rank=get_rank(),
                )
            _note_retired(writer, s, folder)
            return Choice(s, manifest, folder)
        skipped.append((folder, str(problem)))
        if storage.exists(storage.join(folder, MANIFEST_NAME), storage_options=opts):
            committed_bad += 1
    if committed_bad:
        listing = "; ".join(f"{f}: {why}" for f, why in skipped)
        raise CheckpointCorruptError(
            f"CheckpointManager.restore: {writer.config.directory} has checkpoints, but none "
            f"verifies ({listing}). Move the folder away to start fresh, or repair the files"
        )
    for bad_folder, why in skipped:
        warn(
            f"CheckpointManager.restore: ignoring {bad_folder}: {why}; no checkpoint to restore",
            rank=get_rank(),
        )
    return None


def _note_retired(writer: StepWriter, step: int, folder: str) -> None:
    """Warn when step ``step`` is read from a retired copy, not from its own folder."""
    if folder != writer.checkpoint_path(step):
        warn(
            f"CheckpointManager.restore: reading step {step} from {folder}: a re-save of step "
            f"{step} was killed between its two renames, leaving no {writer.checkpoint_path(step)}"
            f"; the next save puts it back under that name (do not delete it)",
            rank=get_rank(),
        )


def latest_step(writer: StepWriter) -> Optional[int]:
    """The newest committed step, one only a retired copy holds included (see :func:`choose`)."""
    return max([*writer.committed_steps(), *writer.retired_steps()], default=None)


class _Live(NamedTuple):
    """What preparing a step learnt of each live model, kept for loading it.

    Loading changes no key, shape or dtype, so these stay true until the load.

    Attributes:
        pairs: Per model entry whose saved state is plainly its own, the
            ``(live, saved)`` tensors to copy (``model_state.plain_pairs``).
        owns: Per other model entry, its ``state_dict()`` (taken once).
    """

    pairs: dict[str, model_state.Pairs]
    owns: dict[str, Any]


def _load_ready(
    state: MutableMapping[str, Any],
    ready: dict[str, Any],
    files: dict[str, str],
    ignore_mismatched: bool,
    policy: model_state.DTypePolicy,
    live: _Live,
) -> None:
    """Load each prepared entry into its live object (plain values into ``state``).

    ``live``: what preparing learnt of each model (see :class:`_Live`).
    """
    # Parameters ignore_mismatched skipped: optimizers must not get their old
    # per-parameter state (it has the old shape), so models load first.
    skipped: set[int] = set()
    for name in sorted(ready, key=lambda n: not isinstance(state[n], nn.Module)):
        value, target, file = ready[name], state[name], files[name]
        if isinstance(target, nn.Module):
            pairs = live.pairs.get(name)
            if pairs is not None and model_state.copy_pairs(pairs):
                continue
            keys = model_state.load_fitting(
                target,
                value,
                name=f"{file} (entry {name!r})",
                strict=True,
                ignore_mismatched=ignore_mismatched,
                dtypes=policy,
                own=live.owns.get(name),
            )
            if keys:
                params = dict(target.named_parameters())
                skipped.update(id(params[k]) for k in keys if k in params)
        elif has_state_dict(target):
            if skipped and isinstance(target, torch.optim.Optimizer):
                value = without_skipped(value, target, skipped, f"{file} (entry {name!r})")
            try:
                target.load_state_dict(value)
            except DDPStateError:
                raise
            except Exception as exc:
                raise InvalidArgumentError(
                    f"{file}: restoring {name!r} into {type(target).__name__} failed "
                    f"({error_text(exc)}); was it saved from the same kind of object?"
                ) from exc
        else:
            state[name] = value


def _prepare(
    name: str,
    value: Any,
    state: Mapping[str, Any],
    file: str,
    policy: model_state.DTypePolicy,
    live: _Live,
) -> Any:
    """Entry ``name``'s loaded ``value`` made ready for its live object; refuses, never loads.

    Models get their keys adapted and dtypes checked against their ``state_dict()``,
    kept in ``live`` for the load (a model's own plain checkpoint, nothing to adapt
    or refuse, only its copy pairs); optimizers saved by
    parameter name are laid out as the live optimizer's positions (those saved
    by position, by earlier versions, stay as they are).
    """
    target = state[name]
    where = f"{file} (entry {name!r})"
    if isinstance(target, nn.Module):
        if not isinstance(value, Mapping):
            raise InvalidArgumentError(
                f"{file}: entry {name!r} holds a {type(value).__name__}, not a state "
                f"dict, so it cannot be loaded into {type(target).__name__}"
            )
        pairs = model_state.plain_pairs(target, value)
        if pairs is not None:
            live.pairs[name] = pairs
            return value
        own = live.owns[name] = target.state_dict()
        # A model's own checkpoint has exactly its keys: no key-by-key matching.
        same = adapted_if_same(value, own)
        try:
            adapted = adapt_state_dict(value, target) if same is None else same
        except KeyMismatchError as exc:
            # restore's strict= is about the entries of `state`; a model's keys load whole.
            raise with_message(
                exc,
                str(exc).replace(
                    STRICT_ADVICE,
                    f"to start a changed model (a new layer) from these weights, load them with "
                    f"ddpstate.load_model_state(model, {file!r}, strict=False): restore loads "
                    f"a model's keys strictly, its strict=False relaxes only the entries",
                ),
            ) from exc
        model_state.check_dtypes(
            adapted, own, name=where, target=type(target).__name__, policy=policy
        )
        return adapted
    if not isinstance(target, torch.optim.Optimizer):
        return value
    model: Optional[nn.Module] = None
    if optim_state.is_by_name(value):
        owner = optim_state.owner(target, state, where)
        if owner is None:
            raise InvalidArgumentError(
                f"{where}: the optimizer state was saved by parameter name, but no model "
                f"entry of restore's state holds the optimizer's parameters; pass its model "
                f"in the same state (e.g. {{'model': model, {name!r}: optimizer}})"
            )
        model = state[owner]
        value = optim_state.to_positional(value, target, state[owner], where)
    optim_state.check_dtypes(value, target, model, policy=policy, where=where)
    return value


def _rng_states(rng: Any, manifest: dict[str, Any]) -> list[Any]:
    """Every saving rank's RNG states from a step's ``_rng.pt``; refused when there are none."""
    states = rng.get("ranks") if isinstance(rng, dict) else None
    if not isinstance(states, list) or not states:
        raise CheckpointCorruptError(f"{RNG_FILE} of step {manifest.get('step')} has no RNG states")
    return states


def restore_rng(rng: Any, manifest: dict[str, Any]) -> None:
    """Restore this rank's RNG states from a step's ``_rng.pt`` (see ``restore``'s docstring)."""
    states = _rng_states(rng, manifest)
    saved_world, rank, world = len(states), get_rank(), get_world_size()
    if saved_world == world:
        restore_rng_state(states[rank])
        return
    if rank == 0:
        warn(
            f"CheckpointManager.restore: step {manifest.get('step')} was saved by "
            f"{saved_world} ranks and is restored by {world}: ranks below {saved_world} "
            f"restore their own saved RNG states; a rank r >= {saved_world} restores rank "
            f"r % {saved_world}'s and re-seeds every generator from it and r",
            rank=get_rank(),
        )
    base = states[rank % saved_world]
    restore_rng_state(base)
    if rank >= saved_world:
        seed_all(derived_seed(base, rank))


def share_restore_outcome(
    step: Optional[int], error: Optional[Exception], timeout: Timeout
) -> None:
    """Raise ``error`` (this rank's, or another's) on every rank, or return on every rank."""
    if error is None:
        shared: Optional[DDPStateError] = None
    else:
        text = f"restoring step {step} failed on rank {get_rank()}: {error}"
        shared = (
            with_message(error, text)
            if isinstance(error, DDPStateError)
            else DDPStateError(f"{text} ({type(error).__name__})")
        )
    try:
        share_outcome(shared, name=f"CheckpointManager.restore(step={step})", timeout=timeout)
    except DDPStateError as raised:
        if error is not None:
            raise raised from error
        raise


def without_skipped(value: Any, optimizer: Any, skipped: set[int], where: str) -> Any:
    """``value`` (an optimizer state dict) less the state of the ``skipped`` parameters.

    Saved optimizer state is keyed by parameter position in ``param_groups``, so
    positions are matched against the live optimizer's parameters; those start
    afresh (as new parameters do) and a warning names how many.
    """
    if not isinstance(value, Mapping) or not isinstance(value.get("state"), Mapping):
        return value
    positions = {i for i, p in enumerate(optim_state.params(optimizer)) if id(p) in skipped}
    dropped = [k for k in value["state"] if k in positions]
    if not dropped:
        return value
    warn(
        f"{where}: dropped the saved optimizer state of {len(dropped)} parameter(s) skipped "
        f"by ignore_mismatched=True (they start with fresh optimizer state)",
        rank=get_rank(),
    )
    kept = dict(value)
    kept["state"] = {k: v for k, v in value["state"].items() if k not in positions}
    return kept


def _check_none_elsewhere(writer: StepWriter, timeout: Timeout) -> None:
    """Rank 0 found nothing to restore: one round in which every rank confirms it sees none.

    A rank that sees committed steps where rank 0 sees none is on storage the
    ranks do not share (a node-local disk); starting fresh there would silently
    drop the run it could resume, so every rank is told which ranks see what.
    """

    def decide(latest: list[Optional[int]]) -> Optional[CheckpointNotFoundError]:
        seeing = [(r, s) for r, s in enumerate(latest) if s is not None]
        if not seeing:
            return None
        listed = ", ".join(f"rank {r} (step {s})" for r, s in seeing[:8])
        more = " ..." if len(seeing) > 8 else ""
        return CheckpointNotFoundError(
            f"CheckpointManager.restore: {listed}{more} see committed checkpoints in "
            f"{writer.config.directory} where rank 0 sees none: the folder is not shared storage "
            f"between the ranks; nothing is damaged; put the checkpoint folder on storage "
            f"every rank sees (a shared filesystem or an fsspec URL)"
        )

    gather_and_decide(
        latest_step(writer),
        decide,
        name="CheckpointManager.restore (visibility)",
        timeout=timeout,
    )


def _choose_durable(
    writer: StepWriter, step: Optional[int], below: Optional[int] = None
) -> Optional[Choice]:
    """Every rank: rank 0 chooses the durable step (the others help verify) and tells all."""
    timeout = writer.config.timeout
    choice: Optional[Choice] = None
    choose_error: Optional[Exception] = None
    # Several ranks: each checksums a share of the candidate's files (_manager.verify_split).
    split = is_distributed() and get_world_size() > 1
    if get_rank() == 0:
        try:
            choice = choose(writer, step, split, below)
        except Exception as exc:
            choose_error = _untouched(exc)  # chosen before anything loads
            if not is_distributed():
                if choose_error is exc:
                    raise
                raise choose_error from exc
        finally:
            if split:
                _verify_split.finish(timeout)
    elif split:
        _verify_split.follow(writer.config.storage_options, timeout)
    share_outcome(choose_error, name="CheckpointManager.restore", timeout=timeout)
    choice = broadcast_object(choice, src_rank=0, timeout=timeout)
    if choice is None and split and not _fs.is_remote(writer.config.directory):
        _check_none_elsewhere(writer, timeout)
    return choice


def _check_entries(names: list[str], saved_entries: Mapping[str, Any], folder: str) -> None:
    """``restore(strict=True)``: the live state and the checkpoint hold the same entries."""
    missing = [n for n in names if n not in saved_entries]
    unexpected = [n for n in saved_entries if n not in names]
    if missing or unexpected:
        raise KeyMismatchError(
            f"CheckpointManager.restore: {folder} has entries {sorted(saved_entries)}, but "
            f"state has {sorted(names)} (missing from the checkpoint: {missing}; not in "
            f"state: {unexpected}); pass strict=False to restore the common entries",
            missing=missing,
            unexpected=unexpected,
        )


def restore(
    writer: StepWriter,
    local: Optional[LocalTier],
    state: MutableMapping[str, Any],
    *,
    step: Optional[int],
    map_location: Any,
    strict: bool,
    ignore_mismatched: bool,
    allow_dtype_change: bool,
) -> RestoreSource:
    """Every rank: ``CheckpointManager.restore`` once the async write is done (see its docstring).

    Returns where the state came from; its ``step`` is None when there is no
    checkpoint (``state`` untouched).
    """
    with calling(restore_call(step)):
        names = check_state(state, "restore")
        if step is not None:
            step = check_step(step)
        # The node-local tier answers first when it holds a step at least as new as the durable
        # (a collective: every rank gets the same answer).
        latest = functools.partial(latest_step, writer)
        found = local.choose(latest) if local is not None and step is None else None
        failed: Optional[CheckpointCorruptError] = None
        below: Optional[int] = None
        while True:
            if found is None:
                choice = _choose_durable(writer, step, below)
                if choice is None:
                    if failed is not None:  # nothing older verifies: the state is untouched
                        raise failed
                    return RestoreSource(None, "none")
                source = RestoreSource(choice.step, "durable", choice.folder)
                manifest = choice.manifest
            else:
                source, manifest = found
            # Unpickling and loading make objects per tensor, none in a cycle: with
            # 25,000 tensors the collector's passes were a fifth of a restore (issue 42).
            try:
                with gc_paused():
                    staged = _stage_step(
                        writer,
                        state,
                        source,
                        manifest,
                        names=names,
                        strict=strict,
                        map_location=map_location,
                        ignore_mismatched=ignore_mismatched,
                        allow_dtype_change=allow_dtype_change,
                        mapped=found is not None,
                    )
            except CheckpointCorruptError as exc:
                # A file refused as it was read (nothing loaded yet), on every rank
                # alike: the next older step that verifies, as if this one had failed its check.
                if step is not None or found is not None:
                    raise
                warn(
                    f"CheckpointManager.restore: skipping {source.path}: {exc}; trying the "
                    f"steps before {source.step}",
                    rank=get_rank(),
                )
                failed, below = exc, source.step
                continue
            with gc_paused():
                _apply(state, source, manifest, staged, writer.config.timeout)
            return source


#: Said by a failed restore when nothing had been loaded into the live objects yet.
UNTOUCHED = "the live state is as it was before restore (nothing was loaded into it)"


def _untouched(error: Exception) -> Exception:
    """``error`` saying the live state is as it was (a ddpstate error; others get a note)."""
    if isinstance(error, DDPStateError):
        return with_message(error, f"{error}; {UNTOUCHED}")
    note = getattr(error, "add_note", None)
    if note is not None:
        note(UNTOUCHED)
    return error


def _stage_step(
    writer: StepWriter,
    state: MutableMapping[str, Any],
    source: RestoreSource,
    manifest: dict[str, Any],
    *,
    names: list[str],
    strict: bool,
    map_location: Any,
    ignore_mismatched: bool,
    allow_dtype_change: bool,
    mapped: bool,
) -> _Staged:
    """Every rank: restore's first phase; any rank's failure is raised on all, state untouched.

    Two phases, so damage found anywhere leaves every rank's live state as it was:
    the step's bytes were all CRC'd when it was chosen (its DCP shards with them,
    split across the ranks); here every rank reads its file entries into memory,
    checks its DCP entries against the step's metadata (keys, shapes) and refuses
    what cannot load (a dtype change...), and the ranks agree it succeeded. Only
    then does :func:`_apply` load into the live objects.
    ``mapped``: the local tier is node-local memory, so its files are mapped, not copied.
    """
    # On a URL, a step saved over another lives in the version folder its manifest names.
    opts = writer.config.storage_options
    folder = storage.committed_folder(str(source.path), storage_options=opts)
    error: Optional[Exception] = None
    staged: Optional[_Staged] = None
    try:
        if strict:
            _check_entries(names, manifest["entries"], folder)
        policy: model_state.DTypePolicy = "allow" if allow_dtype_change else "refuse"
        staged = _stage(
            writer, state, folder, manifest, map_location, ignore_mismatched, policy, mapped
        )
    except Exception as exc:
        error = _untouched(exc)
        if not is_distributed():
            if error is exc:
                raise
            raise error from exc
    share_restore_outcome(source.step, error, writer.config.timeout)
    assert staged is not None  # every rank staged (an error was raised on all above)
    return staged


#: Said by a restore that failed while it loaded into the live objects.
PARTLY = "the live state may be partly loaded from this step; call restore again"


def _apply(
    state: MutableMapping[str, Any],
    source: RestoreSource,
    manifest: dict[str, Any],
    staged: _Staged,
    timeout: Timeout,
) -> None:
    """Every rank: restore's second phase, loading ``staged`` (and the DCP shards) into ``state``.

    What fails here fails after every check passed (an I/O error midway through
    the shards): it is raised on every rank saying the state may be partly
    loaded, never that it is untouched, and no older step is tried instead.
    """
    error: Optional[Exception] = None
    try:
        if staged.dcp is not None:
            _dcp.load_entries(state, staged.dcp_kinds, staged.dcp)
        _load_ready(
            state, staged.ready, staged.files, staged.ignore_mismatched, staged.policy, staged.live
        )
        restore_rng(staged.rng, manifest)
    except Exception as exc:
        error = with_message(exc, f"{exc}; {PARTLY}") if isinstance(exc, DDPStateError) else exc
        if not is_distributed():
            if error is exc:
                raise
            raise error from exc
    share_restore_outcome(source.step, error, timeout)


class _Staged(NamedTuple):
    """A step checked on this rank (its file entries read), not yet loaded into the live objects."""

    dcp_kinds: dict[str, str]
    dcp: Optional[_dcp.PlannedLoad]
    ready: dict[str, Any]
    files: dict[str, str]
    rng: Any
    policy: model_state.DTypePolicy
    ignore_mismatched: bool
    live: _Live


def _stage(
    writer: StepWriter,
    state: MutableMapping[str, Any],
    folder: str,
    manifest: dict[str, Any],
    map_location: Any,
    ignore_mismatched: bool,
    policy: model_state.DTypePolicy,
    mapped: bool,
) -> _Staged:
    """Read every entry and the RNG states of the step in ``folder``; refuse, never load."""
    saved_entries, opts = manifest["entries"], writer.config.storage_options
    # DCP entries: checked against the step's metadata here, read into the live objects later.
    dcp_kinds = {
        n: saved_entries[n]["kind"]
        for n in state
        if n in saved_entries and saved_entries[n].get("kind") in _dcp.KINDS
    }
    dcp = _dcp.plan_load(state, dcp_kinds, folder, ignore_mismatched, opts) if dcp_kinds else None
    files = {
        name: storage.join(folder, saved_entries[name]["file"])
        for name in state
        if name in saved_entries and name not in dcp_kinds
    }
    # No mmap on the durable tier: a later rotation deletes these files, and on
    # a shared filesystem another node's mapped pages could then vanish (SIGBUS).
    # A local file unlinked on this node keeps its pages while mapped.
    load = functools.partial(checkpoint.load, barrier=False, storage_options=opts)
    safe = writer.config.safe_globals
    loaded = {
        name: load(path, map_location=map_location, mmap=mapped, safe_globals=safe)
        for name, path in files.items()
    }
    rng_file = storage.join(folder, str(manifest.get("rng_file", RNG_FILE)))
    rng = load(rng_file, map_location="cpu", mmap=False)
    _rng_states(rng, manifest)
    # Model keys adapted and dtypes checked; optimizer state mapped by name onto the
    # live layout (_manager/optim_state.py).
    live = _Live({}, {})
    ready = {
        name: _prepare(name, value, state, files[name], policy, live)
        for name, value in loaded.items()
    }
    return _Staged(dcp_kinds, dcp, ready, files, rng, policy, ignore_mismatched, live)
