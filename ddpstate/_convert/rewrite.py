"""``convert_file``: rewrite a checkpoint's keys or format, streaming, without loading it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Any, NamedTuple, Optional, Union

from ddpstate import formats, storage
from ddpstate._convert.common import (
    Edited,
    StateEdit,
    apply_edit,
    default_destination,
    destination,
    format_from_name,
    is_dcp_folder,
    old_arguments,
    raise_problems,
    same_file,
)
from ddpstate._convert.results import ConvertResult
from ddpstate._convert.tensor_data import load_tensor
from ddpstate._convert.writers import (
    alias_notes,
    copied_pickle,
    write_pt,
    write_safetensors,
    write_sharded_safetensors,
)
from ddpstate._fs import PathLike
from ddpstate._gc import gc_paused
from ddpstate._layout.hf_index import folder_of
from ddpstate._streaming.cast import Casts, target_dtype
from ddpstate._streaming.hf_write import parse_size
from ddpstate._streaming.opener import model_unit, read_checkpoint
from ddpstate._streaming.pickle_scan import is_pickled_module, iter_tensors
from ddpstate._streaming.progress import Progress
from ddpstate._streaming.reader import Checkpoint
from ddpstate._streaming.stream import Sink
from ddpstate.errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    InvalidArgumentError,
    concerning,
)
from ddpstate.formats import HF_SHARDED, PT, SAFETENSORS, FormatName, parse_format


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
    """Rewrite a checkpoint file's keys or format without loading it into memory.

    torch.save files: only the pickled structure is rewritten; every tensor
    record is copied byte for byte (in the kernel where the OS allows).
    safetensors: the header is rewritten and the data copied. Across formats,
    one tensor at a time. Legacy (pre-1.6) files are streamed the same way.
    Key rules are :mod:`ddpstate.keys`' own, applied to the model state dict
    :func:`ddpstate.keys.find_state_dict` locates (or ``edit.key``); everything else
    in the checkpoint comes through unchanged. The output is written atomically
    and every storage is tagged ``cpu``, so it loads without ``map_location``
    on a machine without a GPU. No code from the file runs.

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
        weights_only: ``False`` accepts pickles naming globals
            ``torch.load(weights_only=True)`` refuses; they are copied through as they
            are, never run.
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
    # The scan makes a few objects per tensor, none in a cycle: without the collector
    # held off, full collections over them took a seventh of the time at 100,000 tensors.
    with (
        gc_paused(),
        read_checkpoint(src_text, unsafe=not weights_only, storage_options=storage_options) as ckpt,
    ):
        raise_problems(ckpt)
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
    dtype: Optional[str]
    shard_limit: Optional[int]
    in_place: bool
    overwrite: bool
    fsync: bool


def _convert(
    ckpt: Checkpoint,
    edit: StateEdit,
    out: _Output,
    *,
    progress: bool,
    storage_options: Optional[dict[str, Any]],
) -> ConvertResult:
    done = apply_edit(ckpt.obj, edit, whole=out.format != SAFETENSORS)
    casts = _plan_casts(ckpt, done.root if out.format == PT else done.sd, out.dtype)
    if casts is not None and casts.count:
        done.notes.append(
            f"cast {casts.count} floating tensor(s) to {out.dtype}; integer and bool tensors kept"
        )
    if out.in_place and not _changes(ckpt, done, out.format, casts):
        done.notes.append("nothing to change; the file was left as it is")
        return done.result(ckpt.path, out.dst, ckpt.format, out.format, 0, 0, written=False)
    dst_format = out.format
    total = sum(s.nbytes for s in ckpt.storages)
    with contextlib.closing(Progress(total, "convert", enabled=None if progress else False)) as bar:
        if out.shard_limit is not None:
            meta = dict(ckpt.st_metadata)
            meta.setdefault("format", "pt")
            count, copied, aliases, overlaps = write_sharded_safetensors(
                ckpt, done.sd, meta, casts, out.dst, out.shard_limit, bar,
                fsync=out.fsync, overwrite=out.overwrite,
            )  # fmt: skip
            done.notes += alias_notes(aliases, overlaps)
            dst_format = HF_SHARDED
        else:
            with storage.atomic_write(
                out.dst, storage_options=storage_options, fsync=out.fsync
            ) as f:
                sink = Sink(f, bar, write_back=out.fsync)
                count, copied = _write_file(sink, ckpt, done, out.format, casts)
    cast = casts.count if casts is not None else 0
    return done.result(ckpt.path, out.dst, ckpt.format, dst_format, count, copied, cast=cast)


def _changes(ckpt: Checkpoint, done: Edited, dst_format: str, casts: Optional[Casts]) -> bool:
    """True when the output would differ from the source (``in_place`` skips the write if not)."""
    return bool(
        (casts is not None and casts.count)
        or done.renamed
        or done.metadata_changed
        or done.dropped
        or dst_format != _kind(ckpt)
        or ckpt.format == formats.LEGACY
        or any(s.location != "cpu" for s in ckpt.storages)
        or (done.sd is not None and done.path is None)
    )


def _write_file(
    sink: Sink, ckpt: Checkpoint, done: Edited, dst_format: str, casts: Optional[Casts]
) -> tuple[int, int]:
    """Write one output file; ``(tensors, bytes)``."""
    if dst_format == SAFETENSORS:
        meta = dict(ckpt.st_metadata)
        if ckpt.format != SAFETENSORS:
            # Hugging Face loaders ask for this entry in torch-made files.
            meta.setdefault("format", "pt")
        count, copied, aliases, overlaps = write_safetensors(sink, ckpt, done.sd, meta, casts)
        done.notes += alias_notes(aliases, overlaps)
        return count, copied
    pickle_bytes = None
    # A cast rewrites tensor records: the tree is re-emitted, never copied.
    if not done.dropped and not is_pickled_module(ckpt.obj) and casts is None:
        pickle_bytes = copied_pickle(ckpt, done.path, done.source_sd, done.sd)
    return write_pt(sink, ckpt, done.root, pickle_bytes, casts)


def _plan_casts(ckpt: Checkpoint, tree: Any, dtype: Optional[str]) -> Optional[Casts]:
    if dtype is None:
        return None
    if ckpt.byteorder != sys.byteorder:
        raise CheckpointFormatError(
            f"{ckpt.path}: its tensors are stored {ckpt.byteorder}-endian; convert it without "
            f"--dtype first, load it and save it again on this machine, then cast"
        )
    records = (r for _, r in iter_tensors(tree))
    return Casts(records, dtype, lambda rec: load_tensor(ckpt, rec), ckpt.path)
