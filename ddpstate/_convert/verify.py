"""``verify_file``: check that a checkpoint file, sharded folder or checkpoint folder is intact."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Optional

import torch

from ddpstate import formats, storage
from ddpstate._convert.common import old_arguments
from ddpstate._convert.folders import verify_training_folder
from ddpstate._convert.results import VerifyResult
from ddpstate._convert.source import Checkpoint, failures_named, iter_tensors, read_checkpoint
from ddpstate._fs import PathLike
from ddpstate._io.torch_io import check_container
from ddpstate._layout.hf_index import find_index, key_problems, read_index
from ddpstate._layout.torch_zip import check_crcs
from ddpstate._manager.config import make_config
from ddpstate._manager.restore import choose
from ddpstate._manager.writer import StepWriter
from ddpstate._manifest import StepFolders, step_name, verify_checkpoint
from ddpstate._progress import Progress
from ddpstate.errors import CheckpointCorruptError, CheckpointFormatError, DDPStateError

# Files other than torch zips are read through in pieces this size.
_PIECE = 4 << 20


def verify_file(
    src: PathLike,
    *,
    weights_only: bool = True,
    progress: bool = False,
    storage_options: Optional[dict[str, Any]] = None,
    **legacy: Any,
) -> VerifyResult:
    """Check that a checkpoint file loads with torch and every record is whole.

    The verdict is torch's: the file must load with ``torch.load(weights_only=True)``
    (safetensors: the ``safetensors`` library), after the container check that
    refuses what torch's reader does not (duplicate or overlapping records, names
    outside the archive folder, compressed records). torch.save files: every zip
    record is then read and its CRC-32 compared with the directory's. Legacy and
    safetensors files are read through.

    A folder is checked as a CheckpointManager step folder or directory by
    :func:`ddpstate.manager.verify_checkpoint` (manifest, sizes, CRC-32s,
    commit marker, ``latest`` pointer); the result's format is ``"manager"``. For a
    manager directory, ``checkpoints`` says which committed steps verify and
    ``resume_from`` names the step ``CheckpointManager.restore()`` takes (its own
    chooser, run read-only; it reads the newest candidates once more).
    An Accelerate ``save_state`` or Hugging Face Trainer ``checkpoint-N`` folder
    (format ``"accelerate"``/``"hf_trainer"``): its ddpstate manifest when it has
    one, then each file on its own (weights-only; files that pickle other
    objects, such as RNG states, read as structure with nothing run; JSON parsed).
    A ``torch.distributed.checkpoint`` folder: its ``.metadata`` must parse, and
    every file it names must exist and reach its largest offset + length (DCP
    records no checksums); a ddpstate ``manifest.json`` in it adds its CRC-32s.

    Args:
        src: The checkpoint file, or a CheckpointManager, Accelerate or Trainer folder.
        weights_only: ``False`` loads with torch's full unpickler, which runs
            whatever code the file names: only for files you trust.
        progress: Draw a progress bar on stderr (only on a terminal).
        storage_options: fsspec options for URLs.
        **legacy: ``unsafe=`` (now ``weights_only=``, inverted), with a
            ``DeprecationWarning``.

    Returns:
        A :class:`VerifyResult`; ``.ok`` is the verdict, ``.problems`` says what is wrong.

    Raises:
        CheckpointNotFoundError: No such file.
        CheckpointFormatError: Not a checkpoint file at all, or a folder that
            is not a CheckpointManager folder.
        UnsafeCheckpointError: Unsafe globals and ``weights_only`` is True.

    Example:
        >>> import torch, tempfile, os
        >>> from ddpstate.convert import verify_file
        >>> p = os.path.join(tempfile.mkdtemp(), "m.pt")
        >>> torch.save({"w": torch.ones(2)}, p)
        >>> verify_file(p).ok
        True
    """
    unsafe = not old_arguments("verify_file", legacy, weights_only=weights_only)[0]
    text = os.fspath(src)
    if storage.isdir(text, storage_options=storage_options):
        # On a URL, a folder saved over a committed one (DurableWriter, ddpstate.save) is the
        # version folder its manifest points to; a manager folder follows its own pointers.
        committed = storage.committed_folder(text, storage_options=storage_options)
        try:
            kind = formats.detect_format(committed, storage_options=storage_options)
        except CheckpointFormatError:
            find_index(text, storage_options)  # raises for two indexes, naming them
            kind = formats.MANAGER  # verify_checkpoint says what a manager folder lacks
        if kind == formats.DCP:
            # DCP needs torch: imported only for a folder, so files stay torch-free.
            from ddpstate._convert.dcp import verify_dcp

            return verify_dcp(committed, storage_options=storage_options)
        if kind in (formats.ACCELERATE, formats.HF_TRAINER):

            def verify_one(path: str, weights_only: bool) -> VerifyResult:
                if not (weights_only or unsafe):  # never unpickled: its records alone
                    return verify_records(path, progress=progress, storage_options=storage_options)
                return verify_file(
                    path, weights_only=weights_only and not unsafe, progress=progress,
                    storage_options=storage_options,
                )  # fmt: skip

            return verify_training_folder(committed, kind, verify_one, storage_options)
        if kind == formats.MANAGER:
            return _verify_folder(text, storage_options)
    index_path = find_index(text, storage_options)
    if index_path is not None:
        return verify_sharded(index_path, unsafe, progress, storage_options)
    try:
        with failures_named(text):
            ckpt = read_checkpoint(text, unsafe=unsafe, storage_options=storage_options)
    except CheckpointCorruptError as exc:
        return VerifyResult(path=text, format=None, problems=(str(exc),))
    return _verify_bytes(ckpt.path, ckpt, progress, storage_options)


def verify_records(
    path: str, *, progress: bool = False, storage_options: Optional[dict[str, Any]] = None
) -> VerifyResult:
    """Check a file's bytes without unpickling it: a torch zip's container and CRC-32s.

    For files whose pickle holds objects beyond weights-only (a Lightning ``.ckpt``, a
    Trainer's ``training_args.bin``): their integrity, with nothing from them run. Legacy
    and safetensors files are read through.

    Args:
        path: The file (local path or fsspec URL).
        progress: Draw a progress bar on stderr (only on a terminal).
        storage_options: fsspec options for URLs.

    Returns:
        A :class:`~ddpstate.convert.VerifyResult` (``tensors`` is 0: nothing is unpickled).

    Example:
        >>> import torch, tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "m.pt")
        >>> torch.save({"w": torch.ones(2)}, p)
        >>> verify_records(p).ok
        True
    """
    with failures_named(path):
        return _verify_bytes(path, None, progress, storage_options)


def _verify_bytes(
    path: str, ckpt: Optional[Checkpoint], progress: bool, opts: Optional[dict[str, Any]]
) -> VerifyResult:
    """Read every byte of a file, each zip record against its CRC-32.

    ``ckpt`` is the file as torch loaded it; without it nothing is unpickled (a file
    whose pickle needs more than weights-only: its container and records alone).
    """
    problems: list[str] = []
    notes: list[str] = []
    kind = ckpt.format if ckpt is not None else formats.detect_format(path, storage_options=opts)
    bar = Progress(ckpt.size if ckpt else 0, "verify", enabled=None if progress else False)
    with contextlib.closing(bar), storage.open_read(path, storage_options=opts) as f:
        if kind == formats.TORCH_ZIP:
            try:
                archive = check_container(f, path)
            except CheckpointCorruptError as exc:
                return VerifyResult(path=path, format=None, problems=(str(exc),))
            problems, unchecked = check_crcs(f, archive, bar.update)
            read = sum(r.size for r in archive.records.values())
            if unchecked:
                notes.append(
                    f"{unchecked} record(s) carry no CRC (saved with CRC turned off): read, "
                    f"not checked"
                )
        else:
            read = 0
            while piece := f.read(_PIECE):
                read += len(piece)
                bar.update(len(piece))
    return VerifyResult(
        path=path,
        format=kind,
        problems=tuple(problems),
        tensors=sum(1 for _ in iter_tensors(ckpt.obj)) if ckpt is not None else 0,
        bytes_read=read,
        notes=tuple(notes),
    )


def _verify_folder(path: str, storage_options: Optional[dict[str, Any]]) -> VerifyResult:
    # One implementation: the manager's restore() accepts exactly what this passes.
    found = verify_checkpoint(path, storage_options=storage_options)
    steps = ", ".join(str(s) for s in found.steps) or "none"
    notes = [
        f"{found.files} file(s) of committed step(s) {steps} checked against their manifest",
        *found.notes,
    ]
    verdicts: dict[str, bool] = {}
    resume: Optional[str] = None
    if StepFolders(path, storage_options).committed_steps():  # a manager directory
        for step in found.steps:
            name = step_name(step)
            verdicts[name] = not any(p.startswith(f"{name}: ") for p in found.problems)
        chosen = _restore_choice(path, storage_options)
        resume = step_name(chosen) if chosen is not None else None
        notes.append(
            f"restore() takes {resume} (the newest step that verifies)"
            if resume is not None
            else "restore() finds no step that verifies: it would refuse to resume"
        )
    return VerifyResult(
        path=found.path,
        format=formats.MANAGER,
        problems=found.problems,
        bytes_read=found.bytes_read,
        notes=tuple(notes),
        checkpoints=verdicts,
        resume_from=resume,
    )


def _restore_choice(directory: str, opts: Optional[dict[str, Any]]) -> Optional[int]:
    """The step ``CheckpointManager(directory).restore()`` takes: its own chooser, read-only."""
    config = make_config(
        directory, keep_last=None, best=None, async_save=False, format=formats.PT,
        storage_options=opts, timeout=None, safe_globals=(), local=None, writers="rank0",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its "skipping step_N" repeats the problems listed
        try:
            chosen = choose(StepWriter(config), None)
        except CheckpointCorruptError:  # committed steps, none of them whole
            return None
    return chosen.step if chosen is not None else None


def verify_sharded(
    index_path: str, unsafe: bool, progress: bool, storage_options: Optional[dict[str, Any]]
) -> VerifyResult:
    """Check a sharded checkpoint: the index, every shard, and that they agree.

    Every shard the index names must exist and pass :func:`ddpstate.convert.verify_file`
    (CRC-32s, sizes); every key must be in exactly the shard the index names
    and in no other; ``metadata.total_size``, when given, must equal the bytes
    of the tensors the index lists.

    Args:
        index_path: The index file (as :func:`~ddpstate._layout.hf_index.find_index` finds it).
        unsafe: As for :func:`ddpstate.convert.verify_file`.
        progress: Draw a progress bar per shard on stderr (only on a terminal).
        storage_options: fsspec options for URLs.

    Returns:
        A :class:`~ddpstate.convert.VerifyResult` for the index; each problem
        names the shard file or key.
    """
    try:
        index = read_index(index_path, storage_options)
    except DDPStateError as exc:
        return VerifyResult(path=index_path, format=None, problems=(str(exc),))
    problems: list[str] = []
    tensors = read = 0
    listed_bytes = 0
    for shard in index.shards:
        try:
            where = index.shard_path(shard)
        except DDPStateError as exc:  # a symlink out of the folder, a FIFO: never opened
            problems.append(str(exc))
            continue
        if not storage.exists(where, storage_options=storage_options):
            problems.append(f"shard {shard} is missing (the index names it)")
            continue
        # The same checks verify_file runs, then the index's keys.
        try:
            with failures_named(where):
                ckpt = read_checkpoint(where, unsafe=unsafe, storage_options=storage_options)
        except DDPStateError as exc:
            problems.append(f"shard {shard}: {exc}")
            continue
        found = _verify_bytes(ckpt.path, ckpt, progress, storage_options)
        problems += [f"shard {shard}: {p}" for p in found.problems]
        tensors += found.tensors
        read += found.bytes_read
        if found.problems:
            continue
        obj = ckpt.obj
        if not isinstance(obj, dict):
            problems.append(f"shard {shard} is not a flat map of names to tensors")
            continue
        problems += key_problems(index, shard, obj)
        # Tied entries (aliases of one stored tensor) count once, as they are stored.
        stored = {
            (v.data_ptr(), v.shape, v.stride(), v.dtype): v.nbytes
            for k, v in obj.items()
            if isinstance(v, torch.Tensor) and index.weight_map.get(k) == shard
        }
        listed_bytes += sum(stored.values())
    if index.total_size is not None and not problems and listed_bytes != index.total_size:
        problems.append(
            f"metadata.total_size is {index.total_size} but the tensors the index lists hold "
            f"{listed_bytes} bytes"
        )
    return VerifyResult(
        path=index.path,
        format=formats.HF_SHARDED,
        problems=tuple(problems),
        tensors=tensors,
        bytes_read=read,
        notes=(f"{len(index.shards)} shard(s), {len(index.weight_map)} key(s) in the index",),
    )
