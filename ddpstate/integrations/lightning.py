"""ddpstate inside Lightning: durable checkpoint writes and a resume that skips damaged files.

``Trainer(plugins=[DDPStateCheckpointIO()])`` (or ``Fabric(plugins=[...])``) makes every
checkpoint Lightning writes durable (fsynced before and after its atomic rename) and
loads them through ddpstate (weights-only, named errors);
``trainer.fit(model, ckpt_path=last_verified_checkpoint(dirpath))`` resumes from the
newest checkpoint that verifies. Needs ``pip install "ddpstate[lightning]"``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any, Optional

from ddpstate import storage
from ddpstate.checkpoint import load, save
from ddpstate.dist import get_rank
from ddpstate.errors import InvalidArgumentTypeError
from ddpstate.integrations._common import missing_framework, modified_time, newest_verified

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError as exc:  # the framework is an optional extra
    raise missing_framework("lightning", "lightning") from exc

__all__ = ["DDPStateCheckpointIO", "last_verified_checkpoint"]

#: ModelCheckpoint's file suffix.
CKPT_SUFFIX = ".ckpt"
_STEP = re.compile(r"step=(\d+)")


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


class DDPStateCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes and reads checkpoints through ddpstate.

    Saves go to a temporary file beside the target, fsynced, renamed onto it, and the
    folder fsynced (object stores: one upload), so a crash or power loss leaves the
    old checkpoint or the new one, never a torn file. Before writing, anything that
    a weights-only load could not restore is refused, named by its path in the
    checkpoint. Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on rank
    0 only, so neither is a collective: nothing waits for the other ranks.

    Args:
        storage_options: fsspec options (credentials, endpoint) for URL paths;
            ``trainer.save_checkpoint(..., storage_options=)`` adds to them per call.
        weights_only: Load weights-only (tensors, numbers, strings, containers and
            ddpstate's everyday types); ``False`` for checkpoints holding your own
            classes that you trust. Also checked at save time.
        safe_globals: Your own data-only types a weights-only load may build.

    Example:
        >>> import lightning as L  # doctest: +SKIP
        >>> from ddpstate.integrations.lightning import DDPStateCheckpointIO
        >>> trainer = L.Trainer(plugins=[DDPStateCheckpointIO()])  # doctest: +SKIP
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
        loaded: dict[str, Any] = load(
            path,
            map_location="cpu" if map_location is None else map_location,
            weights_only=self.weights_only if weights_only is None else weights_only,
            mmap=False,  # Lightning keeps the optimizer's tensors: plain memory, like torch.load
            barrier=False,  # each rank reads for itself, as Lightning calls it on every rank
            storage_options=self.storage_options,
            safe_globals=self.safe_globals,
        )
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (a missing one is no error)."""
        storage.remove(path, storage_options=self.storage_options, recursive=True, missing_ok=True)


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
