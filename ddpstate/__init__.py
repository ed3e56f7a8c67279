"""ddpstate: safe, durable PyTorch checkpoints and model state under DDP.

The public names (``ddpstate.__all__``), by area:

.. code-block:: text

    Save and load (every rank calls; rank 0 writes; weights_only loads)
        save, load                  -- a state dict or any checkpoint, atomically written
        save_model_state            -- a model's weights, unwrapped, keys normalized
        load_model_state            -- weights into a model, across any wrapping
    Training state over time
        CheckpointManager           -- rotation, verified auto-resume, async saves, SIGTERM
        RestoreSource               -- which tier and step restore took the state from
        verify_checkpoint           -- check a manager folder's steps, without torch
        ResumableDistributedSampler -- exact mid-epoch resume of the data order
        capture_rng_state, restore_rng_state -- every RNG a training step touches
    Processes and ranks
        init_distributed            -- torchrun / srun / mp.spawn aware process group
        barrier                     -- all ranks meet, with a deadline
        get_rank, get_world_size, get_local_rank, is_main_process
        main_process_first, rank_zero_only -- rank 0 first, or rank 0 only
    Models under DDP
        wrap_ddp                    -- device, DDP and a BatchNorm policy in one call
        convert_sync_batchnorm, revert_sync_batchnorm, sync_batchnorm_stats
        explain_ddp_errors          -- names the cause of DDP's in-place BatchNorm error
    State-dict keys
        strip_prefix, add_prefix, normalize_keys -- module. / _orig_mod. prefixes
        adapt_state_dict            -- keys matched to a target model's structure
        find_state_dict, replace_state_dict -- the state dict inside a checkpoint
        unwrap_model                -- the model inside DDP / DataParallel / torch.compile
    Files
        detect_format               -- a checkpoint's format from its bytes
        convert_file                -- the ddpstate convert command as a function
    Errors (all derive from DDPStateError)
        DDPStateError, InvalidArgumentError, CheckpointNotFoundError,
        CheckpointFormatError, CheckpointCorruptError, UnsafeCheckpointError,
        KeyMismatchError, BarrierTimeoutError

Every other name stays importable from ``ddpstate`` and lives in its submodule:
``ddpstate.errors``, ``ddpstate.dist``, ``ddpstate.keys``, ``ddpstate.batchnorm``,
``ddpstate.checkpoint``, ``ddpstate.manager``, ``ddpstate.convert``,
``ddpstate.formats``, ``ddpstate.location``, ``ddpstate.storage``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ddpstate._version import __version__ as __version__

# Every error class, eagerly (torch-free): `except ddpstate.SomeError` must not import
# torch. The star brings those outside `__all__` (``ddpstate.errors.__all__`` lists all).
from ddpstate.errors import *  # noqa: F403
from ddpstate.errors import (
    BarrierTimeoutError,
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    DDPStateError,
    InvalidArgumentError,
    KeyMismatchError,
    UnsafeCheckpointError,
)

# Everything else loads on first use (PEP 562): most of it needs torch, and the
# `ddpstate` command streams key rewrites without importing torch at all, which
# keeps it in the memory of a file copy.
if TYPE_CHECKING:
    from ddpstate._manager.local_tier import RestoreSource
    from ddpstate._manifest import CheckpointVerification as CheckpointVerification
    from ddpstate._manifest import verify_checkpoint
    from ddpstate.batchnorm import BatchNormNd as BatchNormNd
    from ddpstate.batchnorm import BatchNormPolicy as BatchNormPolicy
    from ddpstate.batchnorm import (
        convert_sync_batchnorm,
        explain_ddp_errors,
        revert_sync_batchnorm,
        sync_batchnorm_stats,
        wrap_ddp,
    )
    from ddpstate.checkpoint import IncompatibleKeys as IncompatibleKeys
    from ddpstate.checkpoint import (
        load,
        load_model_state,
        save,
        save_model_state,
    )
    from ddpstate.convert import ConvertResult as ConvertResult
    from ddpstate.convert import DiffResult as DiffResult
    from ddpstate.convert import InspectResult as InspectResult
    from ddpstate.convert import VerifyResult as VerifyResult
    from ddpstate.convert import convert_file
    from ddpstate.convert import diff_files as diff_files
    from ddpstate.convert import inspect_file as inspect_file
    from ddpstate.convert import verify_file as verify_file
    from ddpstate.dist import DistContext as DistContext
    from ddpstate.dist import all_gather_object as all_gather_object
    from ddpstate.dist import (
        barrier,
        get_local_rank,
        get_rank,
        get_world_size,
        init_distributed,
        is_main_process,
        main_process_first,
        rank_zero_only,
    )
    from ddpstate.dist import broadcast_object as broadcast_object
    from ddpstate.dist import default_timeout as default_timeout
    from ddpstate.dist import is_distributed as is_distributed
    from ddpstate.dist import is_local_main_process as is_local_main_process
    from ddpstate.formats import FormatName as FormatName
    from ddpstate.formats import detect_format
    from ddpstate.formats import parse_format as parse_format
    from ddpstate.keys import KNOWN_PREFIXES as KNOWN_PREFIXES
    from ddpstate.keys import STATE_DICT_NAMES as STATE_DICT_NAMES
    from ddpstate.keys import KeyMatch as KeyMatch
    from ddpstate.keys import OnCollision as OnCollision
    from ddpstate.keys import (
        adapt_state_dict,
        add_prefix,
        find_state_dict,
        normalize_keys,
        replace_state_dict,
        strip_prefix,
        unwrap_model,
    )
    from ddpstate.keys import detect_prefixes as detect_prefixes
    from ddpstate.keys import match_keys as match_keys
    from ddpstate.location import MapLocation as MapLocation
    from ddpstate.location import resolve_map_location as resolve_map_location
    from ddpstate.manager import CheckpointManager
    from ddpstate.manager import KeepBest as KeepBest
    from ddpstate.manager import NodeLocal as NodeLocal
    from ddpstate.rng import capture_rng_state, restore_rng_state
    from ddpstate.sampler import ResumableDistributedSampler
    from ddpstate.storage import atomic_write as atomic_write
    from ddpstate.storage import open_read as open_read

#: The module that defines each public name outside the eager imports above.
_HOMES: dict[str, str] = {
    "ddpstate.batchnorm": "BatchNormNd BatchNormPolicy convert_sync_batchnorm "
    "explain_ddp_errors revert_sync_batchnorm sync_batchnorm_stats wrap_ddp",
    "ddpstate.checkpoint": "IncompatibleKeys load load_model_state save save_model_state",
    "ddpstate.convert": "ConvertResult DiffResult InspectResult VerifyResult convert_file "
    "diff_files inspect_file verify_file",
    "ddpstate.dist": "DistContext all_gather_object barrier broadcast_object default_timeout "
    "get_local_rank get_rank get_world_size init_distributed is_distributed "
    "is_local_main_process is_main_process main_process_first rank_zero_only",
    "ddpstate.formats": "detect_format FormatName parse_format",
    "ddpstate.keys": "KNOWN_PREFIXES STATE_DICT_NAMES KeyMatch OnCollision adapt_state_dict "
    "add_prefix detect_prefixes find_state_dict match_keys normalize_keys replace_state_dict "
    "strip_prefix unwrap_model",
    "ddpstate.location": "MapLocation resolve_map_location",
    "ddpstate.manager": "CheckpointManager KeepBest NodeLocal",
    # Torch-free (ddpstate.manager re-exports all three).
    "ddpstate._manifest": "CheckpointVerification verify_checkpoint",
    "ddpstate._manager.local_tier": "RestoreSource",
    "ddpstate.rng": "capture_rng_state restore_rng_state",
    "ddpstate.sampler": "ResumableDistributedSampler",
    "ddpstate.storage": "atomic_write open_read",
}
#: Public name -> the module that defines it.
_EXPORTS = {name: module for module, names in _HOMES.items() for name in names.split()}

#: Public submodules, imported on first attribute access (``ddpstate.keys``).
_SUBMODULES = frozenset(
    {
        "batchnorm",
        "checkpoint",
        "cli",
        "convert",
        "dcp",
        "dist",
        "errors",
        "formats",
        "keys",
        "location",
        "manager",
        "rng",
        "sampler",
        "storage",
    }
)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        if name in _SUBMODULES:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # The public face: what ``__all__`` lists, the public submodules and the
    # module's own dunders. Every other name of ``_EXPORTS`` still resolves.
    dunders = {name for name in globals() if name.startswith("__") and name.endswith("__")}
    return sorted(set(__all__) | _SUBMODULES | dunders)


# What README's "Using it" needs (tests/test_structure.py pins it).
__all__ = [
    # checkpoint
    "load",
    "load_model_state",
    "save",
    "save_model_state",
    # manager, sampler, rng
    "CheckpointManager",
    "RestoreSource",
    "verify_checkpoint",
    "ResumableDistributedSampler",
    "capture_rng_state",
    "restore_rng_state",
    # dist
    "barrier",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
    "main_process_first",
    "rank_zero_only",
    # batchnorm
    "convert_sync_batchnorm",
    "explain_ddp_errors",
    "revert_sync_batchnorm",
    "sync_batchnorm_stats",
    "wrap_ddp",
    # keys
    "adapt_state_dict",
    "add_prefix",
    "find_state_dict",
    "normalize_keys",
    "replace_state_dict",
    "strip_prefix",
    "unwrap_model",
    # formats, convert
    "convert_file",
    "detect_format",
    # errors
    "DDPStateError",
    "BarrierTimeoutError",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "InvalidArgumentError",
    "KeyMismatchError",
    "UnsafeCheckpointError",
]
