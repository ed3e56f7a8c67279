"""The protocol-2 writer of ``_streaming/pickle_emit.py`` writes the bytes it always wrote.

The expected bytes come from a frozen copy of the emitter as it was before
(tests/streaming/emit_reference.py, a subclass of CPython's pure-Python pickler), run in
this same process over the same objects, so object identity (shared objects,
CPython's cached one-character strings) is the same for both.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import pickle
import random
from typing import Any

import pytest

from ddpstate._streaming.pickle_emit import dump_checkpoint_pickle, dump_within
from ddpstate._streaming.pickle_scan import (
    DtypeRef,
    GlobalRef,
    Opaque,
    OpaqueCall,
    StandIn,
    StorageRecord,
    StorageTypeRef,
    TensorRecord,
    scan_pickle,
)

from .emit_reference import reference_dump_checkpoint_pickle, reference_dump_within

_DTYPES = ("float32", "float16", "bfloat16", "int64", "uint8", "bool")
_STORAGE_TYPES = ("FloatStorage", "HalfStorage", "BFloat16Storage", "LongStorage", "UntypedStorage")


def _opaque_class(module: str, name: str) -> type[Opaque]:
    # What the scanner makes of a global it does not know.
    qualname = f"{module}.{name}"
    return type(f"<{qualname}>", (Opaque,), {"__slots__": (), "ref": GlobalRef(module, name)})


class _Trees:
    """Random object trees of everything a scanned (and rewritten) checkpoint holds."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.pool: list[Any] = []  # objects to share between places of the tree
        self.storages: list[StorageRecord] = []
        self.tensors: list[TensorRecord] = []
        self.classes = [_opaque_class("mod.sub", f"C{i}") for i in range(4)]
        self.shapes: list[tuple[int, ...]] = [(), (3,), (2, 3)]

    def string(self) -> str:
        rng = self.rng
        roll = rng.random()
        if roll < 0.25:
            return chr(rng.randrange(32, 300))  # one character: often a cached object
        if roll < 0.3:
            return "".join(chr(rng.randrange(0xD800, 0xE000)) for _ in range(2))  # surrogates
        if roll < 0.35:
            return "x" * rng.choice((255, 256, 70_000))
        alphabet = "abc._0123456789é€😀"
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))

    def integer(self) -> int:
        rng = self.rng
        bits = rng.choice((1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 500, 2047, 2048, 2100))
        value = rng.getrandbits(bits)
        if rng.random() < 0.5:
            value = -value
        return value + rng.choice((0, 0, 1, -1))

    def scalar(self) -> Any:
        rng = self.rng
        return rng.choice(
            (
                self.integer,
                lambda: rng.choice((0.0, -0.0, 1.5, float("inf"), float("nan"), rng.random())),
                lambda: rng.random() < 0.5,
                lambda: None,
                self.string,
                lambda: bytes(rng.randrange(256) for _ in range(rng.choice((0, 1, 5, 300)))),
                lambda: bytearray(rng.randrange(256) for _ in range(rng.choice((0, 3)))),
            )
        )()

    def storage(self) -> StorageRecord:
        if self.storages and self.rng.random() < 0.4:
            return self.rng.choice(self.storages)
        type_name = self.rng.choice(_STORAGE_TYPES)
        record = StorageRecord(
            key=str(len(self.storages) + 7),
            type_name=type_name,
            dtype="uint8" if type_name == "UntypedStorage" else "float32",
            location=self.rng.choice(("cpu", "cuda:0")),
            numel=self.rng.choice((0, 6, 1 << 40)),
        )
        self.storages.append(record)
        return record

    def tensor(self, depth: int) -> TensorRecord:
        rng = self.rng
        if self.tensors and rng.random() < 0.15:
            return rng.choice(self.tensors)  # the same tensor twice
        if rng.random() < 0.5:
            shape = rng.choice(self.shapes)  # a shape tuple shared with another tensor
        else:
            shape = tuple(rng.randrange(1, 5) for _ in range(rng.randrange(0, 4)))
            self.shapes.append(shape)
        record = TensorRecord(
            storage=self.storage(),
            offset=rng.choice((0, 3, 70_000)),
            shape=shape,
            stride=tuple(rng.randrange(1, 9) for _ in shape),
            dtype=rng.choice(_DTYPES),
            requires_grad=rng.random() < 0.2,
            rebuild=rng.choice(("v2", "v3")),
            metadata=rng.choice((None, {}, {"conj": True})),
        )
        kind = rng.random()
        if kind < 0.3:
            record.parameter = True
            record.param_requires_grad = rng.random() < 0.5
            if rng.random() < 0.5:
                record.param_state = {"tag": self.string()}
        elif kind < 0.4:
            state = rng.choice((None, {"attr": self.node(depth + 1)}))
            record.from_type = (rng.choice(self.classes), state)
        self.tensors.append(record)
        return record

    def placeholder(self, depth: int) -> Any:
        rng = self.rng
        roll = rng.random()
        if roll < 0.15:
            return GlobalRef(rng.choice(("torch", "numpy.core", "a.b")), rng.choice(("f", "g")))
        if roll < 0.25:
            return DtypeRef("torch", rng.choice(_DTYPES))
        if roll < 0.3:
            return StorageTypeRef("torch", "FloatStorage")
        if roll < 0.35:
            return StandIn("collections.OrderedDict", collections.OrderedDict, False)
        if roll < 0.45:
            return rng.choice(self.classes)
        cls = rng.choice(self.classes)
        args = tuple(self.node(depth + 1) for _ in range(rng.randrange(0, 3)))
        if roll < 0.6:
            obj = cls(*args)  # REDUCE
        elif roll < 0.7:
            obj = cls.__new__(cls, *args)  # NEWOBJ
        elif roll < 0.75:
            obj = cls.__new__(cls, *args, key=self.node(depth + 1))  # __newobj_ex__
        else:
            obj = OpaqueCall(cls(), args)
        if rng.random() < 0.5:
            obj.state = self.node(depth + 1)
        if rng.random() < 0.3:
            obj.listitems = [self.node(depth + 1) for _ in range(rng.choice((1, 2)))]
        if rng.random() < 0.1:
            obj.listitems = [self.scalar() for _ in range(1001)]  # two APPENDS batches
        if rng.random() < 0.3:
            obj.dictitems = [(self.string(), self.node(depth + 1)) for _ in range(2)]
        return obj

    def container(self, depth: int) -> Any:
        rng = self.rng
        size = rng.choice((0, 1, 2, 3, 4, 5, 999, 1000, 1001, 2001))
        kind = rng.choice(("dict", "list", "tuple", "odict", "set", "frozenset", "counter"))
        big = size > 5
        # Around the 1,000-item batches the items are leaves, so a tree stays small.
        child = (lambda: self.scalar()) if big else (lambda: self.node(depth + 1))
        if kind in ("set", "frozenset"):
            items = {self.string() if rng.random() < 0.5 else self.integer() for _ in range(size)}
            return set(items) if kind == "set" else frozenset(items)
        if kind == "counter":
            return collections.Counter({self.string(): self.integer() for _ in range(size)})
        if kind in ("dict", "odict"):
            mapping = {self.key(): child() for _ in range(size)}
            if kind == "dict":
                return mapping
            ordered = collections.OrderedDict(mapping)
            if rng.random() < 0.5:
                ordered._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
            return ordered
        values = [child() for _ in range(size)]
        if kind == "list":
            if values and rng.random() < 0.1:
                values.append(values)  # a list holding itself
            return values
        return tuple(values)

    def key(self) -> Any:
        return self.string() if self.rng.random() < 0.85 else self.integer()

    def node(self, depth: int = 0) -> Any:
        rng = self.rng
        if self.pool and rng.random() < 0.1:
            return rng.choice(self.pool)
        roll = rng.random()
        if depth > 3 or roll < 0.45:
            obj = self.scalar()
        elif roll < 0.6:
            obj = self.tensor(depth)
        elif roll < 0.65:
            obj = self.storage()
        elif roll < 0.75:
            obj = self.placeholder(depth)
        else:
            obj = self.container(depth)
        if not isinstance(obj, (int, float, type(None))):
            self.pool.append(obj)
        return obj

    def tree(self) -> Any:
        return {self.key(): self.node() for _ in range(self.rng.randrange(1, 30))}


def _expect_same(tree: Any, replace: Any = None) -> bytes:
    expected, expected_storages = reference_dump_checkpoint_pickle(tree, replace)
    got, storages = dump_checkpoint_pickle(tree, replace)
    assert got == expected
    assert [id(s) for s in storages] == [id(s) for s in expected_storages]
    return got


@pytest.mark.parametrize("seed", range(60))
def test_random_trees_give_the_same_bytes(seed: int) -> None:
    trees = _Trees(seed)
    tree = trees.tree()
    replace = None
    if trees.tensors and seed % 3 == 0:
        # convert --dtype: some records written in place of others.
        replace = {id(t): trees.tensor(0) for t in trees.tensors[::2]}
    _expect_same(tree, replace)


def test_memo_past_256_slots_and_batches_of_1000() -> None:
    # Distinct strings fill the memo past BINPUT's 255 (LONG_BINPUT, LONG_BINGET
    # after), and containers sit on either side of each 1,000-item batch.
    strings = [f"key{i}" for i in range(3000)]
    tree = {
        "strings": strings,
        "again": list(reversed(strings)),
        "dicts": [{s: i for i, s in enumerate(strings[:n])} for n in (999, 1000, 1001, 2000, 2001)],
        "lists": [list(range(n)) for n in (1, 999, 1000, 1001, 2001)],
        "tuples": [tuple(range(n)) for n in (1, 2, 3, 4, 1001)],
        "chars": [chr(c) for c in range(0, 400)] * 2,
        "ints": [2**k + d for k in range(0, 2100, 7) for d in (-1, 0, 1)]
        + [-(2**k) + d for k in range(0, 2100, 7) for d in (-1, 0, 1)],
    }
    data = _expect_same(tree)
    assert pickle.LONG_BINPUT in data and pickle.LONG_BINGET in data
    assert pickle.loads(data) == tree


def test_a_scanned_torch_checkpoint_gives_the_same_bytes(tmp_path: Any) -> None:
    torch = pytest.importorskip("torch")
    import io
    import zipfile

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    param = torch.nn.Parameter(torch.ones(2))
    param.note = "attr"  # a Parameter with state
    state = {
        "model": model.state_dict(),
        "module": model,
        "param": param,
        "view": torch.arange(10.0)[2:8:2],
        "half": torch.zeros(3, dtype=torch.bfloat16),
        "opt": {"lr": 0.1, "betas": (0.9, 0.999), "step": 10**30},
        "blob": b"\x00\x01" * 5,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        data = archive.read(name)

    def storage(pid: Any) -> StorageRecord:
        _, cls, key, location, numel = pid
        return StorageRecord(key, cls.name, "float32", location, numel)

    tree = scan_pickle(io.BytesIO(data), storage).obj
    _expect_same(tree)


def test_dump_within_continues_the_numbering() -> None:
    ordered = collections.OrderedDict
    strings = ["a", "shared"]
    memo = {id(ordered): (3, ordered), id(strings[1]): (4, strings[1])}
    globals_ = {"collections.OrderedDict": 3, "torch.float32": 2}
    for base in (5, 255, 256, 300):
        state = {
            "": {"version": 1},
            "x": [strings[1], DtypeRef("torch", "float32"), collections.OrderedDict(b=1)],
            "y": [f"s{i}" for i in range(300)],
        }
        expected = reference_dump_within(state, base, dict(memo), dict(globals_))
        assert dump_within(state, base, dict(memo), dict(globals_)) == expected


def test_dump_within_refuses_storages() -> None:
    record = StorageRecord("0", "FloatStorage", "float32", "cpu", 1)
    with pytest.raises(pickle.PicklingError, match="no storages"):
        dump_within([record], 0, {}, {})


def test_a_name_that_could_smuggle_opcodes_is_refused() -> None:
    with pytest.raises(pickle.PicklingError, match="refusing to write the global name"):
        dump_checkpoint_pickle({"f": GlobalRef("os", "system\ncposix")})


class _Outer:
    class Inner:  # a nested global: protocol 2 writes getattr(_Outer, "Inner")
        pass


@dataclasses.dataclass
class _Point:  # object.__reduce_ex__(2): copyreg.__newobj__ and a state
    x: int
    y: Any


class _Named:
    def __reduce__(self) -> str:
        return "_NAMED"  # "save me as the module global of this name"


_NAMED = _Named()


class _WithSetter:
    def __init__(self) -> None:
        self.value = 1

    def __reduce__(self) -> tuple[Any, ...]:
        return (_WithSetter, (), {"value": self.value}, None, None, _set_state)


def _set_state(obj: Any, state: Any) -> None:
    obj.__dict__.update(state)


def test_real_python_objects_give_the_same_bytes() -> None:
    # Not what a scan makes, but what a caller's rewrite could put in the tree.
    point = _Point(1, [2, 3])
    tree = {
        "nested": [_Outer.Inner, _Outer.Inner, _Outer],
        "point": [point, point, _Point(4, point)],
        "named": _NAMED,
        "setter": _WithSetter(),
        "complex": complex(1, 2),  # copyreg.dispatch_table
        "function": [_set_state, len, collections.OrderedDict, set],
        "types": [type(None), type(NotImplemented), type(...), int, type],
        "counter": collections.Counter("abracadabra"),
        "partial": functools.partial(max, 1, key=abs),
    }
    data = _expect_same(tree)
    assert pickle.loads(data)["point"][2].y == point


def test_a_local_class_is_refused_as_pickle_refuses_it() -> None:
    class Local:
        pass

    with pytest.raises(pickle.PicklingError):
        reference_dump_checkpoint_pickle({"c": Local})
    with pytest.raises(pickle.PicklingError):
        dump_checkpoint_pickle({"c": Local})
