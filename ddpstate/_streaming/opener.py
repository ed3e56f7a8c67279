"""Opening whatever a streaming command is given: one checkpoint file, or a sharded folder.

The single-file reader (:mod:`ddpstate._streaming.reader`) sits below the
Hugging Face sharded reader (:mod:`ddpstate._streaming.hf_read`), which merges one
:class:`~ddpstate._streaming.reader.Checkpoint` per shard; this module sits
above both and picks one, so neither has to import the other back.
"""

from __future__ import annotations

from typing import Any, Optional

from ddpstate import formats, storage
from ddpstate._layout.hf_index import is_index_name
from ddpstate._streaming.hf_read import open_sharded
from ddpstate._streaming.reader import Checkpoint, read_file
from ddpstate.errors import CheckpointFormatError

__all__ = ["read_checkpoint"]


def read_checkpoint(
    path: str,
    *,
    unsafe: bool = False,
    storage_options: Optional[dict[str, Any]] = None,
) -> Checkpoint:
    """Read a checkpoint's structure: the zip directory and pickle, or the safetensors header.

    No tensor data is read and no code from the file runs: globals become
    placeholders. Structural problems (a missing tensor record, a size that
    does not match) are collected in ``Checkpoint.problems``.

    Args:
        path: Local path or fsspec URL of a single checkpoint file, or of a
            Hugging Face sharded checkpoint (its shards merged into one view).
        unsafe: Read pickles that name globals ``torch.load(weights_only=True)``
            refuses (they stay placeholders; nothing runs either way).
        storage_options: fsspec options for URLs.

    Returns:
        The open :class:`~ddpstate._streaming.reader.Checkpoint`; close it when
        done (or use ``with``).

    Raises:
        CheckpointNotFoundError: No such file.
        CheckpointFormatError: Not a checkpoint file, or a TorchScript archive
            or a torch.distributed.checkpoint folder.
        CheckpointCorruptError: The file is truncated or its structure damaged.
        UnsafeCheckpointError: The pickle names unsafe globals and ``unsafe`` is False.

    Example:
        >>> import torch, tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "m.pt")
        >>> torch.save({"module.w": torch.ones(2)}, p)
        >>> with read_checkpoint(p) as ckpt:
        ...     ckpt.format, list(ckpt.obj)
        ('pt', ['module.w'])
    """
    # Folders and index files are told apart by detect_format, as before; a plain
    # file goes straight to the reader, which opens it once and detects its format
    # from the bytes it has open.
    if is_index_name(path) or storage.isdir(path, storage_options=storage_options):
        kind = formats.detect_format(path, storage_options=storage_options)
        if kind == formats.HF_SHARDED:
            return open_sharded(path, unsafe=unsafe, storage_options=storage_options)
        if kind == formats.DCP:
            raise CheckpointFormatError(
                f"{path}: a torch.distributed.checkpoint folder; this command reads single "
                f"checkpoint files (torch.save, legacy torch or safetensors)"
            )
    return read_file(path, unsafe=unsafe, storage_options=storage_options)
