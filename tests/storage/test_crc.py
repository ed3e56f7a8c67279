"""ddpstate._crc: the CRC-32 chosen, put together from pieces, alongside a transfer, in parallel."""

from __future__ import annotations

import io
import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import zlib
from typing import Any, Callable, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpstate import _crc, storage
from ddpstate._crc import PIECE, crc32_alongside, crc32_combine, crc32_of_pieces, crc32_parallel

# The CRC-32 libraries ddpstate depends on where they have wheels (pyproject.toml): the
# tests that compare against one run where it is installed (everywhere in CI).
try:
    import isal
    from isal import isal_zlib
except ImportError:
    isal = isal_zlib = None
try:
    import zlib_ng as zlib_ng_package
    from zlib_ng import zlib_ng
except ImportError:
    zlib_ng_package = zlib_ng = None
needs_both = pytest.mark.skipif(
    isal is None or zlib_ng is None, reason="isal or zlib-ng has no wheel for this platform"
)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


#: Every CRC-32 ddpstate may pick, each of which must give zlib's values.
IMPLEMENTATIONS: dict[str, Callable[..., int]] = {
    "zlib": zlib.crc32,
    **({"zlib-ng": zlib_ng.crc32} if zlib_ng is not None else {}),
    **({"isal": isal_zlib.crc32} if isal_zlib is not None else {}),
    "ddpstate": _crc.crc32,
}


def _data(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


# Sizes from empty to several MiB, cut anywhere: the libraries take different code paths
# by length (tails, alignment, folding loops), so piece boundaries are drawn, not chosen.
_sizes = st.one_of(st.integers(0, 300), st.integers(0, 3 * PIECE // 2))


@settings(max_examples=40, deadline=None)
@given(_sizes, st.integers(0, 2**32 - 1), st.lists(st.floats(0, 1), max_size=5), st.integers())
def test_every_implementation_gives_zlibs_crc_whole_and_in_pieces(
    size: int, start: int, cuts: list[float], seed: int
) -> None:
    data = _data(size, seed)
    want = zlib.crc32(data, start)
    bounds = [0, *sorted(int(c * size) for c in cuts), size]
    for name, crc32 in IMPLEMENTATIONS.items():
        assert crc32(data, start) == want, name
        crc = start
        for a, b in itertools.pairwise(bounds):
            crc = crc32(data[a:b], crc)  # continued piece by piece
        assert crc == want, name
    pieces = [(_crc.crc32(data[a:b]), b - a) for a, b in itertools.pairwise(bounds)]
    assert crc32_of_pieces(pieces) == zlib.crc32(data)


@settings(max_examples=40, deadline=None)
@given(_sizes, st.integers(1, 9), st.integers(0, 2**32 - 1), st.integers())
def test_crc32_parallel_gives_zlibs_crc_for_any_cut(
    size: int, threads: int, start: int, seed: int
) -> None:
    data = _data(size, seed)
    assert crc32_parallel(data, start, threads=threads) == zlib.crc32(data, start)
    assert crc32_parallel(memoryview(data), start) == zlib.crc32(data, start)


@pytest.mark.parametrize("size", [0, 1, 2 * PIECE - 1, 2 * PIECE, 5 * PIECE + 12345])
def test_crc32_parallel_takes_any_buffer_and_the_sizes_around_its_rule(size: int) -> None:
    data = bytearray(_data(size, size))
    assert crc32_parallel(data, 99) == zlib.crc32(data, 99)
    as_floats = memoryview(data[: size - size % 4]).cast("f")  # not a byte format
    assert crc32_parallel(as_floats) == zlib.crc32(as_floats)


@needs_both
@settings(max_examples=200)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(1, 2**45))
def test_the_libraries_combine_and_ddpstates_own_agree(crc1: int, crc2: int, len2: int) -> None:
    """The GF(2) arithmetic kept for a zlib-only platform is the libraries' crc32_combine."""
    own = _crc._multiply(_crc._x_to_8n(len2), crc1) ^ crc2
    assert (
        own == isal_zlib.crc32_combine(crc1, crc2, len2) == zlib_ng.crc32_combine(crc1, crc2, len2)
    )
    assert crc32_combine(crc1, crc2, len2) == own


@needs_both
def test_the_fastest_installed_crc_is_chosen() -> None:
    assert (_crc.crc32, _crc.IMPLEMENTATION) == (isal_zlib.crc32, f"isal {isal.__version__}")


_CHOSEN = """
import sys, zlib
for name in sys.argv[1:]:
    sys.modules[name] = None  # the real import machinery then raises ImportError for it
from ddpstate import _crc
data = bytes(range(256)) * 40000 + b"tail"
assert _crc.crc32_parallel(data, 5, threads=3) == zlib.crc32(data, 5)
assert _crc.crc32_of_pieces([(zlib.crc32(data[:7]), 7), (zlib.crc32(data[7:]), len(data) - 7)]) \
    == zlib.crc32(data)
print(_crc.IMPLEMENTATION)
"""


@pytest.mark.parametrize(
    ("blocked", "chosen"),
    [
        ((), f"isal {getattr(isal, '__version__', '')}"),
        (("isal",), f"zlib-ng {getattr(zlib_ng_package, '__version__', '')}"),
        (("isal", "zlib_ng"), f"zlib {zlib.ZLIB_RUNTIME_VERSION}"),
    ],
)
@needs_both
def test_without_isal_zlib_ng_is_chosen_then_zlib(blocked: tuple[str, ...], chosen: str) -> None:
    env: dict[str, Any] = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, "-c", _CHOSEN, *blocked],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == chosen
