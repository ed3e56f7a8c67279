"""Hugging Face sharded checkpoints' index: find, read and check ``*.safetensors.index.json``.

The layout (``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``
next to ``model-00001-of-00003.safetensors``...) is ``{"metadata": {"total_size":
N}, "weight_map": {key: shard file name}}``. As ``transformers`` writes it, a tied
key (one tensor under two names) is not in the weight map: every key the index names
is a tensor stored in the shard it names. ddpstate records its tied keys in the
index's ``metadata`` under :data:`~ddpstate._layout.safetensors.ALIASES_KEY` (and in
the shard's header), so its own readers give them back. This module knows the index
alone, so format detection (:mod:`ddpstate.formats`) and the writers can use it
without the shard readers; it imports nothing of ddpstate but ``_fs``, ``storage``,
``errors`` (below the layouts) and the safetensors layout's vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, Optional

from ddpstate import _fs, storage
from ddpstate._layout.safetensors import ALIASES_KEY
from ddpstate.errors import CheckpointCorruptError, CheckpointFormatError, CheckpointNotFoundError

#: How the index files of the layout end (transformers writes these two).
INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")
#: The index name ``transformers`` and :mod:`ddpstate._layout.hf_write` give safetensors shards.
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
        aliases: Tied key -> the key whose tensor it shares, from the index's
            ``metadata`` (ddpstate's sharded output); these keys are not in
            ``weight_map``, and the shard of their canonical key gives them back.
    """

    path: str
    folder: str
    weight_map: dict[str, str]
    shards: tuple[str, ...]
    total_size: Optional[int]
    keys_of: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def order(self) -> list[str]:
        """Every key a reader gives back: the weight map's, then the tied ones (in their order)."""
        return [*self.weight_map, *self.aliases]

    def shard_path(self, shard: str) -> str:
        """The full path or URL of one shard, checked to be a regular file in the folder.

        Raises:
            CheckpointCorruptError: A symlink leading out of the folder, a FIFO
                or a device stands where the shard should be (:func:`ddpstate._fs.confined_file`).
        """
        return _fs.confined_file(
            self.folder, shard, checkpoint=self.path, entry=f"the index's shard {shard!r}"
        )

    def missing(self, shard: str) -> CheckpointNotFoundError:
        """The error for a shard the index names that is not there."""
        return CheckpointNotFoundError(
            f"{storage.join(self.folder, shard)}: shard named by {self.path} is missing; "
            f"download every shard the index lists ({len(self.shards)} in all)"
        )


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
            f"{storage.join(path, names[0])}"
        )
    return storage.join(path, names[0]) if names else None


def open_index(path: str, storage_options: Optional[dict[str, Any]] = None) -> ShardIndex:
    """Find and read the index of the sharded checkpoint at ``path`` (the index or its folder).

    Raises:
        CheckpointFormatError: ``path`` holds no index, or more than one.
        CheckpointNotFoundError, CheckpointCorruptError: As for :func:`read_index`.
    """
    index_path = find_index(path, storage_options)
    if index_path is None:
        raise CheckpointFormatError(f"{path}: no *.safetensors.index.json or *.bin.index.json")
    return read_index(index_path, storage_options)


def _bad_index(path: str, detail: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{path}: not a valid sharded-checkpoint index ({detail}); re-download it, or pass a "
        f"single checkpoint file"
    )


def _check_shard_name(index: str, key: str, shard: Any) -> str:
    if not isinstance(shard, str) or not shard:
        raise _bad_index(index, f"weight_map[{key!r}] is {shard!r}, not a file name")
    # The names come from a downloaded file: never let one reach outside the folder.
    why = _fs.name_problem(shard)
    if why is not None:
        raise _bad_index(
            index, f"weight_map[{key!r}] names {shard!r}, outside the index's folder: it {why}"
        )
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
    aliases = metadata.get(ALIASES_KEY, {}) if isinstance(metadata, dict) else {}
    return ShardIndex(
        path=path,
        folder=folder_of(path),
        weight_map=weight_map,
        shards=tuple(sorted(by_shard)),
        total_size=total,
        keys_of={shard: frozenset(keys) for shard, keys in by_shard.items()},
        aliases=_check_aliases(path, aliases, weight_map),
    )


def _check_aliases(path: str, aliases: Any, weight_map: dict[str, str]) -> dict[str, str]:
    """The index's tied keys, each naming a key of the weight map and not in it itself."""
    if not isinstance(aliases, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
    ):
        raise _bad_index(path, f"metadata[{ALIASES_KEY!r}] is not a map of key -> key")
    for alias, canonical in aliases.items():
        if alias in weight_map or canonical not in weight_map:
            raise _bad_index(
                path,
                f"metadata[{ALIASES_KEY!r}] ties {alias!r} to {canonical!r}, but the weight map "
                f"{'lists the first' if alias in weight_map else 'does not list the second'}",
            )
    return dict(aliases)


def check_keys(index: ShardIndex, shard: str, part: Mapping[Any, Any]) -> None:
    """Raise unless ``shard`` holds exactly the keys the index assigns to it.

    Raises:
        CheckpointCorruptError: A key is missing from its shard, the shard holds a
            key the index lists elsewhere or not at all, or a tied key is not the
            tensor the index ties it to.
    """
    problems = key_problems(index, shard, part)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointCorruptError(
            f"{index.path}: the index and its shards disagree: {problems[0]}{more}; re-download "
            f"the checkpoint (`ddpstate verify` lists every problem)"
        )


def key_problems(index: ShardIndex, shard: str, part: Mapping[Any, Any]) -> list[str]:
    """What is wrong between the entries ``shard`` holds and those the index gives it.

    ``part`` is what a reader gives back, tied keys included: each tied key the
    index records goes with the shard of the key whose tensor it shares, and is
    that very tensor (the shard's own header says which key it shares).
    """
    held = set(part)
    tied = {a for a, c in index.aliases.items() if index.weight_map[c] == shard}
    untied = [
        f"tied key {a!r} is recorded with {index.aliases[a]!r}, but {shard} gives it another tensor"
        for a in sorted(tied & held)
        if index.aliases[a] in part and part[a] is not part[index.aliases[a]]
    ]
    if held == index.keys_of.get(shard, frozenset()) | tied and not untied:
        return []
    problems = [
        f"key {k!r} is listed in {shard} but that shard does not hold it"
        for k, s in index.weight_map.items()
        if s == shard and k not in held
    ]
    problems += [
        f"tied key {a!r} is recorded with {index.aliases[a]!r} in {shard} but that shard does "
        f"not give it back"
        for a in sorted(tied - held)
    ]
    for k in part:
        if k in tied:
            continue
        owner = index.weight_map.get(k)
        if owner is None:
            problems.append(f"{shard} holds key {k!r}, which the index does not list")
        elif owner != shard:
            problems.append(f"key {k!r} is in {shard} too, but the index puts it in {owner}")
    return problems + untied
