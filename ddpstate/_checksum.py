"""Checksumming a step folder's files, whole or in byte-range pieces, torch-free.

A step folder's manifest records each file's size and CRC-32. Reading every
byte for that CRC is most of what verifying or restoring a step costs, so the
bytes are cut into consecutive pieces (:func:`assign`: equal runs over the
files laid end to end; a small file stays whole) that several readers check at
once: ranks of a job (``_manager/verify_split.py``, ``_manager/local_check.py``)
or threads of one process (:func:`check_files`; the CRC-32 (``_crc.crc32``) and file
reads release the GIL). Each piece's read (:class:`PieceRead`) carries its size and
CRC; :func:`file_problem` puts a file's pieces back together (``_crc``) and
judges them with the words one pass over the whole file uses, so the problems
never depend on how the work was split. :class:`ChecksumWriter` takes a file's
size and CRC-32 on its way out, as the manifest lists them (:func:`write_listed_file`).
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from ddpstate import _crc, _fs, storage
from ddpstate.errors import CheckpointNotFoundError, DDPStateError

__all__ = [
    "ChecksumWriter",
    "Finding",
    "MIN_PIECE",
    "Piece",
    "PieceRead",
    "assign",
    "check_files",
    "check_share",
    "checksum_hex",
    "error_text",
    "file_problem",
    "file_problems",
    "read_piece",
    "write_listed_file",
]

_READ_CHUNK = 8 << 20


def checksum_hex(crc: int) -> str:
    """A CRC-32 as the manifest writes it: eight lowercase hex digits.

    Example:
        >>> from ddpstate._checksum import checksum_hex
        >>> checksum_hex(0xABC)
        '00000abc'
    """
    return f"{crc & 0xFFFFFFFF:08x}"


def error_text(exc: BaseException) -> str:
    """An exception as problems quote it: ``"Type: message"``.

    Example:
        >>> from ddpstate._checksum import error_text
        >>> error_text(OSError("disk gone"))
        'OSError: disk gone'
    """
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class PieceRead:
    """What one reader found in bytes ``start`` onwards of a listed file (see :func:`read_piece`).

    ``problem`` is the file's whole problem text when it could not be read
    ("" when it was); ``size`` and ``crc`` are the bytes read and their CRC-32.
    """

    start: int
    size: int
    crc: int
    problem: str = ""


def read_piece(
    path: str, filename: str, start: int, stop: Optional[int], opts: Optional[dict[str, Any]]
) -> PieceRead:
    """Checksum bytes ``[start, stop)`` of a listed file (``stop`` None: to its end).

    A file shorter than ``start`` gives an empty piece: the pieces' sizes still
    add up to the file's, so :func:`file_problem` reports a truncation exactly as
    one pass over the whole file does.
    """
    try:
        with storage.open_read(path, storage_options=opts) as f:
            if start:
                f.seek(start)
            limit = None if stop is None else max(0, stop - start)
            size, crc = storage.size_and_crc32(f, _READ_CHUNK, limit)
    except CheckpointNotFoundError:
        return PieceRead(start, 0, 0, f"{filename} is missing")
    except (OSError, DDPStateError) as exc:
        return PieceRead(start, 0, 0, f"{filename} cannot be read ({error_text(exc)})")
    return PieceRead(start, size, crc)


def file_problem(filename: str, expected: Mapping[str, Any], pieces: list[PieceRead]) -> str:
    """The problem of a listed file from the reads of its consecutive pieces ("" if none).

    The first piece that could not be read decides; otherwise the pieces' total
    size and combined CRC-32 are judged against the manifest's ``expected``
    entry, with the words one pass over the whole file would use.
    """
    pieces = sorted(pieces, key=lambda p: p.start)
    for piece in pieces:
        if piece.problem:
            return piece.problem
    size = sum(p.size for p in pieces)
    want = expected.get("size")
    if size != want:
        how = "truncated" if isinstance(want, int) and size < want else "the wrong size"
        return f"{filename} is {how}: {size} bytes, the manifest says {want}"
    crc = checksum_hex(_crc.crc32_of_pieces((p.crc, p.size) for p in pieces))
    if crc != expected.get("crc32"):
        return (
            f"{filename} fails its checksum (CRC-32 {crc}, the manifest says "
            f"{expected.get('crc32')}): its bytes are damaged"
        )
    return ""


#: Files smaller than this are checked whole by one rank, never split.
MIN_PIECE = 16 << 20

#: One rank's piece of a listed file: (file, first byte, end byte or None for "to the end").
Piece = tuple[str, int, Optional[int]]


def assign(sizes: Mapping[str, int], world: int, min_piece: int = MIN_PIECE) -> list[list[Piece]]:
    """Split the files' bytes across ``world`` ranks in equal runs; the same on every rank.

    The files, in name order, are laid end to end and cut into ``world``
    consecutive runs of equal length. A file of at least ``min_piece`` bytes is
    cut where a run ends (its last piece reads on to the file's real end, so
    extra bytes are counted); a smaller one goes whole to the rank whose run
    holds its first byte (a run may then end up to ``min_piece`` long or short).
    Every file has at least one piece, an empty file included.

    Args:
        sizes: Each file's size as the manifest lists it (0 where it has none).
        world: How many ranks share the bytes.
        min_piece: The smallest file that is split.

    Returns:
        Per rank, its pieces ``(file, start, stop)`` in name order.

    Example:
        >>> from ddpstate._checksum import assign
        >>> assign({"model.pt": 100, "_rng.pt": 4}, 2, min_piece=10)
        [[('_rng.pt', 0, None), ('model.pt', 0, 48)], [('model.pt', 48, None)]]
    """
    total = sum(max(0, size) for size in sizes.values())
    cuts = [total * r // world for r in range(world)]
    shares: list[list[Piece]] = [[] for _ in range(world)]
    position = 0
    for name in sorted(sizes):
        size = max(0, sizes[name])
        owner = bisect.bisect_right(cuts, position) - 1
        start = 0
        if size >= min_piece:
            for rank in range(owner + 1, world):
                cut = cuts[rank] - position
                if cut >= size:
                    break
                if cut > start:
                    shares[owner].append((name, start, cut))
                    start = cut
                owner = rank
        shares[owner].append((name, start, None))
        position += size
    return shares


#: A share's finding: the file (or "" for a failure outside any file) and what was read.
Finding = tuple[str, PieceRead]


def file_problems(
    files: Mapping[str, Mapping[str, Any]], shares: Iterable[list[Finding]]
) -> list[str]:
    """The shares' problems in manifest order (``files``), as one rank checking them all reports.

    Each file's pieces are put together (``file_problem``); findings
    outside the listed files (a share that failed as a whole) come last.

    Example:
        >>> import zlib
        >>> from ddpstate._checksum import PieceRead
        >>> from ddpstate._checksum import file_problems
        >>> files = {"a.pt": {"size": 4, "crc32": f"{zlib.crc32(b'abcd'):08x}"}}
        >>> ab, cd = PieceRead(0, 2, zlib.crc32(b"ab")), PieceRead(2, 2, zlib.crc32(b"cd"))
        >>> file_problems(files, [[("a.pt", cd)], [("a.pt", ab)]])
        []
        >>> file_problems(files, [[("a.pt", ab)]])
        ['a.pt is truncated: 2 bytes, the manifest says 4']
    """
    reads: dict[str, list[PieceRead]] = {}
    for share in shares:
        for filename, read in share:
            reads.setdefault(filename, []).append(read)
    problems = [
        file_problem(name, expected, reads[name])
        for name, expected in files.items()
        if name in reads
    ]
    for name, found in reads.items():
        if name not in files:
            problems.extend(read.problem for read in found if read.problem)
    return [p for p in problems if p]


def _sizes(files: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """Each listed file's size as the manifest says (0 where it says nothing usable)."""
    return {n: max(0, e["size"]) if isinstance(e.get("size"), int) else 0 for n, e in files.items()}


def check_share(
    folder: str,
    files: Mapping[str, Mapping[str, Any]],
    opts: Optional[dict[str, Any]],
    index: int,
    count: int,
    min_piece: int = MIN_PIECE,
) -> list[Finding]:
    """Checksum share ``index`` of ``count`` of the listed files' bytes (see :func:`assign`).

    An ``index`` outside ``range(count)`` checks nothing; a piece that cannot be
    checked is a finding, never an exception (other readers may be waiting).

    Args:
        folder: The folder (local path or fsspec URL).
        files: The manifest's entries of the files, in manifest order.
        opts: fsspec storage options, or None.
        index: This checker's share.
        count: How many checkers split the bytes.
        min_piece: The smallest file that is split.

    Returns:
        (file, read) per piece of this share; :func:`file_problems` judges them.
    """
    pieces = assign(_sizes(files), count, min_piece)[index] if 0 <= index < count else []
    found: list[Finding] = []
    for filename, start, stop in pieces:
        try:
            # A name the manifest gives is a claim: a symlink out or a FIFO is never opened.
            path = _fs.confined_file(folder, filename, checkpoint=folder, entry="its manifest")
            read = read_piece(path, filename, start, stop, opts)
        except Exception as exc:
            read = PieceRead(start, 0, 0, f"{filename} cannot be checked ({error_text(exc)})")
        found.append((filename, read))
    return found


def _workers(total: int) -> int:
    """Threads for a pass over ``total`` bytes: one per CPU (at most 8), one for small folders."""
    if total < 2 * MIN_PIECE:
        return 1
    return max(1, min(_crc.MAX_THREADS, _crc.cpus(), total // MIN_PIECE))


def check_files(
    folder: str,
    files: Mapping[str, Mapping[str, Any]],
    opts: Optional[dict[str, Any]],
    workers: Optional[int] = None,
    min_piece: int = MIN_PIECE,
) -> tuple[list[str], int, int]:
    """Checksum ``files`` (name -> manifest entry) in ``folder`` with threads sharing the bytes.

    Args:
        folder: The folder (local path or fsspec URL).
        files: The manifest's entries of the files to check, in manifest order.
        opts: fsspec storage options, or None.
        workers: Threads (None: one per CPU, at most 8, and one below 32 MiB).
        min_piece: The smallest file that threads split (see :func:`assign`).

    Returns:
        (problems in manifest order, files read, bytes read).

    Example:
        >>> import os, tempfile, zlib
        >>> from ddpstate._checksum import check_files, checksum_hex
        >>> folder = tempfile.mkdtemp()
        >>> _ = open(os.path.join(folder, "a.pt"), "wb").write(b"abc")
        >>> good = {"a.pt": {"size": 3, "crc32": checksum_hex(zlib.crc32(b"abc"))}}
        >>> check_files(folder, good, None, workers=2)
        ([], 1, 3)
        >>> check_files(folder, {"b.pt": {"size": 1, "crc32": "0"}}, None)
        (['b.pt is missing'], 0, 0)
    """
    sizes = _sizes(files)
    count = max(1, workers if workers is not None else _workers(sum(sizes.values())))
    with ThreadPoolExecutor(count, thread_name_prefix="ddpstate-checksum") as pool:
        found = list(
            pool.map(lambda i: check_share(folder, files, opts, i, count, min_piece), range(count))
        )
    pairs = [pair for share in found for pair in share]
    unread = {name for name, read in pairs if read.problem}
    read_files = {name for name, _ in pairs} - unread
    return file_problems(files, found), len(read_files), sum(r.size for _, r in pairs)


class ChecksumWriter(io.RawIOBase):
    """A write-only stream that counts bytes and CRC-32s them on their way to ``raw``.

    Used by ``torch.save`` (a step's files) and DCP's writer (a shard's stream:
    ``tell`` and ``fileno`` are the file's). With ``pieces``, ``crc`` covers the bytes
    since the last :meth:`tell` and each ``tell`` ends a piece, recorded in ``pieces`` as
    ``(offset, length, crc)``: DCP calls ``tell`` before and after each item it writes,
    so the pieces are its items' byte ranges, each checkable on its own.
    """

    def __init__(self, raw: Any, *, pieces: bool = False) -> None:
        super().__init__()
        self._raw = raw
        self.size = 0
        self.crc = 0
        self.pieces: Optional[list[tuple[int, int, int]]] = [] if pieces else None
        self._start = 0
        # torch.save's C++ writer replaces an exception from write() with its own
        # "unexpected pos" error; the real cause (disk full...) is kept here.
        self.error: Optional[BaseException] = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        def put(_: int, piece: memoryview) -> int:
            written = self._raw.write(piece)
            return piece.nbytes if written is None else int(written)

        try:  # a large write is CRC-32'd in pieces on helper threads as it goes out
            count, self.crc = _crc.crc32_alongside(memoryview(data).cast("B"), put, self.crc)
        except BaseException as exc:
            self.error = exc
            raise
        self.size += count
        return count

    def tell(self) -> int:
        if self.pieces is not None and self.size > self._start:
            self.pieces.append((self._start, self.size - self._start, self.crc))
            self._start, self.crc = self.size, 0
        return int(self._raw.tell())

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def flush(self) -> None:
        if not self._raw.closed:  # also called when this wrapper is collected
            self._raw.flush()


def write_listed_file(
    path: str,
    write: Callable[[ChecksumWriter], Any],
    *,
    fsync: bool = True,
    storage_options: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Write one file atomically through a :class:`ChecksumWriter`; its manifest entry.

    ``write(writer)`` writes the bytes. torch.save's C++ writer hides a failed
    ``write`` behind its own error: the real cause (disk full...) is raised instead.

    Returns:
        ``{"size": ..., "crc32": ...}`` as the manifest lists the file.
    """
    with storage.atomic_write(path, storage_options=storage_options, fsync=fsync) as raw:
        writer = ChecksumWriter(raw)
        try:
            write(writer)
        except Exception as exc:
            if writer.error is not None and writer.error is not exc:
                raise writer.error from exc
            raise
    return {"size": writer.size, "crc32": checksum_hex(writer.crc)}
