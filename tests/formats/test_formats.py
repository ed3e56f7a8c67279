"""Format detection by bytes, and the safetensors writer/reader (ties, metadata, dtypes)."""

from __future__ import annotations

import collections
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
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpstate import formats
from ddpstate._io.safetensors_io import (
    ALIASES_KEY,
    DTYPE_NAMES,
    STATE_DICT_METADATA_KEY,
    read_safetensors,
    read_safetensors_header,
    safetensors_header_for,
    write_safetensors,
)
from ddpstate._layout.safetensors import KEY_ORDER_KEY
from ddpstate.errors import CheckpointCorruptError, CheckpointFormatError, CheckpointNotFoundError
from ddpstate.formats import detect_format, sniff_format
from tests.samples import RESNET20

SAMPLE = RESNET20


def _write(path: Path, sd: Any, metadata: Any = None) -> dict[str, str]:
    with open(path, "wb") as f:
        return write_safetensors(f, sd, metadata, name=str(path))


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    # Random bytes reinterpreted: every bit pattern (NaN payloads included) must survive.
    nbytes = torch.empty((), dtype=dtype).element_size() * int(torch.tensor(shape).prod())
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


# ------------------------------------------------------------------------------- detection


def test_detect_every_format(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "a.bin")
    torch.save({"w": torch.ones(1)}, tmp_path / "b.pt", _use_new_zipfile_serialization=False)
    _write(tmp_path / "c.pt", {"w": torch.ones(1)})  # safetensors with a misleading suffix
    torch.jit.save(torch.jit.script(torch.nn.Linear(1, 1)), str(tmp_path / "d.pt"))
    assert detect_format(tmp_path / "a.bin") == formats.TORCH_ZIP
    assert detect_format(tmp_path / "b.pt") == formats.LEGACY
    assert detect_format(tmp_path / "c.pt") == "safetensors"
    assert detect_format(tmp_path / "d.pt") == "torchscript"
    with open(tmp_path / "a.bin", "rb") as f:
        assert detect_format(f) == formats.TORCH_ZIP
    (tmp_path / "e.json").write_text('{"not": "a checkpoint"}')
    with pytest.raises(CheckpointFormatError, match="JSON"):
        detect_format(tmp_path / "e.json")
    with pytest.raises(CheckpointNotFoundError):
        detect_format(tmp_path / "missing.pt")
    assert sniff_format(b"") is None


def test_zip_directory_zip64_truncation_and_foreign_zips(tmp_path: Path) -> None:
    import zipfile

    torch.save({"w": torch.ones(3)}, tmp_path / "a.pt")
    raw = bytearray((tmp_path / "a.pt").read_bytes())
    # Point the classic end record at its zip64 record, as files over 4 GiB must.
    at = raw.rfind(b"PK\x05\x06")
    raw[at + 12 : at + 20] = b"\xff" * 8
    (tmp_path / "zip64.pt").write_bytes(raw)
    assert detect_format(tmp_path / "zip64.pt") == formats.TORCH_ZIP
    for cut in (1, 30, len(raw) // 2):
        (tmp_path / "cut.pt").write_bytes(raw[:-cut])
        with pytest.raises(CheckpointCorruptError, match=r"cut\.pt.*truncated"):
            detect_format(tmp_path / "cut.pt")
    st = tmp_path / "cut.safetensors"
    _write(st, {"w": torch.ones(4)})
    st.write_bytes(st.read_bytes()[:20])
    with pytest.raises(CheckpointCorruptError, match=r"cut\.safetensors.*header is cut short"):
        detect_format(st)
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as z:
        z.writestr("docs/readme.txt", "hello")
    with pytest.raises(CheckpointFormatError, match=r"without data.pkl.*docs/readme.txt"):
        detect_format(tmp_path / "other.zip")


@pytest.mark.skipif(not SAMPLE.exists(), reason="needs the shared legacy sample file")
def test_detect_legacy_sample() -> None:
    assert detect_format(SAMPLE) == formats.LEGACY


# ------------------------------------------------------------------------------- safetensors


@pytest.mark.parametrize("dtype", sorted(DTYPE_NAMES, key=str), ids=str)
def test_every_shared_dtype_round_trips_bit_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    sd = {
        "scalar": _sample(dtype, ()),
        "matrix": _sample(dtype, (3, 5)),
        "empty": _sample(dtype, (0, 4)),
        "transposed": _sample(dtype, (4, 6)).t(),  # non-contiguous
        "strided": _sample(dtype, (10,))[::3],
    }
    path = tmp_path / "x.safetensors"
    _write(path, sd)
    for mmap in (True, False):
        back = read_safetensors(path, mmap=mmap)
        assert list(back) == list(sd)  # the library reads data order; ddpstate's entry restores
        for key, value in sd.items():
            assert _same_bits(back[key], value), (key, mmap)
    back = read_safetensors(path.read_bytes())
    assert all(_same_bits(back[k], v) for k, v in sd.items())


def test_other_readers_see_a_valid_file(tmp_path: Path) -> None:
    sd = {"a": torch.randn(3, 2), "b": torch.arange(4, dtype=torch.int64), "c": torch.tensor(1.5)}
    path = tmp_path / "x.safetensors"
    _write(path, sd, {"epoch": "3"})
    theirs = safetensors.torch.load_file(path)
    assert theirs.keys() == sd.keys()
    assert all(torch.equal(theirs[k], v) for k, v in sd.items())
    with safetensors.safe_open(path, framework="pt") as f:
        assert f.metadata()["epoch"] == "3"


def test_files_from_the_reference_writer_read_back(tmp_path: Path) -> None:
    sd = {"x": torch.randn(7), "mask": torch.tensor([True, False]), "h": torch.randn(2, 2).half()}
    path = tmp_path / "ref.safetensors"
    safetensors.torch.save_file(sd, path, metadata={"k": "v"})
    back = read_safetensors(path)
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    assert read_safetensors_header(path).metadata == {"k": "v"}


def test_tied_tensors_are_written_once_and_come_back_shared(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
    model[1].weight = model[0].weight  # embedding = output head
    sd = model.state_dict()
    assert sd["0.weight"].data_ptr() == sd["1.weight"].data_ptr()
    path = tmp_path / "tied.safetensors"
    with pytest.warns(UserWarning, match=r"1\.weight -> 0\.weight"):
        aliases = _write(path, sd)
    assert aliases == {"1.weight": "0.weight"}
    # Written once: the file holds one 50x8 float32 matrix of data.
    header = read_safetensors_header(path)
    assert list(header.tensors) == ["0.weight"]
    assert path.stat().st_size == header.data_start + 50 * 8 * 4
    assert json.loads(header.metadata[ALIASES_KEY]) == {"1.weight": "0.weight"}
    back = read_safetensors(path)
    assert back["1.weight"] is back["0.weight"]
    assert torch.equal(back["1.weight"], sd["0.weight"])
    fresh = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
    fresh.load_state_dict(back)
    assert torch.equal(fresh[1].weight, model[0].weight)


def test_overlapping_but_different_views_are_copied_with_a_warning(tmp_path: Path) -> None:
    base = torch.arange(10.0)
    sd = {"all": base, "tail": base[5:]}
    with pytest.warns(UserWarning, match="overlap"):
        aliases = _write(tmp_path / "o.safetensors", sd)
    assert aliases == {}
    back = read_safetensors(tmp_path / "o.safetensors")
    assert torch.equal(back["tail"], base[5:]) and back["tail"].data_ptr() != back["all"].data_ptr()


def test_state_dict_metadata_and_caller_metadata_survive(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    sd = model.state_dict()
    assert sd._metadata["1"]["version"] == 2  # type: ignore[attr-defined]
    path = tmp_path / "m.safetensors"
    _write(path, sd, {"step": "100", "note": "ünïcode"})
    back = read_safetensors(path)
    assert back._metadata == sd._metadata  # type: ignore[attr-defined]
    meta = read_safetensors_header(path).metadata
    assert meta["step"] == "100" and meta["note"] == "ünïcode"
    assert STATE_DICT_METADATA_KEY in meta
    # _metadata versions are what BatchNorm's loader consults: the round trip loads cleanly.
    torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).load_state_dict(back)


@pytest.mark.parametrize(
    ("sd", "metadata", "match"),
    [
        (
            {"a": torch.ones(1), "step": 3, "cfg": {"lr": 1}},
            None,
            r"'step' is a int.*'cfg' is a dict",
        ),
        ({"nested": {"w": torch.ones(1)}}, None, "'nested' is a dict"),
        ({"s": torch.eye(3).to_sparse()}, None, "sparse_coo.*to_dense"),
        ({"q": torch.ones(2, dtype=torch.float64)}, {"ddpstate.mine": "x"}, "reserved"),
        ({"q": torch.ones(2)}, {"n": 3}, "not str -> str"),
        ({"__metadata__": torch.ones(2)}, None, "reserved by the format"),
        ([torch.ones(1)], None, "flat mapping"),
    ],
)
def test_unstorable_input_is_refused_naming_keys(sd: Any, metadata: Any, match: str) -> None:
    buf = io.BytesIO()
    with pytest.raises(CheckpointFormatError, match=match):
        write_safetensors(buf, sd, metadata)
    assert buf.getvalue() == b""  # refused before anything was written


def test_header_layout_is_aligned_and_padded() -> None:
    sd = collections.OrderedDict(
        b=torch.ones(3, dtype=torch.bool), d=torch.ones(2, dtype=torch.float64)
    )
    header, order, _ = safetensors_header_for(sd)
    assert len(header) % 8 == 0
    assert [k for k, _ in order] == ["d", "b"]  # 8-byte elements first: every tensor aligned
    (length,) = struct.unpack("<Q", header[:8])
    parsed = json.loads(header[8 : 8 + length])
    assert list(parsed) == ["__metadata__", "b", "d"]  # header keeps dict order
    assert json.loads(parsed["__metadata__"][KEY_ORDER_KEY]) == ["b", "d"]


def test_mmap_read_is_private(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    _write(path, {"w": torch.zeros(4)})
    before = path.read_bytes()
    back = read_safetensors(path, mmap=True)
    back["w"].add_(1)
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "damage",
    ["truncate_data", "bad_json", "bad_offsets", "unknown_dtype", "bad_alias"],
)
def test_damaged_files_raise_corrupt(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "d.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _write(path, {"a": torch.ones(4), "b": torch.ones(2)})
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    if damage == "truncate_data":
        raw = raw[:-3]
    elif damage == "bad_json":
        raw = raw[:8] + b"{" + b"x" * (length - 1) + raw[8 + length :]
    else:
        if damage == "bad_offsets":
            header["a"]["data_offsets"] = [0, 12]
        elif damage == "unknown_dtype":
            header["a"]["dtype"] = "F99"
        else:
            header["__metadata__"] = {ALIASES_KEY: json.dumps({"c": "zzz"})}
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        raw = struct.pack("<Q", len(text)) + text + raw[8 + length :]
    path.write_bytes(raw)
    # A dtype code ddpstate does not know is most likely a newer format, not damage.
    error = CheckpointFormatError if damage == "unknown_dtype" else CheckpointCorruptError
    with pytest.raises(error, match=r"d\.safetensors"):
        read_safetensors(path)


def test_mmap_true_needs_a_path() -> None:
    with pytest.raises(CheckpointFormatError, match="mmap=True"):
        read_safetensors(io.BytesIO(b""), mmap=True)


_DTYPES = sorted(DTYPE_NAMES, key=str)


@settings(max_examples=30, deadline=None)
@given(
    entries=st.dictionaries(
        st.text(min_size=1, max_size=12).filter(lambda k: k != "__metadata__"),
        st.tuples(
            st.sampled_from(_DTYPES),
            st.lists(st.integers(0, 4), max_size=3),
            st.booleans(),
        ),
        max_size=6,
    ),
    metadata=st.dictionaries(
        st.text(max_size=8).filter(lambda k: not k.startswith("ddpstate.") and k != "__metadata__"),
        st.text(max_size=8),
        max_size=3,
    ),
)
def test_round_trip_property(entries: dict[str, Any], metadata: dict[str, str]) -> None:
    sd = {}
    for key, (dtype, shape, transpose) in entries.items():
        t = _sample(dtype, tuple(shape))
        sd[key] = t.t() if transpose and t.dim() == 2 else t
    buf = io.BytesIO()
    write_safetensors(buf, sd, metadata)
    back = read_safetensors(buf.getvalue())
    assert list(back) == list(sd)
    assert all(_same_bits(back[k], v) for k, v in sd.items())
    stored = read_safetensors_header(buf.getvalue()).metadata
    assert {k: v for k, v in stored.items() if not k.startswith("ddpstate.")} == metadata
