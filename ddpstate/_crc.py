"""CRC-32, fast: one implementation chosen at import, large buffers checked on several threads.

Every checksum ddpstate records or checks is zlib's CRC-32, so manifests and
zip records keep their meaning whichever library computes it. :data:`crc32` is
the fastest one installed, chosen once here and nowhere else: ``isal``
(Intel's ISA-L, a dependency where it has wheels), then ``zlib-ng``, then the
standard library's ``zlib`` (:data:`IMPLEMENTATION` names it; ``ddpstate
--version`` prints it). Each releases the GIL, so :func:`crc32_parallel` checks
a large buffer in pieces on helper threads and :func:`crc32_combine` joins the
pieces' CRCs from their lengths alone (zlib's ``crc32_combine``: the library's
where it has one; Python's ``zlib`` has none, so there it is done with
polynomial arithmetic over GF(2): ``len2`` zero bytes appended to the first
piece multiply its CRC by ``x^(8*len2)`` modulo the CRC polynomial).
Torch-free.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
import zlib
from collections.abc import Callable, Iterable
from typing import Any, Optional

__all__ = [
    "IMPLEMENTATION",
    "MAX_THREADS",
    "PIECE",
    "cpus",
    "crc32",
    "crc32_alongside",
    "crc32_combine",
    "crc32_later",
    "crc32_of_pieces",
    "crc32_parallel",
]

_Crc32 = Callable[..., int]  # (data, crc=0) -> the CRC-32 of data continuing crc
_Combine = Callable[[int, int, int], int]


def _choose() -> tuple[_Crc32, Optional[_Combine], str]:
    """The fastest CRC-32 installed: isal, then zlib-ng, then zlib (all give zlib's values)."""
    try:
        import isal  # type: ignore[import-not-found,unused-ignore]
        from isal import isal_zlib  # type: ignore[import-not-found,unused-ignore]

        return isal_zlib.crc32, isal_zlib.crc32_combine, f"isal {isal.__version__}"
    except ImportError:  # no wheel for this platform (ppc64le, s390x, Windows on ARM...)
        pass
    try:
        import zlib_ng  # type: ignore[import-not-found,unused-ignore]
        from zlib_ng import zlib_ng as ng  # type: ignore[import-not-found,unused-ignore]

        return ng.crc32, ng.crc32_combine, f"zlib-ng {zlib_ng.__version__}"
    except ImportError:
        pass
    return zlib.crc32, None, f"zlib {zlib.ZLIB_RUNTIME_VERSION}"


_library_combine: Optional[_Combine]
#: The CRC-32 every checksum goes through: ``crc32(data, crc=0)``, as ``zlib.crc32``.
crc32: _Crc32
#: Which library :data:`crc32` is, with its version, e.g. ``"isal 1.9.1"``.
IMPLEMENTATION: str
crc32, _library_combine, IMPLEMENTATION = _choose()

# zlib's CRC-32 polynomial, bit-reversed: bit 31 stands for x^0, bit 0 for x^31.
_POLY = 0xEDB88320
_X0 = 1 << 31  # the polynomial 1


def _multiply(a: int, b: int) -> int:
    """``a(x) * b(x)`` modulo the CRC polynomial, both in the reversed bit order."""
    product = 0
    bit = _X0
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    """``x^(2^k)`` modulo the polynomial for k = 0..31 (they repeat with period 32 onwards)."""
    table = [_X0 >> 1]  # x^1
    for _ in range(31):
        table.append(_multiply(table[-1], table[-1]))
    return table


_X_TO_2_TO_K = _powers()


def _x_to_8n(n: int) -> int:
    """``x^(8n)`` modulo the polynomial: the operator "append n zero bytes" on a CRC."""
    result = _X0
    k = 3  # 8n = n * 2^3
    while n:
        if n & 1:
            result = _multiply(_X_TO_2_TO_K[k & 31], result)
        n >>= 1
        k += 1
    return result


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``len(b)``.

    Args:
        crc1: ``zlib.crc32`` of the first piece.
        crc2: ``zlib.crc32`` of the second piece.
        len2: The second piece's length in bytes (0 or more).

    Returns:
        ``zlib.crc32(a + b)``, without reading ``a`` or ``b``.

    Raises:
        ValueError: ``len2`` is negative.

    Example:
        >>> import zlib
        >>> from ddpstate._crc import crc32_combine
        >>> a, b = b"step folder ", b"checksums"
        >>> crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
        True
    """
    if len2 < 0:
        raise ValueError(f"crc32_combine: len2 must be 0 or more, not {len2}")
    if len2 == 0:
        return crc1
    if _library_combine is not None:
        return _library_combine(crc1 & 0xFFFFFFFF, crc2 & 0xFFFFFFFF, len2)
    return _multiply(_x_to_8n(len2), crc1 & 0xFFFFFFFF) ^ (crc2 & 0xFFFFFFFF)


def crc32_of_pieces(pieces: Iterable[tuple[int, int]]) -> int:
    """The CRC-32 of consecutive pieces given as ``(crc32, length)`` in file order.

    Args:
        pieces: Each piece's ``zlib.crc32`` and length, first piece first.

    Returns:
        ``zlib.crc32`` of the pieces' concatenation (0 for no pieces).

    Example:
        >>> import zlib
        >>> from ddpstate._crc import crc32_of_pieces
        >>> data = bytes(range(256)) * 40
        >>> parts = [data[:1000], data[1000:1000], data[1000:]]
        >>> crc32_of_pieces((zlib.crc32(p), len(p)) for p in parts) == zlib.crc32(data)
        True
    """
    crc = 0
    for piece_crc, length in pieces:
        crc = crc32_combine(crc, piece_crc, length)
    return crc


#: A large transfer is CRC-32'd in pieces this size, each while the next one moves.
PIECE = 4 << 20
_pool: Optional[tuple[int, concurrent.futures.ThreadPoolExecutor]] = None
_pool_lock = threading.Lock()


def cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one).

    Example:
        >>> from ddpstate._crc import cpus
        >>> cpus() >= 1
        True
    """
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


#: The most helper threads a process checksums with (memory bandwidth runs out first).
MAX_THREADS = 8


def _helpers() -> concurrent.futures.ThreadPoolExecutor:
    """This process's CRC threads (made again in a forked child, which has none of them)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            workers = min(MAX_THREADS, cpus())
            _pool = (os.getpid(), concurrent.futures.ThreadPoolExecutor(workers, "ddpstate-crc"))
        return _pool[1]


def crc32_later(data: Any) -> concurrent.futures.Future[int]:
    """The CRC-32 of ``data`` (bytes the caller no longer changes), on a helper thread.

    Example:
        >>> import zlib
        >>> from ddpstate._crc import crc32_later
        >>> crc32_later(b"abc").result() == zlib.crc32(b"abc")
        True
    """
    return _helpers().submit(crc32, data, 0)


def crc32_alongside(
    view: memoryview, move: Callable[[int, memoryview], int], crc: int = 0
) -> tuple[int, int]:
    """Move ``view``'s bytes in pieces (a read into it, a write from it), CRC-32ing them.

    ``move(offset, piece)`` moves one piece and returns how many bytes it moved; a
    short move ends the transfer. Each piece moved is CRC-32'd on a helper thread
    while the next one moves (``zlib.crc32`` and file I/O both release the GIL),
    so a spare core hides the checksum; the pieces' CRCs are put together with
    :func:`crc32_combine`. All of it is done before this returns, so ``view`` may
    be a caller's buffer. A view under two pieces is moved and CRC-32'd inline.

    Args:
        view: The bytes to move (a byte-format memoryview).
        move: Moves one piece at an offset into ``view``.
        crc: The CRC-32 to continue (of the bytes before ``view``).

    Returns:
        ``(bytes moved, CRC-32 of the bytes before and those moved)``.

    Example:
        >>> import zlib
        >>> from ddpstate._crc import crc32_alongside
        >>> data = memoryview(bytes(range(256)) * 40000)
        >>> out = bytearray()
        >>> crc32_alongside(data, lambda at, piece: out.extend(piece) or len(piece))[1] == (
        ...     zlib.crc32(data))
        True
    """
    if view.nbytes < 2 * PIECE:
        moved = move(0, view)
        return moved, crc32(view[:moved], crc)
    tasks: list[tuple[concurrent.futures.Future[int], int]] = []
    done = 0
    try:
        while done < view.nbytes:
            piece = view[done : done + PIECE]
            moved = move(done, piece)
            tasks.append((crc32_later(piece[:moved]), moved))
            done += moved
            if moved < piece.nbytes:
                break
    finally:  # the helpers read view: wait for them, also when a move failed
        crcs = [(task.result(), n) for task, n in tasks]
    for piece_crc, n in crcs:
        crc = crc32_combine(crc, piece_crc, n)
    return done, crc


def crc32_parallel(data: Any, crc: int = 0, *, threads: Optional[int] = None) -> int:
    """The CRC-32 of a buffer already in memory, in pieces on several threads when it pays.

    A buffer of at least two :data:`PIECE` s on a process with more than one CPU is
    cut into one equal run per thread (at most :data:`MAX_THREADS`); the caller's
    thread checksums the first while helpers do the rest, and :func:`crc32_combine`
    joins them. Otherwise (one CPU, a small buffer) it is one :data:`crc32` call, so
    it never costs more than that.

    Args:
        data: A C-contiguous buffer (bytes, bytearray, memoryview, a NumPy array).
        crc: The CRC-32 to continue (of the bytes before ``data``).
        threads: Cut into this many runs whatever the size (None: the rule above).

    Returns:
        ``zlib.crc32(data, crc)``.

    Example:
        >>> import zlib
        >>> from ddpstate._crc import PIECE, crc32_parallel
        >>> data = bytes(range(256)) * (PIECE // 64)
        >>> crc32_parallel(data, 7) == zlib.crc32(data, 7)
        True
    """
    view = memoryview(data).cast("B")
    if threads is None:
        threads = min(cpus(), MAX_THREADS, view.nbytes // PIECE)
    if threads < 2:
        return crc32(view, crc)
    bounds = [view.nbytes * i // threads for i in range(threads + 1)]
    later = [
        (_helpers().submit(crc32, view[a:b], 0), b - a) for a, b in itertools.pairwise(bounds[1:])
    ]
    try:
        crc = crc32(view[: bounds[1]], crc)
    finally:  # the helpers read data: wait for them, also when this thread failed
        crcs = [(task.result(), n) for task, n in later]
    for piece_crc, n in crcs:
        crc = crc32_combine(crc, piece_crc, n)
    return crc
