"""The result types of the file commands (``convert``, ``inspect``, ``diff``, ``verify``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from ddpstate.formats import FormatName


@dataclasses.dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert_file` did.

    Attributes:
        src: The source file.
        dst: The file written (``src`` itself for ``in_place``).
        src_format: ``"pt"``, ``"pt_legacy"``, ``"safetensors"``, ``"hf_sharded"`` or
            ``"dcp"`` (:mod:`ddpstate.formats`).
        dst_format: ``"pt"``, ``"safetensors"``, ``"hf_sharded"`` (``max_shard_size``)
            or ``"dcp"``.
        state_dict_path: Where the model state dict was found (dotted; ``""``
            for a bare state dict), or None when no key rule was needed.
        renamed: How many state-dict keys changed.
        tensors: Tensors written.
        bytes_copied: Tensor bytes copied from the source.
        dropped: Top-level entries removed by ``drop_optimizer``.
        left_out: Entries not written to a safetensors file (only the model
            state dict goes there).
        notes: Other things worth telling the user, one line each.
        written: False when ``in_place`` found nothing to change and left the file alone.
        cast: Tensors cast to ``dtype`` (``convert --dtype``).
    """

    src: str
    dst: str
    src_format: FormatName
    dst_format: FormatName
    state_dict_path: Optional[str]
    renamed: int
    tensors: int
    bytes_copied: int
    dropped: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    written: bool = True
    cast: int = 0


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One row of :class:`InspectResult`'s key table."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    device: str


@dataclasses.dataclass(frozen=True)
class InspectResult:
    """What :func:`inspect_file` found, read from headers and the pickle only.

    Attributes:
        path: The file.
        format: Its format.
        file_size: Bytes on disk.
        tensor_count: Tensors anywhere in the checkpoint (optimizer state included).
        tensor_bytes: Bytes of tensor data stored (shared storages counted once).
        dtype_bytes: Stored bytes per dtype.
        devices: Number of storages per device tag recorded in the file.
        prefixes: Wrapper prefixes leading every model key (``module.``...).
        state_dict_path: Dotted path of the model state dict (``""``: the file
            is one), or None when there is none.
        structure: ``(top-level key, description)`` for nested checkpoints.
        tensors: The model state dict's keys (or every tensor's path when
            there is no state dict).
        unsafe_globals: Globals only ``unsafe=True`` reads.
        problems: Structural damage found (``ddpstate verify`` checks more).
        notes: Other remarks (a pickled whole module, ...).
    """

    path: str
    format: FormatName
    file_size: int
    tensor_count: int
    tensor_bytes: int
    dtype_bytes: dict[str, int]
    devices: dict[str, int]
    prefixes: tuple[str, ...]
    state_dict_path: Optional[str]
    structure: tuple[tuple[str, str], ...]
    tensors: tuple[TensorInfo, ...]
    unsafe_globals: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``ddpstate inspect --json`` prints)."""
        out = dataclasses.asdict(self)
        out["structure"] = [{"key": k, "value": v} for k, v in self.structure]
        out["tensors"] = [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
             "device": t.device}
            for t in self.tensors
        ]  # fmt: skip
        return out


@dataclasses.dataclass(frozen=True)
class DiffResult:
    """How two checkpoints' model state dicts differ.

    Attributes:
        a: First file.
        b: Second file.
        only_a: Keys only in ``a`` (after normalizing wrapper prefixes unless raw).
        only_b: Keys only in ``b``.
        mismatched: ``(key, what a has, what b has)`` for shape, dtype or type differences.
        max_abs_diff: Largest absolute difference per shared tensor of equal shape and dtype.
        atol: The tolerance used.
        different_values: Keys whose difference exceeds ``atol``.
        notes: Remarks (which state dicts were compared...).
    """

    a: str
    b: str
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    mismatched: tuple[tuple[str, str, str], ...]
    max_abs_diff: dict[str, float]
    atol: float
    different_values: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def equal(self) -> bool:
        """True when the keys match and every tensor agrees within ``atol``."""
        return not (self.only_a or self.only_b or self.mismatched or self.different_values)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``ddpstate diff --json`` prints)."""
        return {
            **dataclasses.asdict(self),
            "equal": self.equal,
            "mismatched": [{"key": k, "a": a, "b": b} for k, a, b in self.mismatched],
            "max_abs_diff": {k: _json_float(v) for k, v in self.max_abs_diff.items()},
        }


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """Whether a checkpoint file is intact.

    Attributes:
        path: The file.
        format: Its format (None when it could not be read at all).
        problems: What is wrong; empty when the file is good.
        tensors: Tensors checked.
        bytes_read: Bytes read to check the data.
        notes: Remarks that are not problems (no CRC recorded...).
        checkpoints: For a folder of checkpoints (a CheckpointManager directory, a
            Lightning ``dirpath``, an Accelerate ``checkpoints/`` folder, a Hugging Face
            ``output_dir``): each checkpoint's name and whether it verified.
        resume_from: The checkpoint of such a folder that resuming takes
            (``CheckpointManager.restore()``, or the integration's
            ``last_verified_checkpoint``/``load_state``); None when none verifies.
    """

    path: str
    format: Optional[FormatName]
    problems: tuple[str, ...]
    tensors: int = 0
    bytes_read: int = 0
    notes: tuple[str, ...] = ()
    checkpoints: dict[str, bool] = dataclasses.field(default_factory=dict)
    resume_from: Optional[str] = None

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {**dataclasses.asdict(self), "ok": self.ok}


def _json_float(value: float) -> Any:
    return value if math.isfinite(value) else str(value)  # JSON has no NaN or inf
