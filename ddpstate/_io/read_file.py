"""One checkpoint file (or folder) read into memory by its bytes, in any format ddpstate reads.

``ddpstate.load`` (and ``load_model_state`` through it) reads here on the
ranks that read: the format comes from the bytes (``formats.detect_format``),
never from the name, and each format's reader places the tensors where
``map_location`` resolved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from ddpstate import _fs, storage
from ddpstate._hf.read import load_sharded
from ddpstate._io import torch_io
from ddpstate._io.safetensors_io import read_safetensors
from ddpstate.errors import CheckpointAccessError, CheckpointFormatError
from ddpstate.formats import (
    DCP,
    HF_SHARDED,
    LEGACY,
    SAFETENSORS,
    TORCH_ZIP,
    TORCHSCRIPT,
    detect_format,
)
from ddpstate.location import ResolvedMapLocation, place_all, require_reachable

__all__ = ["detect", "read"]

# torch.load goes by this suffix: a torch file so named cannot be mapped by it.
_SAFETENSORS_SUFFIXES = (".safetensors",)


def detect(text: str, storage_options: Optional[dict[str, Any]]) -> str:
    try:
        return detect_format(text, storage_options=storage_options)
    except PermissionError as exc:
        raise CheckpointAccessError(
            f"{text}: permission denied ({exc}); check the file's permissions"
        ) from exc


def _mmap_refused(text: str, why: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{text}: mmap=True is not possible here ({why}); pass mmap=None")


def read(
    text: str,
    resolved: ResolvedMapLocation,
    weights_only: bool,
    mmap: Optional[bool],
    storage_options: Optional[dict[str, Any]],
    safe_globals: Sequence[Any] = (),
) -> Any:
    require_reachable(resolved, text)
    kind = detect(text, storage_options)
    remote = _fs.is_remote(text)
    local = _fs.local_path(text)
    if kind == TORCHSCRIPT:
        raise CheckpointFormatError(
            f"{text}: this is a TorchScript archive, not a checkpoint: use torch.jit.load"
        )
    if kind == HF_SHARDED:
        return load_sharded(
            text,
            resolved,
            weights_only=weights_only,
            mmap=mmap,
            storage_options=storage_options,
            safe_globals=safe_globals,
        )
    if kind == DCP:
        if mmap:
            raise _mmap_refused(text, "a torch.distributed.checkpoint folder")
        state = torch_io.load_dcp(
            text if remote else local,
            name=text,
            weights_only=weights_only,
            storage_options=storage_options,
            remote=remote,
            safe_globals=safe_globals,
        )
        return place_all(state, "cpu", resolved)
    if kind == SAFETENSORS:
        if mmap and remote:
            raise _mmap_refused(text, "the file is remote")
        if remote:
            with storage.open_read(text, storage_options=storage_options) as f:
                tensors = read_safetensors(f, mmap=False)
        else:
            tensors = read_safetensors(local, mmap=mmap is None or mmap)
        return place_all(tensors, "cpu", resolved)
    # torch.save's zip or legacy format
    if mmap and (remote or kind == LEGACY):
        raise _mmap_refused(text, "the file is remote" if remote else "legacy files cannot be")
    # torch.load cannot map a torch file named .safetensors (it goes by the suffix).
    mappable = kind == TORCH_ZIP and not remote and not local.endswith(_SAFETENSORS_SUFFIXES)
    use_mmap = mappable if mmap is None else bool(mmap)
    if remote:
        with storage.open_read(text, storage_options=storage_options) as f:
            return torch_io.load_torch_file(
                f,
                kind=kind,
                name=text,
                map_location=resolved,
                weights_only=weights_only,
                mmap=False,
                safe_globals=safe_globals,
            )
    return torch_io.load_torch_file(
        local,
        kind=kind,
        name=text,
        map_location=resolved,
        weights_only=weights_only,
        mmap=use_mmap,
        safe_globals=safe_globals,
    )
