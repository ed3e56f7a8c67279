"""Sharded and parallel writes with torch.distributed.checkpoint (DCP), committed the ddpstate way.

DCP has every rank write its own part of the state into one folder (FSDP2
``DTensor`` shards; replicated DDP tensors split across ranks by its dedup
planner) and reshards on load. What it does not give is ddpstate's commit
protocol, so this module adds it around DCP's writer:

1. every rank writes its files with ``FileSystemWriter(sync_files=True)`` (each
   file fsynced before DCP's coordinator writes ``.metadata``);
2. every rank checksums the files it wrote itself (``__<rank>_*.distcp``; rank 0
   also ``.metadata``) and sends name, size and CRC-32 to rank 0 in one
   ``gather_and_decide`` round, so the ranks agree on the outcome;
3. rank 0 fsyncs the folder and writes ddpstate's ``manifest.json`` listing
   every file: the commit marker, last, after every rank's files are durable.

Layouts (the names below are this module's constants):

``ddpstate.save(sharded_state, path)`` writes a folder that torch's own
``dcp.load`` reads as well::

    <path>/
        .metadata           # DCP's index (written by rank 0)
        __0_0.distcp        # rank 0's part
        __1_0.distcp        # rank 1's part, ...
        manifest.json       # ddpstate's commit marker, {"format": "dcp", "files": {...}}

A :class:`~ddpstate.CheckpointManager` step folder (written by
``_manager/dcp_step.py`` with :func:`write_shards`) keeps the rank-0 files as
before and puts the DCP entries (sharded models and optimizers, or every model
and optimizer with ``writers="all"``) in one DCP checkpoint below ``dcp/``::

    step_0000000100/
        dcp/.metadata, dcp/__<rank>_0.distcp ...
        extra.pt, _rng.pt   # plain values and other objects, as before
        manifest.json       # files: {"dcp/.metadata": ..., "dcp/__0_0.distcp": ..., ...}
                            # entries: {"model": {"file": "dcp/.metadata", "kind": "dcp_module"}}
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator, Mapping
from typing import Any, Optional

from ddpstate import _fs, _manifest, storage
from ddpstate._checksum import checksum_hex, error_text
from ddpstate._io import savecheck as _savecheck
from ddpstate._io.torch_io import dcp_failure
from ddpstate._manifest import (
    FOLDER_FORMAT,
    MANIFEST_NAME,
    METADATA_NAME,
    SHARD_SUFFIX,
)
from ddpstate.dist import get_rank, is_distributed
from ddpstate.errors import (
    CheckpointWriteError,
    DDPStateError,
    ShardedStateError,
)

_READ_CHUNK = 8 << 20
_REFUSED_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")


# ------------------------------------------------------------------------- detection


def _first_sharded(obj: Any) -> Optional[str]:
    """Where ``obj`` holds its first ``DTensor``/``ShardedTensor`` and what it is, or None."""
    sharded = _savecheck.sharded_types()
    if not sharded:
        return None  # torch.distributed.tensor never imported: no DTensor can exist
    found = (
        f"{where} is a {type(value).__name__}"
        for where, value in _savecheck.walk(obj, "obj", set())
        if isinstance(value, sharded)
    )
    return next(found, None)


def holds_sharded(obj: Any) -> bool:
    """Tell whether ``obj`` holds a ``DTensor``/``ShardedTensor`` (cheap when none can exist)."""
    return _first_sharded(obj) is not None


def _local_only(path: str) -> str:
    """``path``'s local form; a URL is refused (DCP's local writer, no fsspec one yet).

    Raises:
        CheckpointWriteError: ``path`` is an fsspec URL.
    """
    if _fs.is_remote(path):
        raise CheckpointWriteError(
            f"{path}: sharded (torch.distributed.checkpoint) saves go to local or shared "
            f"filesystem paths only in this version; save to a mounted folder and copy it"
        )
    return _fs.local_path(path)


# ------------------------------------------------------------------------- writing


def _own_files(folder: str, rank: int, coordinator: bool) -> list[str]:
    """The files this rank wrote: DCP prefixes each rank's files with ``__<rank>_``."""
    names = [os.path.basename(p) for p in glob.glob(os.path.join(folder, f"__{rank}_*"))]
    names = [n for n in names if n.endswith(SHARD_SUFFIX)]
    if coordinator:
        names.append(METADATA_NAME)
    return sorted(names)


def _checksum(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        size, crc = storage.size_and_crc32(f, _READ_CHUNK)
    return {"size": size, "crc32": checksum_hex(crc)}


def _checksumming_fs(sums: dict[str, dict[str, Any]]) -> Any:
    """DCP's local FileSystem, recording each data file's size and CRC-32 as it is written."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class ChecksummingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            name = os.path.basename(os.fspath(path))
            with super().create_stream(path, mode) as raw:
                if mode != "wb" or not name.endswith(SHARD_SUFFIX):
                    yield raw
                    return
                stream = _manifest.ChecksumWriter(raw)
                yield stream
                sums[name] = {"size": stream.size, "crc32": checksum_hex(stream.crc)}

    return ChecksummingFileSystem()


def write_shards(
    state_dict: Mapping[str, Any], folder: str, process_group: Any = None
) -> dict[str, dict[str, Any]]:
    """Write this rank's part of ``state_dict`` into the local ``folder`` with DCP; checksum it.

    A collective where a process group exists (``dcp.save``). Every file is
    fsynced by DCP's writer (``sync_files=True``) before its coordinator
    writes ``.metadata``.

    Args:
        process_group: DCP's group (None: the default one); async saves pass their own.

    Returns:
        The files this rank wrote (name -> ``{"size", "crc32"}``), ``.metadata`` on rank 0.

    Raises:
        Exception: What DCP raised (the caller shares it with every rank).
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    local = _local_only(folder)
    os.makedirs(local, exist_ok=True)
    writer = FileSystemWriter(local, single_file_per_rank=True, sync_files=True)
    sums: dict[str, dict[str, Any]] = {}
    writer.fs = _checksumming_fs(sums)
    save(dict(state_dict), storage_writer=writer, process_group=process_group)
    rank = get_rank() if is_distributed() else 0
    files = {}
    for name in _own_files(local, rank, rank == 0):
        path = os.path.join(local, name)
        known = sums.get(name)
        # Read back only what was not seen whole on its way out (.metadata, or a stream
        # that seeked): the size on disk must be what passed through.
        files[name] = known if known and known["size"] == os.path.getsize(path) else _checksum(path)
    return files


def merge_files(
    gathered: list[Any], prefix: str = ""
) -> tuple[dict[str, dict[str, Any]], list[tuple[int, str]]]:
    """Rank 0: every rank's reported files (prefixed) and every rank's failure, from one gather."""
    files: dict[str, dict[str, Any]] = {}
    failures: list[tuple[int, str]] = []
    for rank, info in enumerate(gathered):
        if info.get("error"):
            failures.append((rank, str(info["error"])))
        for name, entry in (info.get("files") or {}).items():
            files[prefix + name] = entry
    return files, failures


def failure_text(exc: BaseException) -> str:
    """One line for a rank's DCP failure (DCP wraps each rank's error in CheckpointException)."""
    exc = dcp_failure(exc) or exc
    return str(exc) if isinstance(exc, DDPStateError) else error_text(exc)


# ------------------------------------------------------------------------- save() on sharded state


def check_folder_target(
    obj: Any,
    path: str,
    format: Optional[str],
    has_metadata: bool,
    *,
    max_shard_size: bool = False,
) -> None:
    """Refuse, on this rank, a sharded ``save()`` whose target cannot be a DCP folder.

    Raises:
        ShardedStateError: ``path`` names a single file, or a file format (or the
            Hugging Face sharded layout, ``max_shard_size``) was asked for.
    """
    refused = format is not None or has_metadata or max_shard_size
    if path.lower().endswith(_REFUSED_SUFFIXES) or refused:
        # A file cannot hold every rank's shards, and a folder named *.pt would fool readers.
        why = (
            f"format={format!r} was asked for"
            if format is not None
            else "metadata= is for safetensors files"
            if has_metadata
            else "max_shard_size= writes the Hugging Face layout of a whole state dict"
            if max_shard_size
            else "the path names a single file"
        )
        at = _first_sharded(obj) or "it holds sharded tensors"
        raise ShardedStateError(
            f"cannot save {path}: {at} (FSDP2 / tensor-parallel "
            f"DTensor state), which ddpstate saves as a torch.distributed.checkpoint folder (every "
            f"rank writes its shards), but {why}. Give a folder path (e.g. "
            f"{os.path.splitext(path)[0] or path}_dcp) and no format=/metadata=/max_shard_size=; "
            f"to get one file, gather a full state dict first: "
            f"torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
            f"options=StateDictOptions(full_state_dict=True, cpu_offload=True))"
        )


def check_sharded_types(obj: Any, path: str) -> None:
    """Refuse sharded types DCP cannot write (legacy ``ShardedTensor`` outside DCP's planner).

    Raises:
        ShardedStateError: ``obj`` holds a legacy ``ShardedTensor``.
    """
    for where, value in _savecheck.walk(obj, "obj", set()):
        if type(value).__name__ == "ShardedTensor":
            raise ShardedStateError(
                f"cannot save {path}: {where} is a legacy ShardedTensor (FSDP1 / "
                f"torch.distributed._shard), which ddpstate does not write; move to FSDP2 "
                f"(fully_shard, DTensor state) or save it with torch.distributed.checkpoint"
            )


def prepare_temp(path: str) -> str:
    """Rank 0: stage a fresh local folder beside ``path`` for a sharded ``save()``.

    Raises:
        CheckpointWriteError: ``path`` is a URL, or an existing file (a folder is replaced whole).
    """
    local = _local_only(path)
    if os.path.lexists(local) and not os.path.isdir(local):
        raise CheckpointWriteError(
            f"{path} exists and is a file; a sharded save writes a folder there. Give another "
            f"path (ddpstate never deletes files it did not write)"
        )
    return storage.stage_folder(local).path


def commit_folder(temp: str, path: str, files: Mapping[str, Any], world_size: int) -> None:
    """Rank 0: write the manifest last into ``temp`` (from :func:`prepare_temp`), swap it in.

    The manifest has a step manifest's shape with ``format`` and no entries.
    """
    target = os.path.abspath(_fs.local_path(path))
    staged = storage.StagedFolder(target, temp, manifest_name=MANIFEST_NAME)
    staged.commit(_manifest.manifest_for(None, {}, world_size, None, dict(files), FOLDER_FORMAT))
