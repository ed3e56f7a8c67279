"""``convert_file``: rewrite a checkpoint's keys or format, streaming, without loading it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional, Union

from ddpstate import formats
from ddpstate._convert.common import (
    check_rules,
    destination,
    dotted,
    drop_optimizer_state,
    find_state_dict,
    format_from_name,
    is_dcp_folder,
    raise_problems,
    rename,
    same_file,
)
from ddpstate._convert.results import ConvertResult
from ddpstate._convert.tensor_data import load_tensor, native_byteorder
from ddpstate._convert.writers import (
    alias_notes,
    copied_pickle,
    write_pt,
    write_safetensors,
    write_sharded_safetensors,
)
from ddpstate._fs import PathLike
from ddpstate._gc import gc_paused
from ddpstate._streaming.cast import Casts, target_dtype
from ddpstate._streaming.opener import read_checkpoint
from ddpstate._streaming.pickle_scan import (
    is_pickled_module,
    iter_tensors,
    module_state_dict,
    opaque_name,
)
from ddpstate._streaming.progress import Progress
from ddpstate._streaming.reader import Checkpoint
from ddpstate._streaming.stream import Sink
from ddpstate.errors import CheckpointExistsError, CheckpointFormatError, InvalidArgumentError
from ddpstate.formats import HF_SHARDED, PT, SAFETENSORS, FormatName, parse_format


def convert_file(
    src: PathLike,
    dst: Optional[PathLike] = None,
    *,
    strip_prefix: Optional[str] = None,
    add_prefix: Optional[str] = None,
    normalize: bool = False,
    key: Optional[str] = None,
    to: Optional[str] = None,
    drop_optimizer: bool = False,
    in_place: bool = False,
    overwrite: bool = False,
    unsafe: bool = False,
    progress: bool = False,
    fsync: bool = True,
    storage_options: Optional[dict[str, Any]] = None,
    dtype: Optional[str] = None,
    max_shard_size: Optional[Union[int, str]] = None,
) -> ConvertResult:
    """Rewrite a checkpoint file's keys or format without loading it into memory.

    torch.save files: only the pickled structure is rewritten; every tensor
    record is copied byte for byte (in the kernel where the OS allows).
    safetensors: the header is rewritten and the data copied. Across formats,
    one tensor at a time. Legacy (pre-1.6) files are streamed the same way.
    Key rules are :mod:`ddpstate.keys`' own, applied to the model state dict
    :func:`ddpstate.keys.find_state_dict` locates (or ``key``); everything else
    in the checkpoint comes through unchanged. The output is written atomically
    and every storage is tagged ``cpu``, so it loads without ``map_location``
    on a machine without a GPU. No code from the file runs.

    A ``torch.distributed.checkpoint`` folder as ``src`` is consolidated into
    one ``.pt`` or ``.safetensors`` file (read whole, with torch: DCP has no
    streaming reader); ``to="dcp"`` writes a file's state as a DCP folder,
    under a temporary name first and renamed into place when complete.

    Args:
        src: The checkpoint file or DCP folder (local path or fsspec URL).
        dst: Where to write; default :func:`default_destination`.
        strip_prefix: Remove this prefix (e.g. ``"module."``) from the model's keys.
        add_prefix: Add this prefix to every model key.
        normalize: Remove every wrapper prefix (``module.``, ``_orig_mod.``).
        key: Dotted path of the model state dict inside the checkpoint.
        to: ``"pt"``, ``"safetensors"`` or ``"dcp"``; default: from ``dst``'s suffix
            (``.safetensors``; ``.pt``, ``.pth``, ``.bin``, ``.ckpt``), else the source's kind.
            safetensors output holds the model state dict only; ``"dcp"`` writes
            ``dst`` as a ``torch.distributed.checkpoint`` folder (local, required).
        drop_optimizer: Leave optimizer state out of the output.
        in_place: Replace ``src`` itself (atomically).
        overwrite: Replace an existing ``dst``.
        unsafe: Accept pickles naming globals ``torch.load(weights_only=True)``
            refuses; they are copied through as they are, never run.
        progress: Draw a progress bar on stderr (only when it is a terminal).
        fsync: ``False`` skips the fsyncs of a local output: as fast as ``cp``
            and still atomic against a crashed process, but a power loss or OS
            crash can leave the new file empty. Refused with ``in_place``,
            where the output replaces the only copy.
        storage_options: fsspec options for URLs.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (or torch's names): cast
            every floating tensor written to it, one tensor in memory at a
            time, exactly as ``tensor.to(dtype)``; integer and bool tensors
            (``num_batches_tracked``...) are kept as they are.
        max_shard_size: Write ``dst`` as a folder in the Hugging Face sharded
            layout (``model-00001-of-0000N.safetensors`` shards of at most this
            size, ``"2GB"``, ``"500MB"``, ``"1.5GiB"`` or bytes, and
            ``model.safetensors.index.json``), atomically as a whole; safetensors only.

    Returns:
        A :class:`ConvertResult`.

    Raises:
        CheckpointNotFoundError: ``src`` does not exist.
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is False.
        CheckpointFormatError: ``src`` is not a checkpoint ddpstate reads, or
            the state dict cannot go to safetensors.
        CheckpointCorruptError: ``src`` is truncated or damaged.
        UnsafeCheckpointError: ``src`` needs unsafe globals and ``unsafe`` is False.
        StateDictNotFoundError: No model state dict to apply the key rule to.
        KeyCollisionError: Renaming would make two keys equal.
        InvalidArgumentError: Conflicting arguments (also a ``ValueError``).

    Example:
        >>> import torch, tempfile, os
        >>> from ddpstate.convert import convert_file
        >>> folder = tempfile.mkdtemp()
        >>> src = os.path.join(folder, "dp.pt")
        >>> torch.save({"epoch": 3, "state_dict": {"module.w": torch.ones(2)}}, src)
        >>> result = convert_file(src, strip_prefix="module.")
        >>> os.path.basename(result.dst), result.renamed
        ('dp.converted.pt', 1)
        >>> list(torch.load(result.dst)["state_dict"])
        ['w']
    """
    check_rules(strip_prefix, add_prefix, normalize)
    cast_to = None if dtype is None else target_dtype(dtype)
    if to is not None:
        to = parse_format(to, allowed=(PT, SAFETENSORS, formats.DCP), what="to")
    shard_limit = shard_dst = None
    if max_shard_size is not None:
        shard_limit, shard_dst = _check_sharded_output(dst, to, in_place, max_shard_size)
    if in_place and dst is not None:
        raise InvalidArgumentError("pass either dst or in_place=True, not both")
    if in_place and not fsync:
        raise InvalidArgumentError(
            "in_place=True needs fsync: the output replaces the only copy of the source "
            "(drop --no-fsync, or write to a new DST)"
        )
    src_text = os.fspath(src)
    from_dcp = is_dcp_folder(src_text, storage_options)
    if from_dcp or to == formats.DCP:
        if in_place:
            raise InvalidArgumentError(
                "in_place=True cannot turn a file into a folder or a folder into a file; name DST"
            )
        # DCP needs torch; imported only here so the streaming paths stay torch-free.
        from ddpstate._dcp import convert as _dcp_convert

        dst_text = None if dst is None else os.fspath(dst)
        options: dict[str, Any] = dict(
            strip=strip_prefix, add=add_prefix, normalize=normalize, key=key,
            drop_optimizer=drop_optimizer, overwrite=overwrite, unsafe=unsafe, fsync=fsync,
            storage_options=storage_options,
        )  # fmt: skip
        if dtype is not None or max_shard_size is not None:
            raise InvalidArgumentError(
                f"{src_text}: dtype and max_shard_size do not apply when converting from or to a "
                f"torch.distributed.checkpoint folder; convert to a .pt file first, then cast "
                f"or shard that"
            )
        if from_dcp:
            return _dcp_convert.convert_from_dcp(src_text, dst_text, to=to, **options)
        return _dcp_convert.convert_to_dcp(src_text, dst_text, **options)
    # The scan makes a few objects per tensor, none in a cycle: without the collector
    # held off, full collections over them took a seventh of the time at 100,000 tensors.
    with (
        gc_paused(),
        read_checkpoint(src_text, unsafe=unsafe, storage_options=storage_options) as ckpt,
    ):
        raise_problems(ckpt)
        dst_format = (
            to or format_from_name(dst) or (SAFETENSORS if ckpt.format == SAFETENSORS else PT)
        )
        if shard_dst is not None:
            dst_format = SAFETENSORS
            dst_text = shard_dst
            if same_file(src_text, dst_text) or same_file(ckpt.path, dst_text):
                raise CheckpointExistsError(
                    f"{dst_text} is the source; write the sharded copy to a new folder"
                )
        elif in_place and ckpt.format == HF_SHARDED:
            raise InvalidArgumentError(
                f"{ckpt.path}: in_place=True cannot replace a sharded checkpoint; name a new DST "
                f"(a folder with max_shard_size for a sharded copy)"
            )
        elif in_place:
            dst_text = src_text
        else:
            # A sharded source is named after its folder, not its index file.
            dst_text = destination(
                src_text, dst, dst_format, overwrite, storage_options, base=_sharded_base(ckpt)
            )
        return _convert(
            ckpt,
            dst_text,
            dst_format,
            strip=strip_prefix,
            add=add_prefix,
            normalize=normalize,
            key=key,
            drop_optimizer=drop_optimizer,
            in_place=in_place,
            progress=progress,
            fsync=fsync,
            storage_options=storage_options,
            dtype=cast_to,
            shard_limit=shard_limit,
            overwrite=overwrite,
        )


def _sharded_base(ckpt: Checkpoint) -> Optional[str]:
    if ckpt.format != HF_SHARDED:
        return None
    from ddpstate._layout.hf_index import folder_of

    return folder_of(ckpt.path)


def _check_sharded_output(
    dst: Optional[PathLike], to: Optional[str], in_place: bool, max_shard_size: Union[int, str]
) -> tuple[int, str]:
    """``(shard size limit, output folder)``, or the error for a combination that cannot be."""
    from ddpstate._streaming.hf_write import parse_size

    limit = parse_size(max_shard_size)
    if to not in (None, SAFETENSORS):
        raise InvalidArgumentError(
            "max_shard_size writes safetensors shards; drop --to pt (to='pt') or max_shard_size"
        )
    if in_place or dst is None:
        raise InvalidArgumentError(
            "max_shard_size writes a folder of shards: name the output folder as DST "
            "(not --in-place)"
        )
    return limit, os.fspath(dst)


def _convert(
    ckpt: Checkpoint,
    dst: str,
    dst_format: FormatName,
    *,
    strip: Optional[str],
    add: Optional[str],
    normalize: bool,
    key: Optional[str],
    drop_optimizer: bool,
    in_place: bool,
    progress: bool,
    fsync: bool,
    storage_options: Optional[dict[str, Any]],
    dtype: Optional[str] = None,
    shard_limit: Optional[int] = None,
    overwrite: bool = False,
) -> ConvertResult:
    root = ckpt.obj
    notes: list[str] = []
    renaming = strip is not None or add is not None or normalize
    need_sd = renaming or key is not None or dst_format == SAFETENSORS
    path: Optional[tuple[Any, ...]] = None
    sd: Any = None
    if is_pickled_module(root) and need_sd:
        sd = module_state_dict(root)
        notes.append(
            f"the source is a pickled whole nn.Module ({opaque_name(root)}); its parameters "
            f"and buffers were written as a plain state dict"
        )
    elif need_sd:
        path, sd = find_state_dict(root, key)
    renamed = 0
    metadata_changed = False
    new_root = root
    source_sd = sd
    if sd is not None:
        new_sd = rename(sd, strip, add, normalize)
        renamed = sum(1 for a, b in zip(sd, new_sd, strict=False) if a != b)
        renamed += abs(len(sd) - len(new_sd))
        metadata_changed = getattr(sd, "_metadata", None) != getattr(new_sd, "_metadata", None)
        if path is None:
            new_root = new_sd
        elif new_sd is not sd:
            from ddpstate import keys

            new_root = keys.replace_state_dict(root, path, new_sd)
        sd = new_sd
    dropped: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()
    if dst_format == SAFETENSORS:
        if isinstance(new_root, Mapping) and path:
            left_out = tuple(str(k) for k in new_root if k != path[0])
            if len(path) > 1:
                left_out = (f"the rest of {path[0]!s}", *left_out)
    elif drop_optimizer:
        new_root, dropped = drop_optimizer_state(new_root, path)
        if not dropped:
            notes.append("no optimizer state found to drop")
    casts = _plan_casts(ckpt, new_root if dst_format == PT else sd, dtype)
    if casts is not None and casts.count:
        notes.append(
            f"cast {casts.count} floating tensor(s) to {dtype}; integer and bool tensors kept"
        )
    changed = (
        (casts is not None and casts.count)
        or renamed
        or metadata_changed
        or dropped
        or dst_format != (SAFETENSORS if ckpt.format == SAFETENSORS else PT)
        or ckpt.format == formats.LEGACY
        or any(s.location != "cpu" for s in ckpt.storages)
        or (sd is not None and path is None)
    )
    if in_place and not changed:
        return ConvertResult(
            src=ckpt.path,
            dst=dst,
            src_format=ckpt.format,
            dst_format=dst_format,
            state_dict_path=dotted(path) if sd is not None else None,
            renamed=0,
            tensors=0,
            bytes_copied=0,
            notes=(*notes, "nothing to change; the file was left as it is"),
            written=False,
        )
    total = sum(s.nbytes for s in ckpt.storages)
    bar = Progress(total, "convert", enabled=None if progress else False)
    from ddpstate import storage

    try:
        if shard_limit is not None:
            meta = dict(ckpt.st_metadata)
            meta.setdefault("format", "pt")
            count, copied, aliases, overlaps = write_sharded_safetensors(
                ckpt, sd, meta, casts, dst, shard_limit, bar, fsync=fsync, overwrite=overwrite
            )
            notes += alias_notes(aliases, overlaps)
            dst_format = HF_SHARDED
        else:
            with storage.atomic_write(dst, storage_options=storage_options, fsync=fsync) as out:
                sink = Sink(out, bar, write_back=fsync)
                if dst_format == SAFETENSORS:
                    meta = dict(ckpt.st_metadata)
                    if ckpt.format != SAFETENSORS:
                        # Hugging Face loaders ask for this entry in torch-made files.
                        meta.setdefault("format", "pt")
                    count, copied, aliases, overlaps = write_safetensors(
                        sink, ckpt, sd, meta, casts
                    )
                    notes += alias_notes(aliases, overlaps)
                else:
                    pickle_bytes = None
                    # A cast rewrites tensor records: the tree is re-emitted, never copied.
                    if not dropped and not is_pickled_module(root) and casts is None:
                        pickle_bytes = copied_pickle(ckpt, path, source_sd, sd)
                    count, copied = write_pt(sink, ckpt, new_root, pickle_bytes, casts)
    finally:
        bar.close()
    return ConvertResult(
        src=ckpt.path,
        dst=dst,
        src_format=ckpt.format,
        dst_format=dst_format,
        state_dict_path=dotted(path) if sd is not None else None,
        renamed=renamed,
        tensors=count,
        bytes_copied=copied,
        dropped=dropped,
        left_out=left_out,
        notes=tuple(notes),
        cast=casts.count if casts is not None else 0,
    )


def _plan_casts(ckpt: Checkpoint, tree: Any, dtype: Optional[str]) -> Optional[Casts]:
    if dtype is None:
        return None
    if ckpt.byteorder != native_byteorder():
        raise CheckpointFormatError(
            f"{ckpt.path}: its tensors are stored {ckpt.byteorder}-endian; convert it without "
            f"--dtype first, load it and save it again on this machine, then cast"
        )
    records = (r for _, r in iter_tensors(tree))
    return Casts(records, dtype, lambda rec: load_tensor(ckpt, rec), ckpt.path)
