"""Training folders as units: what ``inspect`` says about one, and how ``verify`` checks one.

A CheckpointManager step folder, an Accelerate ``save_state`` folder and a Hugging
Face Trainer ``checkpoint-N`` folder (:data:`ddpstate.formats.TRAINING_FOLDERS`;
their files' roles in :mod:`ddpstate._layout.folders`). ``inspect`` and ``convert``
read the model weights :func:`ddpstate._convert.source.model_unit` picks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, Optional

from ddpstate import _fs, _manifest, formats, storage
from ddpstate._checksum import error_text
from ddpstate._convert.results import VerifyResult
from ddpstate._layout.folders import role_of
from ddpstate._layout.hf_index import is_index_name
from ddpstate._progress import human_bytes
from ddpstate.errors import DDPStateError, UnsafeCheckpointError

# Roles whose files ``verify`` reads through the index (the shards) or as JSON.
_SHARD_ROLE = "model weights shard"


def describe(
    path: str, kind: str, unit: Optional[str], opts: Optional[dict[str, Any]]
) -> list[str]:
    """``inspect``'s lines about a training folder: its kind, manifest, files and their roles.

    A manager directory is described by its newest committed step folder (what
    ``inspect`` reads), after a line naming its committed steps.
    """
    manager = kind == formats.MANAGER
    committed = _manifest.StepFolders(path, opts).committed_steps() if manager else []
    if committed:
        newest = _manifest.step_name(committed[-1])
        steps = ", ".join(map(str, committed))
        return [
            f"{path}: CheckpointManager directory, committed steps {steps}; shown: its newest "
            f"committed step {newest} (`ddpstate verify` names the one restore() takes)",
            *describe(storage.join(path, newest), kind, unit, opts),
        ]
    what = formats.DESCRIPTIONS[kind]  # type: ignore[index]
    shown = f"shown: its model weights {unit}" if unit else "no model weights picked"
    lines = [f"{path}: {what}; {shown}"]
    manifest, problem = _manifest.read_manifest(path, opts)
    roles: dict[str, str] = {}
    if manifest is None:
        exists = storage.exists(storage.join(path, _manifest.MANIFEST_NAME), storage_options=opts)
        lines.append(f"ddpstate manifest: {problem if exists else 'none'}")
    else:
        step = manifest.get("step")
        metrics = ", ".join(f"{k}={v}" for k, v in (manifest.get("metrics") or {}).items())
        lines.append(
            "ddpstate manifest: present (`ddpstate verify` checks it)"
            + (f"; step {step}" if step is not None else "")
            + (f"; metrics {metrics}" if metrics else "")
        )
        for name, entry in (manifest.get("entries") or {}).items():
            roles[str(entry.get("file"))] = f"entry {name!r} ({entry.get('kind')})"
    for name in storage.listdir(path, storage_options=opts):
        where = storage.join(path, name)
        if storage.isdir(where, storage_options=opts):
            lines.append(f"file {name}/: folder")
            continue
        size = "" if _fs.is_remote(where) else f", {human_bytes(os.path.getsize(where))}"
        lines.append(f"file {name}: {roles.get(name) or role_of(name)}{size}")
    return lines


VerifyOne = Callable[[str, bool], VerifyResult]


def verify_training_folder(
    path: str, kind: str, verify_one: VerifyOne, opts: Optional[dict[str, Any]]
) -> VerifyResult:
    """Check an Accelerate or Hugging Face Trainer folder: its manifest if any, then each file.

    Weights, optimizer and other torch files are read end to end by ``verify_one``
    (``(path, weights_only)``: :func:`ddpstate.convert.verify_file`) weights-only;
    where they pickle other Python objects (RNG states, TrainingArguments), only
    their zip records are checked (``weights_only=False``), never unpickled; a
    sharded model is checked through its index; JSON files must parse.
    """
    problems: list[str] = []
    notes: list[str] = []
    tensors = read = 0
    manifest = storage.exists(storage.join(path, _manifest.MANIFEST_NAME), storage_options=opts)
    if manifest:
        found = _manifest.verify_checkpoint(path, storage_options=opts)
        problems += list(found.problems)
        notes.append(f"{found.files} file(s) checked against the ddpstate manifest")
        read += found.bytes_read
    else:
        notes.append(
            f"no ddpstate {_manifest.MANIFEST_NAME}: each file is checked, not that the set is "
            f"complete"
        )
    for name in storage.listdir(path, storage_options=opts):
        where = storage.join(path, name)
        role = role_of(name)
        if name == _manifest.MANIFEST_NAME or role == _SHARD_ROLE:
            continue  # checked above / through the index
        if name.endswith(".json") and not is_index_name(name):
            try:
                with storage.open_read(where, storage_options=opts) as f:
                    json.loads(f.read())
            except (ValueError, OSError, DDPStateError) as exc:
                problems.append(f"{name}: not readable JSON ({error_text(exc)})")
            continue
        if role == "other":
            notes.append(f"{name}: not a file ddpstate knows (not checked)")
            continue
        try:
            try:
                result = verify_one(where, True)
            except UnsafeCheckpointError as exc:
                result = verify_one(where, False)
                notes.append(
                    f"{name} ({role}) pickles Python objects beyond tensors "
                    f"({', '.join(exc.unsafe_globals[:3])}...): its records checked, never "
                    f"unpickled"
                )
        except DDPStateError as exc:
            problems.append(f"{name}: {exc}")
            continue
        problems += [f"{name}: {p}" for p in result.problems]
        tensors += result.tensors
        read += result.bytes_read
    return VerifyResult(
        path=path,
        format=kind,  # type: ignore[arg-type]
        problems=tuple(problems),
        tensors=tensors,
        bytes_read=read,
        notes=tuple(notes),
    )
