"""DCP storage that commits the ddpstate way and verifies what it reads: :mod:`ddpstate.dcp`.

:class:`DurableWriter` is torch's ``FileSystemWriter`` (``FsspecWriter`` for URLs)
with its file system wrapped (:class:`_Checksummed`): every ``.distcp`` stream is a
:class:`~ddpstate._checksum.ChecksumWriter` in pieces mode, so each item's bytes are
CRC-32'd on their way out (DCP calls ``tell`` before and after each item). DCP's
stream transforms (``_extensions``: ``ZStandard``, custom ones) wrap that stream, so
the CRC-32s are over the bytes as stored (compressed), the bytes a reader reads back.
Each rank's ``write_data`` returns DCP's ``WriteResult`` s with ``storage_data`` a
:class:`_Checked` (torch's ``_StorageInfo``; on a file's first item, the file's
pieces), which DCP gathers to the coordinator as it does every save; ``finish`` puts
torch's own objects back before torch writes ``.metadata``, then writes ddpstate's
``manifest.json`` last (each file's size, whole-file CRC-32 and its pieces as
``chunks``: its items' byte ranges; with ``serialization_format=SAFETENSORS`` the
byte items and the one safetensors blob torch writes after them) and commits:

Each save stages under its own name, which DCP's coordinator picks when it plans the
save (``prepare_global_plan``, after every rank's local plan and before any write) and
hands every rank inside its plan (:class:`_Staging`):

- local paths: a fresh ``.<name>.ddpstate-tmp-<hex>`` folder beside the target,
  ``flock``-ed while the save runs; the commit fsyncs it and swaps it in
  (:class:`ddpstate.storage.StagedFolder`), then deletes the staging folders of this
  target that killed saves left.
- URLs: the target itself when nothing is committed there (shard names carry the
  save's nonce), else a fresh version folder ``<target>/v-<hex>``; the commit is one
  PUT of ``manifest.json`` (for a version folder: a pointer naming it), and only
  then are the previous checkpoint's files deleted. Plain DCP reads the folder the
  pointer names: ``dcp.load(state, checkpoint_id=<target>/<version>)``.

Either way the commit is a compare-and-swap: a save whose target another save committed
while it was in flight fails, on every rank, naming the target.

:class:`VerifiedReader` is ``FileSystemReader`` (``FsspecReader``) whose file system
returns, for each shard file, a :class:`_VerifiedFile`: reads go straight into
torch's buffers and are CRC-32'd there, and each item read is compared with its
recorded CRC-32 when DCP closes the file. A transform's reader (``_extension_registry``)
reads through it, so a compressed item is checked as stored, before it is decompressed.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import io
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemBase,
    FileSystemReader,
    FileSystemWriter,
    SerializationFormat,
)
from torch.futures import Future

from ddpstate import _fs, _manifest, storage
from ddpstate._checksum import ChecksumWriter, checksum_hex
from ddpstate._crc import crc32, crc32_alongside, crc32_combine, crc32_of_pieces
from ddpstate._io.dcp_items import check_item_files, fsspec_dcp
from ddpstate._manifest import FOLDER_FORMAT, MANIFEST_NAME, METADATA_NAME, SHARD_SUFFIX
from ddpstate.dist import get_rank, is_distributed
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    InvalidArgumentError,
)

__all__ = ["DurableWriter", "VerifiedReader"]

Chunks = dict[int, tuple[int, int]]  # offset -> (length, crc32)
_WINDOW = 64 << 10  # bytes at each end of an item that VerifiedReader reads whole (zip headers)


@dataclasses.dataclass(frozen=True)
class _Checked:
    """A ``WriteResult.storage_data`` on its way to ``finish``: torch's own, and its file's pieces.

    ``pieces`` (``(offset, length, crc)`` of the bytes as stored, after any stream
    transform) is filled on the first item of each file only, empty on the others.
    """

    info: Any  # torch's _StorageInfo(relative_path, offset, length[, transform_descriptors])
    pieces: tuple[tuple[int, int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class _Staging:
    """A rank's ``SavePlan.storage_data``: torch's file-name prefix and the folder to write into.

    The coordinator fills it in planning, so every rank writes where this save staged.
    """

    prefix: str
    folder: str


def _rank() -> int:
    return get_rank() if is_distributed() else 0


def _file_system(path: str, storage_options: Optional[dict[str, Any]]) -> FileSystemBase:
    """torch's file system for ``path``: the local one, or fsspec's with ``storage_options``."""
    if not _fs.is_remote(path):
        return FileSystem()
    fs: FileSystemBase = fsspec_dcp.FileSystem()
    fs.init_path(path, **(storage_options or {}))
    return fs


class _Checksummed(FileSystemBase):
    """torch's file system for one checkpoint, CRC-ing what is written, checking what is read.

    Writes: each ``.distcp`` stream records its items' ``(offset, length, crc)`` in
    ``pieces``, any other file its size and CRC in ``whole``. Reads: a file that
    ``chunks`` lists is served by :class:`_VerifiedFile`.
    """

    def __init__(self, inner: FileSystemBase, folder: str) -> None:
        self.inner = inner
        self.folder = folder
        self.pieces: dict[str, list[tuple[int, int, int]]] = {}
        self.whole: dict[str, dict[str, Any]] = {}
        self.chunks: dict[str, Chunks] = {}
        self.rank: Optional[int] = None  # DCP's rank of this process, once it says

    @contextlib.contextmanager
    def create_stream(self, path: Union[str, os.PathLike[str]], mode: str) -> Iterator[Any]:
        name = os.path.basename(os.fspath(path))
        with self.inner.create_stream(path, mode) as raw:
            if "r" in mode:
                chunks = self.chunks.get(name)
                if chunks is None:
                    yield raw
                    return
                verified = _VerifiedFile(raw, chunks, self, name)
                try:  # .metadata: pickle reads in small pieces; shards: DCP reads item views
                    yield verified if name.endswith(SHARD_SUFFIX) else io.BufferedReader(verified)
                finally:  # also when torch choked on damaged bytes: say which
                    verified.check()
                return
            writer = ChecksumWriter(raw, pieces=name.endswith(SHARD_SUFFIX))
            yield writer
            if writer.pieces is None:
                self.whole[name] = {"size": writer.size, "crc32": checksum_hex(writer.crc)}
            else:
                writer.tell()  # ends the last piece
                self.pieces[name] = writer.pieces

    def concat_path(
        self, path: Union[str, os.PathLike[str]], suffix: str
    ) -> Union[str, os.PathLike[str]]:
        return self.inner.concat_path(path, suffix)

    def rename(
        self, path: Union[str, os.PathLike[str]], new_path: Union[str, os.PathLike[str]]
    ) -> None:
        self.inner.rename(path, new_path)

    def init_path(self, path: Union[str, os.PathLike[str]]) -> Union[str, os.PathLike[str]]:
        return path

    def mkdir(self, path: Union[str, os.PathLike[str]]) -> None:
        self.inner.mkdir(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike[str]]) -> bool:
        return True

    def exists(self, path: Union[str, os.PathLike[str]]) -> bool:
        return self.inner.exists(path)

    def rm_file(self, path: Union[str, os.PathLike[str]]) -> None:
        self.inner.rm_file(path)


class _VerifiedFile(io.RawIOBase):
    """A shard file whose reads are CRC-checked against its recorded chunks (items).

    An item is a small zip (torch's format) around its tensor bytes: torch reads
    its first and last bytes in many small, scattered pieces (headers, names,
    directory) and the tensor in one piece. So the first touch of a chunk reads
    its head and tail (``_WINDOW`` bytes each; the whole chunk if it is small) in
    one read each, CRC-32s them and serves torch's small reads from memory; the
    bytes in between go straight from the file into torch's buffer and are
    CRC-32'd there, no copy. :meth:`check` (when the stream closes, or fails)
    puts each touched chunk's CRC together (``_crc.crc32_combine``), reading only
    middle bytes torch skipped, and raises if it differs from the manifest's. DCP
    closes a shard's stream before it returns from ``read_data``, so a damaged
    range fails the load on every rank.
    """

    def __init__(self, raw: Any, chunks: Chunks, fs: _Checksummed, name: str) -> None:
        super().__init__()
        self._raw = raw
        self._fs = fs
        self._chunks = chunks
        self._starts = sorted(chunks)
        self._end = max((o + n for o, (n, _) in chunks.items()), default=0)
        self._where = storage.join(fs.folder, name)
        self._pos = 0
        self._ends: dict[int, tuple[int, int, int, int]] = {}  # chunk -> head/tail CRC, length
        self._seen: dict[int, list[tuple[int, int, int]]] = {}  # chunk -> middle (pos, n, crc)
        self._window: tuple[int, memoryview, memoryview] = (-1, memoryview(b""), memoryview(b""))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_END:
            offset += self._end
        elif whence == io.SEEK_CUR:
            offset += self._pos
        self._pos = offset
        return offset

    def _chunk(self, pos: int) -> int:
        at = bisect.bisect_right(self._starts, pos) - 1
        start = self._starts[at] if at >= 0 else -1
        if start < 0 or pos >= start + self._chunks[start][0]:
            raise self._error(f"byte {pos} is outside every range the manifest records")
        return start

    def _read(self, pos: int, out: memoryview) -> int:
        self._raw.seek(pos)
        got = int(self._raw.readinto(out) or 0)
        if not got:
            start = self._chunk(pos)
            raise self._error(
                f"it ends at byte {pos}, inside bytes {start}..{start + self._chunks[start][0]} "
                f"(the file is truncated)"
            )
        return got

    def _read_exact(self, pos: int, n: int) -> memoryview:
        buf = memoryview(bytearray(n))
        got = 0
        while got < n:
            got += self._read(pos + got, buf[got:])
        return buf

    def _ends_of(self, start: int) -> tuple[memoryview, memoryview]:
        """Chunk ``start``'s head and tail bytes, read (and CRC-32'd) on first touch."""
        if self._window[0] != start:
            length = self._chunks[start][0]
            head_n = length if length <= 2 * _WINDOW else _WINDOW
            tail_n = 0 if head_n == length else _WINDOW  # none when the head is all of it
            head = self._read_exact(start, head_n)
            tail = self._read_exact(start + length - tail_n, tail_n)
            crcs = (crc32(head, 0), len(head), crc32(tail, 0), len(tail))
            if self._ends.setdefault(start, crcs) != crcs:  # read again, and it changed
                raise self._error(f"bytes {start}..{start + length} changed while being read")
            self._window = (start, head, tail)
        return self._window[1], self._window[2]

    def readinto(self, b: Any) -> int:
        pos = self._pos
        if pos >= self._end:
            return 0
        start = self._chunk(pos)
        head, tail = self._ends_of(start)
        end = start + self._chunks[start][0]
        middle, tail_at = start + len(head), end - len(tail)
        out = memoryview(b).cast("B")
        out = out[: min(len(out), end - pos)]
        done = 0
        if pos < middle:  # from the head in memory
            done = min(len(out), middle - pos)
            out[:done] = head[pos - start : pos - start + done]
        if done < len(out) and pos + done < tail_at:  # straight from the file into torch's buffer
            at, want = pos + done, min(len(out) - done, tail_at - pos - done)
            seen = self._seen.setdefault(start, [])
            # A stream transform (a decompressor) reads an item in many small reads, one
            # after the other: the CRC goes on from the last one (no combine per read).
            last = seen[-1] if seen and seen[-1][0] + seen[-1][1] == at else None
            got, crc = crc32_alongside(
                out[done : done + want],
                lambda offset, piece: self._read(at + offset, piece),
                0 if last is None else last[2],
            )
            if last is None:
                seen.append((at, got, crc))
            else:
                seen[-1] = (last[0], last[1] + got, crc)
            done += got
            if got < want:
                self._pos += done
                return done
        if done < len(out):  # from the tail in memory
            n = len(out) - done
            out[done:] = tail[pos + done - tail_at : pos + done - tail_at + n]
            done += n
        self._pos += done
        return done

    def check(self) -> None:
        """Raise if a chunk read so far differs from its recorded CRC-32."""
        for start, (head_crc, head_n, tail_crc, tail_n) in sorted(self._ends.items()):
            length, want = self._chunks[start]
            seen = sorted(self._seen.get(start, []), key=lambda piece: piece[1])
            pieces = {p: (n, c) for p, n, c in seen}  # the longest piece read at each position
            crc, pos, end = head_crc, start + head_n, start + length - tail_n
            while pos < end:
                if pos in pieces and pos + pieces[pos][0] <= end:
                    n, c = pieces[pos]
                else:  # bytes torch did not read (or read in overlapping pieces): read them
                    n = min([p for p in pieces if p > pos] + [end]) - pos
                    c = crc32(self._read_exact(pos, n), 0)
                crc, pos = crc32_combine(crc, c, n), pos + n
            crc = crc32_combine(crc, tail_crc, tail_n)
            if crc != want:
                raise self._error(
                    f"bytes {start}..{start + length} have CRC-32 {checksum_hex(crc)}, but the "
                    f"manifest records {checksum_hex(want)} (the file is damaged)"
                )
        self._ends.clear()
        self._seen.clear()

    def _error(self, what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"{self._where}: {what}; rank {_rank() if self._fs.rank is None else self._fs.rank} "
            f"refused it. Restore an older checkpoint or re-save this one (`ddpstate verify` "
            f"lists every damaged file)"
        )


class DurableWriter(FileSystemWriter):
    """A ``torch.distributed.checkpoint`` storage writer that commits like ddpstate.

    Use it wherever torch's ``FileSystemWriter`` goes:
    ``dcp.save(state, storage_writer=DurableWriter(path))``, ``dcp.async_save``,
    torchtitan. Every rank writes its shards into the folder this save staged
    (named by the coordinator when DCP plans the save: beside ``path`` on local
    disks, a fresh version prefix below it on object stores that hold a committed
    checkpoint), CRC-32-ing each item as its bytes go out; the coordinator writes
    ``.metadata``, then ``manifest.json`` last (size, CRC-32 and per-item CRC-32
    chunks of every file), and commits: on local paths it fsyncs the folder and
    swaps it into place, on URLs one PUT of the manifest (or of a pointer to the
    version) does it, and the replaced checkpoint's files go only after that. A
    save that dies midway commits nothing and leaves the previous checkpoint at
    ``path`` intact; :meth:`discard`, or the next successful save, deletes what it
    left. Two saves to one ``path`` at once (an un-awaited ``dcp.async_save``, a
    requeued job): the one that commits second fails on every rank, naming ``path``.
    The folder loads with plain ``dcp.load`` (on a URL, from the version folder
    ``ddpstate.storage.committed_folder(path)`` names); :class:`VerifiedReader`
    finds it itself and checks every byte it reads.

    Args:
        path: The checkpoint folder (local path or fsspec URL such as ``s3://b/ckpt``).
        storage_options: fsspec options for a URL (``{"endpoint_url": ...}``).
        single_file_per_rank: As for torch's ``FileSystemWriter``, in the same
            order; so are ``thread_count``, ``per_thread_copy_ahead``,
            ``cache_staged_state_dict`` and ``overwrite`` (``overwrite=False``
            refuses a ``path`` holding a committed checkpoint).
        sync_files: fsync each file and the folder (local paths; object stores
            are durable once a file is closed).
        _extensions: DCP's stream transforms, as for ``FileSystemWriter``
            (``[ZStandard()]`` compresses); the manifest's CRC-32s are of the
            bytes as stored, after the transforms.
        serialization_format: As for ``FileSystemWriter``; with ``SAFETENSORS``
            the manifest records each file's bytes as written (read such a folder
            with a safetensors-aware reader, not ``FileSystemReader``).

    Raises:
        CheckpointWriteError: ``overwrite=False`` and ``path`` holds a committed
            checkpoint; from ``dcp.save`` (inside torch's ``CheckpointException``)
            when the commit fails, or another save committed ``path`` while this
            one was in flight.

    Example:
        >>> import os, tempfile, torch
        >>> import torch.distributed.checkpoint as dcp
        >>> from ddpstate.dcp import DurableWriter, VerifiedReader
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = dcp.save({"w": torch.ones(3)}, storage_writer=DurableWriter(path), no_dist=True)
        >>> sorted(os.listdir(path))
        ['.metadata', '__0_0.distcp', 'manifest.json']
        >>> state = {"w": torch.zeros(3)}
        >>> dcp.load(state, storage_reader=VerifiedReader(path), no_dist=True)
        >>> state["w"]
        tensor([1., 1., 1.])
    """

    def __init__(
        self,
        path: Union[str, os.PathLike[str]],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Optional[Sequence[StreamTransformExtension]] = None,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
        *,
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__(
            os.getcwd(),  # replaced by reset(path) below
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
            _extensions=_extensions,
            serialization_format=serialization_format,
        )
        self.storage_options = storage_options
        self._sync_asked = sync_files
        #: The manifest's files (name to size and CRC-32s), on the coordinator after a save.
        self.files: dict[str, dict[str, Any]] = {}
        self.reset(path)

    def reset(self, checkpoint_id: Union[str, os.PathLike[str], None] = None) -> None:
        """Start a new save, to ``checkpoint_id`` when given (DCP calls this)."""
        super().reset()
        if not checkpoint_id:
            return
        text = os.fspath(checkpoint_id)
        self.remote = _fs.is_remote(text)
        self.target = text if self.remote else os.path.abspath(_fs.local_path(text))
        self.sync_files = self._sync_asked and not self.remote
        self.checked = _Checksummed(_file_system(text, self.storage_options), self.target)
        self.fs = self.checked  # type: ignore[assignment]  # torch annotates its own class
        self.path = self.target  # until planning names this save's staging folder
        #: The coordinator's staged folder for this save (prepare_global_plan).
        self.staged: Optional[storage.StagedFolder] = None
        if not self.overwrite and storage.exists(
            storage.join(self.target, MANIFEST_NAME), **self._opts()
        ):
            raise CheckpointWriteError(
                f"{self.target} holds a committed checkpoint and overwrite=False; save "
                f"elsewhere or pass overwrite=True"
            )

    @property
    def checkpoint_id(self) -> Union[str, os.PathLike[str]]:
        """The checkpoint folder being written (not its staging folder)."""
        return self.target

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike[str]]) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.is_coordinator = is_coordinator
        if not self.use_collectives:
            raise InvalidArgumentError(
                f"{self.target}: DurableWriter commits one checkpoint for all ranks, so it "
                f"needs dcp.save's collectives; drop use_collectives=False"
            )

    def discard(self) -> None:
        """Delete what a failed save left; call it on every rank after ``dcp.save`` raised.

        The coordinator deletes this save's staging folder (the checkpoint at
        ``path`` was never touched). Files a save to an empty URL wrote in place
        stay: they are listed in no manifest, and the next save there deletes them.
        Without this call the next successful save of ``path`` deletes them too.

        Example:
            >>> import os, tempfile
            >>> from ddpstate.dcp import DurableWriter
            >>> writer = DurableWriter(os.path.join(tempfile.mkdtemp(), "ckpt"))
            >>> writer.discard()  # nothing staged yet: nothing to delete
        """
        if self.staged is not None:
            self.staged.discard()

    def _opts(self) -> dict[str, Any]:
        return {"storage_options": self.storage_options}

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan  # the coordinator makes the staging folder (prepare_global_plan)

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        if not self.remote and os.path.lexists(self.target) and not os.path.isdir(self.target):
            raise CheckpointWriteError(
                f"{self.target} exists and is a file; a DCP checkpoint is a folder. Give "
                f"another path (ddpstate never deletes files it did not write)"
            )
        # This save's own staging folder, named here and sent to every rank in its plan.
        self.staged = storage.stage_folder(
            self.target, fsync=self.sync_files, storage_options=self.storage_options
        )
        # In place on a URL (nothing committed there): a nonce in each shard's name keeps
        # a killed or overlapping save's files from being taken for this one's.
        nonce = f"{os.urandom(4).hex()}_" if self.staged.path == self.target else ""
        return [
            dataclasses.replace(
                plan, storage_data=_Staging(plan.storage_data.prefix + nonce, self.staged.path)
            )
            for plan in super().prepare_global_plan(plans)
        ]

    def write_data(self, plan: Any, planner: Any) -> Future[list[Any]]:
        fs = self.checked
        staging: _Staging = plan.storage_data
        self.path = staging.folder if self.remote else Path(staging.folder)
        fs.pieces.clear()
        written = super().write_data(plan, planner)
        written.wait()
        # Each file's pieces ride to the coordinator with the first item DCP wrote into it.
        unsent = dict(fs.pieces)
        checked = [
            dataclasses.replace(
                result,
                storage_data=_Checked(
                    result.storage_data,
                    tuple(unsent.pop(result.storage_data.relative_path, ())),
                ),
            )
            for result in written.value()
        ]
        for name, pieces in unsent.items():  # a file no item went into (more threads than items)
            if pieces:
                raise CheckpointWriteError(
                    f"{self.target}: rank {_rank()} wrote {name} but DCP reports no item in it; "
                    f"DurableWriter cannot list it"
                )
            fs.rm_file(fs.concat_path(self.path, name))  # empty: the manifest lists every file
        done: Future[list[Any]] = Future()
        done.set_result(checked)
        return done

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        fs = self.checked
        chunks: dict[str, list[tuple[int, int, int]]] = {}
        plain = []
        for rank_results in results:
            for r in rank_results:
                c: _Checked = r.storage_data
                if c.pieces:
                    chunks[c.info.relative_path] = list(c.pieces)
            plain.append(
                [dataclasses.replace(r, storage_data=r.storage_data.info) for r in rank_results]
            )
        files = {name: _file_entry(pieces) for name, pieces in chunks.items()}
        staged = self.staged
        if staged is None:
            raise CheckpointWriteError(
                f"{self.target}: DurableWriter.finish ran on a rank that did not plan the save"
            )
        try:
            super().finish(metadata, plain)  # torch writes .metadata: torch's own objects only
            files[METADATA_NAME] = fs.whole[METADATA_NAME + ".tmp"]
            manifest = _manifest.manifest_for(None, {}, len(results), None, files, FOLDER_FORMAT)
            staged.commit(manifest)
        except BaseException as exc:  # plain dcp.save never calls discard(): clean up here
            staged.discard(exc)
            raise
        self.files = files
        if staged.path == self.target and self.remote:  # a killed save's shards, in place
            for name in storage.listdir(self.target, **self._opts()):
                if name.endswith(SHARD_SUFFIX) and name not in files:
                    storage.remove(storage.join(self.target, name), missing_ok=True, **self._opts())


def _file_entry(pieces: list[tuple[int, int, int]]) -> dict[str, Any]:
    """A shard's manifest entry from its pieces as written: size, whole-file CRC, chunks."""
    end = sum(n for _, n, _ in pieces)  # ChecksumWriter's pieces follow each other from byte 0
    return {
        "size": end,
        "crc32": checksum_hex(crc32_of_pieces((c, n) for _, n, c in pieces)),
        "chunks": [[o, n, checksum_hex(c)] for o, n, c in pieces],
    }


def _chunk_table(files: Mapping[str, Any]) -> dict[str, Chunks]:
    """Each listed file's ranges (offset -> (length, crc)); a file without chunks is one range."""
    table: dict[str, Chunks] = {}
    for listed, entry in files.items():
        if isinstance(entry, dict):
            rows = entry.get("chunks") or [[0, entry.get("size"), entry.get("crc32")]]
            table[listed] = {int(o): (int(n), int(str(c), 16)) for o, n, c in rows}
    return table


class VerifiedReader(FileSystemReader):
    """A ``torch.distributed.checkpoint`` storage reader that checks every byte it reads.

    ``dcp.load(state, storage_reader=VerifiedReader(path))`` loads a checkpoint
    :class:`DurableWriter` (or ``ddpstate.save``) committed, resharding as DCP
    does. The folder's manifest is read and ``.metadata`` checked when the
    reader is made; each shard byte range is CRC-32'd as it is read (no second
    pass) and compared with the recorded one before ``dcp.load`` returns. A
    damaged or truncated shard raises :class:`~ddpstate.errors.CheckpointCorruptError`
    naming the file and the rank; ``dcp.load`` hands it to every rank inside its
    ``CheckpointException`` (``failures[rank][0]``; ``ddpstate.load_model_state``
    into a sharded model raises it as is).

    Args:
        path: The checkpoint folder (local path or fsspec URL).
        _extension_registry: As for torch's ``FileSystemReader``: where the stream
            transforms ``.metadata`` names are found (a custom one registered;
            torch's ``ZStandard`` by default). The bytes are checked as stored,
            before any transform reads them.
        storage_options: fsspec options for a URL.

    Raises:
        CheckpointNotFoundError: Nothing at ``path``, or a folder without a
            manifest (an interrupted save).
        CheckpointFormatError: A folder plain ``dcp.save`` wrote (``.metadata``
            but no manifest): it still loads with torch's ``FileSystemReader``.
        CheckpointCorruptError: The manifest or ``.metadata`` is damaged.

    Example:
        >>> import os, tempfile, torch
        >>> import torch.distributed.checkpoint as dcp
        >>> from ddpstate.dcp import VerifiedReader
        >>> path = tempfile.mkdtemp()
        >>> _ = dcp.save({"w": torch.ones(3)}, checkpoint_id=path, no_dist=True)
        >>> VerifiedReader(path)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ddpstate.errors.CheckpointFormatError: ...: written by plain torch.distributed.checkpoint...
    """

    def __init__(
        self,
        path: Union[str, os.PathLike[str]],
        _extension_registry: Optional[ExtensionRegistry] = None,
        *,
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__(os.getcwd(), _extension_registry)  # path: replaced by reset(path) below
        self.storage_options = storage_options
        self.reset(path)

    def reset(self, checkpoint_id: Union[str, os.PathLike[str], None] = None) -> None:
        """Point at ``checkpoint_id`` (DCP calls this) and check its manifest and ``.metadata``."""
        super().reset()
        if not checkpoint_id:
            return
        # On a URL, a checkpoint saved over another lives in the version its manifest names.
        text = storage.committed_folder(checkpoint_id, storage_options=self.storage_options)
        self.path = text if _fs.is_remote(text) else _fs.local_path(text)
        self.checked = _Checksummed(_file_system(text, self.storage_options), text)
        self.checked.chunks = self._committed_chunks(text)
        self.fs = self.checked  # type: ignore[assignment]  # torch annotates its own class
        with self.fs.create_stream(self.fs.concat_path(self.path, METADATA_NAME), "rb") as f:
            f.read()  # a damaged .metadata is refused here, not as DCP's AssertionError text

    def set_up_storage_reader(
        self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        check_item_files(os.fspath(self.path), metadata, listed=self.checked.chunks)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.checked.rank = self.rank

    def _committed_chunks(self, text: str) -> dict[str, Chunks]:
        opts = self.storage_options
        if not storage.exists(text, storage_options=opts):
            raise CheckpointNotFoundError(f"{text}: no such checkpoint folder")
        manifest, problem = _manifest.read_manifest(text, opts)
        if manifest is not None:
            try:
                return _chunk_table(manifest["files"])
            except (TypeError, ValueError) as exc:
                raise CheckpointCorruptError(
                    f"{text}: its {MANIFEST_NAME} records ranges that are not numbers ({exc}); "
                    f"re-save the checkpoint"
                ) from exc
        has_metadata = storage.exists(storage.join(text, METADATA_NAME), storage_options=opts)
        manifest_path = storage.join(text, MANIFEST_NAME)
        if has_metadata and not storage.exists(manifest_path, storage_options=opts):
            raise CheckpointFormatError(
                f"{text}: written by plain torch.distributed.checkpoint (it has {METADATA_NAME} "
                f"but no {MANIFEST_NAME}), so nothing records its checksums and VerifiedReader "
                f"cannot check it. It still loads with plain DCP: dcp.load(state, "
                f"checkpoint_id={text!r}); save with ddpstate.dcp.DurableWriter to get a "
                f"verified checkpoint"
            )
        error = CheckpointCorruptError if "damaged" in str(problem) else CheckpointNotFoundError
        raise error(f"{text}: not a committed checkpoint: {problem}")
