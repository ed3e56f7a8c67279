"""ddpstate._crc: CRC-32 put together from pieces, and CRC-32 alongside a transfer."""

from __future__ import annotations

import io
import os
import signal
import threading
import zlib
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpstate import _crc, storage
from ddpstate._crc import PIECE, crc32_alongside, crc32_combine, crc32_of_pieces


@given(st.binary(max_size=300), st.binary(max_size=300))
def test_combine_equals_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@settings(max_examples=20)
@given(st.lists(st.binary(max_size=100), max_size=6))
def test_pieces_equal_the_whole(parts: list[bytes]) -> None:
    assert crc32_of_pieces((zlib.crc32(p), len(p)) for p in parts) == zlib.crc32(b"".join(parts))


@pytest.mark.parametrize("size", [0, 10, 2 * PIECE - 1, 2 * PIECE, 5 * PIECE + 12345])
def test_alongside_moves_every_byte_in_order_and_crcs_them(size: int) -> None:
    data = memoryview(os.urandom(size))
    out = bytearray()
    offsets: list[int] = []

    def move(offset: int, piece: memoryview) -> int:
        offsets.append(offset)
        out.extend(piece)
        return piece.nbytes

    moved, crc = crc32_alongside(data, move, crc=zlib.crc32(b"before"))
    assert moved == size and bytes(out) == bytes(data)
    assert crc == zlib.crc32(bytes(data), zlib.crc32(b"before"))
    assert offsets == ([0] if size < 2 * PIECE else list(range(0, size, PIECE)))


def test_a_short_move_ends_the_transfer_with_the_crc_of_what_moved() -> None:
    data = memoryview(os.urandom(4 * PIECE))

    def move(offset: int, piece: memoryview) -> int:
        return piece.nbytes if offset < 2 * PIECE else 100  # "end of file" in the third piece

    moved, crc = crc32_alongside(data, move)
    assert moved == 2 * PIECE + 100
    assert crc == zlib.crc32(data[:moved])


def test_a_failing_move_waits_for_the_helpers_then_raises() -> None:
    data = memoryview(bytearray(4 * PIECE))
    calls = []

    def move(offset: int, piece: memoryview) -> int:
        calls.append(offset)
        if offset >= 2 * PIECE:
            raise OSError("disk full")
        return piece.nbytes

    with pytest.raises(OSError, match="disk full"):
        crc32_alongside(data, move)
    assert calls == [0, PIECE, 2 * PIECE]


def test_a_forked_child_gets_its_own_helper_threads() -> None:
    """The helpers of the parent do not exist in a forked child: the child makes its own."""
    data = memoryview(os.urandom(3 * PIECE))
    crc32_alongside(data, lambda offset, piece: piece.nbytes)  # the parent's helpers start
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: would wait forever on the parent's threads
        try:
            ok = crc32_alongside(data, lambda o, p: p.nbytes)[1] == zlib.crc32(data)
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    done = threading.Event()
    got: list[bytes] = []

    def wait() -> None:
        got.append(os.read(read, 1))
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    try:
        assert done.wait(30), "the forked child hung on its parent's helper threads"
    finally:
        if not done.is_set():
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)
    assert got == [b"1"]
    assert _crc._pool is not None and _crc._pool[0] == os.getpid()


@settings(max_examples=30)
@given(st.binary(max_size=2000), st.integers(1, 300), st.none() | st.integers(0, 2500))
def test_size_and_crc32_reads_in_chunks_with_crcs_on_helper_threads(
    data: bytes, chunk: int, limit: Optional[int]
) -> None:
    want = data if limit is None else data[:limit]
    got = storage.size_and_crc32(io.BytesIO(data), chunk, limit)
    assert got == (len(want), zlib.crc32(want))
