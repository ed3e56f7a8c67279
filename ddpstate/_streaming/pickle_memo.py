"""Checking a pickle's memo indexes before an unpickler allocates for them."""

from __future__ import annotations

import os
import pickle
import pickletools
from typing import IO

__all__ = ["check_memo_indexes", "opcode_end"]

# The opcodes the walk looks at, as the byte values it compares (data[pos] is an int).
_STOP = pickle.STOP[0]
_PUT = pickle.PUT[0]
_LONG_BINPUT = pickle.LONG_BINPUT[0]
_GLOBAL = pickle.GLOBAL[0]
_INST = pickle.INST[0]

# opcode byte -> pickletools' argument size code (n >= 0: fixed; < 0: variable).
_OPCODE_ARGS = {ord(op.code): op.arg.n if op.arg is not None else 0 for op in pickletools.opcodes}
# Memo slots allowed beyond a PUT's byte position: at most 16 MiB of memo table.
_MEMO_SLACK = 1 << 20
_LENGTH_WIDTH = {-2: 1, -3: 4, -4: 4, -5: 8}  # pickletools codes of length-prefixed args


def opcode_end(data: bytes, pos: int) -> int:
    """Where the opcode at ``pos`` of a well-formed pickle ends, its argument included.

    Example:
        >>> opcode_end(pickle.dumps("ab", protocol=2), 2)
        9
    """
    code = data[pos]
    n = _OPCODE_ARGS[code]
    if n >= 0:
        return pos + 1 + n
    if n == -1:  # up to a newline (two lines for GLOBAL and INST)
        end = data.find(b"\n", pos + 1)
        return (data.find(b"\n", end + 1) if code in (_GLOBAL, _INST) else end) + 1
    width = _LENGTH_WIDTH[n]
    length = int.from_bytes(data[pos + 1 : pos + 1 + width], "little", signed=n == -3)
    return pos + 1 + width + length


def _memo_error(name: str, at: int, index: int) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(
        f"{name} at byte {at} names memo slot {index}, far more than the pickle could have "
        f"filled by then"
    )


def _walk_memo(data: bytes, pos: int, available: int) -> tuple[bool, int]:
    """Check the PUT/LONG_BINPUT opcodes of the pickle in ``data`` from ``pos`` on.

    Returns ``(True, end)`` once STOP (or something the unpickler itself will reject)
    is reached, or ``(False, at)`` when the opcode starting at ``at`` runs past the
    data. A pickler numbers memo entries 0, 1, 2... and each PUT takes at least one
    byte, so an index beyond the opcode's position (plus a slack for picklers that
    reuse a memo across dumps) is damage: UnpicklingError. So is an argument claiming
    more bytes than the ``available`` ones the file still holds (the unpickler would
    ask the file for all of them at once).
    """
    args = _OPCODE_ARGS
    widths = _LENGTH_WIDTH
    size = len(data)
    limit = _MEMO_SLACK
    at = pos
    while pos < size:
        at = pos
        code = data[pos]
        n = args.get(code)
        if n is None or code == _STOP:  # not an opcode (the unpickler reports it)
            return True, pos
        pos += 1
        if n >= 0:
            if code == _LONG_BINPUT:
                if pos + 4 > size:
                    return False, at
                index = int.from_bytes(data[pos : pos + 4], "little")
                if index > pos + limit:
                    raise _memo_error("LONG_BINPUT", at, index)
            pos += n
        elif n == -1:  # up to a newline (two lines for GLOBAL and INST)
            end = data.find(b"\n", pos)
            if end >= 0 and code in (_GLOBAL, _INST):
                end = data.find(b"\n", end + 1)
            if end < 0:
                return False, at
            if code == _PUT:
                text = data[pos:end]
                if text.isdigit() and int(text) > pos + limit:
                    raise _memo_error("PUT", at, int(text))
            pos = end + 1
        else:
            width = widths.get(n)
            if width is None:
                return True, at
            if pos + width > size:
                return False, at
            length = int.from_bytes(data[pos : pos + width], "little", signed=n == -3)
            if length < 0:
                return True, at
            pos += width + length
            if pos > available:
                raise pickle.UnpicklingError(
                    f"the argument at byte {at} claims {length} bytes, but only "
                    f"{max(0, available - at - 1 - width)} remain in the file"
                )
    # Past the end: resume at the opcode whose argument runs beyond the data.
    return False, pos if pos <= size else at


def check_memo_indexes(file: IO[bytes]) -> None:
    """Refuse a pickle whose PUT opcodes name memo slots it cannot have filled.

    CPython's C unpickler grows its memo table to twice the largest index a PUT or
    LONG_BINPUT names and zero-fills it, so one damaged 4-byte index can make it
    allocate and touch gigabytes before anything else is noticed. This walks the
    opcodes first (reading the pickle in growing chunks, at most twice its size in
    memory) and returns the file to where it was.

    Raises:
        pickle.UnpicklingError: A memo index is far beyond its own byte position, or
            an argument claims more bytes than the file has left.
    """
    start = file.tell()
    available = file.seek(0, os.SEEK_END) - start
    file.seek(start)
    data = b""
    pos = 0
    try:
        while True:
            done, pos = _walk_memo(data, pos, available)
            if done:
                return
            chunk = file.read(max(1 << 20, len(data)))
            if not chunk:
                return  # truncated: the unpickler reports it
            data += chunk
    finally:
        file.seek(start)
