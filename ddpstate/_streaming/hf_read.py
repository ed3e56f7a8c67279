"""Hugging Face sharded checkpoints streamed: the shards read as one checkpoint.

The layout (``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``
next to ``model-00001-of-00003.safetensors``...) is ``{"metadata": {"total_size":
N}, "weight_map": {key: shard file name}}`` (:mod:`ddpstate._layout.hf_index` reads it).
This module opens the shards as one merged :class:`~ddpstate._streaming.reader.Checkpoint`
for the streaming commands (headers only, one tensor read at a time);
:mod:`ddpstate._io.hf_sharded` loads them with torch for :func:`ddpstate.load`.
"""

from __future__ import annotations

import bisect
import collections
import itertools
from typing import Any, Optional

from ddpstate import formats
from ddpstate._layout.hf_index import ShardIndex, check_keys, open_index
from ddpstate._streaming.pickle_scan import TensorRecord
from ddpstate._streaming.reader import Checkpoint, read_file
from ddpstate._streaming.stream import Source
from ddpstate.errors import CheckpointFormatError, CheckpointNotFoundError


class _ShardsSource(Source):
    """The shards as one address space: shard ``i``'s byte ``b`` is at ``base[i] + b``.

    The streaming engine reads a checkpoint through one :class:`Source`; giving
    it this one lets convert, diff and inspect run on a sharded checkpoint
    unchanged, one tensor in memory at a time.
    """

    def __init__(self, name: str, sources: list[Source]) -> None:
        self.name = name
        self.sources = sources
        self.bases = [0, *itertools.accumulate(source.size for source in sources)]
        self.size = self.bases.pop()
        self.fd = None  # no single descriptor: copies go through user space

    def close(self) -> None:
        for source in self.sources:
            source.close()

    def _locate(self, offset: int) -> tuple[Source, int]:
        i = max(bisect.bisect_right(self.bases, offset) - 1, 0)
        return self.sources[i], offset - self.bases[i]

    def segment_end(self, offset: int) -> int:
        """The end, in this address space, of the shard holding ``offset``."""
        source, inner = self._locate(offset)
        return offset - inner + source.size

    def read_at(self, offset: int, length: int) -> bytes:
        source, inner = self._locate(offset)
        return source.read_at(inner, length)

    def readinto_at(self, offset: int, view: memoryview) -> int:
        source, inner = self._locate(offset)
        return source.readinto_at(inner, view)


def _state_dict_of(ckpt: Checkpoint, shard: str, index: ShardIndex) -> dict[str, Any]:
    obj = ckpt.obj
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, TensorRecord) for k, v in obj.items()
    ):
        raise CheckpointFormatError(
            f"{index.shard_path(shard)}: a shard of {index.path} that is not a flat map of "
            f"names to tensors; a sharded checkpoint's shards hold state-dict entries only"
        )
    return obj


def open_sharded(
    path: str, *, unsafe: bool = False, storage_options: Optional[dict[str, Any]] = None
) -> Checkpoint:
    """Open every shard down to its structure and merge them into one :class:`Checkpoint`.

    The result's ``obj`` is the whole state dict (keys in the index's order), its
    ``source`` reads any shard's bytes, and no tensor data is read.

    Args:
        path: The index file or the folder holding it.
        unsafe: As for :func:`ddpstate._streaming.reader.read_file` (``.bin`` shards).
        storage_options: fsspec options for URLs.

    Returns:
        The merged checkpoint; its ``format`` is ``formats.HF_SHARDED`` and its
        ``path`` the index.

    Raises:
        CheckpointNotFoundError: The index or a shard is missing.
        CheckpointCorruptError: The index and the shards disagree, or a shard is damaged.
        CheckpointFormatError: A shard is not a flat state dict, or the shards'
            byte orders differ.
    """
    index = open_index(path, storage_options)
    shards: list[Checkpoint] = []
    try:
        for shard in index.shards:
            where = index.shard_path(shard)
            try:
                shards.append(read_file(where, unsafe=unsafe, storage_options=storage_options))
            except CheckpointNotFoundError as exc:
                raise index.missing(shard) from exc
        merged: collections.OrderedDict[str, Any] = collections.OrderedDict()
        for shard, ckpt in zip(index.shards, shards, strict=True):
            entries = _state_dict_of(ckpt, shard, index)
            check_keys(index, shard, list(entries))
            merged.update(entries)
        orders = {c.byteorder for c in shards}
        if len(orders) > 1:
            raise CheckpointFormatError(
                f"{index.path}: its shards mix byte orders ({', '.join(sorted(orders))}); "
                f"re-save them on one machine"
            )
        source = _ShardsSource(index.path, [c.source for c in shards])
        storages = []
        for shard, ckpt, base in zip(index.shards, shards, source.bases, strict=True):
            if any(storage.compressed for storage in ckpt.storages):
                # Inflating needs the shard's own zip reader; torch.save never compresses.
                raise CheckpointFormatError(
                    f"{index.shard_path(shard)}: stores compressed zip records (not torch.save's "
                    f"own output), which a sharded read cannot stream; convert that shard on "
                    f"its own first (`ddpstate convert`)"
                )
            for storage in ckpt.storages:
                if storage.data_offset >= 0:
                    storage.data_offset += base
                storages.append(storage)
        st_metadata = next((c.st_metadata for c in shards if c.format == formats.SAFETENSORS), {})
        return Checkpoint(
            path=index.path,
            format=formats.HF_SHARDED,
            size=source.size,
            obj=collections.OrderedDict((k, merged[k]) for k in index.weight_map),
            storages=storages,
            globals_used=tuple(sorted({g for c in shards for g in c.globals_used})),
            unsafe_globals=tuple(sorted({g for c in shards for g in c.unsafe_globals})),
            byteorder=shards[0].byteorder,
            problems=[
                f"{s}: {p}" for s, c in zip(index.shards, shards, strict=True) for p in c.problems
            ],
            source=source,
            st_metadata=dict(st_metadata),
        )
    except BaseException:
        for ckpt in shards:
            ckpt.close()
        raise
