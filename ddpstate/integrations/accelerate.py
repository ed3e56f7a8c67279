"""Accelerate's ``save_state``/``load_state``, staged and committed with a ddpstate manifest.

``save_state`` writes exactly the files ``Accelerator.save_state`` writes (it calls
it), but into a hidden folder beside the target; the main process then records
every file's size and CRC-32 in ``manifest.json``, written last, fsyncs and swaps
the folder in. A crash or a failure midway leaves the previous checkpoints as
they were, and ``total_limit`` rotation runs only once the new one is committed
(Accelerate deletes the oldest first). ``load_state`` with no folder takes the
newest ``checkpoint_N`` that verifies, naming each one it skips. Needs
``pip install -e ".[accelerate]"`` from a checkout (``pip install "ddpstate[accelerate]"``
once ddpstate is on PyPI).
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Any, Optional

from ddpstate import _manifest, dist, storage
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    DDPStateError,
    InvalidArgumentError,
)
from ddpstate.integrations import _common

__all__ = ["load_state", "save_state"]

#: The ``format`` field of the manifest of a folder Accelerate wrote.
FORMAT = "accelerate"
_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")


def _require_accelerate() -> None:
    if importlib.util.find_spec("accelerate") is None:
        raise _common.missing_framework("accelerate", "accelerate")


def _checkpoints_dir(accelerator: Any) -> str:
    return os.path.join(accelerator.project_dir, "checkpoints")


def _target(accelerator: Any, output_dir: Optional[str]) -> str:
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise InvalidArgumentError(
                "save_state: pass output_dir, or turn on automatic checkpoint naming "
                "(Accelerator(project_config=ProjectConfiguration(automatic_checkpoint_naming=True)))"
            )
        return os.path.abspath(os.fspath(output_dir))
    if output_dir is not None:
        raise InvalidArgumentError(
            f"save_state: output_dir={output_dir!r} with automatic checkpoint naming on "
            f"(Accelerate would ignore it and write under {_checkpoints_dir(accelerator)}); "
            f"drop output_dir"
        )
    target = os.path.join(_checkpoints_dir(accelerator), f"checkpoint_{accelerator.save_iteration}")
    if os.path.exists(target):
        raise CheckpointExistsError(
            f"save_state: {target} already exists; set accelerator.project_configuration.iteration "
            f"past it (load_state does so on resume)"
        )
    return os.path.abspath(target)


def _manifest_of(folder: str, world_size: int) -> bytes:
    """The manifest of every file in ``folder``: each fsynced (Accelerate's writes never are)."""
    return _manifest.manifest_for(None, {}, world_size, None, _common.synced_files(folder), FORMAT)


def _rotate(accelerator: Any, target: str) -> None:
    """Keep the newest ``total_limit`` committed checkpoints; remove every older folder.

    Each goes manifest first, so a crash midway leaves an uncommitted folder,
    never a committed one with files missing.
    """
    limit = accelerator.project_configuration.total_limit
    if limit is None or not accelerator.project_configuration.automatic_checkpoint_naming:
        return
    folders = _common.numbered(os.path.dirname(target), _CHECKPOINT_RE)
    committed = [
        n for n, path in folders if os.path.exists(os.path.join(path, _manifest.MANIFEST_NAME))
    ]
    if len(committed) <= limit:
        return
    oldest_kept = committed[-limit]
    for n, path in folders:
        if n >= oldest_kept:
            break
        try:
            _common.remove_checkpoint(path)
        except DDPStateError as exc:
            raise CheckpointWriteError(
                f"save_state: {target} {_manifest.COMMITTED_BUT} removing the old checkpoint "
                f"{path} (total_limit={limit}) failed ({exc}); delete it by hand"
            ) from exc


def save_state(accelerator: Any, output_dir: Optional[str] = None, **kw: Any) -> str:
    """``accelerator.save_state``, committed atomically with a ddpstate manifest.

    Call it on every process, as ``Accelerator.save_state``. The main process
    stages a hidden folder beside the target; every process runs Accelerate's own
    ``save_state`` into it (so the files are exactly Accelerate's: weights,
    optimizer, scheduler, sampler, ``random_states_<i>.pkl``, custom objects); the
    main process then writes ``manifest.json`` (each file's size and CRC-32) last,
    fsyncs and swaps the folder in, and only then removes checkpoints beyond
    ``total_limit``. Any process's failure is raised on every process and leaves
    the folders on disk as they were. Local folders shared by the processes.

    Args:
        accelerator: The ``accelerate.Accelerator``.
        output_dir: The folder to write; None with automatic checkpoint naming
            (``project_dir/checkpoints/checkpoint_<iteration>``).
        **kw: Passed to ``Accelerator.save_state`` (``safe_serialization=`` ...).

    Returns:
        The committed folder.

    Raises:
        InvalidArgumentError: No folder named and automatic naming off (or both given).
        CheckpointExistsError: The automatic ``checkpoint_<iteration>`` exists.
        DDPStateError: Some process failed to write (the same error on every process).

    Example:
        >>> from accelerate import Accelerator  # doctest: +SKIP
        >>> from ddpstate.integrations.accelerate import save_state  # doctest: +SKIP
        >>> save_state(Accelerator(), "ckpt")  # doctest: +SKIP
        '/abs/ckpt'
    """
    _require_accelerate()
    config = accelerator.project_configuration
    target = staged = None
    error: Optional[BaseException] = None
    if dist.is_main_process():
        try:
            target = _target(accelerator, output_dir)
            staged = storage.stage_folder(target)
        except DDPStateError as exc:
            error = exc
    dist.share_outcome(error, name="save_state: staging")
    target, path = dist.broadcast_object((target, staged and staged.path))
    iteration, auto = config.iteration, config.automatic_checkpoint_naming
    config.automatic_checkpoint_naming = False  # so that it writes where it is told
    try:
        accelerator.save_state(path, **kw)
    except Exception as exc:
        error = exc
    finally:
        config.automatic_checkpoint_naming = auto
    try:
        dist.share_outcome(error, name=f"save_state({target}): writing")
        if staged is not None:  # the main process commits, then rotates
            try:
                staged.commit(_manifest_of(staged.path, dist.get_world_size()))
                _rotate(accelerator, staged.target)
            except Exception as exc:
                error = exc
        dist.share_outcome(error, name=f"save_state({target}): committing")
    except BaseException as exc:
        if staged is not None:
            staged.discard(exc)
        if not os.path.exists(os.path.join(target, _manifest.MANIFEST_NAME)):
            config.iteration = iteration  # nothing was committed: the number is free
        raise
    return str(target)


def load_state(accelerator: Any, input_dir: Optional[str] = None, **kw: Any) -> str:
    """``accelerator.load_state`` from the newest checkpoint that verifies.

    Call it on every process. With no ``input_dir`` (automatic checkpoint naming)
    the main process checks ``project_dir/checkpoints/checkpoint_N`` newest first
    against their manifests (sizes, CRC-32s) and takes the first that passes,
    warning about each one skipped (a truncated or missing file, no manifest);
    every process then runs Accelerate's own ``load_state`` on it (weights,
    optimizer, scheduler, RNG, custom objects, step), and the iteration counter
    moves past it so the next save does not collide. A named ``input_dir`` that
    holds a manifest must pass it.

    Args:
        accelerator: The ``accelerate.Accelerator``.
        input_dir: The folder to load; None: the newest verified automatic checkpoint.
        **kw: Passed to ``Accelerator.load_state``.

    Returns:
        The folder loaded.

    Raises:
        CheckpointNotFoundError: No checkpoint verifies.
        CheckpointCorruptError: ``input_dir``'s manifest does not match its files.
        InvalidArgumentError: No folder named and automatic naming off.

    Example:
        >>> from ddpstate.integrations.accelerate import load_state  # doctest: +SKIP
        >>> load_state(accelerator)  # doctest: +SKIP
        '/abs/project/checkpoints/checkpoint_3'
    """
    _require_accelerate()
    config = accelerator.project_configuration
    # The main process chooses; every process gets its choice, or its error.
    chosen: str = dist.gather_to_receivers(
        None,
        lambda _: _choose(accelerator, input_dir),
        dst=0,
        name="load_state: choosing the checkpoint",
    )
    accelerator.load_state(chosen, **kw)
    match = _CHECKPOINT_RE.match(os.path.basename(chosen))
    if config.automatic_checkpoint_naming and match:
        config.iteration = int(match.group(1)) + 1
    return chosen


def _choose(accelerator: Any, input_dir: Optional[str]) -> str:
    if input_dir is not None:
        folder = os.path.abspath(os.fspath(input_dir))
        if os.path.exists(os.path.join(folder, _manifest.MANIFEST_NAME)):
            found = _manifest.verify_checkpoint(folder)
            if found.problems:
                raise CheckpointCorruptError(
                    f"load_state: {folder} fails its manifest: {'; '.join(found.problems)}"
                )
        return folder
    if not accelerator.project_configuration.automatic_checkpoint_naming:
        raise InvalidArgumentError(
            "load_state: pass input_dir, or turn on automatic checkpoint naming"
        )
    parent = _checkpoints_dir(accelerator)
    candidates = [path for _, path in reversed(_common.numbered(parent, _CHECKPOINT_RE))]
    chosen = _common.newest_verified(candidates, what="load_state")
    if chosen is None:
        raise CheckpointNotFoundError(
            f"load_state: no checkpoint_N folder in {parent} verifies ({len(candidates)} found); "
            f"nothing to resume from"
        )
    return chosen
