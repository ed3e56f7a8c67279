"""convert's copy-through of data.pkl: byte for byte what re-emitting writes, or not taken."""

from __future__ import annotations

import collections
import io
import pickle
import random
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # registers safe globals now, not inside a test (conftest's guard)
import torch.distributed.tensor
from torch import nn

import ddpstate._convert.rewrite as convert_mod
from ddpstate._streaming.pickle_memo import check_memo_indexes
from ddpstate._streaming.pickle_rewrite import rename_keys, walk
from ddpstate.convert import convert_file
from tests.convert.test_convert import _checkpoints, _trained

_COPIED_PICKLE = convert_mod.copied_pickle


def _both(
    monkeypatch: pytest.MonkeyPatch, src: Path, tmp_path: Path, **options: Any
) -> tuple[bytes, bytes, bool]:
    """(output of the code as it runs, output with the copy-through turned off, copied?)."""
    calls: list[bool] = []

    def spy(*args: Any) -> Any:
        out = _COPIED_PICKLE(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(convert_mod, "copied_pickle", spy)
    fast = tmp_path / "fast.pt"
    convert_file(src, fast, overwrite=True, **options)
    monkeypatch.setattr(convert_mod, "copied_pickle", lambda *args: None)
    slow = tmp_path / "slow.pt"
    convert_file(src, slow, overwrite=True, **options)
    return fast.read_bytes(), slow.read_bytes(), any(calls)


def _big(count: int, prefix: str = "module.") -> dict[str, Any]:
    # Sizes around the pickler's batch of 1000 (an empty last batch, a last batch of one).
    return {
        "epoch": 3,
        "state_dict": {f"{prefix}layers.{i}.w": torch.full((2,), float(i)) for i in range(count)},
        "names": [f"n{i}" for i in range(count)],
    }


RULES: list[dict[str, Any]] = [
    {"strip_prefix": "module."},
    {"add_prefix": "module."},
    {"normalize": True},
    {},
]


@pytest.mark.parametrize("name", ["dataparallel", "ddp", "compiled", "nested", "lightning"])
@pytest.mark.parametrize("rule", RULES, ids=["strip", "add", "normalize", "none"])
def test_real_checkpoints_convert_to_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, rule: dict[str, Any]
) -> None:
    ckpt, prefix = _checkpoints()[name]
    src = tmp_path / "src.pt"
    torch.save(ckpt, src)
    options = dict(rule)
    if "strip_prefix" in options:
        options["strip_prefix"] = prefix
    fast, slow, copied = _both(monkeypatch, src, tmp_path, fsync=False, **options)
    assert fast == slow
    assert copied, "the copy-through was not taken"


@pytest.mark.parametrize("count", [999, 1000, 1001, 2000, 2001])
@pytest.mark.parametrize("rule", RULES, ids=["strip", "add", "normalize", "none"])
def test_plain_state_dicts_are_copied_through_to_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, count: int, rule: dict[str, Any]
) -> None:
    src = tmp_path / "src.pt"
    torch.save(_big(count), src)
    fast, slow, copied = _both(monkeypatch, src, tmp_path, fsync=False, **rule)
    assert copied, "the copy-through was not taken"
    assert fast == slow
    out = torch.load(tmp_path / "fast.pt", weights_only=True)
    assert out["names"] == [f"n{i}" for i in range(count)]
    assert len(out["state_dict"]) == count


def test_a_bare_state_dict_is_copied_through(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    src = tmp_path / "src.pt"
    torch.save({"module.a.w": torch.ones(2), "module.b.w": torch.zeros(3)}, src)
    fast, slow, copied = _both(monkeypatch, src, tmp_path, strip_prefix="module.")
    assert copied and fast == slow
    assert list(torch.load(tmp_path / "fast.pt", weights_only=True)) == ["a.w", "b.w"]


def test_shapes_that_must_fall_back_still_convert_right(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    t = torch.ones(3)
    shared_key = "module.shared.weight"
    cases: dict[str, Any] = {
        # The key string itself is also a value elsewhere (fetched from the memo).
        "shared key": {"state_dict": {shared_key: t}, "names": [shared_key]},
        # The same text written twice: which one is the dict key cannot be told apart.
        "twice": {"state_dict": {"module.a.w": t}, "names": ["".join(["module.a", ".w"])]},
        # Stripping leaves a one-character key, an object the unpickler shares.
        "short": {"state_dict": {"module.w": t, "module.b.w": t}},
        # A container referred to twice.
        "shared dict": (lambda d: {"state_dict": d, "ema": d})({"module.a.w": t}),
        # Storages tagged for a GPU are retagged cpu.
        "globals": {"state_dict": {"module.a.w": t}, "device": torch.device("cpu")},
    }
    for name, ckpt in cases.items():
        src = tmp_path / "src.pt"
        torch.save(ckpt, src)
        options: dict[str, Any] = {"strip_prefix": "module.", "key": "state_dict"}
        fast, slow, copied = _both(monkeypatch, src, tmp_path, fsync=False, unsafe=True, **options)
        assert not copied, name
        assert fast == slow, name


def test_metadata_is_spliced_and_drop_optimizer_re_emits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    net, opt = _trained()
    src = tmp_path / "src.pt"
    state = nn.DataParallel(net).state_dict()
    # The optimizer after the state dict: every memo slot after _metadata is renumbered.
    torch.save(
        {
            "state_dict": state,
            "optimizer": opt.state_dict(),
            "tail": [f"s{i}" for i in range(300)] + ["x"] * 3,
        },
        src,
    )
    for rule in RULES:
        fast, slow, copied = _both(monkeypatch, src, tmp_path, key="state_dict", **rule)
        assert copied and fast == slow, rule
    torch.save({**_big(5), "optimizer": opt.state_dict()}, src)
    _, _, copied = _both(monkeypatch, src, tmp_path, drop_optimizer=True)
    assert not copied


def test_walk_refuses_what_re_emitting_would_change() -> None:
    def dumps(obj: Any, protocol: int = 2) -> bytes:
        return pickle.dumps(obj, protocol=protocol)

    assert walk(dumps({"a.b": [1, 2.5, None, True, 70000, -5, 1 << 40]})) is not None
    assert walk(dumps({"a.b": 1}, protocol=4)) is None  # frames, other opcodes
    assert walk(dumps({"a.b": b"raw"})) is None  # bytes go through _codecs.encode
    assert walk(dumps({"a.b": {1, 2}})) is None  # a global outside the list
    assert walk(dumps(("x", "x"))) is not None  # one object, memoized once
    assert walk(b"\x80\x02X\x01\x00\x00\x00xq\x00X\x01\x00\x00\x00xq\x01\x86q\x02.") is None
    shared = [1, 2]
    assert walk(dumps({"a": shared, "b": shared})) is None
    data = dumps({"k.one": 1, "k.two": 2})
    # Damage: a memo slot out of order, a string running past the end.
    assert walk(data.replace(b"q\x01", b"q\x05", 1)) is None
    assert walk(data[:-6]) is None
    assert walk(data.replace(b"X\x05\x00\x00\x00", b"X\x05\x00\x00\x10", 1)) is None


def test_rename_keys_changes_only_the_keys() -> None:
    sd = collections.OrderedDict((f"module.l{i}", [i, f"v{i}"]) for i in range(2500))
    data = pickle.dumps({"sd": sd, "note": "module.l0 is not a key here"}, protocol=2)
    layout = walk(data)
    assert layout is not None
    renames = [(k, k[len("module.") :]) for k in sd]
    out = rename_keys(data, layout, renames)
    assert out is not None
    loaded = pickle.load(io.BytesIO(out))
    assert list(loaded["sd"]) == [f"l{i}" for i in range(2500)]
    assert loaded["note"] == "module.l0 is not a key here"
    assert rename_keys(data, layout, [("module.l1", "x")]) is None  # one character
    assert rename_keys(data, layout, [("absent.key", "other.key")]) is None


def test_random_checkpoints_convert_to_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rng = random.Random(20)
    for trial in range(12):
        sd: dict[str, Any] = {}
        base = torch.arange(64, dtype=torch.float32)
        for i in range(rng.randint(1, 40)):
            kind = rng.random()
            if kind < 0.2 and sd:
                value = sd[rng.choice(list(sd))]  # tied weights
            elif kind < 0.4:
                value = base[rng.randint(0, 10) :].view(-1)[: rng.randint(1, 20)]  # shared storage
            elif kind < 0.5:
                value = nn.Parameter(torch.randn(rng.randint(1, 4)))
            else:
                value = torch.randn(tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 4))))
            sd[f"module.m{i}.{rng.choice(['weight', 'bias', 'w', 'running_mean'])}"] = value
        ckpt = {"epoch": trial, "state_dict": sd, "lr": rng.random(), "tag": "run"}
        src = tmp_path / "src.pt"
        torch.save(ckpt, src)
        rule = rng.choice(RULES)
        fast, slow, copied = _both(monkeypatch, src, tmp_path, fsync=False, **rule)
        assert copied, trial
        assert fast == slow, trial


def test_walk_accepts_nothing_the_memo_check_refuses() -> None:
    # The scan skips check_memo_indexes for pickles walk accepted: over random byte
    # damage, whatever walk accepts must pass that check too.
    net, opt = _trained()
    buffer = io.BytesIO()
    torch.save({"state_dict": net.state_dict(), "optimizer": opt.state_dict()}, buffer)
    with zipfile.ZipFile(buffer) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    assert walk(data) is not None
    rng = random.Random(7)
    accepted = 0
    for _ in range(3000):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        if walk(bytes(damaged)) is None:
            continue
        accepted += 1
        check_memo_indexes(io.BytesIO(bytes(damaged)))  # must not raise
    assert accepted  # some damage (to a float, a key's text) leaves the shape intact
    for cut in range(len(data)):  # and it never raises: truncated anywhere
        assert walk(data[:cut]) is None


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("rule", RULES, ids=["strip", "add", "normalize", "none"])
def test_sequential_models_convert_to_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, nested: bool, rule: dict[str, Any]
) -> None:
    # nn.Sequential's _metadata keys are one character ("0", "1"), the same text as
    # the storage keys written before them.
    inner = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model = nn.Sequential(collections.OrderedDict(module=inner))
    sd = model.state_dict()
    src = tmp_path / "src.pt"
    torch.save({"model": sd, "epoch": 3} if nested else sd, src)
    options = dict(rule)
    if nested:
        options["key"] = "model"
    fast, slow, _ = _both(monkeypatch, src, tmp_path, fsync=False, **options)
    assert fast == slow
