"""Sharded and parallel writes with torch.distributed.checkpoint (DCP), committed the ddpstate way.

DCP has every rank write its own part of the state into one folder (FSDP2
``DTensor`` shards; replicated DDP tensors split across ranks by its dedup
planner) and reshards on load. What it does not give is ddpstate's commit
protocol, so this module adds it around DCP's writer:

1. every rank writes its files with ``FileSystemWriter(sync_files=True)`` (each
   file fsynced before DCP's coordinator writes ``.metadata``);
2. every rank checksums the files it wrote itself (``__<rank>_*.distcp``; rank 0
   also ``.metadata``) and sends name, size and CRC-32 to rank 0 in one
   ``gather_and_decide`` round, so the ranks agree on the outcome;
3. rank 0 fsyncs the folder and writes ddpstate's ``manifest.json`` listing
   every file: the commit marker, last, after every rank's files are durable.

Layouts (the names below are this module's constants):

``ddpstate.save(sharded_state, path)`` writes a folder that torch's own
``dcp.load`` reads as well::

    <path>/
        .metadata           # DCP's index (written by rank 0)
        __0_0.distcp        # rank 0's part
        __1_0.distcp        # rank 1's part, ...
        manifest.json       # ddpstate's commit marker, {"format": "dcp", "files": {...}}

A :class:`~ddpstate.CheckpointManager` step folder keeps the rank-0 files as
before and puts the DCP entries (sharded models and optimizers, or every model
and optimizer with ``writers="all"``) in one DCP checkpoint below ``dcp/``::

    step_0000000100/
        dcp/.metadata, dcp/__<rank>_0.distcp ...
        extra.pt, _rng.pt   # plain values and other objects, as before
        manifest.json       # files: {"dcp/.metadata": ..., "dcp/__0_0.distcp": ..., ...}
                            # entries: {"model": {"file": "dcp/.metadata", "kind": "dcp_module"}}
"""

from __future__ import annotations

import contextlib
import copy
import glob
import io
import os
import threading
import zlib
from collections.abc import Iterator, Mapping, MutableMapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from ddpstate import _fs, _manifest, storage
from ddpstate._checksum import error_text
from ddpstate._io import savecheck as _savecheck
from ddpstate._manager.entries import rng_states
from ddpstate._manifest import (
    DCP_SUBDIR,
    FOLDER_FORMAT,
    MANIFEST_NAME,
    METADATA_NAME,
    SHARD_SUFFIX,
)
from ddpstate.dist import get_rank, is_distributed
from ddpstate.errors import (
    CheckpointWriteError,
    DDPStateError,
    InvalidArgumentError,
    ShardedStateError,
)

if TYPE_CHECKING:
    from ddpstate._manager.writer import InFlight, StepWriter

#: Manifest entry kinds of entries stored in the step's DCP checkpoint.
KIND_MODULE = "dcp_module"
KIND_OPTIMIZER = "dcp_optimizer"
KINDS = (KIND_MODULE, KIND_OPTIMIZER)
#: ``CheckpointManager(writers=...)``: who writes replicated (DDP) models and optimizers.
WRITERS = ("rank0", "all")

_READ_CHUNK = 8 << 20
_REFUSED_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")


# ------------------------------------------------------------------------- detection


def holds_sharded(obj: Any) -> bool:
    """Tell whether ``obj`` holds a ``DTensor``/``ShardedTensor`` (cheap when none can exist)."""
    sharded = _savecheck.sharded_types()
    if not sharded:
        return False  # torch.distributed.tensor never imported: no DTensor can exist
    return any(isinstance(v, sharded) for _, v in _savecheck.walk(obj, "obj", set()))


def _module_is_sharded(module: nn.Module) -> bool:
    sharded = _savecheck.sharded_types()
    return bool(sharded) and any(
        isinstance(t, sharded) for t in [*module.parameters(), *module.buffers()]
    )


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _owner(optimizer: torch.optim.Optimizer, models: Mapping[str, nn.Module]) -> Optional[str]:
    """The entry name of the model whose parameters ``optimizer`` updates."""
    wanted = {id(p) for p in _optimizer_params(optimizer)}
    for name, model in models.items():
        if wanted & {id(p) for p in model.parameters()}:
            return name
    return None


def _models(state: Mapping[str, Any]) -> dict[str, nn.Module]:
    return {n: o for n, o in state.items() if isinstance(o, nn.Module)}


def plan_entries(state: Mapping[str, Any], writers: str, where: str) -> dict[str, str]:
    """The entries of a CheckpointManager ``state`` that go through DCP, name -> kind.

    Sharded models (FSDP2/tensor parallel) and their optimizers always do; with
    ``writers="all"`` every model and optimizer does (replicated DDP state split
    across the ranks). Everything else stays with the rank-0 writer.

    Raises:
        InvalidArgumentError: A DCP optimizer's model is not in ``state``.
    """
    models = _models(state)
    chosen: dict[str, str] = {}
    for name, model in models.items():
        if writers == "all" or _module_is_sharded(model):
            chosen[name] = KIND_MODULE
    for name, obj in state.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        owner = _owner(obj, models)
        sharded = holds_sharded(_optimizer_params(obj))
        if owner is None:
            if sharded or writers == "all":
                raise (ShardedStateError if sharded else InvalidArgumentError)(
                    f"CheckpointManager: state[{name!r}] is an optimizer over "
                    f"{'sharded (DTensor) ' if sharded else ''}parameters, saved with "
                    f"torch.distributed.checkpoint, which keys its state by the parameters' "
                    f"names in their model; no model in state owns them. Put the model in the "
                    f"same state dict (e.g. {{'model': model, {name!r}: optimizer}}) ({where})"
                )
            continue
        if owner in chosen:
            chosen[name] = KIND_OPTIMIZER
    return chosen


# ------------------------------------------------------------------------- state dicts


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Sharded stays sharded (each rank writes its part); plain keys (no module./_orig_mod.).
    return StateDictOptions(full_state_dict=False, cpu_offload=False)


def state_dicts(state: Mapping[str, Any], kinds: Mapping[str, str]) -> dict[str, Any]:
    """Every DCP entry's state dict (keys as ``get_state_dict`` names them), on this rank."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    models = _models(state)
    out: dict[str, Any] = {}
    for name, kind in kinds.items():
        if kind == KIND_MODULE:
            out[name] = get_model_state_dict(state[name], options=_options())
        else:
            owner = _owner(state[name], models)
            out[name] = get_optimizer_state_dict(
                models[str(owner)], state[name], options=_options()
            )
    return out


def load_entries(
    state: MutableMapping[str, Any], kinds: Mapping[str, str], folder: str, where: str
) -> None:
    """Load the DCP entries ``kinds`` of a step into the live objects; resharded as needed.

    A collective where a process group exists (DCP's reader): the live objects'
    own layout (sharded or not, any world size) decides what each rank reads.

    Raises:
        InvalidArgumentError: A live entry is not the kind of object that was saved.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for name, kind in kinds.items():
        want = nn.Module if kind == KIND_MODULE else torch.optim.Optimizer
        if not isinstance(state[name], want):
            raise InvalidArgumentError(
                f"{where}: entry {name!r} was saved from a {want.__name__} (sharded, with "
                f"torch.distributed.checkpoint), but state[{name!r}] is a "
                f"{type(state[name]).__name__}; pass the live {want.__name__}"
            )
        if kind == KIND_OPTIMIZER and _owner(state[name], _models(state)) is None:
            raise InvalidArgumentError(
                f"{where}: entry {name!r} is an optimizer saved with "
                f"torch.distributed.checkpoint, keyed by its model's parameter names; put its "
                f"model in the state passed to restore"
            )
    targets = state_dicts(state, kinds)
    from torch.distributed.checkpoint.state_dict_loader import load

    load(targets, storage_reader=FileSystemReader(folder))
    models = _models(state)
    for name, kind in kinds.items():
        if kind == KIND_MODULE:
            set_model_state_dict(state[name], targets[name], options=_options())
        else:
            owner = models[str(_owner(state[name], models))]
            set_optimizer_state_dict(owner, state[name], targets[name], options=_options())


# ------------------------------------------------------------------------- writing


def _own_files(folder: str, rank: int, coordinator: bool) -> list[str]:
    """The files this rank wrote: DCP prefixes each rank's files with ``__<rank>_``."""
    names = [os.path.basename(p) for p in glob.glob(os.path.join(folder, f"__{rank}_*"))]
    names = [n for n in names if n.endswith(SHARD_SUFFIX)]
    if coordinator:
        names.append(METADATA_NAME)
    return sorted(names)


def _checksum(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        size, crc = storage.size_and_crc32(f, _READ_CHUNK)
    return {"size": size, "crc32": f"{crc:08x}"}


class _ChecksumStream(io.RawIOBase):
    """A write stream that CRC-32s what passes through, so no file is read back to checksum it."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self._raw = raw
        self.size = 0
        self.crc = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        written = self._raw.write(data)
        view = memoryview(data).cast("B")[:written]
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return int(written)

    def tell(self) -> int:
        return int(self._raw.tell())

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return int(self._raw.fileno())


def _checksumming_fs(sums: dict[str, dict[str, Any]]) -> Any:
    """DCP's local FileSystem, recording each data file's size and CRC-32 as it is written."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class ChecksummingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            name = os.path.basename(os.fspath(path))
            with super().create_stream(path, mode) as raw:
                if mode != "wb" or not name.endswith(SHARD_SUFFIX):
                    yield raw
                    return
                stream = _ChecksumStream(raw)
                yield stream
                sums[name] = {"size": stream.size, "crc32": f"{stream.crc:08x}"}

    return ChecksummingFileSystem()


def write_shards(
    state_dict: Mapping[str, Any], folder: str, process_group: Any = None
) -> dict[str, dict[str, Any]]:
    """Write this rank's part of ``state_dict`` into the local ``folder`` with DCP; checksum it.

    A collective where a process group exists (``dcp.save``). Every file is
    fsynced by DCP's writer (``sync_files=True``) before its coordinator
    writes ``.metadata``.

    Args:
        process_group: DCP's group (None: the default one); async saves pass their own.

    Returns:
        The files this rank wrote (name -> ``{"size", "crc32"}``), ``.metadata`` on rank 0.

    Raises:
        Exception: What DCP raised (the caller shares it with every rank).
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    if _fs.is_remote(folder):
        raise CheckpointWriteError(
            f"{folder}: sharded (torch.distributed.checkpoint) saves go to local or shared "
            f"filesystem paths only in this version; save to a mounted folder and copy it"
        )
    local = _fs.local_path(folder)
    os.makedirs(local, exist_ok=True)
    writer = FileSystemWriter(local, single_file_per_rank=True, sync_files=True)
    sums: dict[str, dict[str, Any]] = {}
    writer.fs = _checksumming_fs(sums)
    save(dict(state_dict), storage_writer=writer, process_group=process_group)
    rank = get_rank() if is_distributed() else 0
    files = {}
    for name in _own_files(local, rank, rank == 0):
        path = os.path.join(local, name)
        known = sums.get(name)
        # Read back only what was not seen whole on its way out (.metadata, or a stream
        # that seeked): the size on disk must be what passed through.
        files[name] = known if known and known["size"] == os.path.getsize(path) else _checksum(path)
    return files


def merge_files(
    gathered: list[Any], prefix: str = ""
) -> tuple[dict[str, dict[str, Any]], list[tuple[int, str]]]:
    """Rank 0: every rank's reported files (prefixed) and every rank's failure, from one gather."""
    files: dict[str, dict[str, Any]] = {}
    failures: list[tuple[int, str]] = []
    for rank, info in enumerate(gathered):
        if info.get("error"):
            failures.append((rank, str(info["error"])))
        for name, entry in (info.get("files") or {}).items():
            files[prefix + name] = entry
    return files, failures


def failure_text(exc: BaseException) -> str:
    """One line for a rank's DCP failure (DCP wraps each rank's error in CheckpointException)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            exc = inner
    if isinstance(exc, DDPStateError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def fsync_folder(folder: str) -> None:
    """Make the folder's entries (the files every rank created) durable."""
    storage.fsync_dir(_fs.local_path(folder))


# ------------------------------------------------------------------------- save() on sharded state


def _first_sharded(obj: Any) -> str:
    sharded = _savecheck.sharded_types()
    for where, value in _savecheck.walk(obj, "obj", set()):
        if isinstance(value, sharded):
            return f"{where} is a {type(value).__name__}"
    return "it holds sharded tensors"


def check_folder_target(
    obj: Any,
    path: str,
    format: Optional[str],
    has_metadata: bool,
    *,
    max_shard_size: bool = False,
) -> None:
    """Refuse, on this rank, a sharded ``save()`` whose target cannot be a DCP folder.

    Raises:
        ShardedStateError: ``path`` names a single file, or a file format (or the
            Hugging Face sharded layout, ``max_shard_size``) was asked for.
    """
    refused = format is not None or has_metadata or max_shard_size
    if path.lower().endswith(_REFUSED_SUFFIXES) or refused:
        # A file cannot hold every rank's shards, and a folder named *.pt would fool readers.
        why = (
            f"format={format!r} was asked for"
            if format is not None
            else "metadata= is for safetensors files"
            if has_metadata
            else "max_shard_size= writes the Hugging Face layout of a whole state dict"
            if max_shard_size
            else "the path names a single file"
        )
        raise ShardedStateError(
            f"cannot save {path}: {_first_sharded(obj)} (FSDP2 / tensor-parallel "
            f"DTensor state), which ddpstate saves as a torch.distributed.checkpoint folder (every "
            f"rank writes its shards), but {why}. Give a folder path (e.g. "
            f"{os.path.splitext(path)[0] or path}_dcp) and no format=/metadata=/max_shard_size=; "
            f"to get one file, gather a full state dict first: "
            f"torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
            f"options=StateDictOptions(full_state_dict=True, cpu_offload=True))"
        )


def check_sharded_types(obj: Any, path: str) -> None:
    """Refuse sharded types DCP cannot write (legacy ``ShardedTensor`` outside DCP's planner).

    Raises:
        ShardedStateError: ``obj`` holds a legacy ``ShardedTensor``.
    """
    for where, value in _savecheck.walk(obj, "obj", set()):
        if type(value).__name__ == "ShardedTensor":
            raise ShardedStateError(
                f"cannot save {path}: {where} is a legacy ShardedTensor (FSDP1 / "
                f"torch.distributed._shard), which ddpstate does not write; move to FSDP2 "
                f"(fully_shard, DTensor state) or save it with torch.distributed.checkpoint"
            )


def prepare_temp(path: str) -> str:
    """Rank 0: a fresh local temporary folder next to ``path`` for a sharded ``save()``.

    Raises:
        CheckpointWriteError: ``path`` is an existing file (a folder is replaced whole).
    """
    local = _fs.local_path(path)
    if _fs.is_remote(path):
        raise CheckpointWriteError(
            f"{path}: sharded (torch.distributed.checkpoint) saves go to local or shared "
            f"filesystem paths only in this version; save to a mounted folder and copy it"
        )
    if os.path.lexists(local) and not os.path.isdir(local):
        raise CheckpointWriteError(
            f"{path} exists and is a file; a sharded save writes a folder there. Give another "
            f"path (ddpstate never deletes files it did not write)"
        )
    parent = os.path.dirname(os.path.abspath(local))
    os.makedirs(parent, exist_ok=True)
    temp = storage.temp_path_for(local)
    os.makedirs(temp)
    return temp


def folder_manifest(files: Mapping[str, Any], world_size: int) -> bytes:
    """The commit marker of a ``save()`` DCP folder (the step manifest's shape, no entries)."""
    return _manifest.manifest_for(None, {}, world_size, None, dict(files), FOLDER_FORMAT)


def commit_folder(temp: str, path: str, files: Mapping[str, Any], world_size: int) -> None:
    """Rank 0: write the manifest last into ``temp``, then put ``temp`` at ``path`` atomically."""
    fsync_folder(temp)
    with storage.atomic_write(os.path.join(temp, MANIFEST_NAME)) as f:
        f.write(folder_manifest(files, world_size))
    storage.replace_folder(temp, _fs.local_path(path))


# ------------------------------------------------------------------------- CheckpointManager


def kinds_disagree(infos: list[Any], step: int) -> Optional[InvalidArgumentError]:
    """Rank 0: an error when the ranks do not agree on which entries are DCP entries."""
    differing = [r for r, info in enumerate(infos) if info["dcp"] != infos[0]["dcp"]]
    if not differing:
        return None
    r = differing[0]
    return InvalidArgumentError(
        f"CheckpointManager.save(step={step}): rank {r} holds sharded/DCP entries "
        f"{sorted(infos[r]['dcp'])} but rank 0 holds {sorted(infos[0]['dcp'])}; every rank must "
        f"pass the same kind of model and optimizer (all FSDP2, or none)"
    )


def _prepare(writer: StepWriter, step: int, rank: int) -> str:
    """Rank 0 prepares the step's folder and tells every rank (a collective); raised on all."""
    from ddpstate.dist import broadcast_object

    prepared: Optional[str] = None
    failure = ""
    if rank == 0:
        try:
            prepared = writer.prepare_folder(step)
        except Exception as exc:
            failure = error_text(exc)
    prepared, failure = broadcast_object((prepared, failure), src_rank=0, timeout=writer.timeout)
    if prepared is None:
        target = writer.checkpoint_path(step)
        raise writer.write_failure(step, target, [(0, failure)])
    return str(prepared)


def save_step(
    writer: StepWriter,
    step: int,
    state: Mapping[str, Any],
    kinds: Mapping[str, str],
    entries: Mapping[str, Any],
    rng_blobs: list[bytes],
    metrics: dict[str, float],
) -> None:
    """Write ``kinds``' entries with every rank into ``<step folder>/dcp/``, then commit the step.

    A collective, after ``CheckpointManager.save``'s first round has checked the
    ranks agree. Rank 0 prepares the folder and tells every rank; every rank
    writes and checksums its part; rank 0 gathers the outcome and the file
    list, writes the rank-0 entries and the manifest (last), and every rank
    raises the same error if any rank failed.
    """
    from ddpstate.dist import gather_and_decide

    rank = get_rank() if is_distributed() else 0
    name = f"CheckpointManager.save(step={step})"
    folder = _prepare(writer, step, rank)
    info: dict[str, Any] = {}
    cause: Optional[BaseException] = None
    try:
        info["files"] = write_shards(state_dicts(state, kinds), os.path.join(folder, DCP_SUBDIR))
    except Exception as exc:
        cause = exc
        info["error"] = failure_text(exc)
    causes: list[BaseException] = []

    def decide(infos: list[Any]) -> Optional[DDPStateError]:
        return _commit(writer, step, folder, kinds, infos, entries, rng_blobs, metrics, causes)

    try:
        gather_and_decide(info, decide, dst=0, name=name, timeout=writer.timeout)
    except DDPStateError as shared:
        chained = cause or (causes[0] if causes else None)
        if chained is not None:
            raise shared from chained
        raise


def _commit(
    writer: StepWriter,
    step: int,
    folder: str,
    kinds: Mapping[str, str],
    infos: list[Any],
    entries: Mapping[str, Any],
    rng_blobs: list[bytes],
    metrics: dict[str, float],
    causes: list[BaseException],
) -> Optional[DDPStateError]:
    """Rank 0: commit the step every rank wrote its shards for, or return why it failed."""
    target = writer.checkpoint_path(step)
    files, failures = merge_files(infos, DCP_SUBDIR + "/")
    if failures:
        writer.discard(folder, CheckpointWriteError(failures[0][1]))
        return writer.write_failure(step, target, failures)
    written = {n: {"file": f"{DCP_SUBDIR}/{METADATA_NAME}", "kind": k} for n, k in kinds.items()}
    try:
        fsync_folder(os.path.join(folder, DCP_SUBDIR))
        writer.commit(
            step,
            dict(entries),
            rng_states(rng_blobs),
            metrics,
            prepared=folder,
            written=(files, written),
        )
    except Exception as exc:
        causes.append(exc)
        return writer.write_failure(step, target, [(0, error_text(exc))])
    return None


# ------------------------------------------------------------------------- async saves


def snapshot(state_dict: Any) -> Any:
    """A CPU copy of ``state_dict`` taken now (``DTensor``s stay ``DTensor``s, local shards copied).

    An async save writes the copy in the background while training changes the live tensors.
    """
    if isinstance(state_dict, torch.Tensor):
        # A DTensor's to() copies its local shard and keeps its mesh and placements.
        return state_dict.detach().to("cpu", copy=True)
    if isinstance(state_dict, Mapping):
        return {k: snapshot(v) for k, v in state_dict.items()}
    if isinstance(state_dict, list) or type(state_dict) is tuple:  # (namedtuples: deepcopy)
        return type(state_dict)(snapshot(v) for v in state_dict)
    return copy.deepcopy(state_dict)


def async_group(flight: InFlight, timeout: Any) -> Any:
    """The manager's own gloo group for background DCP writes; created on first use.

    Collective (``new_group``): every rank calls it from the same ``save``. The
    background thread runs DCP's collectives on this group, never on the
    training's, whose collectives the main thread goes on issuing meanwhile.
    None when no process group is initialised (DCP then needs none).
    """
    import torch.distributed as dist

    from ddpstate.dist import resolve_timeout

    if not dist.is_available() or not dist.is_initialized():
        return None
    if flight.dcp_group is None:
        seconds = resolve_timeout(timeout)
        flight.dcp_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
    return flight.dcp_group


def release_group(flight: InFlight) -> None:
    """Destroy the manager's background-write group (at ``close``)."""
    group = flight.dcp_group
    flight.dcp_group = None
    if group is not None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group(group)


def start_async_step(
    writer: StepWriter,
    flight: InFlight,
    step: int,
    state: Mapping[str, Any],
    kinds: Mapping[str, str],
    entries: Mapping[str, Any],
    events: list[Any],
    rng_blobs: list[bytes],
    metrics: dict[str, float],
) -> threading.Thread:
    """Snapshot the DCP entries, then write and commit the step in a background thread.

    Called by every rank from ``CheckpointManager.save`` (a collective: rank 0
    prepares the folder and tells every rank, and the group is created on the
    first call). The thread writes this rank's shards with DCP on the manager's
    own gloo group, gathers every rank's outcome to rank 0, which commits the
    step (manifest last) as :func:`save_step` does, and receives rank 0's
    verdict; a failure is left in ``flight.error`` on every rank, for the next
    ``save``/``wait``/``restore``/``close`` to raise.
    """
    rank = get_rank() if is_distributed() else 0
    folder = _prepare(writer, step, rank)
    group = async_group(flight, writer.timeout)
    copied = snapshot(state_dicts(state, kinds))  # before returning: training goes on

    def run() -> None:
        import torch.distributed as dist

        info: dict[str, Any] = {}
        try:
            for event in events:
                event.synchronize()  # the rank-0 entries' CUDA copies
            info["files"] = write_shards(copied, os.path.join(folder, DCP_SUBDIR), group)
        except Exception as exc:
            info["error"] = failure_text(exc)
        if group is None:
            infos: Optional[list[Any]] = [info]
        else:
            infos = [None] * dist.get_world_size(group) if rank == 0 else None
            dist.gather_object(info, infos, dst=0, group=group)
        causes: list[BaseException] = []
        verdict = None
        if rank == 0:
            assert infos is not None
            verdict = _commit(
                writer, step, folder, kinds, infos, entries, rng_blobs, metrics, causes
            )
            if verdict is not None and causes:
                verdict.__cause__ = causes[0]
        text = [None if verdict is None else str(verdict)]
        if group is not None:
            dist.broadcast_object_list(text, src=0, group=group)
        if verdict is None and text[0] is not None:
            verdict = CheckpointWriteError(text[0])
        flight.error = verdict

    def guarded() -> None:
        try:
            run()
        except Exception as exc:  # the group broke (a rank died): raised at the next call
            target = writer.checkpoint_path(step)
            failure = writer.write_failure(step, target, [(rank, error_text(exc))])
            failure.__cause__ = exc
            flight.error = failure
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: raised as they are
            flight.error = exc

    flight.error = None
    thread = threading.Thread(target=guarded, name=f"ddpstate-dcp-writer-step-{step}", daemon=False)
    thread.start()
    return thread


def restore_entries(
    state: MutableMapping[str, Any],
    kinds: Mapping[str, str],
    step_folder: str,
    ignore_mismatched: bool,
) -> None:
    """Load a step's DCP entries into ``state`` (every rank; resharded to the live layout).

    Raises:
        InvalidArgumentError: ``ignore_mismatched`` was asked for (DCP entries must fit).
    """
    where = storage.join(step_folder, DCP_SUBDIR)
    if ignore_mismatched:
        raise InvalidArgumentError(
            f"{where}: ignore_mismatched=True is not available for entries saved with "
            f"torch.distributed.checkpoint ({sorted(kinds)}); restore them into models of the "
            f"saved shapes"
        )
    load_entries(state, kinds, _fs.local_path(where), where)
