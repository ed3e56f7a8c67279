"""A DCP folder's items confined to it: every file ``.metadata`` names checked before any is opened.

A ``.metadata`` item's ``relative_path`` is a claim of the file, like any path inside
a checkpoint: :func:`check_item_files` refuses one that leads outside the folder
(``..``, an absolute path or URL, a symlink out) or to something that is not a regular
file (a FIFO would block the reader). Every DCP read in ddpstate runs it in
``set_up_storage_reader``, inside DCP's planning round, so each rank raises the error
before reading: :class:`~ddpstate.dcp.VerifiedReader` (``durable_dcp``) and, for a
folder without a manifest, torch's own readers from :func:`plain_reader`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

from ddpstate import _fs
from ddpstate._manifest import MANIFEST_NAME, METADATA_NAME
from ddpstate.errors import CheckpointCorruptError

try:  # the public module (newer torch); torch 2.13 has only the private one
    from torch.distributed.checkpoint import fsspec_filesystem as fsspec_dcp  # type: ignore[attr-defined,unused-ignore]
except ImportError:
    from torch.distributed.checkpoint import _fsspec_filesystem as fsspec_dcp

__all__ = ["PlanOnce", "check_item_files", "fsspec_dcp", "plain_reader"]


def check_item_files(
    folder: str, metadata: Any, listed: Optional[Mapping[str, Any]] = None
) -> None:
    """Refuse a ``.metadata`` whose items lie outside ``folder`` before any shard is opened.

    Each item's ``relative_path`` must name a regular file inside the folder
    (:func:`ddpstate._fs.confined_file`: no ``..``, absolute path, symlink out,
    FIFO or device) and its offset and length must be byte counts. A reader runs
    this in ``set_up_storage_reader``, inside DCP's planning round, so every rank
    raises the error.

    Args:
        folder: The checkpoint folder (local path or fsspec URL).
        metadata: DCP's ``Metadata``.
        listed: The files the folder's manifest records (:class:`VerifiedReader`):
            an item in any other file would be read unchecked, so it is refused.

    Raises:
        CheckpointCorruptError: Naming the folder, the item and the file.
    """
    seen: set[str] = set()
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        entry = f"{METADATA_NAME} item {getattr(index, 'fqn', index)!r}"
        name = info.relative_path
        if isinstance(name, os.PathLike):
            name = os.fspath(name)
        if not isinstance(name, str) or name not in seen:  # each file once: items share files
            _fs.confined_file(folder, name, checkpoint=folder, entry=entry)
            if listed is not None and name not in listed:
                raise CheckpointCorruptError(
                    f"{folder}: {entry} lies in {name!r}, which its {MANIFEST_NAME} does not "
                    f"list, so its bytes could not be checked; the checkpoint is damaged or was "
                    f"edited: restore an older one or re-save it"
                )
            seen.add(name)
        offset, length = info.offset, info.length
        if not isinstance(offset, int) or not isinstance(length, int) or min(offset, length) < 0:
            raise CheckpointCorruptError(
                f"{folder}: {entry} claims bytes at offset {offset!r}, length {length!r} of "
                f"{name!r}, which are not byte counts; the {METADATA_NAME} is damaged: re-save "
                f"the checkpoint"
            )


class _ConfinedReader(FileSystemReader):
    """torch's reader for a plain DCP folder on local disk, its items' files checked first."""

    def set_up_storage_reader(
        self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        check_item_files(os.fspath(self.path), metadata)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


class _ConfinedFsspecReader(fsspec_dcp.FsspecReader):  # type: ignore[misc,unused-ignore]
    """torch's ``FsspecReader`` for a plain DCP folder at a URL, its items' names checked first."""

    def __init__(self, path: str, **storage_options: Any) -> None:
        super().__init__(path, **storage_options)
        self.url = path

    def set_up_storage_reader(
        self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        check_item_files(self.url, metadata)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


def plain_reader(path: str, storage_options: Optional[dict[str, Any]]) -> Any:
    """torch's reader for a DCP folder without a manifest, refusing items outside the folder.

    Args:
        path: The folder (local path or fsspec URL).
        storage_options: fsspec options for a URL.

    Returns:
        A ``torch.distributed.checkpoint`` storage reader (``FileSystemReader`` or
        ``FsspecReader``) that runs :func:`check_item_files` before reading.
    """
    if _fs.is_remote(path):
        return _ConfinedFsspecReader(path, **(storage_options or {}))
    return _ConfinedReader(_fs.local_path(path))


class PlanOnce(DefaultLoadPlanner):
    """DCP's default load planner, keeping the local plan it made first.

    ``CheckpointManager.restore`` plans (and so checks every key and shape)
    before anything loads, then hands this planner to ``dcp.load`` for the
    same state dicts: planning is not cheap (a ``DTensor``'s chunk takes a pass
    over its global size), so the second ask gets the first plan.

    Example:
        >>> planner = PlanOnce()  # then set_up_planner, create_local_plan, dcp.load(planner=)
    """

    _plan: Any = None

    def create_local_plan(self) -> Any:
        """The local plan: made on the first call, the same object on every later one."""
        if self._plan is None:
            self._plan = super().create_local_plan()
        return self._plan
