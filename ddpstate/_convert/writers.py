"""The output writers of ``convert``: a torch.save zip, a safetensors file, a sharded folder."""

from __future__ import annotations

import collections
import hashlib
import struct
import zlib
from collections.abc import Iterator, Mapping
from typing import IO, Any, Optional

from ddpstate import formats
from ddpstate._convert.common import describe
from ddpstate._convert.tensor_data import load_tensor, storage_bytes, torch_dtype
from ddpstate._layout.safetensors import (
    CODES,
    STATE_DICT_METADATA_KEY,
    View,
    build_header,
    find_aliases,
    state_dict_metadata_json,
)
from ddpstate._streaming import hf_write as _hf_write
from ddpstate._streaming.cast import Casts
from ddpstate._streaming.pickle_emit import dump_checkpoint_pickle
from ddpstate._streaming.pickle_rewrite import rename_keys
from ddpstate._streaming.pickle_scan import StorageRecord, TensorRecord
from ddpstate._streaming.progress import Progress
from ddpstate._streaming.reader import Checkpoint
from ddpstate._streaming.stream import Sink
from ddpstate._streaming.zipwriter import CopyCandidate, ReadWindow, ZipWriter
from ddpstate.errors import CheckpointCorruptError, CheckpointFormatError

# torch.save's archive folder name when it cannot use the file's own name.
_ARCHIVE = "archive/"
# The zip format version torch 2.x writes in the "version" record.
_ZIP_VERSION = b"3\n"


def _serialization_id(pickle_bytes: bytes, records: list[tuple[int, int]]) -> bytes:
    # torch.save stores a unique id per save; a digest of the content keeps the
    # output deterministic, so converting an already converted file is a no-op.
    digest = hashlib.sha1(pickle_bytes)
    for crc, size in records:
        digest.update(struct.pack("<IQ", crc, size))
    return str(int(digest.hexdigest(), 16) % 10**40).zfill(40).encode("ascii")


def copied_pickle(
    ckpt: Checkpoint, path: Optional[tuple[Any, ...]], sd: Any, new_sd: Any
) -> Optional[bytes]:
    """``data.pkl`` for the output by copying the source's through, or None.

    Only where the result is, to the byte, what re-emitting the renamed tree
    gives (:mod:`ddpstate._streaming.pickle_rewrite` says why): a torch.save-shaped pickle,
    storages already numbered in first-use order and tagged ``cpu``, and a rename
    that changes the keys and at most the ``_metadata`` attribute (spliced in
    re-emitted), every value kept, dicts all the way down to the state dict.
    """
    layout = ckpt.pickle_layout
    if layout is None or ckpt.format != formats.TORCH_ZIP:
        return None
    if any(s.location != "cpu" or s.key != str(i) for i, s in enumerate(ckpt.storages)):
        return None
    if sd is None:
        return rename_keys(ckpt.pickle_bytes, layout, [])
    if path is None or type(new_sd) is not type(sd) or len(new_sd) != len(sd):
        return None
    state = None
    old_attrs = getattr(sd, "__dict__", None) or {}
    new_attrs = getattr(new_sd, "__dict__", None) or {}
    if old_attrs or new_attrs:
        if set(old_attrs) != {"_metadata"} or set(new_attrs) != {"_metadata"}:
            return None
        state = (old_attrs, new_attrs)  # what the pickler writes as BUILD state
    node = ckpt.obj
    for step in path:
        if not isinstance(node, dict):
            return None
        node = node[step]
    if node is not sd or not isinstance(sd, dict):
        return None
    renames = []
    for (old, value), (new, kept) in zip(sd.items(), new_sd.items(), strict=True):
        if value is not kept or type(old) is not type(new):
            return None
        if old != new:
            if not isinstance(old, str):
                return None
            renames.append((old, new))
    return rename_keys(ckpt.pickle_bytes, layout, renames, state)


def write_pt(
    sink: Sink,
    ckpt: Checkpoint,
    root: Any,
    pickle_bytes: Optional[bytes] = None,
    casts: Optional[Casts] = None,
) -> tuple[int, int]:
    """Write a torch.save zip of ``root`` (or of ``pickle_bytes``); ``(storages, bytes copied)``."""
    if pickle_bytes is not None:
        data_pkl, storages = pickle_bytes, ckpt.storages
    else:
        data_pkl, storages = dump_checkpoint_pickle(root, casts.replace if casts else None)
    writer = ZipWriter(sink)
    writer.add_bytes(_ARCHIVE + "data.pkl", data_pkl)
    writer.add_bytes(_ARCHIVE + ".format_version", b"1")
    writer.add_bytes(_ARCHIVE + ".storage_alignment", b"64")
    writer.add_bytes(_ARCHIVE + "byteorder", ckpt.byteorder.encode("ascii"))
    sizes = [storage.nbytes for storage in storages]
    crcs = list(
        zip(
            writer.add_copies(ckpt.source, _copy_candidates(ckpt, storages, casts)),
            sizes,
            strict=True,
        )
    )
    copied = sum(sizes)
    version = _ZIP_VERSION
    if ckpt.zip_prefix + "version" in ckpt.zip_records:
        record = ckpt.zip_records[ckpt.zip_prefix + "version"]
        version = ckpt.source.read_at(record.data_offset, record.size)
        if zlib.crc32(version) != record.crc32 or not version.strip().isdigit():
            raise CheckpointCorruptError(
                f"{ckpt.path}: zip entry {record.name} holds {version[:16]!r}, not the format "
                f"version number its CRC-32 records; the file is damaged: re-save or "
                f"re-download it (`ddpstate verify` lists every damaged record)"
            )
    writer.add_bytes(_ARCHIVE + "version", version)
    writer.add_bytes(_ARCHIVE + ".data/serialization_id", _serialization_id(data_pkl, crcs))
    writer.close()
    return len(storages), copied


def _copy_candidates(
    ckpt: Checkpoint, storages: list[StorageRecord], casts: Optional[Casts]
) -> Iterator[CopyCandidate]:
    """The output's storage records for :meth:`ZipWriter.add_copies`, made one at a time.

    A storage that ``casts`` makes anew has no offset in the source (``data_offset``
    -1), so it always goes through its ``write`` callback, which casts it.
    """
    for index, storage in enumerate(storages):
        size = storage.nbytes

        def write(out: Sink, storage: StorageRecord = storage, size: int = size) -> int:
            crc = casts.write(out, storage) if casts is not None else None
            return _copy_storage(out, ckpt, storage, size) if crc is None else crc

        # What _copy_storage copies as it is, with the CRC-32 the source records.
        whole = (
            storage.data_offset >= 0
            and not storage.compressed
            and storage.crc32 is not None
            and storage.stored_size == size
        )
        yield CopyCandidate(
            f"{_ARCHIVE}data/{index}",
            size,
            storage.crc32 or 0,
            storage.data_offset if whole else -1,
            write,
        )


def _copy_storage(out: Sink, ckpt: Checkpoint, storage: StorageRecord, size: int) -> int:
    if storage.data_offset < 0:
        raise CheckpointCorruptError(f"{ckpt.path}: storage {storage.key} has no data in the file")
    if storage.compressed:
        data = storage_bytes(ckpt, storage, 0, size)
        out.write_copied(data, len(data))
        return zlib.crc32(data)
    if storage.crc32 is not None and storage.stored_size == size:
        # A zip record copied whole keeps its CRC: no need to read it in user space.
        out.copy_from(ckpt.source, storage.data_offset, size, crc=False)
        return storage.crc32
    return out.copy_from(ckpt.source, storage.data_offset, size, crc=True)


def _safetensors_plan(
    sd: Mapping[Any, Any], name: str
) -> tuple[list[tuple[str, TensorRecord]], dict[str, str], list[str]]:
    problems = []
    for key, value in sd.items():
        if not isinstance(key, str):
            problems.append(f"key {key!r} is not a string")
        elif not isinstance(value, TensorRecord):
            problems.append(f"{key!r} is {describe(value)}, not a tensor")
        elif value.dtype not in CODES:
            problems.append(f"{key!r} has dtype {value.dtype}, which safetensors cannot store")
        elif value.metadata:
            problems.append(f"{key!r} has its conjugate/negative bit set; resolve it first")
    if problems:
        shown = "; ".join(problems[:8])
        raise CheckpointFormatError(
            f"{name}: cannot write safetensors: {shown}. safetensors stores only a flat map of "
            f"names to plain tensors; keep the pt format for this one"
        )
    aliases, overlaps = find_aliases(_view(key, rec) for key, rec in sd.items())
    return [(k, rec) for k, rec in sd.items() if k not in aliases], aliases, overlaps


def _view(key: str, rec: TensorRecord) -> Optional[View]:
    if not rec.numel:
        return None
    start = rec.offset * rec.itemsize
    identity = (id(rec.storage), rec.offset, rec.shape, rec.stride, rec.dtype)
    return View(key, identity, id(rec.storage), start, start + rec.extent() * rec.itemsize)


def write_safetensors(
    sink: Sink,
    ckpt: Checkpoint,
    sd: Mapping[Any, Any],
    metadata: dict[str, str],
    casts: Optional[Casts] = None,
) -> tuple[int, int, dict[str, str], list[str]]:
    """Write ``sd`` as one safetensors file; ``(tensors, bytes, aliases, overlaps)``."""
    if ckpt.byteorder != "little":
        raise CheckpointFormatError(
            f"{ckpt.path}: its tensors are stored big-endian; safetensors is little-endian. "
            f"Convert to pt first, load it and save again on a little-endian machine"
        )
    if casts is not None:
        sd = casts.state_dict(sd)
    canonical, aliases, overlaps = _safetensors_plan(sd, ckpt.path)
    meta = dict(metadata)
    sd_meta = getattr(sd, "_metadata", None)
    if sd_meta is not None:
        meta[STATE_DICT_METADATA_KEY] = state_dict_metadata_json(sd_meta)
    header, order, size = build_header(
        [(key, CODES[rec.dtype], rec.shape, rec.nbytes) for key, rec in canonical], meta, aliases
    )
    sink.write(header)
    records = dict(canonical)
    # Small tensors, copied as they are, are gathered into blocks: the data order
    # keeps the source's order within a dtype, so neighbours are read together
    # (100,000 tensors: a read per MiB instead of one per tensor).
    window = ReadWindow(ckpt.source)
    block = bytearray()
    copied = 0
    for key in order:
        rec = records[key]
        storage = rec.storage
        if (
            casts is None
            and 0 < rec.nbytes < ReadWindow.SMALL
            and storage.data_offset >= 0
            and not storage.compressed
            and rec.is_contiguous()
        ):
            start, length = rec.byte_range()
            block += window.read(storage.data_offset + start, length)
            copied += length
            if len(block) >= ReadWindow.BLOCK:
                sink.write_copied(block, copied)
                block, copied = bytearray(), 0
            continue
        if block:
            sink.write_copied(block, copied)
            block, copied = bytearray(), 0
        if casts is None or casts.write(sink, storage) is None:
            _copy_tensor(sink, ckpt, rec)
    if block:
        sink.write_copied(block, copied)
    return len(canonical), size, aliases, overlaps


def _copy_tensor(sink: Sink, ckpt: Checkpoint, rec: TensorRecord) -> None:
    if rec.numel == 0:
        return
    storage = rec.storage
    if storage.data_offset < 0:
        raise CheckpointCorruptError(f"{ckpt.path}: storage {storage.key} has no data in the file")
    if rec.is_contiguous() and not storage.compressed:
        start, length = rec.byte_range()
        sink.copy_from(ckpt.source, storage.data_offset + start, length, crc=False)
        return
    # A non-contiguous view (or a compressed record): gather this one tensor in memory.
    tensor = load_tensor(ckpt, rec).contiguous()
    data = tensor.reshape(-1).view(torch_dtype("uint8")).numpy().tobytes()
    sink.write_copied(data, len(data))


def alias_notes(aliases: dict[str, str], overlaps: list[str]) -> list[str]:
    """The notes telling of tied tensors written once and overlapping ones copied."""
    notes = []
    if aliases:
        notes.append(
            f"{len(aliases)} tied tensor(s) written once and recorded as aliases "
            f"({', '.join(f'{a} -> {c}' for a, c in list(aliases.items())[:3])})"
        )
    if overlaps:
        notes.append(
            f"tensors overlapping in memory were written as separate copies: "
            f"{'; '.join(overlaps[:3])}"
        )
    return notes


def write_sharded_safetensors(
    ckpt: Checkpoint,
    sd: Mapping[Any, Any],
    metadata: dict[str, str],
    casts: Optional[Casts],
    dst: str,
    limit: int,
    bar: Progress,
    *,
    fsync: bool,
    overwrite: bool,
) -> tuple[int, int, dict[str, str], list[str]]:
    """The state dict as a Hugging Face sharded folder, each shard by ``write_safetensors``."""
    if casts is not None:
        sd = casts.state_dict(sd)
    canonical, aliases, overlaps = _safetensors_plan(sd, ckpt.path)
    nbytes = {key: rec.nbytes for key, rec in canonical}
    shards = _hf_write.plan_shards(list(sd), nbytes, aliases, limit)

    def write_shard(f: IO[bytes], keys: list[str], name: str) -> int:
        part = collections.OrderedDict((k, sd[k]) for k in keys)
        write_safetensors(Sink(f, bar, write_back=fsync), ckpt, part, metadata, casts)
        return sum(nbytes.get(k, 0) for k in keys)

    _hf_write.write_sharded(
        dst, shards, write_shard, order=list(sd), overwrite=overwrite, fsync=fsync
    )
    return len(canonical), sum(nbytes.values()), aliases, overlaps
