"""Random-access reads from a checkpoint file and copies into an output, in constant memory."""

from __future__ import annotations

import errno
import io
import os
import zlib
from collections.abc import Iterator
from typing import IO, Any, ClassVar, Optional

from ddpstate import _fs, storage
from ddpstate._streaming.progress import Progress
from ddpstate.errors import CheckpointCorruptError

# Large enough to run near disk speed, small enough to keep peak memory flat.
_CHUNK = 4 << 20
# copy_file_range in slices this size, so the progress bar moves.
_KERNEL_SLICE = 16 << 20
# Copies up to this size go through user space (see Sink.copy_from), and records up
# to this size are gathered with their neighbours (see ReadWindow).
_SMALL = 64 << 10
# The read-ahead block of a ReadWindow.
_BLOCK = 1 << 20
# Start the disk write-back of every this many bytes written (see Sink._write_back).
_WRITE_BACK = 16 << 20
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


class Source:
    """A checkpoint file open for random-access reads: a local file or an fsspec URL.

    Args:
        path: Local path or fsspec URL.
        storage_options: fsspec options for URLs.

    Raises:
        CheckpointNotFoundError: Nothing exists at ``path``.
        DDPStateError: ``path`` is a folder or cannot be read.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "f")
        >>> _ = open(path, "wb").write(b"abcdef")
        >>> with Source(path) as src:
        ...     src.read_at(2, 3)
        b'cde'
    """

    def __init__(self, path: str, storage_options: Optional[dict[str, Any]] = None) -> None:
        self.name = path
        self.file: IO[bytes] = storage.open_read(path, storage_options=storage_options)
        self.fd: Optional[int] = None
        if not _fs.is_remote(path):
            self.fd = self.file.fileno()
            self.size = os.fstat(self.fd).st_size
        else:
            self.size = int(self.file.seek(0, io.SEEK_END))

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the underlying file."""
        self.file.close()

    def segment_end(self, offset: int) -> int:
        """Where the stretch of bytes holding ``offset`` ends: the file's size here.

        A source made of several files (a sharded checkpoint's shards) ends a
        stretch at each file's end, so read-ahead never runs into the next file.
        """
        return self.size

    def read_at(self, offset: int, length: int) -> bytes:
        """Read exactly ``length`` bytes at ``offset``.

        Raises:
            CheckpointCorruptError: The file ends first (truncated), or a damaged
                header points before its start.
        """
        if offset < 0 or length < 0:
            raise CheckpointCorruptError(
                f"{self.name}: a header points to {length} bytes at byte {offset}, outside the "
                f"file; the file is damaged: re-save or re-download it"
            )
        data = self.read_upto(offset, length)
        if len(data) != length:
            raise self.truncated(offset + length)
        return data

    def truncated(self, end: int) -> CheckpointCorruptError:
        """The error for data said to run to byte ``end``, past the end of the file."""
        return CheckpointCorruptError(
            f"{self.name}: ends at byte {self.size} but data runs to byte {end}; "
            f"the file is truncated: re-save or re-download it"
        )

    def read_upto(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``offset``: fewer where the file ends first (no error)."""
        if self.fd is not None:
            return os.pread(self.fd, length, offset)
        self.file.seek(offset)
        return self.file.read(length)

    def readinto_at(self, offset: int, view: memoryview) -> int:
        """Fill ``view`` from ``offset``; returns the count read (short only at end of file)."""
        if self.fd is not None:
            return os.preadv(self.fd, [view], offset)
        self.file.seek(offset)
        return self.file.readinto(view)  # type: ignore[attr-defined, no-any-return]

    def chunks(self, offset: int, length: int) -> Iterator[memoryview]:
        """``length`` bytes from ``offset``, as views of one reused buffer of up to 4 MiB.

        Raises:
            CheckpointCorruptError: The file ends first.
        """
        buffer = memoryview(bytearray(min(_CHUNK, max(length, 1))))
        end = offset + length
        while offset < end:
            got = self.readinto_at(offset, buffer[: min(end - offset, len(buffer))])
            if got <= 0:
                raise self.truncated(end)
            yield buffer[:got]
            offset += got

    def crc32(self, offset: int, length: int, progress: Optional[Progress] = None) -> int:
        """CRC-32 of ``length`` bytes from ``offset``, read in chunks."""
        crc = 0
        for chunk in self.chunks(offset, length):
            crc = zlib.crc32(chunk, crc)
            if progress is not None:
                progress.update(len(chunk))
        return crc


class ReadWindow:
    """Reads of a source served from one read-ahead block while they fall inside it.

    For gathering many small stretches of a source that lie close together in
    order (a checkpoint's small tensor records): one read per :attr:`BLOCK`
    bytes instead of one per stretch. Stretches under :attr:`SMALL` bytes pay off.
    """

    SMALL: ClassVar[int] = _SMALL
    BLOCK: ClassVar[int] = _BLOCK

    def __init__(self, source: Source) -> None:
        self._source = source
        self._start = 0
        self._data = b""

    def read(self, offset: int, length: int) -> bytes:
        end = offset + length
        if offset < self._start or end > self._start + len(self._data):
            # Never past the end of the file holding offset (a shard of a sharded source).
            ahead = min(_BLOCK, self._source.segment_end(offset) - offset)
            # read_at raises on a source that ends before ``end``.
            self._data = self._source.read_at(offset, max(length, ahead))
            self._start = offset
        return self._data[offset - self._start : end - self._start]


class Sink:
    """An output file plus the byte count written so far, with in-kernel range copies.

    Args:
        file: A writable binary file (the one ``atomic_write`` yields).
        progress: Advanced by every byte copied from a source.

    Example:
        >>> import io
        >>> sink = Sink(io.BytesIO())
        >>> sink.write(b"abc"); sink.position
        3
    """

    def __init__(
        self, file: IO[bytes], progress: Optional[Progress] = None, *, write_back: bool = True
    ) -> None:
        self.file = file
        self.progress = progress
        try:
            self.position = file.tell()
        except (OSError, ValueError):
            self.position = 0
        self._fd: Optional[int]
        try:
            self._fd = file.fileno()
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            self._fd = None
        self._kernel_copy = self._fd is not None and hasattr(os, "copy_file_range")
        # Write-back hints only pay off when an fsync follows; without one they
        # would make the copy wait for the disk that the caller chose not to wait for.
        self._advise = write_back and self._fd is not None and hasattr(os, "posix_fadvise")
        self._written_back = self.position

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes."""
        self.file.write(data)
        self.position += len(data)

    def write_copied(self, data: bytes | bytearray | memoryview, copied: int) -> None:
        """Append ``data``, which carries ``copied`` bytes read from a source.

        Like :meth:`copy_from` for the progress bar and the disk write-back, for
        a caller that gathered many small copies (and what surrounds them) itself.
        """
        self.write(data)
        self._write_back()
        if self.progress is not None:
            self.progress.update(copied)

    def copy_from(self, source: Source, offset: int, length: int, *, crc: bool) -> int:
        """Append ``length`` bytes of ``source`` from ``offset``.

        Args:
            source: Where to read.
            offset: First byte to copy.
            length: How many bytes.
            crc: Also compute the CRC-32 of the bytes (reads them through user space).

        Returns:
            The CRC-32 when ``crc`` is true, else 0.

        Raises:
            CheckpointCorruptError: The source ends before ``offset + length``.
        """
        if length <= 0:
            return 0
        if length <= _SMALL:
            # A checkpoint with 100,000 tensors has mostly small records: one pread
            # into the buffered file beats a flush, a copy_file_range and a seek each.
            data = source.read_at(offset, length)
            self.write_copied(data, length)
            return zlib.crc32(data) if crc else 0
        kernel = not crc and self._kernel_copy and source.fd is not None
        if kernel and self._copy_in_kernel(source, offset, length):
            return 0
        return self._copy_through_buffer(source, offset, length, crc)

    def _write_back(self) -> None:
        # The output is fsynced at the end (atomic_write); asking the kernel to
        # start writing each finished stretch now overlaps that disk write with
        # the copy instead of doing it all at the end, and keeps the copy from
        # filling the page cache. POSIX_FADV_DONTNEED starts write-back of dirty
        # pages on Linux. Only a hint: the final fsync reports any I/O error.
        if not self._advise or self._fd is None:
            return
        pending = self.position - self._written_back
        if pending < _WRITE_BACK:
            return
        self.file.flush()
        try:
            os.posix_fadvise(self._fd, self._written_back, pending, os.POSIX_FADV_DONTNEED)
        except OSError:
            self._advise = False
        self._written_back = self.position

    def _copy_in_kernel(self, source: Source, offset: int, length: int) -> bool:
        assert self._fd is not None and source.fd is not None
        self.file.flush()
        start = self.position
        done = 0
        try:
            while done < length:
                count = os.copy_file_range(
                    source.fd,
                    self._fd,
                    min(length - done, _KERNEL_SLICE),
                    offset + done,
                    start + done,
                )
                if count == 0:
                    raise source.truncated(offset + length)
                done += count
                self.position = start + done
                self._write_back()
                if self.progress is not None:
                    self.progress.update(count)
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY or done:
                raise
            # This filesystem pair cannot copy in the kernel; read and write instead.
            self._kernel_copy = False
            self.position = start
            return False
        self.position = start + length
        # copy_file_range wrote through the descriptor at explicit offsets; move
        # the Python file object's own position past them.
        self.file.seek(self.position)
        return True

    def _copy_through_buffer(self, source: Source, offset: int, length: int, crc: bool) -> int:
        value = 0
        for chunk in source.chunks(offset, length):
            if crc:
                value = zlib.crc32(chunk, value)
            self.write_copied(chunk, len(chunk))
        return value
