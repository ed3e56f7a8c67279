"""ddpstate inside Lightning: durable checkpoint writes and a resume that skips damaged files.

``Trainer(callbacks=[DDPStateCheckpointIO()])`` (or ``Trainer(plugins=[...])``,
``Fabric(plugins=[...])``) makes every checkpoint Lightning writes durable (fsynced before
and after its atomic rename) and loads them through ddpstate (weights-only, named errors);
as a callback it also checks, before the first epoch, that the model's, optimizers' and
callbacks' state can be saved that way.
``trainer.fit(model, ckpt_path=last_verified_checkpoint(dirpath))`` resumes from the
newest checkpoint that verifies. Needs ``pip install -e ".[lightning]"`` from a checkout
(``pip install "ddpstate[lightning]"`` once ddpstate is on PyPI).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any, Optional

from ddpstate import storage
from ddpstate._io.savecheck import check_saveable, safe_globals_named
from ddpstate._warn import warn
from ddpstate.checkpoint import load, save
from ddpstate.dist import get_rank
from ddpstate.errors import InvalidArgumentError, InvalidArgumentTypeError, UnsafeCheckpointError
from ddpstate.integrations._common import missing_framework, modified_time, newest_verified

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # the framework is an optional extra
    raise missing_framework("lightning", "lightning") from exc

__all__ = ["DDPStateCheckpointIO", "last_verified_checkpoint"]

#: ModelCheckpoint's file suffix.
CKPT_SUFFIX = ".ckpt"
_STEP = re.compile(r"step=(\d+)")
# Unsafe-type errors name this class's parameter, not ddpstate.save/load's.
_ALLOW_AS = "DDPStateCheckpointIO(safe_globals=[{}])"


def _options(*given: Any) -> Optional[dict[str, Any]]:
    merged: dict[str, Any] = {}
    for options in given:
        if options is not None and not isinstance(options, dict):
            raise InvalidArgumentTypeError(
                f"storage_options must be a dict of fsspec options or None, not "
                f"{type(options).__name__}"
            )
        merged.update(options or {})
    return merged or None


class DDPStateCheckpointIO(CheckpointIO, Callback):
    """A Lightning ``CheckpointIO`` that writes and reads checkpoints through ddpstate.

    Saves go to a temporary file beside the target, fsynced, renamed onto it, and the
    folder fsynced (object stores: one upload), so a crash or power loss leaves the
    old checkpoint or the new one, never a torn file. Before writing, anything that
    a weights-only load could not restore is refused, named by its path in the
    checkpoint. Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on rank
    0 only, so neither is a collective: nothing waits for the other ranks.

    It is also a ``Callback``: given as ``Trainer(callbacks=[DDPStateCheckpointIO()])``
    it becomes the Trainer's checkpoint plugin (in ``setup``, before a ``ckpt_path`` is
    loaded) and, in ``on_fit_start`` (every rank, before the first training step), checks
    what the checkpoints will hold as far as it is known then (the model's state dict,
    the optimizers', the schedulers', ``hyper_parameters``, the callbacks' and a datamodule's), so
    an unsafe type stops ``fit`` at once, not at the first checkpoint an epoch later. A fit
    that saves no checkpoint (``fast_dev_run``, ``enable_checkpointing=False`` and no
    checkpoint callback) is only warned.
    Given only as ``plugins=[...]`` (or to Fabric) the same check runs at each save.

    Args:
        storage_options: fsspec options (credentials, endpoint) for URL paths;
            ``trainer.save_checkpoint(..., storage_options=)`` adds to them per call.
        weights_only: Load weights-only (tensors, numbers, strings, containers and
            ddpstate's everyday types); ``False`` for checkpoints holding your own
            classes that you trust. Also checked at save time.
        safe_globals: Your own data-only types a weights-only load may build.

    Raises:
        UnsafeCheckpointError: (``fit``, before the first step) The state holds a type a
            weights-only load refuses and a checkpoint callback will save; the message
            names its path and ``DDPStateCheckpointIO(safe_globals=[...])``.
        InvalidArgumentError: (``fit``) The Trainer has another ``CheckpointIO`` plugin.

    Example:
        >>> import lightning as L  # doctest: +SKIP
        >>> from ddpstate.integrations.lightning import DDPStateCheckpointIO
        >>> trainer = L.Trainer(callbacks=[DDPStateCheckpointIO()])  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        storage_options: Optional[dict[str, Any]] = None,
        weights_only: bool = True,
        safe_globals: Sequence[Any] = (),
    ) -> None:
        super().__init__()
        self.storage_options = _options(storage_options)
        self.weights_only = weights_only
        self.safe_globals = list(safe_globals)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` atomically and durably, on the calling rank alone.

        Raises:
            CheckpointWriteError: Writing failed; the previous file at ``path`` is untouched.
            UnsafeCheckpointError: The checkpoint holds an object a weights-only load
                refuses (named); pass ``safe_globals`` or ``weights_only=False``.
        """
        with safe_globals_named(_ALLOW_AS):
            save(
                checkpoint,
                path,
                format="pt",
                src_rank=get_rank(),  # the rank Lightning calls this on writes: no collective
                barrier=False,
                storage_options=_options(self.storage_options, storage_options),
                safe_globals=self.safe_globals,
                weights_only=self.weights_only,
            )

    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Read the checkpoint at ``path`` on this rank (tensors on the CPU by default).

        Raises:
            CheckpointNotFoundError: Nothing at ``path``.
            CheckpointCorruptError: The file is truncated or damaged.
            UnsafeCheckpointError: It needs ``weights_only=False`` (the globals are named).
        """
        with safe_globals_named(_ALLOW_AS):
            loaded: dict[str, Any] = load(
                path,
                map_location="cpu" if map_location is None else map_location,
                weights_only=self.weights_only if weights_only is None else weights_only,
                # Lightning keeps the optimizer's tensors: plain memory, like torch.load.
                mmap=False,
                barrier=False,  # each rank reads for itself, as Lightning calls it on every rank
                storage_options=self.storage_options,
                safe_globals=self.safe_globals,
            )
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (a missing one is no error)."""
        storage.remove(path, storage_options=self.storage_options, recursive=True, missing_ok=True)

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to release (called as a plugin with no arguments, as a callback with three)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Become the Trainer's checkpoint plugin, unless it already is (callback hook).

        Raises:
            InvalidArgumentError: The Trainer has another ``CheckpointIO`` plugin.
        """
        strategy = trainer.strategy
        current = strategy.checkpoint_io  # Lightning's default TorchCheckpointIO when none given
        inner = getattr(current, "checkpoint_io", current)  # a wrapper's (AsyncCheckpointIO)
        if inner is self:
            return
        if current is not inner or type(current) is not TorchCheckpointIO:
            # A wrapper keeps the plugin it was given first: replacing it would not take.
            raise InvalidArgumentError(
                f"DDPStateCheckpointIO is in Trainer(callbacks=...) but the Trainer already has "
                f"another checkpoint plugin ({type(current).__name__}); give only one: pass this "
                f"DDPStateCheckpointIO in plugins=[...] too (wrapped, "
                f"AsyncCheckpointIO(checkpoint_io=it)), or drop the other"
            )
        strategy.checkpoint_io = self

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Check, before the first training step, that the checkpoints can be saved and loaded.

        Refuses only a fit that will save checkpoints (a checkpoint callback such as
        ``ModelCheckpoint``, no ``fast_dev_run``); a fit that saves none gets a warning
        naming the type and the parameter, since only a later ``trainer.save_checkpoint``
        would be refused.

        Raises:
            UnsafeCheckpointError: The state holds a type a weights-only load refuses,
                and the fit will save checkpoints.
        """
        if not self.weights_only:
            return  # the user trusts their checkpoints: anything torch can pickle goes
        known = {
            "state_dict": pl_module.state_dict(),
            "optimizer_states": [opt.state_dict() for opt in trainer.optimizers],
            "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "hyper_parameters": dict(pl_module.hparams),
            "callbacks": {c.state_key: c.state_dict() for c in trainer.callbacks},
        }
        data = trainer.datamodule
        if data is not None:  # saved under its class's name, its hyperparameters beside
            known[type(data).__qualname__] = data.state_dict()
            known["datamodule_hyper_parameters"] = dict(data.hparams)
        try:
            with safe_globals_named(_ALLOW_AS):
                check_saveable(
                    known,
                    what="checkpoint",
                    where="Lightning's checkpoints (checked before the first epoch)",
                    extra=self.safe_globals,
                )
        except UnsafeCheckpointError as exc:
            # Lightning's ModelCheckpoint saves nothing under fast_dev_run.
            if trainer.checkpoint_callbacks and not trainer.fast_dev_run:
                raise
            why = "fast_dev_run" if trainer.fast_dev_run else "no checkpoint callback"
            warn(
                f"{exc}. This fit saves no checkpoint ({why}), so it goes on; "
                f"a trainer.save_checkpoint() call would be refused the same way",
                rank=get_rank(),
            )


def last_verified_checkpoint(
    dirpath: Any, *, storage_options: Optional[dict[str, Any]] = None
) -> Optional[str]:
    """The newest checkpoint in a ``ModelCheckpoint`` folder that verifies, for ``ckpt_path``.

    Every ``.ckpt`` file in ``dirpath`` (``last.ckpt``, ``epoch=1-step=40.ckpt``...) is a
    candidate, newest first (by modification time, then by the step in its name); each
    is read whole and its records' CRC-32s checked, and one that fails (truncated,
    damaged) is skipped with a warning naming it and why.

    Args:
        dirpath: The ``ModelCheckpoint``'s ``dirpath`` (local or fsspec URL).
        storage_options: fsspec options for URLs.

    Returns:
        The path to pass as ``trainer.fit(..., ckpt_path=...)``, or None when there is
        none (no folder, no checkpoint, none that verifies): a fresh start.

    Example:
        >>> import tempfile
        >>> from ddpstate.integrations.lightning import last_verified_checkpoint
        >>> last_verified_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    text = os.fspath(dirpath)
    opts = _options(storage_options)
    if not storage.isdir(text, storage_options=opts):
        return None
    paths = [
        storage.join(text, name)
        for name in storage.listdir(text, storage_options=opts)
        if name.endswith(CKPT_SUFFIX)
    ]

    def newest(path: str) -> tuple[float, int]:
        step = _STEP.search(os.path.basename(path))
        return modified_time(path, opts), int(step.group(1)) if step else -1

    paths.sort(key=newest, reverse=True)
    return newest_verified(paths, what="Lightning checkpoint", storage_options=opts)
