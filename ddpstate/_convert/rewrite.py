"""``convert_file``: rewrite a checkpoint's keys or format, read by torch and written by torch."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, NamedTuple, Optional, Union

import torch

from ddpstate import _fs, formats, storage
from ddpstate._convert.common import (
    Edited,
    StateEdit,
    apply_edit,
    default_destination,
    destination,
    dtype_name,
    format_from_name,
    is_dcp_folder,
    old_arguments,
    same_file,
)
from ddpstate._convert.results import ConvertResult
from ddpstate._convert.source import Checkpoint, failures_named, model_unit, read_checkpoint
from ddpstate._convert.writers import (
    cast_floating,
    write_pt,
    write_safetensors_file,
    write_sharded,
)
from ddpstate._fs import PathLike
from ddpstate._gc import gc_paused
from ddpstate._layout.hf_index import folder_of
from ddpstate._layout.hf_write import parse_size
from ddpstate._progress import Progress
from ddpstate.errors import (
    CheckpointExistsError,
    InvalidArgumentError,
    concerning,
)
from ddpstate.formats import HF_SHARDED, PT, SAFETENSORS, FormatName, parse_format

# ``convert --dtype``'s short names, and the dtype each stands for (torch's own names work too).
_SHORT_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def convert_file(
    src: PathLike,
    dst: Optional[PathLike] = None,
    *,
    edit: Optional[StateEdit] = None,
    format: Optional[str] = None,
    max_shard_size: Optional[Union[int, str]] = None,
    in_place: bool = False,
    overwrite: bool = False,
    weights_only: bool = True,
    progress: bool = False,
    fsync: bool = True,
    storage_options: Optional[dict[str, Any]] = None,
    **legacy: Any,
) -> ConvertResult:
    """Rewrite a checkpoint file's keys or format, through torch's own reader and writer.

    The source is read by ``torch.load(weights_only=True)``, memory-mapped for a
    local zip (tensor bytes stay in the page cache: memory does not grow with
    the file), after ddpstate's container check; safetensors by the
    ``safetensors`` library. The output is written by ``torch.save`` (or
    ddpstate's safetensors writer, one tensor at a time), so it holds exactly
    what torch loads from the source. Key rules are :mod:`ddpstate.keys`' own,
    applied to the model state dict :func:`ddpstate.keys.find_state_dict`
    locates (or ``edit.key``); everything else in the checkpoint comes through
    unchanged. The output is written atomically and every storage is tagged
    ``cpu``, so it loads without ``map_location`` on a machine without a GPU.

    A ``torch.distributed.checkpoint`` folder as ``src`` is consolidated into
    one ``.pt`` or ``.safetensors`` file (read whole, with torch: DCP has no
    streaming reader); ``format="dcp"`` writes a file's state as a DCP folder,
    under a temporary name first and renamed into place when complete.

    Args:
        src: The checkpoint file or DCP folder (local path or fsspec URL).
        dst: Where to write; default :func:`default_destination`.
        edit: What changes in the state (:class:`StateEdit`): which state dict,
            one key rule, ``drop_optimizer``, ``dtype``; default: nothing.
        format: ``"pt"``, ``"safetensors"`` or ``"dcp"``; default: from ``dst``'s suffix
            (``.safetensors``; ``.pt``, ``.pth``, ``.bin``, ``.ckpt``), else the source's kind.
            safetensors output holds the model state dict only; ``"dcp"`` writes
            ``dst`` as a ``torch.distributed.checkpoint`` folder (local, required).
        max_shard_size: Write ``dst`` as a folder in the Hugging Face sharded
            layout (``model-00001-of-0000N.safetensors`` shards of at most this
            size, ``"2GB"``, ``"500MB"``, ``"1.5GiB"`` or bytes, and
            ``model.safetensors.index.json``), atomically as a whole; safetensors only.
        in_place: Replace ``src`` itself (atomically).
        overwrite: Replace an existing ``dst``.
        weights_only: ``False`` reads with ``torch.load(weights_only=False)``:
            torch's full unpickler, which runs whatever code the file names; only
            for files you trust.
        progress: Draw a progress bar on stderr (only when it is a terminal).
        fsync: ``False`` skips the fsyncs of a local output: as fast as ``cp``
            and still atomic against a crashed process, but a power loss or OS
            crash can leave the new file empty. Refused with ``in_place``,
            where the output replaces the only copy.
        storage_options: fsspec options for URLs.
        **legacy: The old names, each with a ``DeprecationWarning``: ``to=`` (now
            ``format=``), ``unsafe=`` (now ``weights_only=``, inverted) and
            ``strip_prefix=``, ``add_prefix=``, ``normalize=``, ``key=``,
            ``drop_optimizer=``, ``dtype=`` (now fields of ``edit``).

    Returns:
        A :class:`ConvertResult`.

    Raises:
        CheckpointNotFoundError: ``src`` does not exist.
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is False.
        CheckpointFormatError: ``src`` is not a checkpoint ddpstate reads, or
            the state dict cannot go to safetensors.
        CheckpointCorruptError: ``src`` is truncated or damaged.
        UnsafeCheckpointError: ``src`` needs unsafe globals and ``weights_only`` is True.
        StateDictNotFoundError: No model state dict to apply the key rule to.
        KeyCollisionError: Renaming would make two keys equal.
        InvalidArgumentError: Conflicting arguments (also a ``ValueError``).
        TypeError: An unknown keyword argument.

    Example:
        >>> import torch, tempfile, os
        >>> from ddpstate.convert import StateEdit, convert_file
        >>> folder = tempfile.mkdtemp()
        >>> src = os.path.join(folder, "dp.pt")
        >>> torch.save({"epoch": 3, "state_dict": {"module.w": torch.ones(2)}}, src)
        >>> result = convert_file(src, edit=StateEdit(strip_prefix="module."))
        >>> os.path.basename(result.dst), result.renamed
        ('dp.converted.pt', 1)
        >>> list(torch.load(result.dst)["state_dict"])
        ['w']
    """
    weights_only, format, fields = old_arguments(
        "convert_file", legacy, weights_only=weights_only, format=format
    )
    if fields and edit is not None:
        raise InvalidArgumentError("pass edit= or its fields' old keyword arguments, not both")
    edit = StateEdit(**fields) if fields else (edit or StateEdit())
    cast_to = None if edit.dtype is None else target_dtype(edit.dtype)
    what = "to" if "to" in legacy else "format"  # the message names the argument as passed
    if format is not None:
        format = parse_format(format, allowed=(PT, SAFETENSORS, formats.DCP), what=what)
    shard_limit = shard_dst = None
    if max_shard_size is not None:
        shard_limit, shard_dst = _check_sharded_output(dst, format, what, in_place, max_shard_size)
    _check_in_place(dst, in_place, fsync)
    src_text = os.fspath(src)
    src_text, edit, folder = _model_of_folder(src_text, edit, in_place, storage_options)
    if (
        folder is not None
        and dst is None
        and storage.isdir(src_text, storage_options=storage_options)
    ):
        dst = default_destination(folder, format or PT)  # a manager's DCP entries: beside the step
    from_dcp = is_dcp_folder(src_text, storage_options)
    if from_dcp or format == formats.DCP:
        if in_place:
            raise concerning("in_place", InvalidArgumentError(
                "in_place=True cannot turn a file into a folder or a folder into a file; name DST"
            ))  # fmt: skip
        if edit.dtype is not None or max_shard_size is not None:
            raise InvalidArgumentError(
                f"{src_text}: dtype and max_shard_size do not apply when converting from or to a "
                f"torch.distributed.checkpoint folder; convert to a .pt file first, then cast "
                f"or shard that"
            )
        # DCP needs torch: imported only here, so the streaming paths stay torch-free.
        from ddpstate._convert import dcp

        convert = dcp.convert_from_dcp if from_dcp else dcp.convert_to_dcp
        return convert(
            src_text, None if dst is None else os.fspath(dst), edit, format=format,
            overwrite=overwrite, weights_only=weights_only, fsync=fsync,
            storage_options=storage_options,
        )  # fmt: skip
    # Unpickling makes a few objects per tensor, none in a cycle: the collector is held off.
    with gc_paused(), failures_named(src_text):
        ckpt = read_checkpoint(src_text, unsafe=not weights_only, storage_options=storage_options)
        dst_format = format or format_from_name(dst) or _kind(ckpt)
        if shard_dst is not None:
            dst_format = SAFETENSORS
            dst_text = shard_dst
            if same_file(src_text, dst_text) or same_file(ckpt.path, dst_text):
                raise CheckpointExistsError(
                    f"{dst_text} is the source; write the sharded copy to a new folder"
                )
        elif in_place and ckpt.format == HF_SHARDED:
            raise concerning("in_place", InvalidArgumentError(
                f"{ckpt.path}: in_place=True cannot replace a sharded checkpoint; name a new DST "
                f"(a folder with max_shard_size for a sharded copy)"
            ))  # fmt: skip
        elif in_place:
            dst_text = src_text
        else:
            # A sharded source is named after its folder, not its index file.
            base = folder or (folder_of(ckpt.path) if ckpt.format == HF_SHARDED else None)
            dst_text = destination(src_text, dst, dst_format, overwrite, storage_options, base)
        output = _Output(dst_text, dst_format, cast_to, shard_limit, in_place, overwrite, fsync)
        return _convert(ckpt, edit, output, progress=progress, storage_options=storage_options)


def _model_of_folder(
    src: str, edit: StateEdit, in_place: bool, storage_options: Optional[dict[str, Any]]
) -> tuple[str, StateEdit, Optional[str]]:
    """A training folder's model weights (``edit.key`` may pick them), the edit, the folder."""
    if not storage.isdir(src, storage_options=storage_options):
        return src, edit, None
    kind = formats.detect_format(src, storage_options=storage_options)
    if kind not in formats.TRAINING_FOLDERS:
        return src, edit, None
    if in_place:
        raise concerning("in_place", InvalidArgumentError(
            f"{src}: in_place=True would rewrite a file inside this {formats.DESCRIPTIONS[kind]} "
            f"(its other files and manifest would no longer match it); name DST"
        ))  # fmt: skip
    unit, key = model_unit(src, kind, edit.key, storage_options)
    return unit, dataclasses.replace(edit, key=key), src.rstrip("/\\") or src


def _kind(ckpt: Checkpoint) -> FormatName:
    """The format a conversion keeps: safetensors stays safetensors, the rest is pt."""
    return SAFETENSORS if ckpt.format == SAFETENSORS else PT


def _check_in_place(dst: Optional[PathLike], in_place: bool, fsync: bool) -> None:
    if in_place and dst is not None:
        raise concerning("in_place", InvalidArgumentError(
            "pass either dst or in_place=True, not both"
        ))  # fmt: skip
    if in_place and not fsync:
        raise concerning("in_place", InvalidArgumentError(
            "in_place=True needs fsync: the output replaces the only copy of the source "
            "(drop --no-fsync, or write to a new DST)"
        ))  # fmt: skip


def _check_sharded_output(
    dst: Optional[PathLike],
    to: Optional[str],
    what: str,
    in_place: bool,
    max_shard_size: Union[int, str],
) -> tuple[int, str]:
    """``(shard size limit, output folder)``, or the error for a combination that cannot be."""
    limit = parse_size(max_shard_size)
    if to not in (None, SAFETENSORS):
        raise InvalidArgumentError(
            f"max_shard_size writes safetensors shards; drop --to pt ({what}='pt') or "
            f"max_shard_size"
        )
    if in_place or dst is None:
        raise InvalidArgumentError(
            "max_shard_size writes a folder of shards: name the output folder as DST "
            "(not --in-place)"
        )
    return limit, os.fspath(dst)


class _Output(NamedTuple):
    """Where and how :func:`_convert` writes."""

    dst: str
    format: FormatName
    dtype: Optional[torch.dtype]
    shard_limit: Optional[int]
    in_place: bool
    overwrite: bool
    fsync: bool


def target_dtype(name: str) -> torch.dtype:
    """The dtype ``name`` (``"bf16"``, ``"fp16"``, ``"fp32"`` or torch's name) stands for.

    Raises:
        InvalidArgumentError: An unknown name (also a ``ValueError``).
    """
    found = _SHORT_NAMES.get(str(name).lower(), str(name).lower())
    if found not in _SHORT_NAMES.values():
        raise concerning("dtype", InvalidArgumentError(
            f"dtype must be one of bf16, fp16, fp32 (or bfloat16, float16, float32), got {name!r}"
        ))  # fmt: skip
    return getattr(torch, found)  # type: ignore[no-any-return]


def _convert(
    ckpt: Checkpoint,
    edit: StateEdit,
    out: _Output,
    *,
    progress: bool,
    storage_options: Optional[dict[str, Any]],
) -> ConvertResult:
    done = apply_edit(ckpt.obj, edit, whole=out.format != SAFETENSORS)
    cast = 0
    if out.dtype is not None:
        dtype = dtype_name(out.dtype)
        # Cast tensors are made in files mapped beside a local output (memory stays flat).
        spill = None if _fs.is_remote(out.dst) else os.path.dirname(os.path.abspath(out.dst))
        if out.format == PT:
            done.root, cast = cast_floating(ckpt, done.root, out.dtype, spill)
        else:
            done.sd, cast = cast_floating(ckpt, done.sd, out.dtype, spill)
        if cast:
            done.notes.append(
                f"cast {cast} floating tensor(s) to {dtype}; integer and bool tensors kept"
            )
    if out.in_place and not _changes(ckpt, done, out.format, cast):
        done.notes.append("nothing to change; the file was left as it is")
        return done.result(ckpt.path, out.dst, ckpt.format, out.format, 0, 0, written=False)
    dst_format = out.format
    meta = dict(ckpt.st_metadata)
    if ckpt.format != SAFETENSORS:
        meta.setdefault("format", "pt")  # Hugging Face loaders ask for it in torch-made files
    with contextlib.closing(
        Progress(ckpt.size, "convert", enabled=None if progress else False)
    ) as bar:
        if out.shard_limit is not None:
            count, copied, notes = write_sharded(
                ckpt, done.sd, meta, out.dst, out.shard_limit,
                fsync=out.fsync, overwrite=out.overwrite,
            )  # fmt: skip
            done.notes += notes
            dst_format = HF_SHARDED
        else:
            with storage.atomic_write(
                out.dst, storage_options=storage_options, fsync=out.fsync
            ) as f:
                if out.format == SAFETENSORS:
                    count, copied, notes = write_safetensors_file(f, ckpt, done.sd, meta, bar)
                    done.notes += notes
                else:
                    count, copied = write_pt(f, done.root, bar)
    return done.result(ckpt.path, out.dst, ckpt.format, dst_format, count, copied, cast=cast)


def _changes(ckpt: Checkpoint, done: Edited, dst_format: str, cast: int) -> bool:
    """True when the output would differ from the source (``in_place`` skips the write if not)."""
    return bool(
        cast
        or done.renamed
        or done.metadata_changed
        or done.dropped
        or dst_format != _kind(ckpt)
        or ckpt.format == formats.LEGACY
        or any(location != "cpu" for location in ckpt.locations.values())
        or (done.sd is not None and done.path is None)
    )
