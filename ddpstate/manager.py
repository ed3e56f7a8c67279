"""Training-state checkpoints over time: rotation, verified auto-resume, async saves, preemption.

On disk, a :class:`CheckpointManager` folder looks like this:

.. code-block:: text

    <directory>/
        latest                      # "step_0000001200\\n", replaced atomically after each commit
        step_0000001100/
        step_0000001200/
            model.pt                # one file per entry of `state` (`.safetensors` for models
            optimizer.pt            #   with format="safetensors")
            _rng.pt                 # every rank's RNG states, and the world size
            dcp/                    # sharded models/optimizers (or all, writers="all"):
                .metadata           #   one torch.distributed.checkpoint, every rank's
                __0_0.distcp ...    #   files listed in the manifest (see _dcp/write.py)
            manifest.json           # written last: the commit marker

A step folder without ``manifest.json`` is an unfinished save and never counts
as a checkpoint; the next save deletes it, along with any temporary file left
by a killed writer. The manifest records each file's size and CRC-32, the step,
the metrics, the world size, the ddpstate and torch versions and the time, and
its own CRC-32; :func:`verify_checkpoint` (``ddpstate verify``) checks all of it.

Rotation runs only after the new checkpoint is committed: it keeps the
``keep_last`` highest steps plus the best ones by a metric
(``best=KeepBest(count, metric)``), and deletes the rest. Saving a step that
already exists replaces it: the new copy is written into a temporary folder
beside the old one and swapped in once committed, so until then the old copy
stays committed, and a crash midway never leaves a mix (the next save deletes
the unfinished copy, or puts the old one back if the crash fell between the two
renames of the swap). On object stores (fsspec URLs), which cannot swap
folders, the new copy goes to a fresh version prefix below the step folder and
one PUT of the step's manifest (a pointer to it) commits it; the old copy's
files are deleted after that. Saving a step lower
than existing ones is a rollback when :meth:`CheckpointManager.restore` loaded
that step or a lower one, or with ``save(..., rollback=True)`` (refused
otherwise: the higher steps may be an earlier run's): once it is committed it
becomes ``latest`` and the higher steps are deleted, so ``restore``,
``steps()`` and ``ddpstate verify`` agree.

``restore`` verifies the newest checkpoint's files against its manifest on rank
0 (sizes and CRC-32, as :func:`verify_checkpoint`), falls back to older ones
with a warning that says what was wrong, broadcasts the choice, and loads it on
every rank.

Sharded models (FSDP2 ``fully_shard``, tensor parallel: ``DTensor``
parameters) and their optimizers are saved with ``torch.distributed.checkpoint``:
every rank writes its own shards into ``step_<n>/dcp/``, and the manifest lists
those files too, so the commit, verification and fallback are the same (restore
checks the shards' bytes as it loads them, through ``ddpstate.dcp.VerifiedReader``);
``restore`` reshards them to the live model's layout (another world size,
FSDP2, DDP or a plain model). The optimizer's model must be in the same
``state``. With ``async_save=True`` each rank copies its shards to CPU in
``save`` and writes them in the background on a gloo group of the manager's own
(created at the first such save, destroyed at ``close``). Sharded tensors
elsewhere (in a plain value) are refused with :class:`~ddpstate.ShardedStateError`.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from types import TracebackType
from typing import Any, Optional

from ddpstate import storage
from ddpstate._fs import PathLike
from ddpstate._manager import dcp_step as _dcp
from ddpstate._manager import restore as _restore
from ddpstate._manager import save as _save
from ddpstate._manager.config import (
    KeepBest,
    NodeLocal,
    check_same_on_every_rank,
    fold_legacy,
    make_config,
)
from ddpstate._manager.entries import check_state, check_step
from ddpstate._manager.local_tier import LocalTier, RestoreSource
from ddpstate._manager.signals import StopSignals
from ddpstate._manager.snapshot import Snapshot
from ddpstate._manager.writer import InFlight, StepWriter

# Importable from here as before (ddpstate.manager.MANIFEST_NAME...).
from ddpstate._manifest import LATEST_NAME as LATEST_NAME
from ddpstate._manifest import MANIFEST_NAME as MANIFEST_NAME
from ddpstate._manifest import RNG_FILE as RNG_FILE
from ddpstate._manifest import STEP_DIGITS as STEP_DIGITS
from ddpstate._manifest import CheckpointVerification, step_name, verify_checkpoint
from ddpstate.dist import Timeout as Timeout
from ddpstate.dist import barrier, is_distributed
from ddpstate.errors import InvalidArgumentError

__all__ = [
    "CheckpointManager",
    "CheckpointVerification",
    "KeepBest",
    "NodeLocal",
    "RestoreSource",
    "verify_checkpoint",
]


class CheckpointManager:
    """Save training state every few steps, keep a few, and resume from the newest good one.

    A collective object: create it, and call :meth:`save`, :meth:`restore`,
    :meth:`wait`, :meth:`should_stop` and :meth:`close`, on every rank, in the
    same order, with the same arguments. Rank 0 writes; every rank gets the
    same outcome (a failed write raises the same error on every rank).

    ``state`` maps entry names (file names: letters, digits, ``_ . -``) to
    objects with ``state_dict()``/``load_state_dict()`` -- model, optimizer,
    LR scheduler, GradScaler, :class:`~ddpstate.ResumableDistributedSampler`,
    your own -- or to plain values (numbers, strings, tensors, lists and dicts
    of them). Models are saved unwrapped (DDP, DataParallel, ``torch.compile``)
    with plain keys and load back into whatever wrapping the live model has.
    Except for the RNG states, which are gathered from every rank, the state
    is taken from rank 0, so it must be the same on every rank (as it is under
    DDP). Plain values must be loadable with ``weights_only=True``: numbers,
    strings, tensors, containers, numpy values, paths, ``datetime`` values,
    ``argparse.Namespace``, or your own types listed in ``safe_globals``;
    anything else is refused by ``save`` before anything is written.

    Checkpoints live in ``<directory>/step_<step>/``; the module docstring
    describes the layout, re-saves, rollbacks, rotation, the step ``restore``
    chooses and how sharded models are saved.

    With ``async_save=True``, ``save`` copies every tensor into CPU memory kept
    between saves (pinned for CUDA tensors), starts the write in a background
    thread, and returns. At most one write is in flight: the next
    :meth:`save`, :meth:`wait`, :meth:`restore` or :meth:`close` waits for it
    and raises its error, on every rank. The copy costs as much CPU memory as
    the state.

    With ``handle_signals=True``, SIGTERM and SIGUSR1 (SLURM's pre-timeout
    signal) no longer kill the process; they make :meth:`should_stop` return
    True, on every rank at the same call. The previous handlers come back at
    :meth:`close`.

    Args:
        directory: Local folder or fsspec URL holding the step folders; on
            several nodes it must be shared storage that every rank can read.
        keep_last: Keep this many checkpoints with the highest steps (>= 1),
            or None to keep all.
        best: Also keep the best checkpoints by a metric:
            ``KeepBest(count, metric, mode="min")`` (:class:`KeepBest`); None
            (default) keeps only the ``keep_last`` newest.
        async_save: Write in a background thread after a snapshot.
        format: ``"pt"`` (torch.save files) or ``"safetensors"`` (models as
            safetensors, the other entries as torch.save files).
        storage_options: fsspec options for URLs.
        handle_signals: Install the SIGTERM/SIGUSR1 handler (main thread only).
        timeout: Seconds (or ``timedelta``) a rank waits for the others in each call
            (its rounds share it); default ``DDPSTATE_TIMEOUT`` or 1800 s. Non-writing
            ranks wait this long for a synchronous write, too.
        safe_globals: Your own data-only types (an ``Enum``, a dataclass...) that
            plain values may hold. ``save`` refuses, before writing, any value
            that ``weights_only`` loading could not restore, naming its path;
            types listed here pass that check and are allowed at ``restore``.
            Needed only beyond the everyday ones: numpy scalars and numeric
            arrays, ``pathlib`` paths, ``datetime`` values, ``argparse.Namespace``,
            ``OrderedDict`` and ``defaultdict``. Pass the same list on every rank.
        local: The node-local tier written by :meth:`save_local`:
            ``NodeLocal(directory, every=1, keep=2)`` (:class:`NodeLocal`, a
            folder such as ``/dev/shm/ddpstate-<job id>``); None (default) turns
            it off.
        writers: ``"rank0"`` (default): rank 0 writes replicated (DDP) models
            and optimizers; ``"all"``: every rank writes a part of them through
            ``torch.distributed.checkpoint`` (its planner splits the tensors by
            size). On one node it ties or loses to ``"rank0"`` (the ranks share
            CPUs and disk; see docs/benchmarks.md's DCP table); it can pay off where each
            rank has its own write bandwidth. Sharded state always uses every rank.
        **legacy: The old flat keywords, each with a ``DeprecationWarning``:
            ``keep_best``, ``metric``, ``mode`` (now ``best=``), ``local_dir``,
            ``local_every``, ``local_keep`` (now ``local=``).

    Raises:
        DDPStateError: An argument is invalid, the ranks passed different
            arguments, an option is passed in both its old and its new spelling,
            or ``handle_signals=True`` outside the main thread.
        TypeError: An unknown keyword argument (also a ``DDPStateError``).

    Example:
        >>> import tempfile, torch, ddpstate
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with ddpstate.CheckpointManager(tempfile.mkdtemp(), keep_last=2) as manager:
        ...     start = manager.restore({"model": model, "optimizer": opt})  # None: fresh run
        ...     for step in range(1, 4):
        ...         manager.save(step, {"model": model, "optimizer": opt})
        ...     manager.steps()
        [2, 3]
    """

    def __init__(
        self,
        directory: PathLike,
        *,
        keep_last: Optional[int] = 3,
        best: Optional[KeepBest] = None,
        async_save: bool = False,
        format: str = "pt",
        storage_options: Optional[dict[str, Any]] = None,
        handle_signals: bool = False,
        timeout: Timeout = None,
        safe_globals: Sequence[Any] = (),
        local: Optional[NodeLocal] = None,
        writers: str = "rank0",
        **legacy: Any,
    ) -> None:
        best, local = fold_legacy(best, local, legacy)
        # Checked once, before any collective; the parts read this one frozen object.
        c = make_config(
            directory, keep_last=keep_last, best=best, async_save=async_save, format=format,
            storage_options=storage_options, timeout=timeout, safe_globals=safe_globals,
            local=local, writers=writers,
        )  # fmt: skip
        # The attributes users read (manager.directory, manager.format...), as before.
        self.directory, self.keep_last, self.keep_best = c.directory, c.keep_last, c.keep_best
        self.metric, self.mode, self.async_save = c.metric, c.mode, c.async_save
        self.format, self.storage_options, self.timeout = c.format, c.storage_options, c.timeout
        self.safe_globals, self.writers = c.safe_globals, c.writers
        self._closed = False
        # Composition: rank 0's writes and the async write in flight (_manager/writer.py),
        # the async copies (snapshot.py), the preemption flag (signals.py), the local tier.
        self._writer, self._flight = StepWriter(c), InFlight()
        self._snapshot, self._signals = Snapshot(), StopSignals()
        # The step restore() loaded: saving it or a higher step rolls back the steps above.
        self._restored_step: Optional[int] = None
        check_same_on_every_rank(c)
        self._local = None if c.local_dir is None else LocalTier(c)
        self.restored_from: Optional[RestoreSource] = None
        if handle_signals:
            self._signals.install()

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self.directory!r}, keep_last={self.keep_last}, "
            f"keep_best={self.keep_best}, metric={self.metric!r}, mode={self.mode!r}, "
            f"async_save={self.async_save}, format={self.format!r})"
        )

    def checkpoint_path(self, step: int) -> str:
        """Return the folder of ``step``'s checkpoint (whether or not it exists).

        Args:
            step: The training step.

        Returns:
            ``<directory>/step_<zero-padded step>``.

        Example:
            >>> import ddpstate
            >>> ddpstate.CheckpointManager("/tmp/run").checkpoint_path(42)
            '/tmp/run/step_0000000042'
        """
        return storage.join(self.directory, step_name(check_step(step)))

    def steps(self) -> list[int]:
        """Return the committed steps (their manifest exists), oldest first.

        Not a collective: this is this process's view of the folder (without
        verifying checksums). An async save still in flight is not listed.

        Returns:
            Sorted step numbers; empty when the folder does not exist.

        Example:
            >>> import tempfile, ddpstate
            >>> ddpstate.CheckpointManager(tempfile.mkdtemp()).steps()
            []
        """
        return sorted(self._writer.committed_steps())

    def latest_step(self) -> Optional[int]:
        """Return the highest committed step, or None when there is none.

        Not a collective (see :meth:`steps`); :meth:`restore` is what all ranks
        agree on.

        Example:
            >>> import tempfile, ddpstate
            >>> ddpstate.CheckpointManager(tempfile.mkdtemp()).latest_step() is None
            True
        """
        return self._writer.latest_step()

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Optional[Mapping[str, Any]] = None,
        rollback: bool = False,
    ) -> None:
        """Save a checkpoint of ``state`` (plus every rank's RNG states) for ``step``.

        A collective. Synchronous mode returns once the checkpoint is committed
        and rotation is done; async mode returns after the snapshot. A step
        lower than committed ones is a rollback (it becomes the latest and the
        higher steps are deleted once it is committed) when this manager's
        :meth:`restore` loaded that step or a lower one, or with
        ``rollback=True``; otherwise it is refused, since the higher steps may
        be another run's in a reused folder. Models ``wrap_ddp``
        prepared with unsynced BatchNorm get their running statistics averaged
        across ranks first (:func:`~ddpstate.sync_batchnorm_stats`).
        Optimizers are saved keyed by their model entry's parameter names (no
        model entry: by position, with a warning; see :meth:`restore`).

        Args:
            step: The training step (an int >= 0; names the folder).
            state: Entry name -> object with ``state_dict()`` or plain value.
            metrics: Name -> number, stored in the manifest; the ``KeepBest``
                metric must be among them when ``best=`` is used.
            rollback: Allow deleting committed steps higher than ``step``
                without having restored ``step`` or a lower one.

        Raises:
            CheckpointWriteError: This write failed (synchronous mode), or the
                previous async write failed (raised before saving anything);
                the checkpoints committed before are untouched.
            InvalidArgumentError: ``step`` is below committed steps that are
                not a rollback (see above); nothing is written or deleted. Or an
                optimizer's parameters are spread over several model entries.
            DDPStateError: Invalid arguments, or the ranks passed different
                steps or entry names; a value ``restore`` could not load (named
                by its path, with the ``safe_globals`` way out) or a meta tensor,
                before anything is committed.
            ShardedStateError: A plain value holds FSDP2/tensor-parallel state
                (``DTensor``), or a sharded optimizer's model is not in ``state``;
                on every rank, before anything is written.
            BarrierTimeoutError: A rank did not reach the save in time.

        Example:
            >>> import tempfile, torch, ddpstate
            >>> manager = ddpstate.CheckpointManager(tempfile.mkdtemp())
            >>> model = torch.nn.Linear(2, 2)
            >>> manager.save(10, {"model": model, "epoch": 1}, metrics={"loss": 0.5})
            >>> manager.latest_step()
            10
        """
        _check_open(self, "save")
        self._writer.finish(self._flight)
        _save.save(
            self._writer, self._flight, self._snapshot, step=step, state=state,
            metrics=metrics, rollback=rollback, restored=self._restored_step,
        )  # fmt: skip

    def save_local(self, step: int, state: Mapping[str, Any]) -> bool:
        """Save ``state`` to the node-local tier when ``step`` is a multiple of ``local.every``.

        Meant to be called every step: other steps return at once, with no
        collective. On a due step it is a collective of one round (the ranks'
        RNG states travel through the store to each node's writer, which tells
        its node whether the write started): each node's local rank 0 copies the state
        into CPU memory kept between saves and writes it to ``local.directory`` in a
        background thread (manifest last, as durable steps), keeping the
        newest ``local.keep`` steps. It never raises for a failed local write
        (out of space, a folder that cannot be made, any write error): it
        warns once, skips that step on that node, and training goes on; the
        durable checkpoints are never touched. :meth:`save` stays the durable
        save, on your own schedule.

        Args:
            step: The training step (an int >= 0), the same on every rank.
            state: As for :meth:`save`.

        Returns:
            True when this rank's node started a local write for ``step``
            (the same on every rank of the node).

        Raises:
            DDPStateError: The manager has no node-local tier, or invalid arguments.

        Example:
            >>> import tempfile, torch, ddpstate
            >>> local = ddpstate.manager.NodeLocal(tempfile.mkdtemp(), every=2)
            >>> manager = ddpstate.CheckpointManager(tempfile.mkdtemp(), local=local)
            >>> model = torch.nn.Linear(2, 2)
            >>> [manager.save_local(s, {"model": model}) for s in (1, 2)]
            [False, True]
            >>> manager.restore({"model": model}), str(manager.restored_from.tier)
            (2, 'local')
        """
        _check_open(self, "save_local")
        if self._local is None:
            raise InvalidArgumentError(
                "CheckpointManager.save_local: this manager has no node-local tier (no local_dir); "
                "pass local=NodeLocal('/dev/shm/ddpstate-<job id>', every=K) to CheckpointManager"
            )
        check_state(state, "save_local")
        return self._local.save(check_step(step), state)

    @property
    def local_skipped(self) -> list[tuple[int, str]]:
        """The local steps this rank's node skipped and why (empty without a node-local tier).

        On the node's writer (local rank 0) every skip, as soon as it is known;
        on its other ranks, those the writer knew at the last due save_local (a
        background write's failure is known at the next due save).
        """
        return [] if self._local is None else list(self._local.skipped)

    def clear_local(self) -> None:
        """Delete the node-local tier's folder on every node (for a fresh start).

        A collective: waits for the local write in flight, lets each node's
        local rank 0 delete the tier's folder, then meets the other ranks. The
        durable checkpoints are untouched. :meth:`close` leaves the local tier
        in place for a restart; this is how it goes away. A no-op without a
        node-local tier.

        Example:
            >>> import os, tempfile, torch, ddpstate
            >>> tier = ddpstate.manager.NodeLocal(os.path.join(tempfile.mkdtemp(), "shm"))
            >>> manager = ddpstate.CheckpointManager(tempfile.mkdtemp(), local=tier)
            >>> manager.save_local(1, {"w": torch.ones(2)})
            True
            >>> manager.clear_local(); os.path.exists(tier.directory)
            False
        """
        _check_open(self, "clear_local")
        if self._local is None:
            return
        self._local.clear()
        if is_distributed():
            barrier(timeout=self.timeout, name="CheckpointManager.clear_local")

    def wait(self) -> None:
        """Wait for the async writes in flight; raise a failed durable write's error on every rank.

        A local-tier write (:meth:`save_local`) is waited for too; its failure is only a warning.

        A collective (a no-op on every rank when nothing is in flight).

        Raises:
            CheckpointWriteError: The background write failed.

        Example:
            >>> import tempfile, torch, ddpstate
            >>> manager = ddpstate.CheckpointManager(tempfile.mkdtemp(), async_save=True)
            >>> manager.save(1, {"w": torch.ones(2)})
            >>> manager.wait()
            >>> manager.steps()
            [1]
        """
        _check_open(self, "wait")
        if self._local is not None:
            self._local.wait()  # never raises for the local tier: a failure is a warning
        self._writer.finish(self._flight)

    def restore(
        self,
        state: MutableMapping[str, Any],
        *,
        step: Optional[int] = None,
        map_location: Any = "auto",
        strict: bool = True,
        ignore_mismatched: bool = False,
        allow_dtype_change: bool = False,
    ) -> Optional[int]:
        """Load the newest valid checkpoint (or ``step``'s) into ``state``; return its step.

        A collective. Rank 0 verifies the candidates newest first, exactly as
        :func:`verify_checkpoint` does (manifest present and intact, every
        file's size and CRC-32, no unlisted checkpoint file), warns about each
        one it skips and why, and broadcasts its choice; every rank then loads
        that checkpoint. With several ranks, rank 0 reads the manifest and
        every rank checks a share of the files (balanced by size); DCP shards
        are checked as they load instead (read once), a damaged one sending
        ``restore()`` on to the next older step. Objects
        with ``load_state_dict`` are loaded in place (models through
        :func:`ddpstate.keys.adapt_state_dict`, so any wrapping works); plain
        values are written back into ``state`` (the dict is updated in place,
        as ``torch.distributed.checkpoint.load`` does). Each rank restores its
        own RNG states.

        Optimizer state comes back by parameter name (earlier files: by position);
        a dtype change is refused unless ``allow_dtype_change``. Every entry is
        checked before any is loaded: a refusal leaves them all untouched.

        With a node-local tier and no ``step``, the tier answers first:
        each node's local rank 0 verifies its newest local step, and the ranks
        restore the newest local step any node holds (a node that lacks it
        receives it from one that has it, over the process group), unless the
        durable tier has a newer committed step or no node has a complete
        local step. ``restored_from`` says, on each rank, which tier and
        step it came from.

        If the world size changed since the save, a warning says so and ranks
        ``r < saved world size`` restore rank ``r``'s saved RNG states, while
        each rank ``r >=`` the saved world size restores rank ``r % saved``'s
        states and then re-seeds all generators from a hash of them and ``r``
        (so no two ranks draw the same numbers).

        Args:
            state: Entry name -> live object (or placeholder for a plain value).
            step: Restore exactly this step (no fallback) instead of the newest.
            map_location: Where tensors load (as :func:`ddpstate.load`);
                ``"auto"`` is this rank's device.
            strict: Raise when ``state`` and the checkpoint have different entries.
            ignore_mismatched: In models, skip tensors whose shape differs from
                the live model's (it keeps its own values there), e.g. a classifier
                head resized for fine-tuning; a warning names them. Optimizers in
                ``state`` drop their saved state for those parameters (another
                warning), so the first step after restore works.
            allow_dtype_change: Cast saved tensors to the live dtypes (float32
                into bfloat16); never between integer, floating and bool.

        Returns:
            The restored step, or None when the folder has no checkpoint yet.

        Raises:
            CheckpointNotFoundError: ``step`` was given and has no checkpoint.
            CheckpointCorruptError: ``step`` was given and fails verification,
                or checkpoints exist but none verifies.
            KeyMismatchError: ``strict`` and the entries differ, or a model's
                keys do not match.
            ShapeMismatchError: A model's tensors have other shapes than the
                live model's (the same error ``load_model_state`` raises).
            DTypeMismatchError: A dtype differs (see ``allow_dtype_change``).
            OptimizerStateMismatchError: Optimizer parameters or groups differ by name.
            UnsafeCheckpointError: A value needs a type not allowed by ``safe_globals``.
            DDPStateError: Loading an entry failed on some rank (named).

        Example:
            >>> import tempfile, torch, ddpstate
            >>> manager = ddpstate.CheckpointManager(tempfile.mkdtemp())
            >>> model = torch.nn.Linear(2, 2)
            >>> manager.save(5, {"model": model, "epoch": 3})
            >>> state = {"model": torch.nn.Linear(2, 2), "epoch": 0}
            >>> manager.restore(state), state["epoch"]
            (5, 3)
        """
        _check_open(self, "restore")
        self._writer.finish(self._flight)
        self.restored_from = _restore.restore(
            self._writer, self._local, state, step=step, map_location=map_location,
            strict=strict, ignore_mismatched=ignore_mismatched,
            allow_dtype_change=allow_dtype_change,
        )  # fmt: skip
        if self.restored_from.step is not None:
            self._restored_step = int(self.restored_from.step)
        return self.restored_from.step

    def should_stop(self) -> bool:
        """Tell whether any rank received SIGTERM/SIGUSR1 (with ``handle_signals=True``).

        A collective: every rank gets the same answer at the same call, so all
        of them save at the same step and leave the loop together. Once True,
        it stays True. Cheap enough for every step: one ``all_reduce`` of a
        one-element tensor on the backend's device (gloo: CPU; NCCL: this
        rank's GPU), no store traffic; it waits as long as the process group's
        own timeout.

        Returns:
            True when some rank was asked to stop.

        Example:
            >>> import tempfile, ddpstate
            >>> ddpstate.CheckpointManager(tempfile.mkdtemp()).should_stop()
            False
        """
        _check_open(self, "should_stop")
        return self._signals.agreed()

    def close(self) -> None:
        """Finish the async write in flight, restore signal handlers, free the snapshot buffers.

        A collective when a write is in flight. Calling it again does nothing.

        Raises:
            CheckpointWriteError: The last background write failed (on every rank).

        Example:
            >>> import tempfile, ddpstate
            >>> manager = ddpstate.CheckpointManager(tempfile.mkdtemp())
            >>> manager.close()
        """
        if self._closed:
            return
        try:
            self._writer.finish(self._flight)
        finally:
            _release(self)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if exc_type is None:
            self.close()
            return
        # The block failed, possibly on this rank only: no collective (it could hang
        # on ranks that went on), but the write in flight still completes.
        self._flight.abandon(exc)
        _release(self)


def _check_open(m: CheckpointManager, what: str) -> None:
    if m._closed:
        raise InvalidArgumentError(
            f"CheckpointManager.{what}: the manager for {m.directory} is closed"
        )


def _release(m: CheckpointManager) -> None:
    """Mark ``m`` closed and free what it holds (DCP group, local tier, buffers, signals)."""
    m._closed = True
    _dcp.release_group(m._flight)
    if m._local is not None:
        m._local.close()
    m._flight.thread = None
    m._snapshot.buffers.clear()
    m._signals.restore()
