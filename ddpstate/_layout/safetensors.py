"""The safetensors byte layout, without torch: header parsing and building, ddpstate's extras.

Two writers (``ddpstate.save`` from live tensors, ``ddpstate convert`` from
tensor records scanned out of a file) and two readers (``ddpstate.load``, and
the streaming reader behind ``inspect``/``convert``/``verify``) share this
module, so the header is parsed, validated and laid out one way everywhere.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import struct
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Optional

from ddpstate.errors import CheckpointCorruptError, CheckpointFormatError

#: safetensors caps its header at 100 MB; a larger claimed length is not safetensors.
SAFETENSORS_MAX_HEADER = 100_000_000

#: Header metadata key: JSON object ``{alias_key: canonical_key}`` for tensors
#: that shared memory with an earlier entry and were written once.
ALIASES_KEY = "ddpstate.aliases"
#: Header metadata key: JSON of the state dict's ``_metadata`` (module path ->
#: ``{"version": ...}``), which ``nn.Module.load_state_dict`` consults.
STATE_DICT_METADATA_KEY = "ddpstate.state_dict_metadata"
#: Header metadata key: JSON list of the state dict's keys in its order, which
#: the file's own order (by dtype, then name, as the library lays data out) loses.
KEY_ORDER_KEY = "ddpstate.key_order"
#: Caller metadata keys may not start with this; ddpstate owns that namespace.
RESERVED_PREFIX = "ddpstate."

#: safetensors dtype code -> (torch dtype name, bytes per element).
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
    "BF16": ("bfloat16", 2), "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2),
    "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1), "C64": ("complex64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1), "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
    "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8),
}  # fmt: skip
# The safetensors library lays data out by its Dtype enum's order, last first, then by
# name. No public name gives that order, so it is kept here; tests/formats/test_safetensors_lib.py
# checks it against the installed library.
_LIBRARY_ORDER = {
    code: rank
    for rank, code in enumerate(
        ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16",
         "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"),
        1,
    )
}  # fmt: skip
#: torch dtype name -> safetensors dtype code.
CODES: dict[str, str] = {name: code for code, (name, _) in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor as the header describes it.

    Attributes:
        code: The safetensors dtype code (``"F32"``...).
        shape: The tensor's shape.
        begin: Offset of its first byte, counted from the start of the data section.
        end: Offset one past its last byte.
    """

    code: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def dtype(self) -> str:
        """The torch dtype name (``"float32"``...)."""
        return DTYPES[self.code][0]


@dataclasses.dataclass(frozen=True)
class Header:
    """A parsed header and what is wrong with it.

    Attributes:
        entries: Key -> :class:`Entry`, in header order.
        metadata: The ``__metadata__`` map (ddpstate's own keys included).
        data_start: File offset of the data section (8 + header length).
        problems: Damage that leaves the header readable (offsets that do not
            fit a shape, data past the end of the file, gaps); empty when intact.
    """

    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int
    problems: tuple[str, ...]


def _corrupt(name: str, detail: str, exc: Optional[BaseException] = None) -> CheckpointCorruptError:
    message = f"{name}: damaged safetensors file ({detail}); re-save or re-download it"
    return CheckpointCorruptError(message if exc is None else f"{message} [{exc}]")


#: The header's named fields: the library's header types refuse one given twice in its
#: object (a tensor's name or a metadata key given twice counts at its last value there, as
#: in ``json.loads``).
_FIELDS = frozenset({"__metadata__", "dtype", "shape", "data_offsets"})


class _Object(dict[str, Any]):
    """A JSON object of a header, knowing the names it gives more than once."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        given = collections.Counter(k for k, _ in pairs)
        self.twice = frozenset(k for k, n in given.items() if n > 1)


def _not_json(literal: str) -> Any:
    raise ValueError(f"{literal} is not JSON")


def _integers(value: Any) -> tuple[int, ...]:
    """A JSON list of integers, as the library's header types take it: not true, 1.0 or "1"."""
    if not isinstance(value, list) or not all(type(n) is int for n in value):
        raise TypeError(f"{value!r} is not a list of integers")
    return tuple(value)


def parse_header(read_at: Callable[[int, int], bytes], size: int, name: str) -> Header:
    """Read and check a safetensors header without touching the data.

    Args:
        read_at: ``read_at(offset, length)`` returns up to ``length`` bytes of the file.
        size: The file's size in bytes.
        name: The file, for messages.

    Returns:
        The :class:`Header`; damage that still lets the entries be listed is
        in its ``problems``.

    Raises:
        CheckpointCorruptError: The header cannot be read: too short, a length
            that does not fit the file (or over safetensors' 100 MB limit, so a
            hostile length is never allocated), not a JSON object, malformed entries.
        CheckpointFormatError: An entry has a dtype code ddpstate does not know.

    Example:
        >>> import json, struct
        >>> text = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
        >>> raw = struct.pack("<Q", len(text)) + text.encode() + bytes(8)
        >>> header = parse_header(lambda o, n: raw[o : o + n], len(raw), "w.safetensors")
        >>> header.entries["w"].shape, header.problems
        ((2,), ())
    """
    head = read_at(0, 8)
    if len(head) < 8:
        raise _corrupt(name, f"only {len(head)} bytes long")
    (length,) = struct.unpack("<Q", head)
    if length > SAFETENSORS_MAX_HEADER or 8 + length > size:
        raise _corrupt(name, f"header length {length} does not fit in {size} bytes")
    try:
        parsed = json.loads(
            bytes(read_at(8, length)).decode("utf-8"),
            object_pairs_hook=_Object,
            parse_constant=_not_json,  # NaN, Infinity: Python's extension, not JSON
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise _corrupt(name, "header is not valid JSON", exc) from exc
    if not isinstance(parsed, _Object):
        raise _corrupt(name, "header is not a JSON object")
    if "__metadata__" in parsed.twice:
        raise _corrupt(name, "__metadata__ is given twice")
    meta = parsed.pop("__metadata__", None)
    meta = {} if meta is None else meta  # null is no metadata to the library; [] or "" are not
    if not isinstance(meta, dict):
        raise _corrupt(name, "__metadata__ is not a JSON object")
    problems: list[str] = []
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        problems.append("__metadata__ is not a map of str -> str")
    data_start = 8 + length
    entries: dict[str, Entry] = {}
    for key, info in parsed.items():
        try:
            code = info["dtype"]
            shape = _integers(info["shape"])
            begin, end = _integers(info["data_offsets"])
            if info.twice & _FIELDS:
                raise ValueError(f"{sorted(info.twice & _FIELDS)} given twice")
        except (KeyError, TypeError, ValueError) as exc:
            raise _corrupt(name, f"entry {key!r} is malformed", exc) from exc
        if not isinstance(code, str) or code not in DTYPES:
            raise CheckpointFormatError(
                f"{name}: tensor {key!r} has safetensors dtype {code!r}, which ddpstate does "
                f"not know; known: {', '.join(DTYPES)}"
            )
        nbytes = math.prod(shape) * DTYPES[code][1]
        if min(shape, default=0) < 0 or begin < 0 or end - begin != nbytes:
            problems.append(
                f"tensor {key!r}: data_offsets {begin}..{end} do not fit shape {list(shape)} "
                f"of {DTYPES[code][0]}"
            )
        if data_start + end > size:
            problems.append(
                f"tensor {key!r} runs to byte {data_start + end} but the file ends at {size}"
            )
        entries[key] = Entry(code, shape, begin, end)
    cursor = 0
    for key, entry in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if entry.begin != cursor:
            problems.append(
                f"tensor data is not contiguous at {key!r} (byte {entry.begin}, expected {cursor})"
            )
            break
        cursor = entry.end
    if not problems and data_start + cursor != size:
        problems.append(
            f"the data section is {size - data_start} bytes but the header describes {cursor}"
        )
    return Header(entries, {str(k): str(v) for k, v in meta.items()}, data_start, tuple(problems))


def restore_extras(
    state_dict: collections.OrderedDict[str, Any], metadata: Mapping[str, str]
) -> list[str]:
    """Apply ddpstate's header extras to a state dict read from a file.

    Aliased keys get their canonical entry's very value (tied tensors come back
    shared), the keys take the state dict's order again, and ``_metadata`` is
    set from its JSON.

    Args:
        state_dict: The entries read, in header order; changed in place.
        metadata: The header's ``__metadata__``.

    Returns:
        What could not be applied (empty when all is well).

    Example:
        >>> sd = collections.OrderedDict(a=1)
        >>> restore_extras(sd, {ALIASES_KEY: '{"b": "a"}'}), dict(sd)
        ([], {'a': 1, 'b': 1})
    """
    problems = []
    if ALIASES_KEY in metadata:
        stored = set(state_dict)
        try:
            for alias, canonical in json.loads(metadata[ALIASES_KEY]).items():
                # A stored tensor is what the library gives under its key, so an alias never
                # replaces one; ddpstate's writer ties an absent key to a stored one only.
                if alias in stored or canonical not in stored:
                    raise ValueError(f"{alias!r} -> {canonical!r}")
                state_dict[alias] = state_dict[canonical]
        except (ValueError, AttributeError, TypeError) as exc:
            problems.append(
                f"{ALIASES_KEY} must tie keys the file does not store to tensors it stores ({exc})"
            )
    if KEY_ORDER_KEY in metadata:
        try:
            order = json.loads(metadata[KEY_ORDER_KEY])
            if (
                not isinstance(order, list)
                or len(order) != len(state_dict)
                or set(order) != state_dict.keys()
            ):
                raise ValueError("it does not list the file's keys")
            for key in order:
                state_dict.move_to_end(key)
        except (ValueError, TypeError) as exc:
            problems.append(f"{KEY_ORDER_KEY} is not the file's keys ({exc})")
    if STATE_DICT_METADATA_KEY in metadata:
        try:
            sd_meta = json.loads(metadata[STATE_DICT_METADATA_KEY])
            state_dict._metadata = collections.OrderedDict(  # type: ignore[attr-defined]
                (k, dict(v)) for k, v in sd_meta.items()
            )
        except (ValueError, AttributeError, TypeError) as exc:
            problems.append(f"{STATE_DICT_METADATA_KEY} is not valid JSON ({exc})")
    return problems


class View(NamedTuple):
    """Where one tensor's bytes lie in memory (or in a file), for finding tied tensors.

    A named tuple: one is made per tensor (100,000 for as many tensors), and a
    tuple is made several times faster than a frozen dataclass.

    Attributes:
        key: The state-dict key.
        identity: Equal for the very same view of the same storage.
        storage: Equal for tensors on the same storage.
        start: First byte within the storage.
        stop: One past the last byte the view can reach.
    """

    key: str
    identity: Hashable
    storage: Hashable
    start: int
    stop: int


def find_aliases(views: Iterable[Optional[View]]) -> tuple[dict[str, str], list[str]]:
    """Tell tied tensors (identical views: written once) from other overlaps (written twice).

    Args:
        views: One :class:`View` per tensor in state-dict order; None for an
            empty tensor (nothing to tie).

    Returns:
        ``({alias: canonical}, ["'b' overlaps 'a'", ...])``.

    Example:
        >>> a = View("a", 1, "s", 0, 8); b = View("b", 1, "s", 0, 8)
        >>> find_aliases([a, b, None])
        ({'b': 'a'}, [])
    """
    canonical_of: dict[Hashable, str] = {}
    aliases: dict[str, str] = {}
    spans: dict[Hashable, list[tuple[int, int, str]]] = {}
    for view in views:
        if view is None:
            continue
        if view.identity in canonical_of:
            aliases[view.key] = canonical_of[view.identity]
            continue
        canonical_of[view.identity] = view.key
        spans.setdefault(view.storage, []).append((view.start, view.stop, view.key))
    overlaps = []
    for entries in spans.values():
        entries.sort()
        # Compare each span with the furthest-reaching one before it, not only its
        # neighbour: a large view holding two small ones overlaps both.
        _, reach, reacher = entries[0]
        for start, stop, key in entries[1:]:
            if start < reach:
                overlaps.append(f"{key!r} overlaps {reacher!r}")
            if stop > reach:
                reach, reacher = stop, key
    return aliases, overlaps


def state_dict_metadata_json(sd_meta: Mapping[Any, Any]) -> str:
    """A state dict's ``_metadata`` as the JSON stored under :data:`STATE_DICT_METADATA_KEY`.

    Raises:
        TypeError, ValueError: A value cannot be written as JSON.

    Example:
        >>> state_dict_metadata_json({"": {"version": 1}})
        '{"":{"version":1}}'
    """
    return json.dumps({str(k): dict(v) for k, v in sd_meta.items()}, separators=(",", ":"))


def build_header(
    tensors: Sequence[tuple[str, str, Sequence[int], int]],
    metadata: Mapping[str, str],
    aliases: Mapping[str, str],
) -> tuple[bytes, list[str], int]:
    """Lay out a safetensors file: the header bytes and the order of the data.

    Data is ordered as the reference writer orders it (its dtype order, larger
    elements first, then by key), so every tensor starts aligned; header keys
    keep the given order; the header is padded with spaces to a multiple of 8 bytes.

    Args:
        tensors: ``(key, dtype code, shape, nbytes)`` of each tensor written
            (aliases left out), in state-dict order.
        metadata: ``__metadata__`` entries; ``aliases`` are added to it.
        aliases: ``{alias: canonical}`` for tied tensors.

    Returns:
        ``(8-byte length + header, keys in data order, data section size)``.

    Example:
        >>> head, order, size = build_header([("w", "F32", [2], 8)], {}, {})
        >>> head[8:].rstrip(), order, size
        (b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', ['w'], 8)
    """
    meta = dict(metadata)
    if aliases:
        meta[ALIASES_KEY] = json.dumps(dict(aliases), separators=(",", ":"))
    order = sorted(tensors, key=lambda t: (-_LIBRARY_ORDER[t[1]], t[0]))
    offsets: dict[str, tuple[int, int]] = {}
    cursor = 0
    for key, _, _, nbytes in order:
        offsets[key] = (cursor, cursor + nbytes)
        cursor += nbytes
    entries: dict[str, Any] = {"__metadata__": meta} if meta else {}
    for key, code, shape, _ in tensors:
        entries[key] = {"dtype": code, "shape": list(shape), "data_offsets": list(offsets[key])}
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text, [key for key, _, _, _ in order], cursor
