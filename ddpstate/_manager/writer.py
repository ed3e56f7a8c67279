"""The durable tier's writes: a step folder written, committed (manifest last), rotated.

:class:`StepWriter` is what rank 0 (the writer) does for a
:class:`~ddpstate.CheckpointManager`: it stages a step's folder (crashed saves
cleaned up by :class:`~ddpstate._manifest.StepFolders`, the folder staged by
:func:`ddpstate.storage.stage_folder`: in place when new), writes each entry
with its size and CRC-32, commits it with the manifest, points ``latest`` at
it, applies a rollback, and rotates old steps out. It also turns a failure
into the one error every rank raises. :class:`InFlight` holds the async write
in flight; sharded saves (``_manager/dcp_step.py``) drive the same writer
through its public methods.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from ddpstate import _fs, _visibility, storage
from ddpstate._checksum import ChecksumWriter, error_text, write_listed_file
from ddpstate._io import savecheck as _savecheck
from ddpstate._io.safetensors_io import write_safetensors
from ddpstate._manager.config import ManagerConfig
from ddpstate._manager.entries import KIND_MODULE, Entry, is_flat_tensor_dict
from ddpstate._manifest import (
    COMMITTED_BUT,
    LATEST_NAME,
    MANIFEST_NAME,
    RNG_FILE,
    StepFolders,
    manifest_for,
    read_manifest,
    step_name,
)
from ddpstate._warn import warn
from ddpstate.dist import is_distributed, share_outcome
from ddpstate.errors import CheckpointWriteError, DDPStateError, UnsafeCheckpointError
from ddpstate.formats import SAFETENSORS

#: The rank that writes the rank-0 entries and commits every step.
WRITER_RANK = 0


@dataclass
class Pending:
    """The step an async save is writing, until the next call waits for it."""

    step: int
    folder: str
    shared: bool = False  # its writer threads already agreed on the error (DCP, every rank)


@dataclass
class InFlight:
    """The async durable write in flight (at most one), and the group sharded ones run on."""

    pending: Optional[Pending] = None
    thread: Optional[threading.Thread] = None
    #: The background write's failure, raised on every rank by :meth:`StepWriter.finish`.
    error: Optional[BaseException] = None
    #: Background DCP writes' own gloo group (``dcp_step.async_group``).
    dcp_group: Any = None

    def start(self, name: str, events: list[Any], work: Callable[[], None]) -> None:
        """Run ``work`` in a background thread once ``events`` (CUDA copies) are done.

        Its exception, whatever it is, goes to ``error`` (the next call raises or warns).
        Not a daemon: an interpreter exiting normally still finishes the write.
        """
        self.error = None

        def run() -> None:
            try:
                for event in events:
                    event.synchronize()
                work()
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, name=name, daemon=False)
        self.thread.start()

    def join(self) -> Optional[Exception]:
        """Wait for the thread in flight and return its failure (an interrupt is raised here)."""
        error: Optional[BaseException] = None
        if self.thread is not None:
            self.thread.join()
            error, self.thread, self.error = self.error, None, None
        if error is not None and not isinstance(error, Exception):
            raise error  # KeyboardInterrupt or SystemExit inside the writer
        return error

    def abandon(self, exc: Optional[BaseException]) -> None:
        """Let the write in flight complete without a collective (the ``with`` block failed).

        Its failure, if any, becomes a note on ``exc``.
        """
        if self.thread is not None:
            self.thread.join()
            if self.error is not None and exc is not None:
                note = getattr(exc, "add_note", None)
                if note is not None:
                    note(f"the async checkpoint write also failed: {self.error!r}")
        self.pending = None


#: Writes one file (path, object, as safetensors, what it is); returns its manifest listing.
FileWrite = Callable[[str, Any, bool, str], dict[str, Any]]


def write_entries(
    folder: str,
    entries: dict[str, Entry],
    rng_states: list[Any],
    write: FileWrite,
    safetensors: bool = False,
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, str]]]:
    """Write a step's entries and every rank's RNG states into ``folder`` (durable or local).

    Returns the manifest's ``files`` and ``entries``. With ``safetensors``, model
    entries that are flat tensor dicts become ``.safetensors`` files.
    """
    files: dict[str, dict[str, Any]] = {}
    listed: dict[str, dict[str, str]] = {}
    for name, entry in entries.items():
        as_safetensors = (
            safetensors and entry.kind == KIND_MODULE and is_flat_tensor_dict(entry.value)
        )
        filename = name + (".safetensors" if as_safetensors else ".pt")
        path = storage.join(folder, filename)
        files[filename] = write(path, entry.value, as_safetensors, f"state[{name!r}]")
        listed[name] = {"file": filename, "kind": entry.kind}
    rng_payload = {"world_size": len(rng_states), "ranks": rng_states}
    files[RNG_FILE] = write(storage.join(folder, RNG_FILE), rng_payload, False, "RNG states")
    return files, listed


class StepWriter(StepFolders):
    """Write, commit and rotate a manager's step folders (see the module docstring)."""

    def __init__(self, config: ManagerConfig) -> None:
        super().__init__(config.directory, config.storage_options)
        self.config = config
        self._metrics: dict[int, dict[str, float]] = {}
        self._warned_newer = False

    def metrics_for(self, step: int) -> dict[str, float]:
        """``step``'s metrics, from its manifest (cached)."""
        if step not in self._metrics:
            manifest, _ = read_manifest(self.checkpoint_path(step), self.storage_options)
            raw = manifest.get("metrics", {}) if manifest else {}
            self._metrics[step] = {
                str(k): float(v) for k, v in raw.items() if isinstance(v, (int, float))
            }
        return self._metrics[step]

    def prepare_folder(self, step: int) -> storage.StagedFolder:
        """Rank 0: clean up crashed saves and stage the folder ``step`` is written into."""
        opts = self.storage_options
        storage.makedirs(self.directory, storage_options=opts)
        higher = [s for s in self.clean_stale() if s > step]
        if higher and not self._warned_newer:
            self._warned_newer = True
            warn(
                f"CheckpointManager: saving step {step}, but {self.checkpoint_path(higher[0])} (a "
                f"higher step) already exists: this save is a rollback. Once step {step} is "
                f"committed, it becomes latest and every higher step is deleted"
            )
        target = self.checkpoint_path(step)
        if storage.exists(target, storage_options=opts) and not storage.isdir(
            target, storage_options=opts
        ):
            raise CheckpointWriteError(
                f"{target} exists and is not a folder, so step {step} cannot be saved there; "
                f"move that file away (ddpstate never deletes files it did not write)"
            )
        # A new step is written in place (its manifest commits it); a re-saved one beside
        # the old copy, which stays committed until the new one is.
        return storage.stage_folder(
            target, storage_options=opts, manifest_name=MANIFEST_NAME, in_place=True
        )

    def commit(
        self,
        step: int,
        entries: dict[str, Entry],
        rng_states: list[Any],
        metrics: dict[str, float],
        prepared: Optional[storage.StagedFolder] = None,
        written: Optional[tuple[dict[str, dict[str, Any]], dict[str, dict[str, str]]]] = None,
    ) -> None:
        """Write and commit a step; ``prepared`` and ``written`` come from a DCP save
        (_manager/dcp_step.py): the folder every rank wrote into, and the (files, entries)
        they wrote there."""
        staged = self.prepare_folder(step) if prepared is None else prepared
        try:
            safetensors = self.config.format == SAFETENSORS
            files, listed = write_entries(
                staged.path, entries, rng_states, self.write_file, safetensors
            )
            if written:  # the DCP shards every rank wrote come first in the manifest
                files, listed = {**written[0], **files}, {**written[1], **listed}
            staged.commit(manifest_for(step, metrics, len(rng_states), listed, files))
        except BaseException as exc:
            staged.discard(exc)
            raise
        self._metrics[step] = metrics
        # A save of an older step is a rollback (save() checked it is one): now that it
        # is committed, `latest` names it, then the newer steps are uncommitted (oldest
        # first, so restore() takes either the old newest or this step, never one in
        # between). `latest` first: if writing it fails, nothing was uncommitted yet. Its
        # atomic write fsyncs the root, which also makes the entry of a step written in
        # place durable before anything older is deleted.
        newer = [s for s in self.committed_steps() if s > step]
        latest = storage.join(self.directory, LATEST_NAME)
        try:
            with storage.atomic_write(latest, storage_options=self.storage_options) as f:
                f.write((step_name(step) + "\n").encode())
        except Exception as exc:
            kept = f"; steps {newer} are still committed, so restore() takes step {max(newer)}"
            raise CheckpointWriteError(
                f"step {step} {COMMITTED_BUT} writing {latest} failed ({error_text(exc)})"
                + (kept if newer else "")
            ) from exc
        for s in newer:
            self.remove_step(s, step, folder_too=False)
        for s in newer:
            self.remove_step(s, step)
        dropped = self.rotate(step, self.config.keep_last, self.config.keep_best, self._score)
        for s in (*newer, *dropped):
            self._metrics.pop(s, None)

    def _score(self, step: int) -> Optional[float]:
        """``step``'s value of ``metric`` for ``keep_best`` (lower is better), or None."""
        value = self.metrics_for(step).get(str(self.config.metric))
        if value is None or math.isnan(value):
            return None
        return value if self.config.mode == "min" else -value

    def write_file(self, path: str, obj: Any, as_safetensors: bool, what: str) -> dict[str, Any]:
        """Write one entry's file atomically; return its size and CRC-32 for the manifest."""

        def write(writer: ChecksumWriter) -> None:
            if as_safetensors:
                write_safetensors(writer, obj, name=path)  # type: ignore[arg-type]
            else:
                extra = self.config.safe_globals
                _savecheck.save_torch(obj, writer, what=what, where=path, extra=extra)  # type: ignore[arg-type]

        return write_listed_file(path, write, storage_options=self.storage_options)

    def rollback_refusal(self, step: int, rollback: bool, restored: Optional[int]) -> str:
        """Rank 0: why saving ``step`` must not delete the higher committed steps, or "".

        ``restored`` is the step the manager's ``restore`` loaded (None: none).
        """
        higher = sorted(s for s in self.committed_steps() if s > step)
        if not higher or rollback or (restored is not None and restored <= step):
            return ""
        came = "never restored" if restored is None else f"restored step {restored}"
        return (
            f"CheckpointManager.save(step={step}): {self.directory} already has committed steps "
            f"{higher} above it, and this manager {came}, so they may be another run's (a "
            f"reused folder). Saving step {step} would roll back: delete them. To roll back on "
            f"purpose, pass save({step}, ..., rollback=True) or restore(step=N) with N <= "
            f"{step} first; otherwise save into another folder or continue above step "
            f"{higher[-1]}. Nothing was written or deleted"
        )

    def write_failure(
        self, step: int, folder: str, failures: list[tuple[int, str]]
    ) -> CheckpointWriteError:
        """The error every rank raises for a failed save of ``step`` (``failures``: rank, text)."""
        detail = "; ".join(f"rank {r}: {m}" for r, m in failures)
        if any(COMMITTED_BUT in m for _, m in failures):
            # The step itself was committed and a later part failed: the folder changed.
            outcome = (
                f"run `ddpstate verify {self.directory}` to see what is committed; restore() "
                f"takes the newest committed step that verifies"
            )
        else:
            outcome = "the checkpoints committed before it are untouched"
        return CheckpointWriteError(
            f"saving step {step} to {folder} failed ({detail}); {outcome}. Check free space, "
            f"permissions and that {self.directory} is a writable folder"
        )

    def failure_for(self, step: int, folder: str, rank: int, exc: BaseException) -> DDPStateError:
        """The error every rank raises when writing ``step`` raised ``exc`` on ``rank``.

        A refusal of the state itself (a model, a function, a type weights_only loading
        refuses) is raised as it is: it says what to save instead, and free space or
        permissions have nothing to do with it. Anything else is a write failure.
        """
        if isinstance(exc, UnsafeCheckpointError):
            return exc
        return self.write_failure(step, folder, [(rank, error_text(exc))])

    def share_outcome(
        self, step: int, error: Optional[DDPStateError], cause: Optional[BaseException] = None
    ) -> None:
        """Raise ``error`` (the writer's) on every rank, or return on every rank."""
        try:
            share_outcome(
                error, name=f"CheckpointManager.save(step={step})", timeout=self.config.timeout
            )
        except DDPStateError as shared:
            # Alone, the writer's own error comes back; with others, the shared one from it.
            if cause is not None and (shared is error or shared.__cause__ is error):
                raise shared from cause
            raise

    def check_seen(self, step: int, folder: str) -> None:
        """Every rank: each sees the manifest the writer committed, or every rank raises."""
        if not is_distributed() or _fs.is_remote(folder):
            return
        _visibility.check_seen(
            storage.join(folder, MANIFEST_NAME),
            WRITER_RANK,
            "wrote",
            f"the checkpoint is committed on rank {WRITER_RANK}'s disk, but restore() needs "
            f"every rank to see it: use a directory on shared storage (a shared filesystem or "
            f"an fsspec URL)",
            name=f"CheckpointManager.save(step={step})",
            timeout=self.config.timeout,
        )

    def finish(self, flight: InFlight) -> None:
        """Wait for the write in ``flight``; raise its error on every rank (a collective)."""
        pending = flight.pending
        if pending is None:
            return
        flight.pending = None
        error = flight.join()
        failure: Optional[DDPStateError] = None
        if pending.shared and isinstance(error, DDPStateError):
            failure = error  # the writer threads of every rank already agreed on it
        elif error is not None:
            failure = self.failure_for(pending.step, pending.folder, 0, error)
        self.share_outcome(pending.step, failure, error)
        self.check_seen(pending.step, pending.folder)
