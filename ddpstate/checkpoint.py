"""The collective save and load: one durable writer, every rank told the outcome, safe reads."""

from __future__ import annotations

import os
import posixpath
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Optional, TypedDict, Union

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # typing_extensions comes with torch
    from typing_extensions import Unpack

import torch

from ddpstate import _fs, _visibility, storage
from ddpstate._calls import calling, path_text
from ddpstate._collectives import MAX_MESSAGE, with_message
from ddpstate._dcp import read as _dcp_read
from ddpstate._dcp import write as _dcp
from ddpstate._fs import PathLike
from ddpstate._io import read_file as _read_file
from ddpstate._io import savecheck as _savecheck
from ddpstate._io.model_state import (
    IncompatibleKeys,
    adapt_named,
    incompatible_keys,
    load_fitting,
    warn_if_little_matched,
)
from ddpstate._io.safetensors_io import save_sharded, write_safetensors
from ddpstate._io.tensor_broadcast import broadcast_with_tensors
from ddpstate._keys.wrappers import unwrapped_state_dict
from ddpstate._layout.hf_write import parse_size
from ddpstate.batchnorm import warn_if_stats_differ
from ddpstate.dist import (
    Timeout,
    compare_across_ranks,
    gather_and_decide,
    get_rank,
    get_world_size,
    is_distributed,
    share_outcome,
)
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointWriteError,
    DDPStateError,
    InvalidArgumentError,
)
from ddpstate.formats import (
    DCP,
    HF_SHARDED,
    SAFETENSORS,
    TORCH_ZIP,
    parse_format,
)
from ddpstate.keys import find_state_dict, match_keys
from ddpstate.location import (
    MapLocation,
    ResolvedMapLocation,
    resolve_map_location,
)

__all__ = [
    "IncompatibleKeys",
    "LoadOptions",
    "load",
    "load_model_state",
    "save",
    "save_model_state",
]


#: Barrier names, so a timeout message says which call a rank is missing from.
SAVE_COLLECTIVE = "ddpstate.save"
LOAD_COLLECTIVE = "ddpstate.load"

_SAFETENSORS_SUFFIXES = (".safetensors",)


# ------------------------------------------------------------------------------- save


def _save_format(path: str, format: Optional[str]) -> str:
    if format is None:
        return SAFETENSORS if path.lower().endswith(_SAFETENSORS_SUFFIXES) else TORCH_ZIP
    return parse_format(format, allowed=(TORCH_ZIP, SAFETENSORS), what=f"save({path!r}) format")


def _check_rank(value: int, what: str) -> None:
    world = get_world_size() if is_distributed() else 1
    if not isinstance(value, int) or not 0 <= value < world:
        raise InvalidArgumentError(f"{what}={value!r} is not a rank of this {world}-rank job")


def _write(
    obj: Any,
    path: str,
    fmt: str,
    storage_options: Optional[dict[str, Any]],
    metadata: Optional[Mapping[str, str]],
    safe_globals: Optional[Sequence[Any]] = (),
    max_shard_size: Optional[Union[int, str]] = None,
) -> None:
    _savecheck.check_tensors(obj, "obj", path)
    remote = _fs.is_remote(path)
    parent = posixpath.dirname(path) if remote else os.path.dirname(_fs.local_path(path))
    if parent and not parent.endswith("://"):
        storage.makedirs(parent, storage_options=storage_options)
    if max_shard_size is not None:
        save_sharded(obj, path, max_shard_size, metadata)
        return
    with storage.atomic_write(path, storage_options=storage_options) as fileobj:
        if fmt == SAFETENSORS:
            write_safetensors(fileobj, obj, metadata, name=path)
        elif safe_globals is None:
            torch.save(obj, fileobj)
        else:
            _savecheck.save_torch(obj, fileobj, what="obj", where=path, extra=safe_globals)


def _save_error(exc: BaseException, path: str, writer: int) -> DDPStateError:
    if isinstance(exc, DDPStateError):
        detail = str(exc)
    else:
        detail = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            detail = f"the writer was interrupted ({type(exc).__name__})"
    message = (
        f"saving {path} failed on rank {writer} (the writer): {detail}. The previous file at "
        f"{path}, if any, is untouched"
    )[:MAX_MESSAGE]
    if isinstance(exc, DDPStateError):
        return with_message(exc, message)
    return CheckpointWriteError(message)


def _disagreement(what: str, seen: list[tuple[Any, ...]]) -> Optional[InvalidArgumentError]:
    """None when every rank passed the same (path, format, src_rank); else the error."""
    differ = [r for r, a in enumerate(seen) if a != seen[0]]
    if not differ:
        return None
    shown = ", ".join(f"rank {r}: {seen[r]!r}" for r in [0, *differ[:7]])
    more = f" and {len(differ) - 7} more" if len(differ) > 7 else ""
    return InvalidArgumentError(
        f"{what} is a collective, but the ranks passed different arguments "
        f"((path, format, src_rank) {shown}{more}); nothing was read or written. Pass the "
        f"same path on every rank (only src_rank writes or reads it); to write or read one "
        f"file per rank, pass barrier=False on every rank"
    )


def _check_same_call(
    what: str, arguments: tuple[Any, ...], timeout: Timeout, found: Optional[int] = 0
) -> None:
    """Every rank passed the same path (and format, src_rank); else raise on every rank.

    ``found``: what this rank sees at the path (``_visibility.stat``); every
    rank must see the same, else the ranks do not share the folder.
    """
    seen = compare_across_ranks((arguments, found), name=what, timeout=timeout)
    if seen is None:
        return
    error: Optional[DDPStateError] = _disagreement(what, [a for a, _ in seen])
    if error is None:
        views = [f for _, f in seen]
        holder = next((r for r, f in enumerate(views) if f is not None), 0)
        error = _visibility.not_shared(
            arguments[0],
            holder,
            views,
            "sees",
            f"use a shared path, or pass src_rank={holder} (one rank reads, the others receive)",
        )
    if error is not None:
        raise error


def save(
    obj: Any,
    path: PathLike,
    *,
    format: Optional[str] = None,
    src_rank: int = 0,
    barrier: bool = True,
    storage_options: Optional[dict[str, Any]] = None,
    metadata: Optional[Mapping[str, str]] = None,
    timeout: Timeout = None,
    safe_globals: Sequence[Any] = (),
    weights_only: bool = True,
    max_shard_size: Optional[Union[int, str]] = None,
) -> None:
    """Save an object durably and atomically; a collective, only ``src_rank`` writes.

    Every rank calls it. ``src_rank`` streams the object to a temporary file
    next to the target, fsyncs it, renames it onto ``path`` and fsyncs the
    folder (object stores: one upload that appears only when complete). The
    outcome is then shared, so either every rank returns, or every rank raises
    the same error, which names the file and the writer; nobody hangs. A failed
    save leaves the previous file byte-for-byte as it was.

    Sharded state (FSDP2 / tensor-parallel ``DTensor``, each rank passing its
    own) is written as a ``torch.distributed.checkpoint`` folder at ``path``:
    every rank writes its shards, ``src_rank`` commits a ``manifest.json``
    listing every file's size and CRC-32 last, then swaps the folder into
    place (``barrier`` is ignored: every rank writes). torch's ``dcp.load``
    reads the folder as well.

    What is saved can be loaded: before anything is written, meta tensors
    are refused, and so is any object
    that :func:`load` with ``weights_only=True`` could not restore (it is
    named by its path in ``obj``). Out of the box that covers tensors, numbers,
    strings, containers, numpy scalars and numeric arrays, ``pathlib`` paths,
    ``datetime`` values, ``argparse.Namespace``, ``OrderedDict`` and ``defaultdict``.

    Args:
        obj: What to save; read on ``src_rank`` only (other ranks may pass None).
        path: Local path or fsspec URL (``s3://``, ``gs://``, ``memory://``...).
            Missing local parent folders are created.
        format: ``"pt"`` (torch.save's zip format; also ``"torch"``) or
            ``"safetensors"`` (any name :func:`~ddpstate.formats.parse_format`
            accepts). Default: safetensors for a ``.safetensors`` suffix, else pt.
        src_rank: The rank that writes.
        barrier: Share the outcome with every rank (and wait for the writer).
            With False, only the writer does anything and only it can raise.
        storage_options: fsspec options (credentials, endpoint) for URLs.
        metadata: str -> str entries for the safetensors header.
        timeout: Seconds to wait for the writer (default ``DDPSTATE_TIMEOUT`` or 1800).
        safe_globals: Your own data-only types (enums, dataclasses...) to allow;
            pass the same list to :func:`load`.
        weights_only: With False, skip the check for objects ``weights_only``
            loading refuses (the file then needs ``load(weights_only=False)``).
        max_shard_size: Write ``path`` as a local folder in the Hugging Face
            sharded layout: safetensors shards of at most this size (``"2GB"``,
            ``"500MB"``, ``"1.5GiB"`` or bytes) named
            ``model-00001-of-0000N.safetensors`` and
            ``model.safetensors.index.json``; ``obj`` must be a state dict. The
            folder is replaced as a whole (staged, then renamed); a folder
            holding other files is refused. A tied key (one tensor under two
            keys) is stored once and left out of the index, as transformers
            does; :func:`load` gives it back tied.

    Raises:
        CheckpointWriteError: Writing failed (folder not writable, disk full,
            an object that cannot be pickled...), on every rank.
        UnsafeCheckpointError: ``obj`` holds an object that only
            ``weights_only=False`` could load; the message names its path.
        ShardedStateError: ``obj`` holds sharded tensors (FSDP2 ``DTensor``) and
            ``path`` names a file (``.pt``, ``.safetensors``...) or ``format``/
            ``metadata`` is given: give a folder path; or a legacy ``ShardedTensor``.
        CheckpointFormatError: The format cannot hold ``obj`` or ``metadata``
            (e.g. non-tensor values for safetensors; the message names the keys).
        InvalidArgumentError: The ranks passed different paths, formats or
            ``src_rank`` (each rank's is named); nothing is written.
        BarrierTimeoutError: Some rank never arrived.

    Example:
        >>> import os, tempfile, torch
        >>> from ddpstate.checkpoint import load, save
        >>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
        >>> save({"w": torch.ones(2)}, path)
        >>> load(path)["w"]
        tensor([1., 1.])
    """
    with calling(f"ddpstate.save({path_text(path)})"):
        text = os.fspath(path)
        _savecheck.check_safe_globals(safe_globals, f"save({text!r})")
        if _dcp.holds_sharded(obj):
            _dcp.check_folder_target(
                obj, text, format, metadata is not None, max_shard_size=max_shard_size is not None
            )
            _dcp.check_sharded_types(obj, text)
            _check_rank(src_rank, "src_rank")
            _save_sharded(obj, text, src_rank, timeout, storage_options)
            return
        fmt = HF_SHARDED if max_shard_size is not None else _save_format(text, format)
        if max_shard_size is not None:
            parse_size(max_shard_size)  # a bad size fails on every rank, before any write
            if format is not None and _save_format(text, format) != SAFETENSORS:
                raise CheckpointFormatError(
                    f"{text}: max_shard_size writes safetensors shards; drop format={format!r}"
                )
        if metadata is not None and fmt not in (SAFETENSORS, HF_SHARDED):
            raise CheckpointFormatError(
                f"{text}: metadata= is stored in safetensors headers only; save with "
                f"format='safetensors', or put the metadata inside the saved object"
            )
        _check_rank(src_rank, "src_rank")
        allowed = list(safe_globals) if weights_only else None
        if not (barrier and is_distributed()):
            if (get_rank() if is_distributed() else src_rank) == src_rank:
                try:
                    _write(obj, text, fmt, storage_options, metadata, allowed, max_shard_size)
                except BaseException as exc:
                    raise _save_error(exc, text, src_rank) from exc
            return
        # One round: every rank sends its (path, format, src_rank) to the writer, which
        # checks that they agree, writes, and answers every rank.
        causes: list[BaseException] = []

        def decide(seen: list[tuple[Any, ...]]) -> Optional[DDPStateError]:
            disagreement = _disagreement(SAVE_COLLECTIVE, seen)
            if disagreement is not None:
                return disagreement
            try:
                _write(obj, text, fmt, storage_options, metadata, allowed, max_shard_size)
            except BaseException as exc:
                causes.append(exc)
                return _save_error(exc, text, src_rank)
            return None

        try:
            gather_and_decide(
                (text, fmt, src_rank), decide, dst=src_rank, name=SAVE_COLLECTIVE, timeout=timeout
            )
        except DDPStateError as shared:
            if causes and not isinstance(causes[0], Exception):
                raise causes[0] from None  # the others were told; the interrupt goes on here
            if causes:
                raise shared from causes[0]
            raise
        if not _fs.is_remote(text):  # committed: can every rank see the file?
            _visibility.check_written(text, src_rank, name=SAVE_COLLECTIVE, timeout=timeout)


def _save_sharded(
    obj: Any, text: str, src_rank: int, timeout: Timeout, storage_options: Optional[dict[str, Any]]
) -> None:
    """Every rank writes its shards of ``obj`` into a DCP folder at ``text``; see ``_dcp``.

    ``_dcp.write_shards`` is ``dcp.save`` through :class:`ddpstate.dcp.DurableWriter`,
    which stages the folder, checksums every item as it is written and commits
    (manifest last, swapped in). Around it, two rounds: the ranks agree on the
    call, then share the outcome, so that every rank raises the same error;
    ``text`` is untouched by a failed save.
    """
    gather_and_decide(
        (text, DCP, src_rank),
        lambda seen: _disagreement(SAVE_COLLECTIVE, seen),
        dst=src_rank,
        name=SAVE_COLLECTIVE,
        timeout=timeout,
    )
    info: dict[str, Any] = {}
    cause: Optional[BaseException] = None
    try:
        _dcp.write_shards(obj, text, storage_options=storage_options)
    except Exception as exc:
        cause = exc
        info["error"] = _dcp.failure_text(exc)

    def outcome(infos: list[Any]) -> Optional[DDPStateError]:
        failures = [(r, i["error"]) for r, i in enumerate(infos) if i.get("error")]
        if not failures:
            return None
        detail = "; ".join(f"rank {r}: {m}" for r, m in failures)
        error = CheckpointWriteError(f"writing the shards failed ({detail})")
        return _save_error(error, text, src_rank)

    try:
        gather_and_decide(info, outcome, dst=src_rank, name=SAVE_COLLECTIVE, timeout=timeout)
    except DDPStateError as shared:
        if cause is not None:
            raise shared from cause
        raise


# ------------------------------------------------------------------------------- load


def _load_and_broadcast(
    text: str,
    resolved: ResolvedMapLocation,
    weights_only: bool,
    mmap: Optional[bool],
    storage_options: Optional[dict[str, Any]],
    src_rank: int,
    timeout: Timeout,
    safe_globals: Sequence[Any] = (),
) -> Any:
    rank = get_rank()
    obj: Any = None
    error: Optional[DDPStateError] = None
    cause: Optional[BaseException] = None
    locations: dict[int, str] = {}
    if rank == src_rank:

        def remember(stored: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
            # Keep each storage on the CPU for the broadcast, and remember where it
            # was saved so every rank can apply map_location to it afterwards.
            locations[stored.data_ptr()] = location
            return stored

        try:
            obj = _read_file.read(text, remember, weights_only, mmap, storage_options, safe_globals)
        except Exception as exc:
            cause = exc
            error = (
                exc
                if isinstance(exc, DDPStateError)
                else CheckpointCorruptError(f"{text}: {type(exc).__name__}: {exc}")
            )
    if error is not None:
        error = with_message(
            error, f"loading {text} failed on rank {src_rank} (the reader): {error}"[:MAX_MESSAGE]
        )
    try:
        share_outcome(error, name=LOAD_COLLECTIVE, timeout=timeout)
    except DDPStateError as shared:
        if cause is not None:
            raise shared from cause
        raise
    return broadcast_with_tensors(obj, locations, src_rank, resolved, timeout)


class LoadOptions(TypedDict, total=False):
    """:func:`load`'s options, which :func:`load_model_state` passes on for a path.

    Each has :func:`load`'s meaning and default.
    """

    map_location: MapLocation
    weights_only: bool
    mmap: Optional[bool]
    barrier: bool
    src_rank: Optional[int]
    storage_options: Optional[dict[str, Any]]
    timeout: Timeout
    safe_globals: Sequence[Any]


def load(
    path: PathLike,
    *,
    map_location: MapLocation = "auto",
    weights_only: bool = True,
    mmap: Optional[bool] = None,
    barrier: bool = True,
    src_rank: Optional[int] = None,
    storage_options: Optional[dict[str, Any]] = None,
    timeout: Timeout = None,
    safe_globals: Sequence[Any] = (),
) -> Any:
    """Load a checkpoint safely onto this rank's device; a collective.

    Every rank first meets the others (a collective named ``ddpstate.load``
    that also checks every rank passed the same path), so nobody reads before
    the writer of a preceding :func:`save` is done.
    The format comes from the file's bytes, whatever its name: torch.save zip,
    legacy (pre-1.6) torch pickle, safetensors, a Hugging Face sharded
    checkpoint (``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``
    and its shards, or their folder), read shard by shard into one state dict, or a
    ``torch.distributed.checkpoint`` folder. A DCP folder is consolidated: the
    whole state, every shard of every rank, is read into this process with
    torch's own reader (no process group needed), tensors on the CPU and then
    placed by ``map_location``. To load a sharded (FSDP2) model, where each
    rank should read only its own shards, use :func:`load_model_state`.

    Args:
        path: Local path or fsspec URL of the file (or DCP folder).
        map_location: ``"auto"`` (this rank's device: ``cuda:LOCAL_RANK`` with
            CUDA, else CPU), a device or string, a dict such as
            ``{"cuda:0": "cuda:1"}``, a ``torch.load``-style callable, or None
            (where the tensors were saved).
        weights_only: Refuse anything that needs arbitrary unpickling. Only
            pass False for files you trust; there is never a silent fallback.
        mmap: Map the file instead of reading it (only the tensors you touch
            cost memory). Default: on for local zip and safetensors files.
        barrier: Meet the other ranks first. With False this is a plain local
            read (also the way to read a different file on each rank).
        src_rank: Only this rank reads the file; the others receive the object
            from it (for nodes without a shared filesystem), one tensor at a time.
        storage_options: fsspec options for URLs.
        timeout: Seconds to wait at the barrier (default ``DDPSTATE_TIMEOUT`` or 1800).
        safe_globals: Your own data-only types to allow with ``weights_only``
            (as given to :func:`save`); numpy values, paths, ``datetime``,
            ``argparse.Namespace`` and ``defaultdict`` are allowed already.

    Returns:
        The saved object, tensors placed by ``map_location``; tied safetensors
        entries are the same tensor again.

    Raises:
        CheckpointNotFoundError: Nothing at ``path``.
        CheckpointFormatError: Not a checkpoint (a TorchScript archive is named as such).
        CheckpointCorruptError: The file is truncated or damaged.
        UnsafeCheckpointError: The file needs arbitrary unpickling; the error
            lists the globals and says how to opt in.
        InvalidArgumentError: The ranks passed different paths or ``src_rank``.
        BarrierTimeoutError: Some rank never arrived.

    Example:
        >>> import os, tempfile, torch
        >>> from ddpstate.checkpoint import load, save
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> save({"w": torch.zeros(2)}, path)
        >>> load(path, map_location="cpu")["w"]
        tensor([0., 0.])
    """
    with calling(f"ddpstate.load({path_text(path)})"):
        text = os.fspath(path)
        _savecheck.check_safe_globals(safe_globals, f"load({text!r})")
        resolved = resolve_map_location(map_location)
        if src_rank is not None:
            _check_rank(src_rank, "src_rank")
        distributed = is_distributed()
        if barrier and distributed:
            found = _visibility.stat(text) if src_rank is None else 0
            _check_same_call(LOAD_COLLECTIVE, (text, None, src_rank), timeout, found)
        if src_rank is None or not distributed:
            return _read_file.read(
                text, resolved, weights_only, mmap, storage_options, safe_globals
            )
        return _load_and_broadcast(
            text, resolved, weights_only, mmap, storage_options, src_rank, timeout, safe_globals
        )


# ------------------------------------------------------------------------------- model state


def save_model_state(model: torch.nn.Module, path: PathLike, **save_kwargs: Any) -> None:
    """Save a model's state dict with wrapper-free keys; a collective like :func:`save`.

    The model is unwrapped (DataParallel, DDP, ``torch.compile``, in any
    nesting): exactly the key segments of the wrapper objects it holds are
    removed (``_metadata`` kept), so the file loads into any wrapping later. A
    real child named ``module`` (``AveragedModel``'s) stays in the keys.

    Args:
        model: A plain or wrapped module (call it on every rank).
        path: Local path or fsspec URL; a ``.safetensors`` suffix picks safetensors.
        **save_kwargs: Passed to :func:`save` (``format``, ``src_rank``,
            ``storage_options``, ``metadata``, ``timeout``, ``max_shard_size``
            to write ``path`` as a Hugging Face sharded folder...).

    Under DDP, when the ranks' BatchNorm running statistics differ (plain
    BatchNorm with buffer broadcast off), a warning names the layers and
    :func:`~ddpstate.sync_batchnorm_stats`: the file would hold rank 0's alone.

    Raises:
        KeyCollisionError: Two keys become one after removing wrapper segments.
        CheckpointWriteError: As for :func:`save`.
        ShardedStateError: The model is sharded (FSDP2).

    Example:
        >>> import os, tempfile, torch
        >>> from ddpstate.checkpoint import load, save_model_state
        >>> path = os.path.join(tempfile.mkdtemp(), "net.safetensors")
        >>> save_model_state(torch.nn.DataParallel(torch.nn.Linear(2, 2)), path)
        >>> sorted(load(path))
        ['bias', 'weight']
    """
    with calling(f"ddpstate.save_model_state({path_text(path)})"):
        state = unwrapped_state_dict(model)
        save(state, path, **save_kwargs)
        if save_kwargs.get("barrier", True):
            # After the save: its own agreement has proven every rank is here, so a
            # rank that skipped the call fails inside save, named as such.
            warn_if_stats_differ(model, where=os.fspath(path), timeout=save_kwargs.get("timeout"))


def load_model_state(
    model: torch.nn.Module,
    source: Union[PathLike, Mapping[str, Any]],
    *,
    strict: bool = True,
    key: Optional[str] = None,
    ignore_mismatched: bool = False,
    **options: Unpack[LoadOptions],
) -> IncompatibleKeys:
    """Load a checkpoint into a model, whatever wrapping either side had.

    A collective when ``source`` is a path (it calls :func:`load`). The model
    state dict is located inside the checkpoint (a bare state dict, or under
    ``"state_dict"``, ``"model"``... see :func:`ddpstate.keys.find_state_dict`),
    its keys are renamed to the ones ``model`` expects (plain, ``module.``,
    ``_orig_mod.``, in any nesting), and ``model.load_state_dict`` is called.
    A tensor saved in another floating dtype than the model's (a float32
    checkpoint into a bfloat16 model) is cast to the model's dtype, with one
    warning naming the count and the dtype pairs; integer, floating, complex and
    bool tensors are never cast into one another (``DTypeMismatchError``).

    A ``torch.distributed.checkpoint`` folder (e.g. saved by FSDP2 on any
    number of ranks) loads into a plain model consolidated (see :func:`load`).
    Into a sharded model (FSDP2 ``fully_shard``, DTensor parameters) it loads
    resharded: the keys are matched from the folder's metadata alone, then
    every rank reads only the pieces of its own shards (``dcp.load``) and
    ``set_model_state_dict`` puts them in place, whatever world size saved it.
    Every rank of the model's process group must then call it. A whole state
    dict (a ``.pt`` or ``.safetensors`` file, or a mapping) loads into a
    sharded model too: each rank keeps its own shard of each tensor.

    Args:
        model: The target module, plain or wrapped.
        source: A path/URL (a file or a DCP folder), or an already loaded
            checkpoint or state dict.
        strict: Require every key to match; with False, load what matches and
            report the rest.
        key: Dotted path of the state dict inside the checkpoint
            (e.g. ``"model.state_dict"``); default: found automatically.
        **options: :func:`load`'s options (:class:`LoadOptions`: ``map_location``,
            ``weights_only``, ``mmap``, ``barrier``, ``src_rank``,
            ``storage_options``, ``timeout``, ``safe_globals``), used when
            ``source`` is a path.
        ignore_mismatched: Skip entries whose shape differs from the model's
            (the model keeps its own values there), e.g. a classifier head resized
            for fine-tuning; they are named in a warning and in ``missing_keys``.

    Returns:
        ``IncompatibleKeys(missing_keys, unexpected_keys)``, both empty when strict
        (except for entries ``ignore_mismatched`` skipped).

    Raises:
        KeyMismatchError: ``strict`` and the keys do not pair up; the message
            shows the nearest names.
        StateDictNotFoundError: No single state dict in the checkpoint (pass ``key``).
        ShapeMismatchError: A tensor's shape does not fit the model's (the
            message lists them and names ``ignore_mismatched=True``).
        DTypeMismatchError: A tensor would change kind of dtype (e.g. int64
            into a float32 parameter); the message names the keys.
        CheckpointCorruptError: A shard file of a DCP folder is missing or damaged.
        InvalidArgumentError: ``src_rank`` with a sharded model (each rank reads its own shards).
        TypeError: An option :func:`load` does not take.

    Example:
        >>> import os, tempfile, torch
        >>> from ddpstate.checkpoint import load_model_state, save
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> wrapped = torch.nn.DataParallel(torch.nn.Linear(2, 2))
        >>> save({"epoch": 1, "model": wrapped.state_dict()}, path)
        >>> load_model_state(torch.nn.Linear(2, 2), path)
        IncompatibleKeys(missing_keys=[], unexpected_keys=[])
    """
    unknown = sorted(set(options) - set(LoadOptions.__annotations__))
    if unknown:
        raise TypeError(f"load_model_state() got an unexpected keyword argument {unknown[0]!r}")
    src_rank, storage_options = options.get("src_rank"), options.get("storage_options")
    timeout = options.get("timeout")
    with calling(f"ddpstate.load_model_state({path_text(source)})"):
        _savecheck.check_safe_globals(options.get("safe_globals", ()), "load_model_state")
        if isinstance(source, (str, os.PathLike)):
            name = os.fspath(source)
            if (
                _dcp_read.is_sharded_model(model)
                and _read_file.detect(name, storage_options) == DCP
            ):
                if src_rank is not None:
                    raise InvalidArgumentError(
                        f"{name}: src_rank={src_rank} does not apply to a sharded (FSDP2/DTensor) "
                        f"model: each rank reads only its own shards from the folder; drop src_rank"
                    )
                if options.get("barrier", True) and is_distributed():
                    _check_same_call(LOAD_COLLECTIVE, (name, None, src_rank), timeout)
                return _dcp_read.load_sharded_model_state(
                    model, name, strict=strict, key=key, ignore_mismatched=ignore_mismatched,
                    storage_options=storage_options, timeout=timeout,
                )  # fmt: skip
            checkpoint = load(source, **options)
        else:
            name, checkpoint = "the given state dict", source
        found_key, state_dict = find_state_dict(checkpoint, key)
        if _dcp_read.is_sharded_model(model):
            return _dcp_read.load_full_into_sharded(
                model, state_dict, name=name, strict=strict, ignore_mismatched=ignore_mismatched
            )
        adapted = adapt_named(state_dict, model, strict=strict, name=name, found_at=found_key)
        skipped = load_fitting(
            model, adapted, name=name, strict=strict, ignore_mismatched=ignore_mismatched
        )
        if strict:
            return IncompatibleKeys(skipped, [])
        match = match_keys(state_dict, model)
        warn_if_little_matched(match, state_dict, name=name)
        return incompatible_keys(strict, skipped, match)
