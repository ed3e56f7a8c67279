"""ddpstate: safe, durable PyTorch checkpoints and model state under DDP."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ddpstate._version import __version__
from ddpstate.errors import (
    AmbiguousStateDictError,
    BarrierTimeoutError,
    BatchNormBufferSyncError,
    BatchNormPolicyError,
    CheckpointAccessError,
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    DDPStateError,
    DeviceMapError,
    DTypeMismatchError,
    InvalidArgumentError,
    KeyCollisionError,
    KeyMismatchError,
    OptimizerStateMismatchError,
    RankFailedError,
    ShapeMismatchError,
    ShardedStateError,
    StateDictNotFoundError,
    StoreConnectionError,
    UnsafeCheckpointError,
)

# Everything else loads on first use (PEP 562): most of it needs torch, and the
# `ddpstate` command streams key rewrites without importing torch at all, which
# keeps it in the memory of a file copy.
if TYPE_CHECKING:
    from ddpstate._manager.local_tier import RestoreSource
    from ddpstate._manifest import CheckpointVerification, verify_checkpoint
    from ddpstate.batchnorm import (
        BatchNormNd,
        BatchNormPolicy,
        convert_sync_batchnorm,
        explain_ddp_errors,
        revert_sync_batchnorm,
        sync_batchnorm_stats,
        wrap_ddp,
    )
    from ddpstate.checkpoint import (
        IncompatibleKeys,
        load,
        load_model_state,
        save,
        save_model_state,
    )
    from ddpstate.convert import (
        ConvertResult,
        DiffResult,
        InspectResult,
        VerifyResult,
        convert_file,
        diff_files,
        inspect_file,
        verify_file,
    )
    from ddpstate.dist import (
        DistContext,
        all_gather_object,
        barrier,
        broadcast_object,
        default_timeout,
        get_local_rank,
        get_rank,
        get_world_size,
        init_distributed,
        is_distributed,
        is_local_main_process,
        is_main_process,
        main_process_first,
        rank_zero_only,
    )
    from ddpstate.formats import FormatName, detect_format, parse_format
    from ddpstate.keys import (
        KNOWN_PREFIXES,
        STATE_DICT_NAMES,
        KeyMatch,
        OnCollision,
        adapt_state_dict,
        add_prefix,
        detect_prefixes,
        find_state_dict,
        match_keys,
        normalize_keys,
        replace_state_dict,
        strip_prefix,
        unwrap_model,
    )
    from ddpstate.location import MapLocation, resolve_map_location
    from ddpstate.manager import CheckpointManager
    from ddpstate.rng import capture_rng_state, restore_rng_state
    from ddpstate.sampler import ResumableDistributedSampler
    from ddpstate.storage import atomic_write, open_read

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "BatchNormNd": "ddpstate.batchnorm",
    "BatchNormPolicy": "ddpstate.batchnorm",
    "convert_sync_batchnorm": "ddpstate.batchnorm",
    "explain_ddp_errors": "ddpstate.batchnorm",
    "revert_sync_batchnorm": "ddpstate.batchnorm",
    "sync_batchnorm_stats": "ddpstate.batchnorm",
    "wrap_ddp": "ddpstate.batchnorm",
    "IncompatibleKeys": "ddpstate.checkpoint",
    "load": "ddpstate.checkpoint",
    "load_model_state": "ddpstate.checkpoint",
    "save": "ddpstate.checkpoint",
    "save_model_state": "ddpstate.checkpoint",
    "ConvertResult": "ddpstate.convert",
    "DiffResult": "ddpstate.convert",
    "InspectResult": "ddpstate.convert",
    "VerifyResult": "ddpstate.convert",
    "convert_file": "ddpstate.convert",
    "diff_files": "ddpstate.convert",
    "inspect_file": "ddpstate.convert",
    "verify_file": "ddpstate.convert",
    "DistContext": "ddpstate.dist",
    "all_gather_object": "ddpstate.dist",
    "barrier": "ddpstate.dist",
    "broadcast_object": "ddpstate.dist",
    "default_timeout": "ddpstate.dist",
    "get_local_rank": "ddpstate.dist",
    "get_rank": "ddpstate.dist",
    "get_world_size": "ddpstate.dist",
    "init_distributed": "ddpstate.dist",
    "is_distributed": "ddpstate.dist",
    "is_local_main_process": "ddpstate.dist",
    "is_main_process": "ddpstate.dist",
    "main_process_first": "ddpstate.dist",
    "rank_zero_only": "ddpstate.dist",
    "detect_format": "ddpstate.formats",
    "FormatName": "ddpstate.formats",
    "parse_format": "ddpstate.formats",
    "KNOWN_PREFIXES": "ddpstate.keys",
    "STATE_DICT_NAMES": "ddpstate.keys",
    "KeyMatch": "ddpstate.keys",
    "OnCollision": "ddpstate.keys",
    "adapt_state_dict": "ddpstate.keys",
    "add_prefix": "ddpstate.keys",
    "detect_prefixes": "ddpstate.keys",
    "find_state_dict": "ddpstate.keys",
    "match_keys": "ddpstate.keys",
    "normalize_keys": "ddpstate.keys",
    "replace_state_dict": "ddpstate.keys",
    "strip_prefix": "ddpstate.keys",
    "unwrap_model": "ddpstate.keys",
    "MapLocation": "ddpstate.location",
    "resolve_map_location": "ddpstate.location",
    "CheckpointManager": "ddpstate.manager",
    # Torch-free (ddpstate.manager re-exports both).
    "CheckpointVerification": "ddpstate._manifest",
    "verify_checkpoint": "ddpstate._manifest",
    "RestoreSource": "ddpstate._manager.local_tier",
    "capture_rng_state": "ddpstate.rng",
    "restore_rng_state": "ddpstate.rng",
    "ResumableDistributedSampler": "ddpstate.sampler",
    "atomic_write": "ddpstate.storage",
    "open_read": "ddpstate.storage",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "__version__",
    # checkpoint
    "IncompatibleKeys",
    "load",
    "load_model_state",
    "save",
    "save_model_state",
    # manager
    "CheckpointManager",
    "CheckpointVerification",
    "verify_checkpoint",
    "RestoreSource",
    "ResumableDistributedSampler",
    "capture_rng_state",
    "restore_rng_state",
    # keys
    "KNOWN_PREFIXES",
    "STATE_DICT_NAMES",
    "KeyMatch",
    "OnCollision",
    "adapt_state_dict",
    "add_prefix",
    "detect_prefixes",
    "find_state_dict",
    "match_keys",
    "normalize_keys",
    "replace_state_dict",
    "strip_prefix",
    "unwrap_model",
    # batchnorm
    "BatchNormNd",
    "BatchNormPolicy",
    "convert_sync_batchnorm",
    "explain_ddp_errors",
    "revert_sync_batchnorm",
    "sync_batchnorm_stats",
    "wrap_ddp",
    # storage, formats, location
    "FormatName",
    "MapLocation",
    "atomic_write",
    "detect_format",
    "parse_format",
    "open_read",
    "resolve_map_location",
    # convert, inspect, diff, verify (the ddpstate command)
    "ConvertResult",
    "DiffResult",
    "InspectResult",
    "VerifyResult",
    "convert_file",
    "diff_files",
    "inspect_file",
    "verify_file",
    # dist
    "DistContext",
    "all_gather_object",
    "barrier",
    "broadcast_object",
    "default_timeout",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed",
    "is_local_main_process",
    "is_main_process",
    "main_process_first",
    "rank_zero_only",
    # errors
    "BarrierTimeoutError",
    "BatchNormBufferSyncError",
    "BatchNormPolicyError",
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "DDPStateError",
    "KeyCollisionError",
    "KeyMismatchError",
    "StateDictNotFoundError",
    "AmbiguousStateDictError",
    "UnsafeCheckpointError",
    "InvalidArgumentError",
    "RankFailedError",
    "CheckpointAccessError",
    "ShapeMismatchError",
    "DTypeMismatchError",
    "OptimizerStateMismatchError",
    "ShardedStateError",
    "DeviceMapError",
    "StoreConnectionError",
]
