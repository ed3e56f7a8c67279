"""Hugging Face sharded checkpoints: an index JSON naming, for every key, the shard file holding it.

The layout (``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``
next to ``model-00001-of-00003.safetensors``...) is ``{"metadata": {"total_size":
N}, "weight_map": {key: shard file name}}``. This module finds and checks the
index and opens the shards: as one merged :class:`~ddpstate._streaming.reader.Checkpoint`
for the streaming commands (headers only, one tensor read at a time), or loaded
with torch for :func:`ddpstate.load`. Nothing here imports torch at import time.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Optional

from ddpstate import _fs
from ddpstate._streaming.stream import Source
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
)

if TYPE_CHECKING:
    from ddpstate._streaming.progress import Progress
    from ddpstate._streaming.reader import Checkpoint
    from ddpstate.convert import VerifyResult
    from ddpstate.location import ResolvedMapLocation

#: How the index files of the layout end (transformers writes these two).
INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")
#: The index name ``transformers`` and :mod:`ddpstate._hf.write` give safetensors shards.
SAFETENSORS_INDEX = "model.safetensors.index.json"
# An index is a few MB at most even for 100,000 keys; a larger one is not an index.
_MAX_INDEX_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class ShardIndex:
    """A parsed index file.

    Attributes:
        path: The index file.
        folder: The folder the shard names are relative to.
        weight_map: Key -> shard file name, in the index's order.
        shards: The shard file names, each once, sorted (the layout numbers them).
        total_size: ``metadata.total_size``, or None when absent.
        keys_of: Shard file name -> the keys the index puts in it.
    """

    path: str
    folder: str
    weight_map: dict[str, str]
    shards: tuple[str, ...]
    total_size: Optional[int]
    keys_of: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)

    def shard_path(self, shard: str) -> str:
        """The full path or URL of one shard."""
        return _join(self.folder, shard)


def _join(folder: str, name: str) -> str:
    from ddpstate import storage

    return storage.join(folder, name)


def folder_of(index: str) -> str:
    """The folder holding an index file (a URL stays a URL)."""
    if _fs.is_remote(index):
        return index.rsplit("/", 1)[0] if "/" in index.split("://", 1)[-1] else index
    return os.path.dirname(_fs.local_path(index)) or "."


def is_index_name(name: str) -> bool:
    """True when a file name ends the way the layout's index files do."""
    return name.lower().endswith(INDEX_SUFFIXES)


def find_index(path: str, storage_options: Optional[dict[str, Any]] = None) -> Optional[str]:
    """The index file of a sharded checkpoint named by ``path``, or None when it is not one.

    Args:
        path: An index file, or a folder holding one.
        storage_options: fsspec options for URLs.

    Returns:
        The index file's path, or None (``path`` is a plain file, or a folder
        without an index).

    Raises:
        CheckpointFormatError: The folder holds more than one index, so which
            checkpoint is meant is unclear.
    """
    from ddpstate import storage

    if not storage.isdir(path, storage_options=storage_options):
        return path if is_index_name(path) else None
    try:
        names = [
            n for n in storage.listdir(path, storage_options=storage_options) if is_index_name(n)
        ]
    except CheckpointNotFoundError:
        return None
    if len(names) > 1:
        raise CheckpointFormatError(
            f"{path}: holds {len(names)} sharded-checkpoint indexes ({', '.join(names)}), so "
            f"which checkpoint to read is unclear; pass the index file itself, e.g. "
            f"{_join(path, names[0])}"
        )
    return _join(path, names[0]) if names else None


def _bad_index(path: str, detail: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{path}: not a valid sharded-checkpoint index ({detail}); re-download it, or pass a "
        f"single checkpoint file"
    )


def _check_shard_name(index: str, key: str, shard: Any) -> str:
    if not isinstance(shard, str) or not shard:
        raise _bad_index(index, f"weight_map[{key!r}] is {shard!r}, not a file name")
    parts = shard.replace("\\", "/").split("/")
    # The names come from a downloaded file: never let one reach outside the folder.
    if shard.startswith(("/", "\\")) or ".." in parts or ":" in shard:
        raise _bad_index(index, f"weight_map[{key!r}] names {shard!r}, outside the index's folder")
    return shard


def read_index(path: str, storage_options: Optional[dict[str, Any]] = None) -> ShardIndex:
    """Read and check an index file.

    Args:
        path: The index file (``*.safetensors.index.json`` / ``*.bin.index.json``).
        storage_options: fsspec options for URLs.

    Returns:
        The :class:`ShardIndex`.

    Raises:
        CheckpointNotFoundError: No such file.
        CheckpointCorruptError: Not JSON, or not shaped like an index (the
            message says what is wrong).
    """
    from ddpstate import storage

    try:
        with storage.open_read(path, storage_options=storage_options) as f:
            raw = f.read(_MAX_INDEX_BYTES + 1)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{path}: no such file; check the path") from exc
    if len(raw) > _MAX_INDEX_BYTES:
        raise _bad_index(path, f"larger than {_MAX_INDEX_BYTES} bytes")
    try:
        parsed = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad_index(path, f"not JSON: {exc}") from exc
    if not isinstance(parsed, dict) or not isinstance(parsed.get("weight_map"), dict):
        raise _bad_index(path, "no 'weight_map' object")
    weight_map: dict[str, str] = {}
    by_shard: dict[str, list[str]] = {}
    for k, v in parsed["weight_map"].items():
        key = str(k)
        keys = by_shard.get(v) if isinstance(v, str) else None
        if keys is None:
            _check_shard_name(path, key, v)  # once per shard name, not per key
            keys = by_shard[v] = []
        keys.append(key)
        weight_map[key] = v
    if not weight_map:
        raise _bad_index(path, "an empty 'weight_map'")
    metadata = parsed.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
        raise _bad_index(path, f"metadata.total_size is {total!r}, not a byte count")
    return ShardIndex(
        path=path,
        folder=folder_of(path),
        weight_map=weight_map,
        shards=tuple(sorted(by_shard)),
        total_size=total,
        keys_of={shard: frozenset(keys) for shard, keys in by_shard.items()},
    )


def _mismatch(index: ShardIndex, detail: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{index.path}: the index and its shards disagree: {detail}; re-download the "
        f"checkpoint (`ddpstate verify` lists every problem)"
    )


def check_keys(index: ShardIndex, shard: str, keys: Sequence[str]) -> None:
    """Raise unless ``shard`` holds exactly the keys the index assigns to it.

    Raises:
        CheckpointCorruptError: A key is missing from its shard, or the shard
            holds a key the index lists elsewhere or not at all.
    """
    problems = key_problems(index, shard, keys)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise _mismatch(index, problems[0] + more)


def key_problems(index: ShardIndex, shard: str, keys: Sequence[str]) -> list[str]:
    """What is wrong between the keys ``shard`` holds and those the index gives it."""
    held = set(keys)
    if held == index.keys_of.get(shard, frozenset()) and len(held) == len(keys):
        return []
    problems = [
        f"key {k!r} is listed in {shard} but that shard does not hold it"
        for k, s in index.weight_map.items()
        if s == shard and k not in held
    ]
    for k in keys:
        owner = index.weight_map.get(k)
        if owner is None:
            problems.append(f"{shard} holds key {k!r}, which the index does not list")
        elif owner != shard:
            problems.append(f"key {k!r} is in {shard} too, but the index puts it in {owner}")
    return problems


# --------------------------------------------------------------------------- streaming view


class _ShardsSource(Source):
    """The shards as one address space: shard ``i``'s byte ``b`` is at ``base[i] + b``.

    The streaming engine reads a checkpoint through one :class:`Source`; giving
    it this one lets convert, diff and inspect run on a sharded checkpoint
    unchanged, one tensor in memory at a time.
    """

    def __init__(self, name: str, sources: list[Source]) -> None:
        self.name = name
        self.sources = sources
        self.bases: list[int] = []
        total = 0
        for source in sources:
            self.bases.append(total)
            total += source.size
        self.size = total
        self.fd = None  # no single descriptor: copies go through user space

    def close(self) -> None:
        for source in self.sources:
            source.close()

    def _locate(self, offset: int) -> tuple[Source, int]:
        import bisect

        i = max(bisect.bisect_right(self.bases, offset) - 1, 0)
        return self.sources[i], offset - self.bases[i]

    def read_at(self, offset: int, length: int) -> bytes:
        source, inner = self._locate(offset)
        return source.read_at(inner, length)

    def readinto_at(self, offset: int, view: memoryview) -> int:
        source, inner = self._locate(offset)
        return source.readinto_at(inner, view)

    def crc32(self, offset: int, length: int, progress: Optional[Progress] = None) -> int:
        source, inner = self._locate(offset)
        return source.crc32(inner, length, progress)


def _state_dict_of(ckpt: Checkpoint, shard: str, index: ShardIndex) -> dict[str, Any]:
    from ddpstate._streaming.pickle_scan import TensorRecord

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
    from ddpstate import formats
    from ddpstate._streaming.reader import Checkpoint

    index_path = find_index(path, storage_options)
    if index_path is None:
        raise CheckpointFormatError(f"{path}: no *.safetensors.index.json or *.bin.index.json")
    index = read_index(index_path, storage_options)
    shards: list[Checkpoint] = []
    try:
        for shard in index.shards:
            shards.append(_open_shard(index, shard, unsafe, storage_options))
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


def _open_shard(
    index: ShardIndex, shard: str, unsafe: bool, storage_options: Optional[dict[str, Any]]
) -> Checkpoint:
    from ddpstate._streaming.reader import read_file

    where = index.shard_path(shard)
    try:
        return read_file(where, unsafe=unsafe, storage_options=storage_options)
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{where}: shard named by {index.path} is missing; download every shard the index "
            f"lists ({len(index.shards)} in all)"
        ) from exc


# --------------------------------------------------------------------------- torch load


def load_sharded(
    path: str,
    resolved: ResolvedMapLocation,
    *,
    weights_only: bool,
    mmap: Optional[bool],
    storage_options: Optional[dict[str, Any]],
    safe_globals: Sequence[Any] = (),
) -> collections.OrderedDict[str, Any]:
    """Load a sharded checkpoint into one state dict, shard by shard.

    safetensors shards go through ddpstate's safetensors reader, torch shards
    through its safe ``torch.load`` (``weights_only`` as given); each shard's
    keys are checked against the index before the next shard is read.

    Args:
        path: The index file or its folder.
        resolved: The resolved ``map_location``.
        weights_only: As for :func:`ddpstate.load` (``.bin`` shards).
        mmap: As for :func:`ddpstate.load`.
        storage_options: fsspec options for URLs.
        safe_globals: As for :func:`ddpstate.load`.

    Returns:
        An ``OrderedDict`` of every tensor, in the index's order.

    Raises:
        CheckpointNotFoundError, CheckpointCorruptError, CheckpointFormatError,
        UnsafeCheckpointError: As for :func:`open_sharded` and :func:`ddpstate.load`.
    """
    from ddpstate import formats, storage
    from ddpstate._io.safetensors_io import read_safetensors
    from ddpstate._io.torch_io import load_torch_file
    from ddpstate.location import _place_all

    index_path = find_index(path, storage_options)
    if index_path is None:
        raise CheckpointFormatError(f"{path}: no *.safetensors.index.json or *.bin.index.json")
    index = read_index(index_path, storage_options)
    remote = _fs.is_remote(index_path)
    if mmap and remote:
        raise CheckpointFormatError(
            f"{path}: mmap=True is not possible here (the shards are remote); pass mmap=None"
        )
    merged: collections.OrderedDict[str, Any] = collections.OrderedDict()
    for shard in index.shards:
        where = index.shard_path(shard)
        try:
            kind = formats.detect_format(where, storage_options=storage_options)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{where}: shard named by {index.path} is missing; download every shard the "
                f"index lists ({len(index.shards)} in all)"
            ) from exc
        if kind == formats.SAFETENSORS:
            if remote:
                with storage.open_read(where, storage_options=storage_options) as f:
                    tensors = read_safetensors(f, mmap=False)
            else:
                tensors = read_safetensors(_fs.local_path(where), mmap=mmap is None or mmap)
            part = _place_all(tensors, "cpu", resolved)
        elif kind in (formats.TORCH_ZIP, formats.LEGACY):
            local = not remote and kind == formats.TORCH_ZIP
            if mmap and not local:
                raise CheckpointFormatError(
                    f"{where}: mmap=True is not possible here (a legacy torch file cannot be "
                    f"mapped); pass mmap=None"
                )
            with _opened(where, remote, storage_options) as src:
                part = load_torch_file(
                    src,
                    kind=kind,
                    name=where,
                    map_location=resolved,
                    weights_only=weights_only,
                    mmap=local if mmap is None else bool(mmap),
                    safe_globals=safe_globals,
                )
        else:
            raise CheckpointFormatError(
                f"{where}: a shard of {index.path} in format {kind!r}; shards must be "
                f"safetensors or torch.save files"
            )
        if not isinstance(part, dict) or not all(isinstance(k, str) for k in part):
            raise CheckpointFormatError(
                f"{where}: a shard of {index.path} that is not a state dict; a sharded "
                f"checkpoint's shards hold state-dict entries only"
            )
        check_keys(index, shard, list(part))
        merged.update(part)
    # The index's order: a state dict's own for files ddpstate writes (then nothing moves).
    if list(merged) == list(index.weight_map):
        return merged
    return collections.OrderedDict((k, merged[k]) for k in index.weight_map)


@contextlib.contextmanager
def _opened(where: str, remote: bool, storage_options: Optional[dict[str, Any]]) -> Iterator[Any]:
    if not remote:
        yield _fs.local_path(where)
        return
    from ddpstate import storage

    with storage.open_read(where, storage_options=storage_options) as f:
        yield f


# --------------------------------------------------------------------------- verify


def verify_sharded(
    path: str,
    *,
    unsafe: bool = False,
    progress: bool = False,
    storage_options: Optional[dict[str, Any]] = None,
) -> VerifyResult:
    """Check a sharded checkpoint: the index, every shard, and that they agree.

    Every shard the index names must exist and pass :func:`ddpstate.convert.verify_file`
    (CRC-32s, sizes); every key must be in exactly the shard the index names
    and in no other; ``metadata.total_size``, when given, must equal the bytes
    of the tensors the index lists.

    Args:
        path: The index file or the folder holding it.
        unsafe: As for :func:`ddpstate.convert.verify_file`.
        progress: Draw a progress bar per shard on stderr (only on a terminal).
        storage_options: fsspec options for URLs.

    Returns:
        A :class:`~ddpstate.convert.VerifyResult` for the index; each problem
        names the shard file or key.

    Raises:
        CheckpointFormatError: A folder holding two indexes.
    """
    from ddpstate import formats, storage
    from ddpstate._streaming.pickle_scan import TensorRecord
    from ddpstate._streaming.reader import read_file
    from ddpstate.convert import VerifyResult, verify_file
    from ddpstate.errors import DDPStateError

    index_path = find_index(path, storage_options) or path
    try:
        index = read_index(index_path, storage_options)
    except DDPStateError as exc:
        return VerifyResult(path=index_path, format=None, problems=(str(exc),))
    problems: list[str] = []
    tensors = read = 0
    listed_bytes = 0
    for shard in index.shards:
        where = index.shard_path(shard)
        if not storage.exists(where, storage_options=storage_options):
            problems.append(f"shard {shard} is missing (the index names it)")
            continue
        try:
            found = verify_file(
                where, unsafe=unsafe, progress=progress, storage_options=storage_options
            )
        except DDPStateError as exc:
            problems.append(f"shard {shard}: {exc}")
            continue
        problems += [f"shard {shard}: {p}" for p in found.problems]
        tensors += found.tensors
        read += found.bytes_read
        if found.problems:
            continue
        with read_file(where, unsafe=unsafe, storage_options=storage_options) as ckpt:
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
