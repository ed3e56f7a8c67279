"""``verify_file``: check that a checkpoint file, sharded folder or checkpoint folder is intact."""

from __future__ import annotations

import contextlib
import os
import zipfile
from typing import Any, Optional

from ddpstate import formats, storage
from ddpstate._convert.common import extent_problems, old_arguments
from ddpstate._convert.folders import verify_training_folder
from ddpstate._convert.results import VerifyResult
from ddpstate._fs import PathLike
from ddpstate._layout.hf_index import find_index, key_problems, read_index
from ddpstate._manifest import verify_checkpoint
from ddpstate._streaming.opener import read_checkpoint
from ddpstate._streaming.pickle_scan import TensorRecord, iter_tensors
from ddpstate._streaming.progress import Progress
from ddpstate._streaming.reader import Checkpoint, zip_entry_bytes
from ddpstate.errors import CheckpointCorruptError, CheckpointFormatError, DDPStateError


def verify_file(
    src: PathLike,
    *,
    weights_only: bool = True,
    progress: bool = False,
    storage_options: Optional[dict[str, Any]] = None,
    **legacy: Any,
) -> VerifyResult:
    """Check that a checkpoint file is readable end to end and every tensor record is whole.

    torch.save files: every zip record is read and its CRC-32 compared with
    the directory's; every storage the pickle refers to must have a record of
    the right size, and every tensor must lie inside its storage. Legacy and
    safetensors files: every tensor's data must be present (and is read).

    A folder is checked as a CheckpointManager step folder or directory by
    :func:`ddpstate.manager.verify_checkpoint` (manifest, sizes, CRC-32s,
    commit marker, ``latest`` pointer); the result's format is ``"manager"``.
    An Accelerate ``save_state`` or Hugging Face Trainer ``checkpoint-N`` folder
    (format ``"accelerate"``/``"hf_trainer"``): its ddpstate manifest when it has
    one, then each file on its own (weights-only; files that pickle other
    objects, such as RNG states, read as structure with nothing run; JSON parsed).
    A ``torch.distributed.checkpoint`` folder: its ``.metadata`` must parse, and
    every file it names must exist and reach its largest offset + length (DCP
    records no checksums); a ddpstate ``manifest.json`` in it adds its CRC-32s.

    Args:
        src: The checkpoint file, or a CheckpointManager, Accelerate or Trainer folder.
        weights_only: ``False`` also reads pickles naming unsafe globals (never run).
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
        try:
            kind = formats.detect_format(text, storage_options=storage_options)
        except CheckpointFormatError:
            find_index(text, storage_options)  # raises for two indexes, naming them
            kind = formats.MANAGER  # verify_checkpoint says what a manager folder lacks
        if kind == formats.DCP:
            # DCP needs torch: imported only for a folder, so files stay torch-free.
            from ddpstate._convert.dcp import verify_dcp

            return verify_dcp(text, storage_options=storage_options)
        if kind in (formats.ACCELERATE, formats.HF_TRAINER):

            def verify_one(path: str, weights_only: bool) -> VerifyResult:
                return verify_file(
                    path, weights_only=weights_only and not unsafe, progress=progress,
                    storage_options=storage_options,
                )  # fmt: skip

            return verify_training_folder(text, kind, verify_one, storage_options)
        if kind == formats.MANAGER:
            return _verify_folder(text, storage_options)
    index_path = find_index(text, storage_options)
    if index_path is not None:
        return verify_sharded(index_path, unsafe, progress, storage_options)
    try:
        ckpt = read_checkpoint(text, unsafe=unsafe, storage_options=storage_options)
    except CheckpointCorruptError as exc:
        return VerifyResult(path=text, format=None, problems=(str(exc),))
    with ckpt:
        return _verify_open(ckpt, progress)


def _verify_open(ckpt: Checkpoint, progress: bool) -> VerifyResult:
    """Check an open checkpoint file: its structure, then every record's bytes."""
    problems = [*ckpt.problems, *extent_problems(ckpt)]
    notes: list[str] = []
    tensors = [r for _, r in iter_tensors(ckpt.obj) if isinstance(r, TensorRecord)]
    zipped = ckpt.format == formats.TORCH_ZIP
    if zipped:
        total = sum(r.compressed_size for r in ckpt.zip_records.values())
    else:
        total = sum(s.stored_size for s in ckpt.storages if s.data_offset >= 0)
    read = 0
    with contextlib.closing(Progress(total, "verify", enabled=None if progress else False)) as bar:
        if zipped:
            read = _verify_zip_records(ckpt, problems, notes, bar)
        else:
            for s in ckpt.storages:
                if s.data_offset >= 0 and s.data_offset + s.stored_size <= ckpt.size:
                    ckpt.source.crc32(s.data_offset, s.stored_size, bar)
                    read += s.stored_size
    return VerifyResult(
        path=ckpt.path,
        format=ckpt.format,
        problems=tuple(problems),
        tensors=len(tensors),
        bytes_read=read,
        notes=tuple(notes),
    )


def _verify_zip_records(
    ckpt: Checkpoint, problems: list[str], notes: list[str], bar: Progress
) -> int:
    read = 0
    unchecked = 0
    for record in ckpt.zip_records.values():
        end = record.data_offset + record.compressed_size
        if end > ckpt.size:
            continue  # already reported by the reader
        if record.method != zipfile.ZIP_STORED:
            try:
                zip_entry_bytes(ckpt.source, record, ckpt.path)  # inflating checks the CRC
            except CheckpointCorruptError as exc:
                problems.append(f"zip entry {record.name}: {exc.__cause__ or exc}")
            read += record.compressed_size
            bar.update(record.compressed_size)
            continue
        crc = ckpt.source.crc32(record.data_offset, record.size, bar)
        read += record.size
        if record.crc32 == 0 and record.size and crc != 0:
            unchecked += 1  # written with torch's CRC computation turned off
        elif crc != record.crc32:
            problems.append(
                f"zip entry {record.name}: CRC-32 {crc:08x} does not match the recorded "
                f"{record.crc32:08x}; its bytes are damaged"
            )
    if unchecked:
        notes.append(
            f"{unchecked} record(s) carry no CRC (saved with CRC turned off): read, not checked"
        )
    return read


def _verify_folder(path: str, storage_options: Optional[dict[str, Any]]) -> VerifyResult:
    # One implementation: the manager's restore() accepts exactly what this passes.
    found = verify_checkpoint(path, storage_options=storage_options)
    steps = ", ".join(str(s) for s in found.steps) or "none"
    return VerifyResult(
        path=found.path,
        format=formats.MANAGER,
        problems=found.problems,
        bytes_read=found.bytes_read,
        notes=(
            f"{found.files} file(s) of committed step(s) {steps} checked against their manifest",
            *found.notes,
        ),
    )


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
        # One open per shard: the same checks verify_file runs, then the index's keys.
        try:
            ckpt = read_checkpoint(where, unsafe=unsafe, storage_options=storage_options)
        except DDPStateError as exc:
            problems.append(f"shard {shard}: {exc}")
            continue
        with ckpt:
            found = _verify_open(ckpt, progress)
            problems += [f"shard {shard}: {p}" for p in found.problems]
            tensors += found.tensors
            read += found.bytes_read
            if found.problems:
                continue
            obj = ckpt.obj
            if not isinstance(obj, dict):
                problems.append(f"shard {shard} is not a flat map of names to tensors")
                continue
            problems += key_problems(index, shard, [str(k) for k in obj])
            # Tied entries (aliases of one stored tensor) count once, as they are stored.
            stored = {
                id(v): v.nbytes
                for k, v in obj.items()
                if isinstance(v, TensorRecord) and index.weight_map.get(k) == shard
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
