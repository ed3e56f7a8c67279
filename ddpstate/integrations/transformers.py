"""ddpstate inside the Hugging Face Trainer: sealed ``checkpoint-N`` folders and a safe resume.

``Trainer(..., callbacks=[DDPStateCallback()])`` makes each ``checkpoint-N/`` durable and
verifiable once the Trainer has written it; ``trainer.train(resume_from_checkpoint=
last_verified_checkpoint(output_dir))`` resumes, through the Trainer's own resume (its
``TrainerState``: global step, epoch, data position), from the newest folder that
verifies. Needs ``pip install "ddpstate[transformers]"``.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

from ddpstate.dist import barrier, is_distributed
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
    """A ``TrainerCallback`` that seals every ``checkpoint-N/`` the Trainer writes.

    On ``on_save`` (the Trainer calls it after the folder is written: model,
    optimizer, scheduler, RNG states, ``trainer_state.json``), every rank first
    meets the others, since each writes its own RNG file, then each process that
    saves (``args.should_save``: the main process, or each node's with
    ``save_on_each_node``) fsyncs every file and the folder and writes ddpstate's
    ``manifest.json`` (sizes and CRC-32s) last. A folder without that manifest was
    interrupted before its commit; :func:`last_verified_checkpoint` skips it, and
    ``ddpstate verify checkpoint-N/`` checks a sealed one.

    Example:
        >>> from transformers import Trainer  # doctest: +SKIP
        >>> from ddpstate.integrations.transformers import DDPStateCallback
        >>> trainer = Trainer(model, args, train_dataset=data,  # doctest: +SKIP
        ...                   callbacks=[DDPStateCallback()])
    """

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Seal ``<output_dir>/checkpoint-<global_step>``.

        Raises:
            CheckpointWriteError: Syncing a file or writing the manifest failed.
            CheckpointFormatError: The folder holds a sub-folder (DeepSpeed's, FSDP's).
        """
        if is_distributed():
            barrier()  # every rank's files (rng_state_<rank>.pth) are written
        if args.should_save:
            name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            _common.seal_folder(
                os.path.join(str(args.output_dir), name),
                format=SEALED_FORMAT,
                world_size=args.world_size,
            )


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
