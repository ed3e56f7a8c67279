"""Sharded and parallel writes with torch.distributed.checkpoint (DCP), committed the ddpstate way.

DCP has every rank write its own part of the state into one folder (FSDP2
``DTensor`` shards; replicated DDP tensors split across ranks by its dedup
planner) and reshards on load. ddpstate's commit protocol comes with
:class:`ddpstate.dcp.DurableWriter` (``_io/durable_dcp.py``): every rank CRC-32s its
items as it writes them into the staging folder the coordinator named for this
save (a version prefix on object stores that hold a commit), DCP gathers the CRCs
with its write results, and the coordinator writes ``.metadata``, then ddpstate's
``manifest.json`` last and commits (a swap into place, or one PUT on object stores).
:func:`write_shards` is ``dcp.save`` with that writer; the rest of this module
decides when a ``save()`` is a sharded one and what it may be given.

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

import os
from collections.abc import Mapping
from typing import Any, Optional

from ddpstate._checksum import error_text
from ddpstate._io import savecheck as _savecheck
from ddpstate._io.torch_io import dcp_failure
from ddpstate._manifest import PART_SUFFIXES
from ddpstate._storage.temps import cleanup_after
from ddpstate.errors import CheckpointWriteError, DDPStateError, ShardedStateError

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


# ------------------------------------------------------------------------- writing


def write_shards(
    state_dict: Mapping[str, Any],
    folder: str,
    process_group: Any = None,
    storage_options: Optional[dict[str, Any]] = None,
) -> dict[str, dict[str, Any]]:
    """``dcp.save`` ``state_dict`` to ``folder`` through :class:`ddpstate.dcp.DurableWriter`.

    A collective where a process group exists. The folder is committed (its
    manifest written last, swapped into place on local disks) when this returns.

    Args:
        process_group: DCP's group (None: the default one); async saves pass their own.
        storage_options: fsspec options for a URL.

    Returns:
        On DCP's coordinator, the files the manifest lists (name -> ``{"size",
        "crc32", "chunks"}``); elsewhere ``{}``.

    Raises:
        DDPStateError: The first failure inside DCP's ``CheckpointException`` (a
            ddpstate error as it is, anything else as ``CheckpointWriteError``).
    """
    from torch.distributed.checkpoint.state_dict_saver import save

    from ddpstate._io.durable_dcp import DurableWriter  # imports DCP (seconds): sharded saves only

    writer = DurableWriter(folder, storage_options=storage_options)
    try:
        save(dict(state_dict), storage_writer=writer, process_group=process_group)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        cleanup_after(exc, f"the staging folder {writer.path}", writer.discard)
        inner = dcp_failure(exc)
        if inner is None or not isinstance(inner, Exception):
            raise
        if isinstance(inner, DDPStateError):
            raise inner from exc
        raise CheckpointWriteError(f"{folder}: dcp.save failed ({error_text(inner)})") from exc
    return writer.files


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
    if path.lower().endswith(PART_SUFFIXES) or refused:
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
