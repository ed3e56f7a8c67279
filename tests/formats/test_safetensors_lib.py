"""Local safetensors files: read by the safetensors library, written byte for byte as it writes."""

from __future__ import annotations

import io
import json
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch

import ddpstate
from ddpstate._io.safetensors_io import (
    ALIASES_KEY,
    DTYPE_NAMES,
    read_safetensors,
    read_safetensors_header,
    write_safetensors,
)
from ddpstate.errors import CheckpointCorruptError


def _plain() -> dict[str, torch.Tensor]:
    return {
        "w": torch.randn(4, 3),
        "b": torch.randn(3).half(),
        "steps": torch.tensor(7),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 5),
    }


def test_ddpstate_save_is_save_file_plus_its_own_header_entries(tmp_path: Path) -> None:
    sd = _plain()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    one = {"w": torch.randn(3, 2)}  # one key: no key order to keep, so byte for byte
    ddpstate.save(one, ours, metadata={"epoch": "3"})
    safetensors.torch.save_file(one, theirs, metadata={"epoch": "3"})
    assert ours.read_bytes() == theirs.read_bytes()
    for metadata in (None, {"epoch": "3", "note": "ünïcode", "step": "12"}):
        ddpstate.save(sd, ours, metadata=metadata)
        safetensors.torch.save_file(sd, theirs, metadata=metadata)
        (our_header, our_data), (their_header, their_data) = _parts(ours), _parts(theirs)
        assert our_data == their_data  # the same tensors in the same order, bit for bit
        ours_meta = our_header.pop("__metadata__")
        their_header.pop("__metadata__", None)
        assert our_header == their_header
        assert json.loads(ours_meta.pop("ddpstate.key_order")) == list(sd)
        assert ours_meta == (metadata or {})
    assert list(ddpstate.load(ours)) == list(sd)  # the state dict's order comes back


def test_the_data_order_is_the_librarys_for_every_dtype(tmp_path: Path) -> None:
    # ddpstate streams the bytes itself: its layout (the library's dtype order, then
    # names) must be save_file's for every dtype both know, ties of size included.
    sd = {
        f"{9 - i}.{code}": torch.ones(3, dtype=dt)
        for i, (dt, code) in enumerate(DTYPE_NAMES.items())
    }
    sd.update({f"z{k}": torch.zeros(0, dtype=t.dtype) for k, t in list(sd.items())[:4]})
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    ddpstate.save(sd, ours)
    safetensors.torch.save_file(sd, theirs)
    (our_header, our_data), (their_header, their_data) = _parts(ours), _parts(theirs)
    our_header.pop("__metadata__")
    assert our_header == their_header
    assert our_data == their_data


def _parts(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def test_files_written_by_ddpstate_load_with_plain_load_file(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    sd = model.state_dict()
    path = tmp_path / "m.safetensors"
    ddpstate.save(sd, path, metadata={"step": "9"})
    theirs = safetensors.torch.load_file(path)
    assert theirs.keys() == sd.keys()
    assert all(torch.equal(theirs[k], v) for k, v in sd.items())
    with safetensors.safe_open(path, framework="pt") as f:
        meta = f.metadata()
    assert meta["step"] == "9" and "ddpstate.state_dict_metadata" in meta
    back = ddpstate.load(path)
    assert back._metadata == sd._metadata  # type: ignore[attr-defined]
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fresh.load_state_dict(back)


@pytest.mark.parametrize("metadata", [None, {"format": "pt", "k": "v"}])
def test_files_written_by_save_file_load_with_ddpstate(
    tmp_path: Path, metadata: dict[str, str] | None
) -> None:
    sd = _plain()
    path = tmp_path / "ref.safetensors"
    safetensors.torch.save_file(sd, path, metadata=metadata)
    for mmap in (None, False):
        back = ddpstate.load(path, mmap=mmap)
        assert sorted(back) == sorted(sd)
        for key, value in sd.items():
            assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
    assert read_safetensors_header(path).metadata == (metadata or {})
    # A model loads it straight away, through the same call as a torch file.
    net = torch.nn.Linear(2, 2)
    safetensors.torch.save_file(net.state_dict(), tmp_path / "net.safetensors")
    ddpstate.load_model_state(torch.nn.Linear(2, 2), tmp_path / "net.safetensors")


def test_tied_tensors_are_deduplicated_for_the_library_and_restored(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Linear(4, 20, bias=False))
    model[1].weight = model[0].weight
    path = tmp_path / "tied.safetensors"
    with pytest.warns(UserWarning, match=r"1\.weight -> 0\.weight"):
        ddpstate.save(model.state_dict(), path)
    theirs = safetensors.torch.load_file(path)
    assert list(theirs) == ["0.weight"]  # written once
    with safetensors.safe_open(path, framework="pt") as f:
        assert json.loads(f.metadata()[ALIASES_KEY]) == {"1.weight": "0.weight"}
    back = ddpstate.load(path)
    assert back["1.weight"] is back["0.weight"]
    assert torch.equal(back["0.weight"], model[0].weight.detach())


def test_views_the_library_would_refuse_are_stored(tmp_path: Path) -> None:
    base = torch.arange(40.0)
    sd = {
        "all": base,  # holds both halves below: each overlaps it, not each other
        "head": base[:10],
        "tail": base[20:],
        "transposed": torch.randn(3, 5).t(),
        "strided": torch.arange(12)[::4],
        "empty_view": base[5:5],
        "conj": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj(),
    }
    path = tmp_path / "views.safetensors"
    with pytest.warns(UserWarning, match="overlap"):
        ddpstate.save(sd, path)
    theirs = safetensors.torch.load_file(path)
    ours = ddpstate.load(path)
    for key, value in sd.items():
        expected = value.resolve_conj()
        assert torch.equal(theirs[key], expected) and torch.equal(ours[key], expected), key
    # The caller's tensors are untouched.
    assert torch.equal(base, torch.arange(40.0)) and sd["conj"].is_conj()


def test_streams_still_write_files_the_library_reads() -> None:
    sd = _plain()
    buf = io.BytesIO()
    write_safetensors(buf, sd, {"k": "v"})
    theirs = safetensors.torch.load(buf.getvalue())
    assert all(torch.equal(theirs[k], v) for k, v in sd.items())
    assert list(read_safetensors(buf.getvalue())) == list(sd)  # streams keep header order


def test_a_plain_open_file_is_streamed_and_readable_by_the_library(tmp_path: Path) -> None:
    path = tmp_path / "open.safetensors"
    with open(path, "wb") as f:
        f.write(b"")
        write_safetensors(f, {"w": torch.ones(3), "b": torch.zeros(2, dtype=torch.int64)})
    theirs = safetensors.torch.load_file(path)
    assert torch.equal(theirs["w"], torch.ones(3)) and theirs["b"].dtype == torch.int64


@pytest.mark.parametrize("damage", ["truncated", "overlapping", "short_header", "garbage_json"])
def test_files_the_library_refuses_raise_corrupt_naming_the_file(
    tmp_path: Path, damage: str
) -> None:
    path = tmp_path / "bad.safetensors"
    safetensors.torch.save_file({"a": torch.ones(8), "b": torch.ones(2)}, path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    if damage == "truncated":
        raw = raw[:-5]
    elif damage == "overlapping":
        text = raw[8 : 8 + length].replace(b"[32,40]", b"[24,32]")
        assert text != raw[8 : 8 + length]
        raw = raw[:8] + text + raw[8 + length :]
    elif damage == "short_header":
        raw = struct.pack("<Q", length - 8) + raw[8:]
    else:
        raw = raw[:8] + b"{" + b"!" * (length - 1) + raw[8 + length :]
    path.write_bytes(raw)
    for mmap in (True, False):
        with pytest.raises(CheckpointCorruptError, match=r"bad\.safetensors"):
            read_safetensors(path, mmap=mmap)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointCorruptError, match=r"bad\.safetensors"):
            ddpstate.load(path)


def test_save_over_an_existing_file_is_atomic_on_refusal(tmp_path: Path) -> None:
    path = tmp_path / "keep.safetensors"
    ddpstate.save({"w": torch.ones(2)}, path)
    before = path.read_bytes()
    with pytest.raises(ddpstate.CheckpointFormatError, match="'x' is a int"):
        ddpstate.save({"w": torch.zeros(2), "x": 3}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["keep.safetensors"]


def test_the_library_written_file_is_the_one_committed_with_our_mode(tmp_path: Path) -> None:
    # save_file writes its own file (mode 0600) and renames it; the save keeps the
    # previous file's mode, leaves no temp file, and the fsynced inode is the new file.
    path = tmp_path / "mode.safetensors"
    ddpstate.save({"w": torch.ones(2)}, path)
    path.chmod(0o640)
    ddpstate.save({"w": torch.zeros(2)}, path)
    assert path.stat().st_mode & 0o777 == 0o640
    assert torch.equal(safetensors.torch.load_file(path)["w"], torch.zeros(2))
    assert [p.name for p in tmp_path.iterdir()] == ["mode.safetensors"]


def test_a_conjugate_view_is_not_taken_for_a_tie(tmp_path: Path) -> None:
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    sd = {"z": z, "z_conj": z.conj()}
    path = tmp_path / "conj.safetensors"
    with pytest.warns(UserWarning, match="overlap"):
        ddpstate.save(sd, path)
    back = ddpstate.load(path)
    assert torch.equal(back["z"], z) and torch.equal(back["z_conj"], z.conj().resolve_conj())


def _crafted(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


_F32 = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}


@pytest.mark.parametrize(
    "entry",
    [
        {**_F32, "shape": [True]},
        {**_F32, "shape": [1.0]},
        {**_F32, "shape": ["1"]},
        {**_F32, "shape": [1.9]},
        {**_F32, "data_offsets": [0.0, 4]},
        {**_F32, "data_offsets": [False, "4"]},
    ],
    ids=["bool-dim", "float-dim", "text-dim", "fraction-dim", "float-offset", "odd-offsets"],
)
def test_a_stream_header_the_library_refuses_is_refused_by_ddpstate_too(
    tmp_path: Path, entry: dict[str, Any]
) -> None:
    """Bytes and streams are read by ddpstate's own header parser, which took int(x) for an
    integer: shapes and offsets the library's JSON types refuse (true, 1.0, "1") were read."""
    raw = _crafted({"a": entry}, bytes(4))
    with pytest.raises(safetensors.SafetensorError):
        safetensors.torch.load(raw)
    with pytest.raises(CheckpointCorruptError, match="'a'"):
        read_safetensors(raw)
    with pytest.raises(CheckpointCorruptError):
        read_safetensors(io.BytesIO(raw))


@pytest.mark.parametrize("metadata", [[], "", 0, False])
def test_a_falsy_metadata_that_is_not_a_map_is_refused_as_the_library_refuses_it(
    metadata: Any,
) -> None:
    raw = _crafted({"__metadata__": metadata, "a": _F32}, bytes(4))
    with pytest.raises(safetensors.SafetensorError):
        safetensors.torch.load(raw)
    with pytest.raises(CheckpointCorruptError, match="__metadata__"):
        read_safetensors(raw)


@pytest.mark.parametrize(
    "aliases",
    ['{"head": "embed"}', '{"embed": "head", "head": "embed"}', '{"y": "embed", "x": "y"}'],
    ids=["alias-of-a-stored-key", "cycle", "alias-of-an-alias"],
)
def test_aliases_that_would_replace_a_stored_tensor_are_damage_not_applied(
    tmp_path: Path, aliases: str
) -> None:
    """A crafted ddpstate.aliases naming a key the file stores replaced that tensor with
    another: ddpstate.load and verify gave what the library does not (head == embed)."""
    path = tmp_path / "m.safetensors"
    stored = {"embed": torch.zeros(2), "head": torch.ones(2)}
    safetensors.torch.save_file(stored, path, metadata={ALIASES_KEY: aliases})
    assert torch.equal(safetensors.torch.load_file(path)["head"], torch.ones(2))
    for source in (path, path.read_bytes()):
        with pytest.raises(CheckpointCorruptError, match=r"ddpstate\.aliases"):
            read_safetensors(source)
    result = ddpstate.convert.verify_file(path)
    assert not result.ok and "ddpstate.aliases" in result.problems[0]


_TWICE = '"dtype": "F32", "shape": [2], "data_offsets": [0, 8]'


@pytest.mark.parametrize(
    "header",
    [
        '{"__metadata__": {"x": "1"}, "__metadata__": {"x": "2"}, "a": {' + _TWICE + "}}",
        '{"a": {"dtype": "I32", ' + _TWICE + "}}",
    ],
    ids=["metadata-twice", "dtype-twice"],
)
def test_a_header_field_given_twice_is_refused_as_the_library_refuses_it(header: str) -> None:
    """json.loads takes a duplicated name's last value; the library's header types refuse a
    field given twice ("duplicate field"), so ddpstate read bytes and streams it refused."""
    text = header.encode()
    raw = struct.pack("<Q", len(text)) + text + bytes(8)
    with pytest.raises(safetensors.SafetensorError, match="duplicate field"):
        safetensors.torch.load(raw)
    with pytest.raises(CheckpointCorruptError, match="twice"):
        read_safetensors(raw)

    # A tensor's name or a metadata key given twice counts at its last value, in both.
    entry = "{" + _TWICE + "}"
    text = f'{{"__metadata__": {{"k": "1", "k": "2"}}, "a": {entry}, "a": {entry}}}'.encode()
    raw = struct.pack("<Q", len(text)) + text + bytes(range(8))
    theirs = safetensors.torch.load(raw)
    ours = read_safetensors(raw)
    assert list(ours) == list(theirs) == ["a"] and torch.equal(ours["a"], theirs["a"])
    assert read_safetensors_header(raw).metadata == {"k": "2"}


def test_a_nan_in_a_header_is_refused_as_the_library_refuses_it() -> None:
    """Python's json reads NaN and Infinity, which are not JSON; the library refuses them."""
    raw = _crafted({"a": {**_F32, "note": float("nan")}}, bytes(4))
    with pytest.raises(safetensors.SafetensorError):
        safetensors.torch.load(raw)
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        read_safetensors(raw)
