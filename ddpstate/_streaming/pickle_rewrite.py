"""Rewriting a torch.save pickle by copying its opcodes through, changing only key strings.

``convert`` used to rebuild ``data.pkl`` from the scanned object tree with a
pure-Python pickler: about 100 µs a tensor. For the pickles torch.save writes
(protocol 2, CPython's pickler) that pickler reproduces the source byte for byte
(``pickle_emit`` was built to), so a key rename only has to change the bytes of
the key strings. :func:`walk` checks, in one pass over the opcodes, that the
pickle has the shape under which that holds, and :func:`rename_keys` then
splices the new key strings in (and a state dict's changed ``_metadata``,
re-emitted on its own, with the memo slots after it renumbered). Anything outside
that shape (other protocols, other globals, shared containers, memo slots out of
order, one-character strings the unpickler would merge) makes :func:`walk` or
:func:`rename_keys` return None, and the caller goes back to the scan-and-re-emit
path. No opcode is interpreted beyond what this needs; the full scan
(``pickle_scan``) still reads the same bytes for its safety and damage checks.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import pickle
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, Optional

from ddpstate._streaming.pickle_emit import dump_within, get_op, int_op, put_op
from ddpstate._streaming.pickle_memo import opcode_end
from ddpstate._streaming.pickle_scan import STORAGE_DTYPE

_PROTO_2 = pickle.PROTO + b"\x02"
_STOP = pickle.STOP[0]
_PUT_1 = pickle.BINPUT[0]
_PUT_4 = pickle.LONG_BINPUT[0]
_GET_1 = pickle.BINGET[0]
_GET_4 = pickle.LONG_BINGET[0]
_INT_1 = pickle.BININT1[0]
_INT_2 = pickle.BININT2[0]
_LONG_1 = pickle.LONG1[0]
_FLOAT = pickle.BINFLOAT[0]
_EMPTY_TUPLE = pickle.EMPTY_TUPLE[0]
_SETITEMS = pickle.SETITEMS[0]
_REDUCE = pickle.REDUCE[0]
# Opcodes CPython's pickler writes at protocol 2 for dicts, lists, tuples, str, int,
# float, bool, None, tensors and storages, and no argument: the change in the number
# of stack items since the last MARK. Opcodes it writes for nothing a state dict
# holds (text forms, bytes, POP/DUP of recursive tuples, NEWOBJ, extensions) are left
# out: a pickle using them takes the re-emitting path.
_PUSHES: dict[int, int] = {
    pickle.EMPTY_TUPLE[0]: 1, pickle.EMPTY_LIST[0]: 1, pickle.EMPTY_DICT[0]: 1,
    pickle.NONE[0]: 1, pickle.NEWTRUE[0]: 1, pickle.NEWFALSE[0]: 1,
    pickle.TUPLE1[0]: 0, pickle.TUPLE2[0]: -1, pickle.TUPLE3[0]: -2,
    pickle.SETITEM[0]: -2, pickle.APPEND[0]: -1, pickle.REDUCE[0]: -1,
    pickle.BUILD[0]: -1, pickle.BINPERSID[0]: 0,
}  # fmt: skip
# Opcodes whose result the pickler memoizes right away (a PUT must follow, and
# only these are followed by one).
_MEMOIZED = frozenset(
    op[0]
    for op in (
        pickle.BINUNICODE, pickle.GLOBAL, pickle.REDUCE, pickle.EMPTY_DICT, pickle.EMPTY_LIST,
        pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3,
    )
)  # fmt: skip
# Empty containers: a memo slot of one fetched again means a shared container.
_CONTAINERS = frozenset((pickle.EMPTY_DICT[0], pickle.EMPTY_LIST[0]))

# The globals ``pickle_emit`` writes back under the very name it read.
_GLOBALS = frozenset(
    [
        "collections.OrderedDict",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "torch.storage.UntypedStorage",
    ]
    + [f"torch.{name}" for name in STORAGE_DTYPE if name != "UntypedStorage"]
)


@dataclasses.dataclass(frozen=True)
class PickleLayout:
    """Where a pickle's strings lie, from a walk that found it in torch.save's own shape.

    Attributes:
        positions: Where each BINUNICODE opcode starts (arrays: 16 bytes a string).
        slots: The memo slot of each of those strings.
        shared: Memo slots some GET refers to.
        edits: ``(position, bytes replaced, replacement)`` that turn the batches of
            exact dicts and lists, which CPython's C pickler writes its own way (an
            empty ``MARK SETITEMS`` after a full batch, a last batch of one item
            with a MARK), into the form its Python pickler writes. Neither changes
            what the pickle builds or its memo.
        globals: ``(position, qualname, memo slot)`` of each GLOBAL opcode.
    """

    positions: array.array[int]
    slots: array.array[int]
    shared: frozenset[int]
    edits: list[tuple[int, int, bytes]]
    globals: list[tuple[int, str, int]] = dataclasses.field(default_factory=list)

    def strings(self) -> Iterator[tuple[int, int]]:
        """``(position, memo slot)`` of each string, in the order they are written."""
        return zip(self.positions, self.slots, strict=True)


@dataclasses.dataclass(slots=True)
class _Walk:
    """What one :func:`walk` has seen so far, and a handler per family of opcodes with an argument.

    Each handler reads the opcode at ``pos`` and returns where it ends, or -1 when
    the pickle is not in torch.save's shape.
    """

    data: bytes
    positions: array.array[int] = dataclasses.field(default_factory=lambda: array.array("q"))
    slots: array.array[int] = dataclasses.field(default_factory=lambda: array.array("q"))
    edits: list[tuple[int, int, bytes]] = dataclasses.field(default_factory=list)
    shared: set[int] = dataclasses.field(default_factory=set)
    # Memo slots of dicts, lists and OrderedDict()s.
    containers: set[int] = dataclasses.field(default_factory=set)
    short: set[bytes] = dataclasses.field(default_factory=set)  # strings of at most one char
    globals: list[tuple[int, str, int]] = dataclasses.field(default_factory=list)
    # (position of the MARK, items before it) of each open MARK.
    marks: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    items: int = 0  # stack items since the last MARK
    memo: int = 0  # the next memo slot
    pending: bool = False  # the last opcode's result must be memoized now

    def number(self, code: int, pos: int) -> int:
        self.items += 1
        if code == _INT_1:
            return pos + 2
        if code == _FLOAT:
            return pos + 9
        data = self.data
        start = pos + 2 if code == _LONG_1 else pos + 1
        end = start + (data[pos + 1] if code == _LONG_1 else 2 if code == _INT_2 else 4)
        value = int.from_bytes(data[start:end], "little", signed=code != _INT_2)
        # Only the shortest form, the one the pickler chooses, writes these bytes back.
        return end if int_op(value) == data[pos:end] else -1

    def fetch(self, code: int, pos: int) -> int:
        data = self.data
        if code == _GET_1:
            index, end = (data[pos + 1] if pos + 1 < len(data) else self.memo), pos + 2
        else:
            index, end = int.from_bytes(data[pos + 1 : pos + 5], "little"), pos + 5
            if index < 256:
                return -1
        if index >= self.memo:
            return -1
        self.shared.add(index)
        self.items += 1
        return end

    def string(self, code: int, pos: int) -> int:
        data = self.data
        length = int.from_bytes(data[pos + 1 : pos + 5], "little")
        end = pos + 5 + length
        if end > len(data):
            return -1
        if length <= 2:
            # The unpickler shares every string of at most one character, which the
            # pickler then memoizes: each may be written once only.
            text = data[pos + 5 : end]
            try:
                chars = len(text.decode("utf-8", "surrogatepass"))
            except UnicodeDecodeError:
                return -1  # damaged: the scan says so
            if chars <= 1:
                if text in self.short:
                    return -1
                self.short.add(text)
        self.positions.append(pos)
        self.slots.append(self.memo)
        self.pending = True
        self.items += 1
        return end

    def mark(self, code: int, pos: int) -> int:
        self.marks.append((pos, self.items))
        self.items = 0
        return pos + 1

    def batch(self, code: int, pos: int) -> int:
        """SETITEMS or APPENDS: an empty batch dropped, a batch of one item made SETITEM/APPEND."""
        if not self.marks:
            return -1
        mark, before = self.marks.pop()
        single = 2 if code == _SETITEMS else 1
        if self.items == 0:
            self.edits += [(mark, 1, b""), (pos, 1, b"")]
        elif self.items == single:
            one = pickle.SETITEM if code == _SETITEMS else pickle.APPEND
            self.edits += [(mark, 1, b""), (pos, 1, one)]
        self.items = before
        return pos + 1

    def mark_tuple(self, code: int, pos: int) -> int:
        if not self.marks or self.items <= 3:  # shorter ones have opcodes of their own
            return -1
        self.items = self.marks.pop()[1] + 1
        self.pending = True
        return pos + 1

    def global_name(self, code: int, pos: int) -> int:
        data = self.data
        end = data.find(b"\n", data.find(b"\n", pos + 1) + 1)
        if end < 0:
            return -1
        qualname = data[pos + 1 : end].replace(b"\n", b".").decode("utf-8", "replace")
        if qualname not in _GLOBALS or any(name == qualname for _, name, _ in self.globals):
            return -1
        self.globals.append((pos, qualname, self.memo))
        self.pending = True
        self.items += 1
        return end + 1

    def layout(self) -> Optional[PickleLayout]:
        """The layout, once STOP is reached; None if a MARK is open or a container shared."""
        if self.marks or self.shared & self.containers:
            return None
        return PickleLayout(
            self.positions, self.slots, frozenset(self.shared), self.edits, self.globals
        )


_HANDLERS: dict[int, Callable[[_Walk, int, int], int]] = {
    **dict.fromkeys((_INT_1, _INT_2, pickle.BININT[0], _LONG_1, _FLOAT), _Walk.number),
    **dict.fromkeys((_GET_1, _GET_4), _Walk.fetch),
    pickle.BINUNICODE[0]: _Walk.string,
    pickle.MARK[0]: _Walk.mark,
    **dict.fromkeys((_SETITEMS, pickle.APPENDS[0]), _Walk.batch),
    pickle.TUPLE[0]: _Walk.mark_tuple,
    pickle.GLOBAL[0]: _Walk.global_name,
}


def walk(data: bytes) -> Optional[PickleLayout]:
    """Check that ``data`` is a pickle as torch.save writes it, and note where its strings are.

    The conditions make re-emitting the scanned tree give ``data`` back (after
    the batch edits): protocol 2; only the opcodes listed above; memo slots filled
    0, 1, 2... right after each object the pickler memoizes; each global named
    once and one of the tensor, storage and OrderedDict globals; ints and tuples
    in their shortest form; no dict, list or no-argument call result fetched from
    the memo (a copy of it would be written apart); each string of at most one
    character written once (the unpickler returns one shared object for all of
    them, which a pickler memoizes). The memo checks cover
    :func:`ddpstate._streaming.pickle_memo.check_memo_indexes` and more.

    Args:
        data: The bytes of ``data.pkl``.

    Returns:
        The layout, or None when the pickle is not in that shape (or damaged).

    Example:
        >>> import pickle
        >>> list(walk(pickle.dumps({"a.w": 1, "b.w": 2}, protocol=2)).strings())
        [(6, 1), (18, 2)]
        >>> walk(pickle.dumps({"a": 1}, protocol=4)) is None
        True
    """
    if not data.startswith(_PROTO_2):
        return None
    state = _Walk(data)
    handlers, pushes, memoized, containers = _HANDLERS, _PUSHES, _MEMOIZED, _CONTAINERS
    size = len(data)
    pos = 2
    previous = -1
    # `while True`, not `while pos < size`: CPython 3.11 starts specializing a
    # running loop's bytecode on unconditional backward jumps only, and walk runs
    # once per file (about 20 % slower unspecialized).
    while True:
        if pos >= size:
            return None
        code = data[pos]
        effect = pushes.get(code)
        if effect is not None:  # no argument: only the stack and the memo change
            state.items += effect
            pos += 1
            if code in memoized:
                state.pending = True
                if code in containers or (code == _REDUCE and previous == _EMPTY_TUPLE):
                    state.containers.add(state.memo)  # OrderedDict() is a container too
        elif code == _STOP:
            return state.layout() if pos + 1 == size else None
        else:
            handler = handlers.get(code)
            if handler is None:
                return None  # a PUT here memoizes nothing the pickler would
            pos = handler(state, code, pos)
            if pos < 0:
                return None
        previous = code
        if not state.pending:
            continue
        # The PUT the pickler writes right after each object it memoizes, to the
        # next slot: one byte below 256, four from there. Read here rather than as
        # an opcode of its own: a third of all opcodes.
        memo = state.memo
        if memo < 256:
            if pos + 1 >= size or data[pos] != _PUT_1 or data[pos + 1] != memo:
                return None
            pos += 2
        else:
            if pos + 5 > size or data[pos] != _PUT_4:
                return None
            if int.from_bytes(data[pos + 1 : pos + 5], "little") != memo:
                return None
            pos += 5
        state.memo = memo + 1
        state.pending = False


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _string_at(data: bytes, pos: int) -> bytes:
    length = int.from_bytes(data[pos + 1 : pos + 5], "little")
    return data[pos + 5 : pos + 5 + length]


def _strings_in(obj: Any, out: set[str], depth: int = 0) -> bool:
    """Collect the str objects of a small tree of dicts, lists and scalars; False if other."""
    if depth > 20:
        return False
    if isinstance(obj, str):
        out.add(obj)
        return True
    if obj is None or type(obj) in (int, float, bool):
        return True
    if type(obj) in (dict, collections.OrderedDict):
        return all(
            _strings_in(k, out, depth + 1) and _strings_in(v, out, depth + 1)
            for k, v in obj.items()
        )
    if type(obj) in (list, tuple):
        return all(_strings_in(v, out, depth + 1) for v in obj)
    return False


def _splice_state(
    data: bytes, layout: PickleLayout, old_state: Any, new_state: Any
) -> Optional[list[tuple[int, int, bytes]]]:
    """Edits that replace a state dict's BUILD state (its ``_metadata``) by ``new_state``.

    The state is found by its ``_metadata`` key (written once in the whole
    pickle), re-emitted at that point of the memo as the old one must have been
    (checked against the bytes there), replaced by the new one, and every memo
    slot after it renumbered. None when any of that cannot be shown.
    """
    found = [
        (pos, index) for pos, index in layout.strings() if _string_at(data, pos) == b"_metadata"
    ]
    if len(found) != 1:
        return None
    name_pos, name_slot = found[0]
    first = name_slot - 1  # the state dict's own slot, just before its key
    start = name_pos - len(put_op(first)) - 1
    if start < 0 or data[start:name_pos] != pickle.EMPTY_DICT + put_op(first):
        return None
    texts: set[str] = set()
    if not (_strings_in(old_state, texts) and _strings_in(new_state, texts)):
        return None
    wanted = {_encode(t): t for t in texts}
    memo: dict[int, Any] = {}
    for pos, _ in layout.strings():
        if pos >= start:
            break
        if _string_at(data, pos) in wanted:
            # The same text before the state: an object the state may share, or not
            # (re-emitting writes nn.Sequential's "0" afresh after the storage key
            # "0"); which one depends on object identity, so re-emit instead.
            return None
    global_slots = {name: index for pos, name, index in layout.globals if pos < start}
    if "collections.OrderedDict" in global_slots:
        # The tree holds real OrderedDicts; the pickler memoized their class there.
        ordered = collections.OrderedDict
        memo[id(ordered)] = (global_slots["collections.OrderedDict"], ordered)
    old, old_count = dump_within(old_state, first, memo, global_slots)
    old += pickle.BUILD
    end = start + len(old)
    if data[start:end] != old:
        return None
    new, new_count = dump_within(new_state, first, memo, global_slots)
    edits = [(start, len(old), new + pickle.BUILD)]
    after = first + old_count
    delta = new_count - old_count
    pos = end
    size = len(data)
    while pos < size:
        code = data[pos]
        stop = opcode_end(data, pos)
        if code in (_PUT_1, _PUT_4, _GET_1, _GET_4):
            index = int.from_bytes(data[pos + 1 : stop], "little")
            if first <= index < after:
                return None  # an object of the old state used again later
            if index >= after and delta:
                renumbered = (put_op if code in (_PUT_1, _PUT_4) else get_op)(index + delta)
                edits.append((pos, stop - pos, renumbered))
        pos = stop
    return edits


def rename_keys(
    data: bytes,
    layout: PickleLayout,
    renames: Sequence[tuple[str, str]],
    state: Optional[tuple[Any, Any]] = None,
) -> Optional[bytes]:
    """``data`` with the BINUNICODE string of each old key replaced by its new key.

    Each old key must be written exactly once in the whole pickle and never fetched
    from the memo (so the string is that dict key and nothing else), and no key,
    old or new, may be one character or empty (the unpickler shares those). The
    layout's batch edits are applied too.

    Args:
        data: A pickle :func:`walk` accepted.
        layout: What :func:`walk` returned for it.
        renames: ``(old key, new key)`` for every key that changes.
        state: ``(old, new)`` BUILD state (``{"_metadata": ...}``) of the state
            dict whose keys change, when that changes too.

    Returns:
        The new pickle, or None when a key cannot be proven to be only a dict key.

    Example:
        >>> import pickle
        >>> data = pickle.dumps({"module.w": 1}, protocol=2)
        >>> new = rename_keys(data, walk(data), [("module.w", "w1")])
        >>> pickle.loads(new)
        {'w1': 1}
    """
    # Each old key's text -> the new key's length prefix and text.
    wanted: Mapping[bytes, bytes] = {
        _encode(old): len(_encode(new)).to_bytes(4, "little") + _encode(new) for old, new in renames
    }
    if len(wanted) != len(renames):
        return None
    if any(len(old) <= 1 or len(new) <= 1 for old, new in renames):
        return None
    edits = list(layout.edits)
    if state is not None:
        spliced = _splice_state(data, layout, *state)
        if spliced is None:
            return None
        start, removed, _ = spliced[0]
        # The re-emitted state writes its own batches.
        edits = [e for e in edits if not start <= e[0] < start + removed] + spliced
    if wanted:
        found: set[bytes] = set()
        shared = layout.shared
        for pos, index in layout.strings():
            text = _string_at(data, pos)
            new = wanted.get(text)
            if new is not None:
                if text in found or index in shared:
                    return None
                found.add(text)
                edits.append((pos + 1, 4 + len(text), new))  # the length prefix and the text
        if len(found) != len(wanted):
            return None
    if not edits:
        return data
    edits.sort()
    out = bytearray()
    view = memoryview(data)
    start = 0
    for pos, removed, replacement in edits:
        if pos < start:
            return None  # overlapping edits: a key inside the replaced state
        out += view[start:pos]
        out += replacement
        start = pos + removed
    out += view[start:]
    return bytes(out)
