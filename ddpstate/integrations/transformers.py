"""ddpstate inside the Hugging Face Trainer: sealed ``checkpoint-N`` folders and a safe resume.

``Trainer(..., callbacks=[DDPStateCallback()])`` makes each ``checkpoint-N/`` durable and
verifiable once the Trainer has written it, and deletes older folders (the Trainer's
``save_total_limit``) only after that; ``trainer.train(resume_from_checkpoint=
last_verified_checkpoint(output_dir))`` resumes, through the Trainer's own resume (its
``TrainerState``: global step, epoch, data position), from the newest folder that
verifies. Needs ``pip install -e ".[transformers]"`` from a checkout
(``pip install "ddpstate[transformers]"`` once ddpstate is on PyPI).
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

from ddpstate import storage
from ddpstate._manifest import COMMITTED_BUT, MANIFEST_NAME
from ddpstate.dist import barrier, is_distributed, share_outcome
from ddpstate.errors import CheckpointWriteError, DDPStateError
from ddpstate.integrations import _common

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # the framework is an optional extra
    raise _common.missing_framework("transformers", "transformers") from exc

__all__ = ["DDPStateCallback", "last_verified_checkpoint"]

#: The manifest's ``format``: what wrote the sealed folder.
SEALED_FORMAT = "transformers-trainer"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class DDPStateCallback(TrainerCallback):
    """A ``TrainerCallback`` that seals every ``checkpoint-N/`` before older ones are deleted.

    On ``on_save`` (the Trainer calls it after the folder is written: model,
    optimizer, scheduler, RNG states, ``trainer_state.json``), every rank first
    meets the others, since each writes its own RNG file, then each process that
    saves (``args.should_save``: the main process, or each node's with
    ``save_on_each_node``) fsyncs every file and the folder, writes ddpstate's
    ``manifest.json`` (sizes and CRC-32s) last, fsyncs ``output_dir``, and only
    then deletes the folders beyond ``save_total_limit``, each manifest first.
    Every rank gets the outcome. A folder without that manifest was interrupted
    before its commit; :func:`last_verified_checkpoint` skips it, and
    ``ddpstate verify checkpoint-N/`` checks a sealed one.

    The Trainer deletes old folders (``save_total_limit``) before it calls
    ``on_save``, so a kill during the seal would leave no verified checkpoint; the
    callback therefore takes the limit over: from ``on_train_begin`` to
    ``on_train_end`` the Trainer sees ``args.save_total_limit = None`` (it is also
    what ``training_args.bin`` records) and the callback applies the limit itself,
    with the Trainer's rules: the newest folder and ``state.best_model_checkpoint``
    are always kept, and at the end of training a limit of 1 keeps only the best.

    Example:
        >>> from transformers import Trainer  # doctest: +SKIP
        >>> from ddpstate.integrations.transformers import DDPStateCallback
        >>> trainer = Trainer(model, args, train_dataset=data,  # doctest: +SKIP
        ...                   callbacks=[DDPStateCallback()])
    """

    def __init__(self) -> None:
        self._save_total_limit: Optional[int] = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Take ``save_total_limit`` over, so that the Trainer deletes nothing before a seal."""
        # None: not set, or already taken by a train() that raised before on_train_end.
        if args.save_total_limit is not None:
            self._save_total_limit = args.save_total_limit
            args.save_total_limit = None

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Seal ``<output_dir>/checkpoint-<global_step>``, then delete those beyond the limit.

        Raises:
            CheckpointWriteError: Syncing a file, writing the manifest or deleting an
                old folder failed (on every rank).
            CheckpointFormatError: The folder holds a sub-folder (DeepSpeed's, FSDP's).
        """
        if is_distributed():
            barrier()  # every rank's files (rng_state_<rank>.pth) are written
        folder = os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        error: Optional[BaseException] = None
        if args.should_save:
            try:
                _common.seal_folder(folder, format=SEALED_FORMAT, world_size=args.world_size)
                # The new folder's own name must outlive a power loss before older ones go.
                storage.fsync_dir(str(args.output_dir))
                _rotate(folder, self._save_total_limit, state.best_model_checkpoint)
            except Exception as exc:  # every rank is told, below
                error = exc
        share_outcome(error, name=f"DDPStateCallback.on_save: sealing {folder}")

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The Trainer's end-of-training rule (a limit of 1 keeps only the best); the limit back.

        Raises:
            CheckpointWriteError: Deleting a folder failed (on every rank).
        """
        limit = self._save_total_limit
        best = state.best_model_checkpoint
        error: Optional[BaseException] = None
        if limit == 1 and best is not None and args.should_save:
            found = _common.numbered(str(args.output_dir), _CHECKPOINT)
            try:
                for _, path in found:
                    if os.path.realpath(path) != os.path.realpath(best):
                        _remove(path, best)
            except Exception as exc:  # every rank is told, below
                error = exc
        if args.save_total_limit is None:
            args.save_total_limit = limit
        share_outcome(error, name="DDPStateCallback.on_train_end: save_total_limit")


def _remove(path: str, kept: str) -> None:
    try:
        _common.remove_checkpoint(path)
    except (DDPStateError, OSError) as exc:  # shutil.rmtree's errors come unwrapped
        raise CheckpointWriteError(
            f"{kept} {COMMITTED_BUT} removing the old checkpoint {path} (save_total_limit) "
            f"failed ({exc}); delete it by hand"
        ) from exc


def _rotate(newest: str, limit: Optional[int], best: Optional[str]) -> None:
    """The Trainer's ``save_total_limit`` rotation, run once ``newest`` is sealed.

    As the Trainer's (``transformers.trainer_utils.rotate_checkpoints``): at most
    ``limit`` ``checkpoint-N`` folders stay, the newest and the best among them, the
    others deleted oldest first. Unlike it, the newest is the folder just sealed (the
    Trainer's is the latest by modification time, or the highest N when those are
    within a second, which can be a stale folder of an abandoned run), and folders
    without a manifest (interrupted saves) go before sealed ones.
    """
    if limit is None or limit <= 0:
        return
    protected = {os.path.realpath(p) for p in (newest, best) if p is not None}
    found = [path for _, path in _common.numbered(os.path.dirname(newest), _CHECKPOINT)]
    others = [path for path in found if os.path.realpath(path) not in protected]
    # Stable: the uncommitted first, each group oldest first.
    others.sort(key=lambda path: os.path.exists(os.path.join(path, MANIFEST_NAME)))
    kept = max(0, limit - (len(found) - len(others)))
    for path in others[: max(0, len(others) - kept)]:
        _remove(path, newest)


def last_verified_checkpoint(
    output_dir: Any, *, storage_options: Optional[dict[str, Any]] = None
) -> Optional[str]:
    """The newest ``checkpoint-N`` folder that verifies, for ``resume_from_checkpoint``.

    Folders are tried from the highest ``N`` down; one without ddpstate's manifest
    (interrupted before :class:`DDPStateCallback` sealed it, or written without it)
    or failing it (a file missing, truncated or changed) is skipped with a warning
    naming it and why. Every byte of the folders checked is read.

    Args:
        output_dir: The Trainer's ``output_dir``.
        storage_options: fsspec options for URLs.

    Returns:
        The folder to pass as ``trainer.train(resume_from_checkpoint=...)``, or None
        when there is none that verifies (a fresh start).

    Example:
        >>> import tempfile
        >>> from ddpstate.integrations.transformers import last_verified_checkpoint
        >>> last_verified_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    found = _common.numbered(os.fspath(output_dir), _CHECKPOINT, storage_options)
    paths = [path for _, path in reversed(found)]
    return _common.newest_verified(
        paths, what="Trainer checkpoint", storage_options=storage_options
    )
