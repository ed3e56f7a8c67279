"""A file's bytes into tensors on a device through two reused pinned host pieces.

Reading a whole file into host memory and then moving each tensor (``.to("cuda")``)
needs host memory for every byte at once (1 GiB for a 1 GiB file). Here the bytes go
through two host buffers of :data:`PIECE` bytes, pinned on CUDA: while one piece's
copy to the device runs (``non_blocking=True``), the next piece is read into the
other, and a buffer is reused only after its copy finished (a CUDA event). Host
memory stays at two pieces whatever the file's size. For another device (the CPU in
tests) the same steps run with plain buffers and synchronous copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Optional

import torch

__all__ = ["PIECE", "read_into", "read_into_tensors"]

#: Bytes per host piece: large enough that each read and copy runs at full speed,
#: small enough that two of them never matter next to the state.
PIECE = 32 << 20


def read_into(f: Any, target: memoryview) -> int:
    """Fill ``target`` from ``f`` where it stands; the bytes read (fewer at the end of ``f``).

    Example:
        >>> import io
        >>> from ddpstate._io.device_copy import read_into
        >>> target = bytearray(4)
        >>> read_into(io.BytesIO(b"abc"), memoryview(target)), bytes(target)
        (3, b'abc\\x00')
    """
    done = 0
    readinto = getattr(f, "readinto", None)
    while done < len(target):
        if readinto is not None:
            got = readinto(target[done:])
        else:
            chunk = f.read(len(target) - done)
            got = len(chunk)
            target[done : done + got] = chunk
        if not got:
            break
        done += got
    return done


class _Pieces:
    """Two host buffers, each reused once the copy out of it has finished."""

    def __init__(self, device: torch.device, size: int) -> None:
        cuda = device.type == "cuda"
        self.buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self.views = [b.numpy().data.cast("B") for b in self.buffers]
        self.stream = torch.cuda.current_stream(device) if cuda else None
        self.copied: list[Optional[Any]] = [None, None]  # the event of each buffer's last copy
        self.turn = 0

    def next(self) -> int:
        """The buffer to fill next, once the device has finished copying out of it."""
        self.turn ^= 1
        event = self.copied[self.turn]
        if event is not None:
            event.synchronize()
        return self.turn

    def copy(self, which: int, n: int, target: torch.Tensor) -> None:
        """``target`` (``n`` bytes) from the start of buffer ``which``, without waiting on CUDA."""
        target.copy_(self.buffers[which][:n], non_blocking=self.stream is not None)
        if self.stream is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
            self.copied[which] = event

    def finish(self) -> None:
        """Wait for every copy: the tensors are complete once this returns."""
        if self.stream is not None:
            self.stream.synchronize()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor on its device (the same memory)."""
    return tensor.reshape(-1).view(torch.uint8)


def read_into_tensors(
    f: Any, targets: Sequence[tuple[int, torch.Tensor]], *, piece: int = PIECE
) -> int:
    """Fill each tensor with the bytes at its offset in ``f``, through two host pieces.

    Args:
        f: A readable, seekable binary file.
        targets: ``(offset in f, tensor)`` pairs; contiguous tensors, all on one device.
        piece: Bytes per host buffer.

    Returns:
        How many of ``targets`` were filled, in order: ``len(targets)``, or the index of
        the first one that ``f`` ended in the middle of.

    Example:
        >>> import io, torch
        >>> from ddpstate._io.device_copy import read_into_tensors
        >>> a, b = torch.empty(3, dtype=torch.uint8), torch.empty(2, dtype=torch.int16)
        >>> read_into_tensors(io.BytesIO(bytes(range(8))), [(0, a), (4, b)], piece=3)
        2
        >>> a.tolist(), b.tolist()
        ([0, 1, 2], [1284, 1798])
    """
    devices = {t.device for _, t in targets}
    if not devices:
        return 0
    if len(devices) > 1:
        on = sorted(map(str, devices))
        raise ValueError(f"read_into_tensors: the tensors are on {on}, not on one device")
    device = devices.pop()
    pieces = _Pieces(device, piece)
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        try:
            for filled, (offset, tensor) in enumerate(targets):
                flat = _as_bytes(tensor)
                f.seek(offset)
                for start in range(0, flat.numel(), piece):
                    n = min(piece, flat.numel() - start)
                    which = pieces.next()
                    if read_into(f, pieces.views[which][:n]) < n:
                        return filled
                    pieces.copy(which, n, flat[start : start + n])
        finally:  # also on an error: the buffers are not freed under a running copy
            pieces.finish()
    return len(targets)
