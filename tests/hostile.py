"""Crafted torch files of issue 40: each made with ``torch.save``, then rewritten as bytes.

Every builder writes one file and returns nothing; the tests decide what must happen to it.
The zip container is written here by hand (:func:`write_zip`, ~40 lines) because the
mutants need what :mod:`zipfile` will not write: two central-directory entries with one
name, two names on one local header, and a deflated record handed over pre-compressed
(a 2 GiB bomb is built from one 64 MiB block repeated, in well under a second).

Nothing here runs a payload: the ``os.system`` pickles only create ``marker`` if a reader
unpickles them for real, which is what the tests check never happens.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tests.payloads import RunsCommand

GIB = 1 << 30
#: What the zip bombs inflate to: 2 GiB from about 2 MB on disk.
BOMB_BYTES = 2 * GIB
#: What the ``builtins.bytes`` file asks to allocate.
BYTES_ASK = 8 * GIB
#: How deep the nested-list file goes.
DEEP = 100_000
#: The stride-0 tensor: 4 floats of storage, viewed as this shape (40 GB materialized).
STRIDE0_SHAPE = (100_000, 100_000)

_STORED, _DEFLATED = zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED
_DOS_DATE = 0x21  # 1980-01-01, the zip epoch: fixed, so the files are reproducible


@dataclass(frozen=True)
class Record:
    """One zip record: ``data`` is what lies on disk (already deflated when ``method`` is)."""

    name: str
    data: bytes
    size: int
    crc: int
    method: int = _STORED


def stored(name: str, data: bytes) -> Record:
    """A stored (uncompressed) record, as torch writes every record."""
    return Record(name, data, len(data), zlib.crc32(data))


def torch_records(obj: Any, **save_kwargs: Any) -> list[Record]:
    """The records of ``torch.save(obj)``, in torch's order."""
    buf = io.BytesIO()
    torch.save(obj, buf, **save_kwargs)
    with zipfile.ZipFile(buf) as z:
        return [stored(i.filename, z.read(i)) for i in z.infolist()]


def archive_of(records: Sequence[Record]) -> str:
    """The archive folder torch named its records under (the first name's first part)."""
    return records[0].name.split("/", 1)[0]


def write_zip(
    path: Path, records: Sequence[Record], aliases: Sequence[tuple[str, int]] = ()
) -> None:
    """Write ``records`` as a zip: local headers in order, then one central entry each, in
    the same order, then one per ``aliases`` pair ``(name, i)``: a second name for the local
    header of ``records[i]`` (the shared-header mutant). No zip64: every file here < 4 GiB."""
    out = bytearray()
    central = bytearray()
    offsets = []
    for r in records:
        offsets.append(len(out))
        name = r.name.encode()
        out += struct.pack(
            "<4s5H3L2H", b"PK\x03\x04", 20, 0, r.method, 0, _DOS_DATE,
            r.crc, len(r.data), r.size, len(name), 0,
        )  # fmt: skip
        out += name + r.data
    entries = [(r.name, r) for r in records] + [(n, records[i]) for n, i in aliases]
    at = {id(r): o for r, o in zip(records, offsets, strict=True)}
    for name_text, r in entries:
        name = name_text.encode()
        central += struct.pack(
            "<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, r.method, 0, _DOS_DATE,
            r.crc, len(r.data), r.size, len(name), 0, 0, 0, 0, 0, at[id(r)],
        )  # fmt: skip
        central += name
    end = struct.pack(
        "<4s4H2LH", b"PK\x05\x06", 0, 0, len(entries), len(entries), len(central), len(out), 0
    )
    path.write_bytes(bytes(out + central + end))


def state(n_tensors: int, prefix: str = "module.") -> dict[str, torch.Tensor]:
    """``n_tensors`` small float tensors, each filled with its index."""
    return {f"{prefix}t{i}": torch.full((3,), float(i)) for i in range(n_tensors)}


def save_records(path: Path, obj: Any, edit: Callable[[list[Record]], list[Record]]) -> None:
    """``torch.save(obj)``, its records passed through ``edit``, written to ``path``."""
    write_zip(path, edit(torch_records(obj)))


# --------------------------------------------------------------------------- duplicates


def duplicate_data_pkl(path: Path, marker: Path, n_tensors: int, evil_first: bool) -> None:
    """A torch file of ``n_tensors`` plus a second ``<archive>/data.pkl`` whose pickle
    reduces to ``os.system("touch marker")``, before or after the real one. Which copy
    torch's reader picks depends on the entry count (issue 40)."""

    def edit(records: list[Record]) -> list[Record]:
        evil = stored(f"{archive_of(records)}/data.pkl", pickle.dumps(RunsCommand(marker), 2))
        return [evil, *records] if evil_first else [*records, evil]

    save_records(path, state(n_tensors), edit)


def duplicate_tensor_record(path: Path, other_first: bool) -> None:
    """``<archive>/data/0`` twice, the copies holding different values (before or after)."""

    def edit(records: list[Record]) -> list[Record]:
        i = next(k for k, r in enumerate(records) if r.name.endswith("/data/0"))
        other = stored(records[i].name, torch.full((3,), 666.0).numpy().tobytes())
        records.insert(i if other_first else i + 1, other)
        return records

    save_records(path, state(2), edit)


def shared_local_header(path: Path) -> None:
    """Two central-directory names on one local header: ``data/1``'s entry points at
    ``data/0``'s bytes (its own record left unreferenced)."""
    records = torch_records(state(2))
    one = next(k for k, r in enumerate(records) if r.name.endswith("/data/1"))
    zero = next(k for k, r in enumerate(records) if r.name.endswith("/data/0"))
    name = records[one].name
    kept = [r for k, r in enumerate(records) if k != one]
    write_zip(path, kept, aliases=[(name, kept.index(records[zero]))])


# --------------------------------------------------------------------------- resources


def _deflated_zeros(name: str, size: int, head: bytes = b"") -> Record:
    """``head`` then zeros up to ``size`` bytes, deflated: one 64 MiB block compressed
    once and repeated (a full flush makes each block's encoding independent)."""
    block = 64 << 20
    assert (size - len(head)) % block == 0
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = co.compress(head) + co.flush(zlib.Z_FULL_FLUSH)
    zeros = co.compress(bytes(block)) + co.flush(zlib.Z_FULL_FLUSH)
    n = (size - len(head)) // block
    crc = zlib.crc32(head)
    chunk = bytes(block)
    for _ in range(n):
        crc = zlib.crc32(chunk, crc)
    return Record(name, first + zeros * n + co.flush(), size, crc, _DEFLATED)


class _Storage:
    """Stands for a storage in :class:`_TorchPickler`: ('storage', FloatStorage, key, ...)."""

    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _Tensor:
    """A float tensor over a :class:`_Storage`, pickled as torch pickles one."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.storage, self.shape, self.stride = storage, shape, stride

    def __reduce__(self) -> Any:
        args = (self.storage, 0, self.shape, self.stride, False, OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


class _TorchPickler(pickle.Pickler):
    """torch.save's data.pkl for tensors whose storage is never allocated here."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        return None


def data_pkl(obj: Any) -> bytes:
    """``obj`` pickled the way torch.save writes data.pkl (protocol 2, persistent storages)."""
    buf = io.BytesIO()
    _TorchPickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def zip_bomb(path: Path, where: str) -> None:
    """About 2 MB on disk inflating to 2 GiB: ``where`` is ``"data.pkl"`` (the real pickle
    followed by zeros: a reader that inflates the record whole holds 2 GiB) or
    ``"tensor"`` (a 2 GiB float tensor record, deflated zeros)."""
    if where == "data.pkl":

        def edit(records: list[Record]) -> list[Record]:
            i = next(k for k, r in enumerate(records) if r.name.endswith("/data.pkl"))
            pad = (64 << 20) - len(records[i].data) % (64 << 20)
            head = records[i].data + bytes(pad)
            records[i] = _deflated_zeros(records[i].name, BOMB_BYTES, head)
            return records

        save_records(path, state(2), edit)
        return
    assert where == "tensor"
    numel = BOMB_BYTES // 4
    records = torch_records({})
    archive = archive_of(records)
    pkl = data_pkl({"module.bomb": _Tensor(_Storage("0", numel), (numel,), (1,))})
    rest = [r for r in records if not r.name.endswith("/data.pkl")]
    write_zip(
        path,
        [
            stored(f"{archive}/data.pkl", pkl),
            _deflated_zeros(f"{archive}/data/0", BOMB_BYTES),
            *rest,
        ],
    )


def _reduce_bytes(size: int) -> bytes:
    """A protocol-2 pickle of ``builtins.bytes(size)``: a few dozen bytes asking for ``size``."""
    return (
        pickle.PROTO + b"\x02"
        + pickle.GLOBAL + b"builtins\nbytes\n"
        + pickle.LONG1 + bytes([5]) + size.to_bytes(5, "little")
        + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP
    )  # fmt: skip


def bytes_bomb(path: Path, container: str) -> None:
    """A file whose object is ``builtins.bytes(8 GiB)``: ``container`` is ``"torch_zip"``
    (the pickle as data.pkl) or ``"legacy"`` (torch's pre-1.6 layout: magic number,
    protocol, sys info, the object, an empty storage list: about 100 bytes)."""
    obj = _reduce_bytes(BYTES_ASK)
    assert pickle.loads(obj.replace(BYTES_ASK.to_bytes(5, "little"), b"\x08\0\0\0\0")) == bytes(8)
    if container == "torch_zip":

        def edit(records: list[Record]) -> list[Record]:
            return [stored(r.name, obj) if r.name.endswith("/data.pkl") else r for r in records]

        save_records(path, {}, edit)
        return
    assert container == "legacy"
    magic = torch.serialization.MAGIC_NUMBER
    proto = torch.serialization.PROTOCOL_VERSION
    sys_info = {"protocol_version": proto, "little_endian": True, "type_sizes": {"int": 4}}
    parts = [pickle.dumps(x, 2) for x in (magic, proto, sys_info)]
    path.write_bytes(b"".join([*parts, obj, pickle.dumps([], 2)]))


def deep_nesting(path: Path, depth: int = DEEP) -> None:
    """``{"deep": [[[...]]]}`` nested ``depth`` lists deep, plus one tensor: torch's
    weights_only unpickler builds it without recursion."""
    inner = pickle.EMPTY_LIST * depth + pickle.APPEND * (depth - 1)
    tensor_part = data_pkl(_Tensor(_Storage("0", 3), (3,), (1,)))
    # The tensor pickle minus its PROTO header and STOP, so it can sit inside the dict.
    tensor_ops = tensor_part[2:-1]
    pkl = (
        pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.MARK
        + pickle.BINUNICODE + struct.pack("<I", 4) + b"deep" + inner
        + pickle.BINUNICODE + struct.pack("<I", 8) + b"module.w" + tensor_ops
        + pickle.SETITEMS + pickle.STOP
    )  # fmt: skip

    def edit(records: list[Record]) -> list[Record]:
        return [stored(r.name, pkl) if r.name.endswith("/data.pkl") else r for r in records]

    save_records(path, {"module.w": torch.arange(3.0)}, edit)


def stride0(path: Path) -> None:
    """4 floats of storage viewed as 100000 x 100000 (stride 0): 40 GB if materialized."""
    view = torch.arange(4.0).as_strided(STRIDE0_SHAPE, (0, 0))
    torch.save({"module.huge": view, "module.ok": torch.ones(2)}, path)


# --------------------------------------------------------------------------- layout


def _rename_folder(prefix: str) -> Callable[[list[Record]], list[Record]]:
    def edit(records: list[Record]) -> list[Record]:
        return [replace(r, name=prefix + r.name.split("/", 1)[1]) for r in records]

    return edit


def _drop(suffix: str) -> Callable[[list[Record]], list[Record]]:
    def edit(records: list[Record]) -> list[Record]:
        return [r for r in records if not r.name.endswith(suffix)]

    return edit


def _backslashes(records: list[Record]) -> list[Record]:
    return [replace(r, name=r.name.replace("/", "\\")) for r in records]


def _two_folders(records: list[Record]) -> list[Record]:
    return [*records, *(replace(r, name="other/" + r.name.split("/", 1)[1]) for r in records)]


def _tensors_elsewhere(records: list[Record]) -> list[Record]:
    return [
        replace(r, name="other/" + r.name.split("/", 1)[1]) if "/data/" in r.name else r
        for r in records
    ]


#: Archive-layout mutants of a 2-tensor torch file, by name; torch 2.13 refuses every one.
LAYOUT_MUTANTS: dict[str, Callable[[list[Record]], list[Record]]] = {
    "dotdot": _rename_folder("../../x/"),
    "absolute": _rename_folder("/abs/"),
    "nested": _rename_folder("a/b/c/"),
    "no_folder": _rename_folder(""),
    "backslashes": _backslashes,
    "no_version": _drop("/version"),
    "no_data_pkl": _drop("/data.pkl"),
    "two_folders": _two_folders,
    "tensors_in_other_folder": _tensors_elsewhere,
}


def layout_mutant(path: Path, name: str) -> None:
    """The 2-tensor torch file rewritten by ``LAYOUT_MUTANTS[name]``."""
    save_records(path, state(2), LAYOUT_MUTANTS[name])
