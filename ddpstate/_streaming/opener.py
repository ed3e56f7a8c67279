"""Opening whatever a streaming command is given: one checkpoint file, or a sharded folder.

The single-file reader (:mod:`ddpstate._streaming.reader`) sits below the
Hugging Face sharded reader (:mod:`ddpstate._streaming.hf_read`), which merges one
:class:`~ddpstate._streaming.reader.Checkpoint` per shard; this module sits
above both and picks one, so neither has to import the other back.
"""

from __future__ import annotations

from typing import Any, Optional

from ddpstate import _fs, _manifest, formats, storage
from ddpstate._layout.folders import model_files
from ddpstate._layout.hf_index import find_index, is_index_name
from ddpstate._streaming.hf_read import open_sharded
from ddpstate._streaming.reader import Checkpoint, read_file
from ddpstate.errors import (
    AmbiguousStateDictError,
    CheckpointFormatError,
    StateDictNotFoundError,
    concerning,
)

__all__ = ["model_unit", "read_checkpoint"]

# Among several models, the one so named is the model (a manager's "model" beside "ema";
# Accelerate's model.safetensors beside model_1.safetensors).
_MODEL = "model"


def _pick(path: str, choices: dict[str, str], key: Optional[str], what: str) -> tuple[str, str]:
    """``(choice, key left)``: the one choice, or the one ``key`` names (whole or first part)."""
    if key is not None:
        for name in (key, key.split(".", 1)[0]):
            if name in choices:
                return name, key[len(name) + 1 :]
    if key is None and (len(choices) == 1 or _MODEL in choices):
        return (_MODEL if _MODEL in choices else next(iter(choices))), ""
    listed = ", ".join(choices) or "none"
    error = AmbiguousStateDictError if len(choices) > 1 else StateDictNotFoundError
    named = f"key={key!r} names none of them" if key is not None else "which one is meant?"
    raise concerning("key", error(
        f"{path} holds {len(choices)} {what} ({listed}): {named} Pass key='<one of them>'"
    ))  # fmt: skip


def model_unit(
    path: str, kind: str, key: Optional[str], storage_options: Optional[dict[str, Any]]
) -> tuple[str, Optional[str]]:
    """The model weights of a training folder, and what is left of ``key`` inside them.

    A CheckpointManager step folder: its manifest's module entry, the one named
    ``model`` among several, or the entry ``key`` names (a manager directory:
    its newest committed step). An Accelerate or Hugging Face Trainer folder:
    its sharded index, or its model weights file (``model.*`` among several, or
    the one ``key`` names).

    Args:
        path: The folder.
        kind: Its kind (:func:`ddpstate.formats.detect_format`), one of
            :data:`ddpstate.formats.TRAINING_FOLDERS`.
        key: The user's key: an entry or file to pick, then a key inside it.
        storage_options: fsspec options for URLs.

    Returns:
        ``(file or folder to read, key inside it or None)``.

    Raises:
        StateDictNotFoundError: No model weights, or ``key`` names none of the choices.
        AmbiguousStateDictError: Several, and ``key`` picks none.
        CheckpointFormatError: A manager folder with no readable manifest.
    """
    opts = storage_options
    if kind != formats.MANAGER:
        index = find_index(path, opts)
        if index is not None:
            return index, key
        names = model_files(storage.listdir(path, storage_options=opts))
        if key in names:
            return storage.join(path, key), None
        stems = {n.split(".", 1)[0]: n for n in names}
        picked, rest = _pick(path, stems, key, "model weights files")
        return storage.join(path, stems[picked]), rest or None
    manifest, problem = _manifest.read_manifest(path, opts)
    if manifest is None:
        steps = _manifest.StepFolders(path, opts).committed_steps()
        if not steps:
            raise CheckpointFormatError(f"{path}: a CheckpointManager folder, but {problem}")
        return model_unit(storage.join(path, _manifest.step_name(steps[-1])), kind, key, opts)
    path = storage.committed_folder(path, storage_options=opts)  # a URL's version folder
    entries = manifest.get("entries") or {}
    # "module", or "dcp_module" for a model saved sharded into the step's DCP folder
    modules = {n: e for n, e in entries.items() if str(e.get("kind")).endswith("module")}
    choices = modules if key is None and modules else entries
    picked, rest = _pick(path, choices, key, "model entries" if choices is modules else "entries")
    file = str(entries[picked]["file"])
    if file.startswith(_manifest.DCP_SUBDIR + "/"):  # sharded entries share one DCP folder
        return storage.join(path, _manifest.DCP_SUBDIR), ".".join(filter(None, (picked, rest)))
    where = _fs.confined_file(
        path, file, checkpoint=path, entry=f"its {_manifest.MANIFEST_NAME} entry {picked!r}"
    )
    return where, rest or None


def read_checkpoint(
    path: str,
    *,
    unsafe: bool = False,
    storage_options: Optional[dict[str, Any]] = None,
) -> Checkpoint:
    """Read a checkpoint's structure: the zip directory and pickle, or the safetensors header.

    No tensor data is read and no code from the file runs: globals become
    placeholders. Structural problems (a missing tensor record, a size that
    does not match) are collected in ``Checkpoint.problems``.

    Args:
        path: Local path or fsspec URL of a single checkpoint file, of a
            Hugging Face sharded checkpoint (its shards merged into one view), or of
            a training folder (its model weights, see :func:`model_unit`).
        unsafe: Read pickles that name globals ``torch.load(weights_only=True)``
            refuses (they stay placeholders; nothing runs either way).
        storage_options: fsspec options for URLs.

    Returns:
        The open :class:`~ddpstate._streaming.reader.Checkpoint`; close it when
        done (or use ``with``).

    Raises:
        CheckpointNotFoundError: No such file.
        CheckpointFormatError: Not a checkpoint file, or a TorchScript archive
            or a torch.distributed.checkpoint folder.
        CheckpointCorruptError: The file is truncated or its structure damaged.
        UnsafeCheckpointError: The pickle names unsafe globals and ``unsafe`` is False.

    Example:
        >>> import torch, tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "m.pt")
        >>> torch.save({"module.w": torch.ones(2)}, p)
        >>> with read_checkpoint(p) as ckpt:
        ...     ckpt.format, list(ckpt.obj)
        ('pt', ['module.w'])
    """
    # Folders and index files are told apart by detect_format, as before; a plain
    # file goes straight to the reader, which opens it once and detects its format
    # from the bytes it has open.
    if is_index_name(path) or storage.isdir(path, storage_options=storage_options):
        kind = formats.detect_format(path, storage_options=storage_options)
        if kind == formats.HF_SHARDED:
            return open_sharded(path, unsafe=unsafe, storage_options=storage_options)
        if kind in formats.TRAINING_FOLDERS:
            unit, _ = model_unit(path, kind, None, storage_options)
            return read_checkpoint(unit, unsafe=unsafe, storage_options=storage_options)
        if kind == formats.DCP:
            raise CheckpointFormatError(
                f"{path}: a torch.distributed.checkpoint folder; this command reads single "
                f"checkpoint files (torch.save, legacy torch or safetensors)"
            )
    return read_file(path, unsafe=unsafe, storage_options=storage_options)
