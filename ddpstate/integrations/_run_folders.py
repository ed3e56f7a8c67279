"""The folders integrations keep checkpoints in, as ``ddpstate verify`` and ``inspect`` read them.

A Lightning ``ModelCheckpoint`` ``dirpath`` (``*.ckpt`` files), an Accelerate project's
``checkpoints/`` (``checkpoint_N`` folders) and a Hugging Face Trainer ``output_dir``
(``checkpoint-N`` folders). :func:`find_run_folder` recognises one from its names;
:func:`verify_run_folder` judges each checkpoint, names the one the integration resumes
from (its own chooser, run here: ``last_verified_checkpoint``, or ``load_state``'s
``newest_verified``), what the framework's own resume would take, and the leftovers of
killed saves. Importing this module imports no framework; the Lightning and Trainer
choosers import theirs when a folder of theirs is verified.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
import warnings
from collections.abc import Callable
from typing import Any, Optional

from ddpstate import storage
from ddpstate._convert.results import VerifyResult
from ddpstate._convert.verify import verify_file, verify_records
from ddpstate._manifest import MANIFEST_NAME
from ddpstate.errors import DDPStateError, UnsafeCheckpointError
from ddpstate.formats import FormatName
from ddpstate.integrations import _common
from ddpstate.integrations.accelerate import _CHECKPOINT_RE as _ACCELERATE_RE

#: The kinds of folder, as :class:`RunFolder` names them.
LIGHTNING, ACCELERATE_DIR, TRAINER_DIR = "lightning", "accelerate", "transformers"
_WHAT = {
    LIGHTNING: "Lightning ModelCheckpoint dirpath",
    ACCELERATE_DIR: "Accelerate checkpoints/ folder",
    TRAINER_DIR: "Hugging Face Trainer output_dir",
}
# transformers.py builds this from transformers' PREFIX_CHECKPOINT_DIR ("checkpoint"); it is
# spelled out here so that recognising a folder does not import transformers.
_TRAINER_RE = re.compile(r"^checkpoint-(\d+)$")
# Lightning's ModelCheckpoint.FILE_EXTENSION; its "last" files are those whose stem this
# matches (ModelCheckpoint._find_last_checkpoints), and ckpt_path="last" takes the newest of
# them by modification time (_CheckpointConnector._parse_ckpt_path).
_CKPT_SUFFIX = ".ckpt"
_LAST_STEM = re.compile(r"^last(-(\d+))?")


@dataclasses.dataclass(frozen=True)
class RunFolder:
    """A folder of one framework's checkpoints.

    Attributes:
        path: The folder holding the checkpoints (an Accelerate project's ``checkpoints/``).
        kind: :data:`LIGHTNING`, :data:`ACCELERATE_DIR` or :data:`TRAINER_DIR`.
        checkpoints: The checkpoints' paths, oldest first (Lightning: by modification
            time; the others by their number).
        leftovers: Names of ddpstate's temporary files and folders in it, which only a
            killed save leaves (``storage.is_temp_name``).
        own_files: The folder is a training folder itself too (a Trainer ``output_dir``
            holding the model ``save_model`` wrote beside its ``checkpoint-N`` folders).
    """

    path: str
    kind: str
    checkpoints: tuple[str, ...]
    leftovers: tuple[str, ...]
    own_files: bool = False

    @property
    def what(self) -> str:
        """The folder's kind in words (``"Hugging Face Trainer output_dir"``)."""
        return _WHAT[self.kind]


def find_run_folder(
    path: str, storage_options: Optional[dict[str, Any]], *, own_files: bool = False
) -> Optional[RunFolder]:
    """The framework folder of checkpoints at ``path``, or None when it is not one.

    ``path`` is one when it holds ``checkpoint-N`` folders (Trainer), ``checkpoint_N``
    folders (Accelerate; or a project folder whose ``checkpoints/`` does) or ``.ckpt``
    files (Lightning).

    Args:
        path: A folder (local path or fsspec URL).
        storage_options: fsspec options for URLs.
        own_files: ``path`` is a training folder itself (``formats.detect_format`` says
            so): only checkpoint folders in it make it a run folder, not ``.ckpt`` files.

    Returns:
        A :class:`RunFolder`, or None.
    """
    opts = storage_options
    if not storage.isdir(path, storage_options=opts):
        return None
    inner = storage.join(path, "checkpoints")
    if storage.isdir(inner, storage_options=opts) and _common.numbered(inner, _ACCELERATE_RE, opts):
        path = inner  # an Accelerate project_dir: its checkpoints live in checkpoints/
    names = storage.listdir(path, storage_options=opts, include_temp=True)
    leftovers = tuple(n for n in names if storage.is_temp_name(n))
    for kind, pattern in ((TRAINER_DIR, _TRAINER_RE), (ACCELERATE_DIR, _ACCELERATE_RE)):
        found = _common.numbered(path, pattern, opts)
        if found:
            return RunFolder(path, kind, tuple(p for _, p in found), leftovers, own_files)
    files = [storage.join(path, n) for n in names if n.endswith(_CKPT_SUFFIX)]
    if own_files or not files:
        return None
    files.sort(key=lambda f: (_common.modified_time(f, opts), f))
    return RunFolder(path, LIGHTNING, tuple(files), leftovers)


def verify_run_folder(
    run: RunFolder,
    *,
    weights_only: bool = True,
    progress: bool = False,
    storage_options: Optional[dict[str, Any]] = None,
) -> VerifyResult:
    """Judge every checkpoint of ``run``, and name the one resuming takes.

    Each checkpoint is checked by :func:`ddpstate.convert.verify_file` (a ``.ckpt`` that
    pickles more than weights-only: its records against their CRC-32s, never unpickled);
    a damaged one is a problem, prefixed with its name. The notes name the checkpoint the
    integration resumes from (its own chooser, run here, which reads its candidates
    again), what the framework's own resume rule takes where that differs, the folders
    no ddpstate manifest seals, and the leftovers of killed saves.

    Args:
        run: The folder, from :func:`find_run_folder`.
        weights_only: As for ``verify_file`` (False: torch's full unpickler).
        progress: Draw a progress bar on stderr (only on a terminal).
        storage_options: fsspec options for URLs.

    Returns:
        A :class:`~ddpstate.convert.VerifyResult` with ``checkpoints`` and ``resume_from``.
    """
    problems: list[str] = []
    notes: list[str] = []
    verdicts: dict[str, bool] = {}
    tensors = read = 0
    kind: Optional[FormatName] = None
    said: dict[str, list[str]] = {}  # a note -> the checkpoints it is true of (said once)
    for path in run.checkpoints:
        name = _name(path)
        found = _verify_one(path, weights_only, progress, storage_options)
        kind = kind or found.format
        verdicts[name] = found.ok
        problems += [f"{name}: {p}" for p in found.problems]
        for note in found.notes:
            if not note.startswith("no ddpstate"):  # said below, in the run's terms
                said.setdefault(note, []).append(name)
        tensors += found.tensors
        read += found.bytes_read
        if run.kind != LIGHTNING and not storage.exists(
            storage.join(path, MANIFEST_NAME), storage_options=storage_options
        ):
            notes.append(
                f"{name}: no ddpstate {MANIFEST_NAME} (a save killed before it was sealed, or "
                f"written without ddpstate): its files are checked, not that the set is "
                f"complete, and ddpstate's resume skips it"
            )
    notes[:0] = [f"{', '.join(names)}: {note}" for note, names in said.items()]
    if run.own_files:  # the model saved beside the checkpoints is checked too
        found = _verify_one(run.path, weights_only, progress, storage_options)
        problems += found.problems
        tensors += found.tensors
        read += found.bytes_read
        notes += [
            f"its own files: {note}"
            for note in found.notes
            if not note.startswith(tuple(f"{name}: " for name in verdicts))
        ]
    resume, choice, known = _resume_choice(run, storage_options)
    notes.append(choice)
    notes += _framework_choice(run, resume if known else "", verdicts)
    problems += _accelerate_takes_a_leftover(run)
    notes += [
        f"{n}: left by a killed save (ddpstate's temporary name; delete it when no save runs)"
        for n in run.leftovers
    ]
    return VerifyResult(
        path=run.path,
        format=kind,
        problems=tuple(problems),
        tensors=tensors,
        bytes_read=read,
        notes=tuple(notes),
        checkpoints=verdicts,
        resume_from=resume,
    )


def _name(path: str) -> str:
    return posixpath.basename(path.replace(os.sep, "/").rstrip("/"))


def _verify_one(
    path: str, weights_only: bool, progress: bool, opts: Optional[dict[str, Any]]
) -> VerifyResult:
    """One checkpoint, as ``ddpstate verify`` checks it on its own; a refusal is its problem."""
    try:
        try:
            return verify_file(
                path, weights_only=weights_only, progress=progress, storage_options=opts
            )
        except UnsafeCheckpointError as exc:  # a .ckpt's hyper-parameters: its records alone
            found = verify_records(path, progress=progress, storage_options=opts)
            unsafe = ", ".join(exc.unsafe_globals[:3])
            return dataclasses.replace(found, notes=(
                *found.notes,
                f"it pickles Python objects beyond tensors ({unsafe}...): its records checked, "
                f"never unpickled",
            ))  # fmt: skip
    except DDPStateError as exc:
        return VerifyResult(path=path, format=None, problems=(str(exc),))


def _resume_choice(
    run: RunFolder, opts: Optional[dict[str, Any]]
) -> tuple[Optional[str], str, bool]:
    """What the integration's own resume takes: ``(name, a sentence saying it, known)``.

    Not known (``False``) where its framework, which its module imports, is not installed.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its "skipping ..." repeats the problems listed
        if run.kind == ACCELERATE_DIR:  # what load_state(accelerator) does with no folder
            newest_first = list(reversed(run.checkpoints))
            chosen = _common.newest_verified(newest_first, what="load_state", storage_options=opts)
            how = "ddpstate.integrations.accelerate.load_state(accelerator)"
        else:
            framework = "transformers" if run.kind == TRAINER_DIR else "lightning"
            try:
                choose = _chooser(run.kind)
            except ImportError as exc:  # its message says what to install
                return None, f"the checkpoint ddpstate's resume takes is not named: {exc}", False
            chosen = choose(run.path, storage_options=opts)
            folder = "output_dir" if run.kind == TRAINER_DIR else "dirpath"
            how = f"ddpstate.integrations.{framework}.last_verified_checkpoint({folder})"
    if chosen is None:
        return None, f"{how} finds none that verifies", True
    name = _name(chosen)
    return name, f"{how} resumes from {name}", True


def _chooser(kind: str) -> Callable[..., Optional[str]]:
    """The integration's ``last_verified_checkpoint`` for ``kind``; raises ImportError."""
    if kind == TRAINER_DIR:
        # Its module imports transformers: imported only for a Trainer's folder.
        from ddpstate.integrations import transformers

        return transformers.last_verified_checkpoint
    # Its module imports lightning: imported only for a Lightning folder.
    from ddpstate.integrations import lightning

    return lightning.last_verified_checkpoint


def _accelerate_takes_a_leftover(run: RunFolder) -> list[str]:
    """A killed save's leftover that Accelerate's own ``load_state()`` would resume from.

    With ``automatic_checkpoint_naming`` it takes, of every entry of ``checkpoints/``, the
    one whose name's first number is highest (``Accelerator.load_state``): a killed save's
    ``.checkpoint_2.ddpstate-tmp-...`` beats ``checkpoint_1``. On a tie the listing's order
    decides, so a leftover tied with a checkpoint counts too.
    """
    if run.kind != ACCELERATE_DIR:
        return []
    first_numbers = [
        (int(m.group()), name)
        for name in (*run.leftovers, *map(_name, run.checkpoints))
        if (m := re.search(r"[0-9]+", name))
    ]
    highest = max((n for n, _ in first_numbers), default=None)
    return [
        f"{name}: Accelerate's own load_state() (automatic_checkpoint_naming) takes this "
        f"folder, which a killed save left behind (not a checkpoint); delete it (no save "
        f"running) or "
        f"resume with ddpstate.integrations.accelerate.load_state(accelerator)"
        for n, name in first_numbers
        if n == highest and name in run.leftovers
    ]


def _framework_choice(
    run: RunFolder, resume: Optional[str], verdicts: dict[str, bool]
) -> list[str]:
    """What the framework's own resume takes, where that is not ``resume`` ("": not known)."""
    names = [_name(p) for p in run.checkpoints]
    if run.kind == LIGHTNING:
        last = [n for n in names if _LAST_STEM.match(n[: -len(_CKPT_SUFFIX)])]  # oldest first
        own, rule = (last[-1] if last else None), 'Lightning\'s own ckpt_path="last"'
    else:  # both take the highest number, whole or not
        own = names[-1] if names else None
        rule = (
            "Accelerate's own load_state() (automatic_checkpoint_naming)"
            if run.kind == ACCELERATE_DIR
            else "the Trainer's own resume_from_checkpoint=True"
        )
    if own is None or own == resume:
        return []
    if verdicts.get(own):
        return [f"{rule} takes {own}"]
    if resume == "":
        return [f"{rule} takes {own}, which fails verification"]
    instead = f"resume from {resume}" if resume else "no checkpoint here verifies"
    return [f"{rule} takes {own}, which fails verification; {instead}"]
