"""Writing the Hugging Face sharded layout: numbered safetensors shards and their index, atomically.

Shards are filled in state-dict order up to the size limit (a tensor larger
than the limit gets a shard of its own, as ``transformers`` does), named
``model-00001-of-00003.safetensors``, and listed in
``model.safetensors.index.json`` (``metadata.total_size`` and ``weight_map``).
A tied key (a tensor stored once under its first key) is left out of the
weight map, as ``transformers`` leaves it out, so every key the index names is
a tensor in the shard it names; ddpstate records it in the index's
``metadata`` (and the shard's header) so that its readers give it back.
Everything is written into a staging folder next to the target, which then
takes the target's name in one step (:func:`ddpstate.storage.replace_folder`),
so a failure leaves whatever was there before untouched.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Optional, Union

from ddpstate import _fs, storage
from ddpstate._layout.hf_index import SAFETENSORS_INDEX, find_index, read_index
from ddpstate._layout.safetensors import ALIASES_KEY
from ddpstate.errors import CheckpointExistsError, DDPStateError, InvalidArgumentError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?I?B?)?\s*$", re.IGNORECASE)
# "GB" is 10**9 bytes and "GiB" 2**30, as transformers' max_shard_size reads them.
_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
    "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
}  # fmt: skip


def parse_size(value: Union[int, str]) -> int:
    """Bytes from ``2GB``, ``500MB``, ``1.5GiB`` or a plain number of bytes.

    Args:
        value: An int, or a string of a number and an optional unit (KB, MB,
            GB, TB: powers of 1000; KiB, MiB, GiB, TiB: powers of 1024).

    Returns:
        The size in bytes (at least 1).

    Raises:
        InvalidArgumentError: Not a size, or not positive (also a ``ValueError``).

    Example:
        >>> parse_size("2GB"), parse_size("1.5GiB"), parse_size(4096)
        (2000000000, 1610612736, 4096)
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.match(str(value)) if isinstance(value, str) else None
        unit = (match.group(2) or "").upper() if match else ""
        if match is None or unit not in _UNITS:
            raise InvalidArgumentError(
                f"max_shard_size {value!r} is not a size; write e.g. 2GB, 500MB, 1.5GiB or a "
                f"number of bytes"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise InvalidArgumentError(f"max_shard_size must be at least 1 byte (got {value!r})")
    return size


def shard_name(number: int, count: int) -> str:
    """The layout's name for shard ``number`` (from 1) of ``count``."""
    return f"model-{number:05d}-of-{count:05d}.safetensors"


def plan_shards(
    keys: Sequence[str], nbytes: Mapping[str, int], owner: Mapping[str, str], limit: int
) -> list[list[str]]:
    """Group keys into shards of at most ``limit`` bytes, in order.

    Args:
        keys: Every key, in state-dict order.
        nbytes: Bytes each stored tensor takes (keys whose tensor is stored).
        owner: For a tied key, the key whose tensor it shares (stored once);
            it goes in that key's shard.
        limit: The most bytes of tensor data per shard.

    Returns:
        The keys of each shard; never an empty shard.
    """
    shards: list[list[str]] = []
    shard_of: dict[str, int] = {}
    filled = 0
    for key in keys:
        if key in owner:
            continue
        size = nbytes[key]
        if not shards or (filled + size > limit and filled > 0):
            shards.append([])
            filled = 0
        shards[-1].append(key)
        shard_of[key] = len(shards) - 1
        filled += size
    for key in keys:
        if key in owner:
            shards[shard_of[owner[key]]].append(key)
    order = {key: i for i, key in enumerate(keys)}
    return [sorted(shard, key=order.__getitem__) for shard in shards] or [[]]


def _replaceable(target: str, overwrite: bool) -> None:
    """Raise unless ``target`` is absent, empty, or (``overwrite``) a sharded checkpoint alone."""
    if not os.path.lexists(target):
        return
    if not os.path.isdir(target):
        raise CheckpointExistsError(
            f"{target} is a file; a sharded checkpoint is written as a folder: name a new one"
        )
    present = set(os.listdir(target))
    if not present:
        return
    ours: set[str] = set()
    try:
        index = find_index(target)
        if index is not None:
            ours = {os.path.basename(index), *read_index(index).shards}
    except DDPStateError:
        ours = set()
    others = sorted(present - ours)
    if others:
        shown = ", ".join(others[:5]) + (" ..." if len(others) > 5 else "")
        raise CheckpointExistsError(
            f"{target} already holds other files ({shown}); a sharded checkpoint replaces the "
            f"whole folder, so name a new or empty folder"
        )
    if not overwrite:
        raise CheckpointExistsError(
            f"{target} already holds a sharded checkpoint; pass --force (overwrite=True) to "
            f"replace it, or name another folder"
        )


def write_index(
    folder: str,
    weight_map: Mapping[str, str],
    total_size: int,
    aliases: Optional[Mapping[str, str]] = None,
) -> None:
    """Write ``model.safetensors.index.json`` (fsynced) into ``folder``.

    ``aliases`` (tied key -> the key whose tensor it shares, neither in
    ``weight_map`` twice) go into ``metadata`` under
    :data:`~ddpstate._layout.safetensors.ALIASES_KEY`, where transformers'
    readers, which read ``weight_map`` alone, do not look.
    """
    metadata: dict[str, object] = {"total_size": total_size}
    if aliases:
        metadata[ALIASES_KEY] = dict(aliases)
    text = json.dumps({"metadata": metadata, "weight_map": dict(weight_map)}, indent=2)
    with storage.atomic_write(os.path.join(folder, SAFETENSORS_INDEX)) as f:
        f.write(text.encode("utf-8") + b"\n")


def write_sharded(
    target: str,
    shards: list[list[str]],
    write_shard: Callable[[IO[bytes], list[str], str], int],
    *,
    order: Sequence[str],
    overwrite: bool,
    aliases: Optional[Mapping[str, str]] = None,
    fsync: bool = True,
) -> dict[str, str]:
    """Write the shards and the index into a staging folder, then put it at ``target``.

    Args:
        target: The folder to create or replace.
        shards: The keys of each shard (see :func:`plan_shards`).
        write_shard: ``write_shard(file, keys, name)`` writes one shard file
            and returns its bytes of tensor data.
        order: Every key in state-dict order, the order of the weight map
            (which is what a reader's state dict gets).
        overwrite: Replace a sharded checkpoint already at ``target``.
        aliases: Tied key -> the key whose tensor it shares: written with that
            key's shard, left out of the weight map and recorded in the index's
            ``metadata`` (see :func:`write_index`).
        fsync: Fsync every file (the folder swap is fsynced either way).

    Returns:
        The weight map written (key -> shard file name), tied keys left out.
    """
    if _fs.is_remote(target):
        raise InvalidArgumentError(
            f"{target}: sharded checkpoints are written to local folders; write locally and "
            f"upload the folder"
        )
    target = os.path.abspath(_fs.local_path(target))
    _replaceable(target, overwrite)
    weight_map: dict[str, str] = {}
    total = 0
    with storage.staged_folder(target) as staged:
        for number, keys in enumerate(shards, 1):
            name = shard_name(number, len(shards))
            path = os.path.join(staged.path, name)
            with storage.atomic_write(path, fsync=fsync) as f:
                total += write_shard(f, keys, name)
            weight_map.update((k, name) for k in keys)
        tied = aliases or {}
        weight_map = {k: weight_map[k] for k in order if k not in tied}
        write_index(staged.path, weight_map, total, {k: tied[k] for k in order if k in tied})
    return weight_map
