"""The training folders users have, told apart by their file names, torch-free.

A ddpstate ``CheckpointManager`` step folder, an Accelerate ``save_state`` folder
and a Hugging Face Trainer ``checkpoint-N`` folder each hold a model's weights
beside optimizer, scheduler, RNG and framework files. This module names each
file's role and picks the model weights, so that ``ddpstate inspect``/``verify``/
``convert`` take such a folder as one unit (:func:`ddpstate.formats.detect_format`
says which kind it is).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Optional

#: Folder kinds (values of :data:`ddpstate.formats.FormatName`).
MANAGER = "manager"
ACCELERATE = "accelerate"
HF_TRAINER = "hf_trainer"

_WEIGHTS = r"(?:model|pytorch_model|adapter_model)(?:_\d+)?\.(?:safetensors|bin)"
#: Each file's role, first match wins (a name matching none is "other").
ROLES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), role)
    for pattern, role in (
        (r"manifest\.json", "ddpstate manifest (sizes, CRC-32s)"),
        (r"_rng\.pt", "RNG states"),
        (_WEIGHTS, "model weights"),
        (r".*\.index\.json", "model weights index (sharded)"),
        (r".*-\d+-of-\d+\.(?:safetensors|bin)", "model weights shard"),
        (r"optimizer(?:_\d+)?\.(?:bin|pt)", "optimizer state"),
        (r"scheduler(?:_\d+)?\.(?:bin|pt)", "LR scheduler state"),
        (r"scaler\.pt", "gradient scaler state"),
        (r"random_states_\d+\.pkl|rng_state(?:_\d+)?\.pth", "RNG states"),
        (r"(?:sampler|dl_state_dict)(?:_\d+)?\.bin", "data loader state"),
        (r"custom_checkpoint_\d+\.pkl", "custom object state"),
        (r"trainer_state\.json", "Trainer state (step, logs)"),
        (r"training_args\.bin", "TrainingArguments (pickled object)"),
        (r".*\.json", "configuration"),
    )
)
_MODEL_RE = re.compile(_WEIGHTS)
_ACCELERATE_RE = re.compile(
    r"random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|(?:optimizer|scheduler|sampler)(?:_\d+)?\.bin"
)
_HF_TRAINER_RE = re.compile(r"trainer_state\.json|training_args\.bin|rng_state(?:_\d+)?\.pth")
_MANAGER_RE = re.compile(r"_rng\.pt|latest|step_\d+")
_STEP_FOLDER_RE = re.compile(r"step_\d+")


def role_of(name: str) -> str:
    """What a file in a training folder holds, from its name ("other" when unknown)."""
    return next((role for pattern, role in ROLES if pattern.fullmatch(name)), "other")


def folder_kind(folder_name: str, names: Sequence[str]) -> Optional[str]:
    """Which training folder ``names`` (a folder's entries) make, or None.

    Args:
        folder_name: The folder's own name (a ``step_N`` folder is a manager's).
        names: The names in it.

    Returns:
        ``"manager"``, ``"hf_trainer"``, ``"accelerate"``, or None.
    """
    if _STEP_FOLDER_RE.fullmatch(folder_name) or any(_MANAGER_RE.fullmatch(n) for n in names):
        return MANAGER
    if any(_HF_TRAINER_RE.fullmatch(n) for n in names):
        return HF_TRAINER
    if any(_ACCELERATE_RE.fullmatch(n) for n in names):
        return ACCELERATE
    return MANAGER if "manifest.json" in names else None


def model_files(names: Sequence[str]) -> list[str]:
    """The model weight files among ``names``: safetensors first, then ``.bin``, each sorted."""
    found = [n for n in names if _MODEL_RE.fullmatch(n)]
    return sorted(found, key=lambda n: (not n.endswith(".safetensors"), n))
