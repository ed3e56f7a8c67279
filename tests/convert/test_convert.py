"""convert_file / inspect_file / diff_files / verify_file on real checkpoint files."""

from __future__ import annotations

import collections
import io
import os
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn

from ddpstate import formats, keys
from ddpstate._convert.source import read_checkpoint
from ddpstate._io.safetensors_io import read_safetensors
from ddpstate._layout.safetensors import ALIASES_KEY, DTYPES, STATE_DICT_METADATA_KEY
from ddpstate.convert import (
    StateEdit,
    convert_file,
    default_destination,
    diff_files,
    inspect_file,
    verify_file,
)
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointFormatError,
    InvalidArgumentError,
    StateDictNotFoundError,
    UnsafeCheckpointError,
)
from tests.payloads import RunsCommand
from tests.samples import RESNET20, data_offset

SAMPLE = RESNET20


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _trained() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.randn(8, 3)).sum().backward()
    opt.step()
    return net, opt


def _in_order(sd: Any, like: Mapping[str, Any]) -> Any:
    """``sd``'s entries in ``like``'s key order, ``_metadata`` kept."""
    out = collections.OrderedDict((k, sd[k]) for k in like)
    if len(out) != len(sd):
        raise AssertionError(f"keys differ: {sorted(sd)} vs {sorted(like)}")
    out._metadata = getattr(sd, "_metadata", None)  # type: ignore[attr-defined]
    return out


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Deep equality: tensors by value, dtype, shape and class; _metadata included."""
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
        assert a.device.type == "cpu" and b.device.type == "cpu", where
    elif isinstance(a, Mapping):
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), f"{where}._metadata"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _ddp_state_dict(net: nn.Module) -> Any:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return nn.parallel.DistributedDataParallel(net).state_dict()


def _checkpoints() -> dict[str, tuple[Any, str]]:
    """name -> (checkpoint as saved by real wrappers, prefix to strip)."""
    net, opt = _trained()
    compiled = torch.compile(net, backend="eager")
    return {
        "dataparallel": (nn.DataParallel(net).state_dict(), "module."),
        "ddp": ({"model": _ddp_state_dict(net), "step": 10}, "module."),
        "compiled": (compiled.state_dict(), "_orig_mod."),
        "nested": (
            {
                "epoch": 7,
                "state_dict": nn.DataParallel(net).state_dict(),
                "optimizer": opt.state_dict(),
            },
            "module.",
        ),
        "lightning": (
            {
                "epoch": 3,
                "global_step": 120,
                "pytorch-lightning_version": "2.4.0",
                "state_dict": collections.OrderedDict(
                    ("model." + k, v) for k, v in net.state_dict().items()
                ),
                "optimizer_states": [opt.state_dict()],
                "lr_schedulers": [{"last_epoch": 3, "base_lrs": [0.1]}],
                "hyper_parameters": {"lr": 0.1, "name": "net"},
            },
            "model.",
        ),
    }


@pytest.mark.parametrize("name", ["dataparallel", "ddp", "compiled", "nested", "lightning"])
def test_strip_matches_the_in_memory_rules(tmp_path: Path, name: str) -> None:
    ckpt, prefix = _checkpoints()[name]
    src = tmp_path / "src.pt"
    torch.save(ckpt, src)
    loaded = torch.load(src, weights_only=True)
    path, sd = keys.find_state_dict(loaded)
    expected = keys.replace_state_dict(loaded, path, keys.strip_prefix(sd, prefix))

    result = convert_file(src, edit=StateEdit(strip_prefix=prefix))

    assert result.dst == str(tmp_path / "src.converted.pt")
    assert result.renamed == len(sd) and result.state_dict_path == ".".join(path)
    out = torch.load(result.dst, weights_only=True)
    assert_same(out, expected)
    # A plain model takes the result as it is.
    plain = Net()
    plain.load_state_dict(keys.find_state_dict(out)[1])
    # Converting the converted file again changes nothing, to the byte.
    again = convert_file(result.dst, tmp_path / "again.pt", edit=StateEdit(strip_prefix=prefix))
    assert again.renamed == 0
    assert (tmp_path / "again.pt").read_bytes() == Path(result.dst).read_bytes()


def test_conflicting_arguments_are_named_and_leave_the_source_alone(tmp_path: Path) -> None:
    src = tmp_path / "dp.pt"
    torch.save({"module.w": torch.ones(3)}, src)
    before = src.read_bytes()
    with pytest.raises(InvalidArgumentError, match="needs fsync"):
        convert_file(src, edit=StateEdit(strip_prefix="module."), in_place=True, fsync=False)
    with pytest.raises(ValueError, match="at most one"):  # still a ValueError for old handlers
        convert_file(src, edit=StateEdit(strip_prefix="module.", normalize=True))
    assert src.read_bytes() == before and os.listdir(tmp_path) == ["dp.pt"]


def test_normalize_and_add_prefix_match_keys(tmp_path: Path) -> None:
    net, _ = _trained()
    sd = torch.compile(nn.DataParallel(net), backend="eager").state_dict()
    src = tmp_path / "mixed.pt"
    torch.save(sd, src)
    convert_file(src, tmp_path / "norm.pt", edit=StateEdit(normalize=True))
    assert_same(torch.load(tmp_path / "norm.pt"), keys.normalize_keys(torch.load(src)))
    convert_file(tmp_path / "norm.pt", tmp_path / "dp.pt", edit=StateEdit(add_prefix="module."))
    assert_same(
        torch.load(tmp_path / "dp.pt"), keys.add_prefix(torch.load(tmp_path / "norm.pt"), "module.")
    )


def test_tensor_records_are_copied_byte_for_byte_and_load_with_mmap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, _ = _checkpoints()["nested"]
    src = tmp_path / "src.pt"
    torch.save(ckpt, src)
    dst = convert_file(src, edit=StateEdit(strip_prefix="module.")).dst
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst) as b:
        old = sorted(a.read(n) for n in a.namelist() if "/data/" in n)
        new = sorted(b.read(n) for n in b.namelist() if "/data/" in n)
        assert old == new
        assert b.testzip() is None  # every CRC in the output is right
        names = [i.filename for i in b.infolist()]
        for name in names:
            offset = data_offset(Path(dst), name)[0]
            assert offset % 64 == 0, name
    # torch.load(mmap=True) with torch's own offset arithmetic and its debug checks.
    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    from torch.utils.serialization import config

    # torch's own patch context: a monkeypatch of the config proxy is not undone
    # faithfully by every pytest (9.2 deletes the entry, breaking every later load).
    with config.patch({"load.calculate_storage_offsets": True}):
        mapped = torch.load(dst, mmap=True, weights_only=True)
    assert_same(mapped["optimizer"], ckpt["optimizer"])


def _retag(path: Path, location: bytes) -> None:
    """Rewrite the device tag of every storage in a torch.save file (as a GPU save would)."""
    with zipfile.ZipFile(path) as zin:
        entries = [(i.filename, zin.read(i.filename)) for i in zin.infolist()]
    with zipfile.ZipFile(path, "w") as zout:
        for name, data in entries:
            if name.endswith("data.pkl"):
                data = data.replace(
                    b"X\x03\x00\x00\x00cpu", b"X" + struct.pack("<I", len(location)) + location
                )
            zout.writestr(name, data)


def test_output_storages_are_tagged_cpu(tmp_path: Path) -> None:
    src = tmp_path / "gpu.pt"
    torch.save({"module.w": torch.arange(4.0)}, src)
    _retag(src, b"cuda:0")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(src, weights_only=True)
    assert inspect_file(src).devices == {"cuda:0": 1}
    dst = convert_file(src, edit=StateEdit(strip_prefix="module.")).dst
    assert inspect_file(dst).devices == {"cpu": 1}
    assert_same(torch.load(dst, weights_only=True), {"w": torch.arange(4.0)})


def test_views_shared_storages_parameters_and_dtypes(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = collections.OrderedDict(
        [
            ("module.base", base),
            ("module.view", base[1:3, 2:]),  # a view into the same storage
            ("module.t", base.t()),  # non-contiguous
            ("module.tied", base),  # the same tensor twice
            ("module.p", nn.Parameter(torch.ones(3))),
            ("module.f8", torch.tensor([0.5, 1.0]).to(torch.float8_e4m3fn)),
            ("module.u16", torch.tensor([1, 2, 3], dtype=torch.int32).to(torch.uint16)),
            ("module.bf16", torch.randn(5).to(torch.bfloat16)),
            ("module.flag", torch.tensor([True, False])),
            ("module.empty", torch.zeros(0, 3)),
            ("module.scalar", torch.tensor(3.5, dtype=torch.float64)),
        ]
    )
    src = tmp_path / "views.pt"
    torch.save(sd, src)
    dst = convert_file(src, edit=StateEdit(strip_prefix="module.")).dst
    out = torch.load(dst, weights_only=True)
    assert_same(out, keys.strip_prefix(torch.load(src, weights_only=True)))
    assert type(out["p"]) is nn.Parameter and out["p"].requires_grad
    assert out["view"].untyped_storage().data_ptr() == out["base"].untyped_storage().data_ptr()
    assert out["tied"] is out["base"]

    st = convert_file(dst, format="safetensors")
    assert st.dst == str(tmp_path / "views.converted.safetensors")
    header = safetensors.torch.load_file(st.dst)
    assert "tied" not in header  # written once ...
    back = read_safetensors(st.dst)
    assert back["tied"] is back["base"]  # ... and restored as the same tensor
    for key, value in out.items():
        assert torch.equal(back[key], value.detach()), key
    assert any("overlap" in n for n in st.notes) and any("tied" in n for n in st.notes)


def test_safetensors_round_trip_and_metadata(tmp_path: Path) -> None:
    net, _ = _trained()
    sd = nn.DataParallel(net).state_dict()
    src = tmp_path / "m.pt"
    torch.save({"epoch": 2, "state_dict": sd, "optimizer": {"state": {}, "param_groups": []}}, src)

    result = convert_file(src, edit=StateEdit(strip_prefix="module."), format="safetensors")
    assert result.dst == str(tmp_path / "m.safetensors")
    assert result.left_out == ("epoch", "optimizer")
    expected = keys.strip_prefix(sd)
    loaded = read_safetensors(result.dst)
    assert list(loaded) == list(expected)  # the state dict's order, kept in the header
    assert_same(_in_order(loaded, expected), expected)
    with safetensors.safe_open(result.dst, "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and STATE_DICT_METADATA_KEY in meta

    # safetensors -> safetensors: header rewritten, data copied.
    again = convert_file(
        result.dst, tmp_path / "dp.safetensors", edit=StateEdit(add_prefix="module.")
    )
    prefixed = keys.add_prefix(expected, "module.")
    assert_same(_in_order(read_safetensors(again.dst), prefixed), prefixed)
    # safetensors -> pt: a plain state dict that a plain model loads.
    pt = convert_file(result.dst, tmp_path / "plain.pt", format="pt")
    assert_same(torch.load(pt.dst, weights_only=True), expected)
    Net().load_state_dict(torch.load(pt.dst, weights_only=True))


def test_key_path_and_drop_optimizer(tmp_path: Path) -> None:
    net, opt = _trained()
    ckpt = {
        "model": {"ema": nn.DataParallel(net).state_dict(), "live": net.state_dict()},
        "optimizer_states": [opt.state_dict()],
        "opt": opt.state_dict(),
        "epoch": 4,
    }
    src = tmp_path / "ema.pt"
    torch.save(ckpt, src)
    with pytest.raises(StateDictNotFoundError):
        convert_file(src, edit=StateEdit(strip_prefix="module."))
    result = convert_file(
        src, edit=StateEdit(key="model.ema", strip_prefix="module.", drop_optimizer=True)
    )
    assert result.dropped == ("optimizer_states", "opt")
    out = torch.load(result.dst, weights_only=True)
    assert list(out) == ["model", "epoch"]
    assert_same(out["model"]["ema"], keys.strip_prefix(nn.DataParallel(net).state_dict()))
    assert_same(out["model"]["live"], net.state_dict())


def test_destination_rules(tmp_path: Path) -> None:
    src = tmp_path / "a.pt"
    torch.save({"module.w": torch.ones(1)}, src)
    dst = tmp_path / "b.pt"
    dst.write_bytes(b"keep me")
    with pytest.raises(CheckpointExistsError, match="--force"):
        convert_file(src, dst, edit=StateEdit(strip_prefix="module."))
    assert dst.read_bytes() == b"keep me"
    convert_file(src, dst, edit=StateEdit(strip_prefix="module."), overwrite=True)
    assert list(torch.load(dst)) == ["w"]
    with pytest.raises(CheckpointExistsError, match="in-place"):
        convert_file(src, src, edit=StateEdit(strip_prefix="module."))
    folder = tmp_path / "out"
    folder.mkdir()
    assert convert_file(src, folder, format="safetensors").dst == str(folder / "a.safetensors")

    before = src.stat().st_ino
    convert_file(src, edit=StateEdit(strip_prefix="module."), in_place=True)
    assert list(torch.load(src)) == ["w"] and src.stat().st_ino != before
    untouched = convert_file(src, edit=StateEdit(strip_prefix="module."), in_place=True)
    assert not untouched.written and src.stat().st_ino != before
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "b.pt", "out"]  # no temporary left

    assert default_destination("x/ckpt.tar", "pt") == "x/ckpt.converted.tar"
    assert default_destination("model.safetensors", "pt") == "model.pt"
    assert default_destination("weights", "safetensors") == "weights.safetensors"


def test_real_dataparallel_sample_converts_and_loads_on_cpu(tmp_path: Path) -> None:
    if not SAMPLE.exists():
        pytest.skip(f"sample checkpoint not found at {SAMPLE}")
    info = inspect_file(SAMPLE)
    assert info.format == formats.LEGACY and info.devices == {"cuda:0": 97}
    assert info.prefixes == ("module.",) and len(info.tensors) == 97
    result = convert_file(SAMPLE, tmp_path / "resnet20.pt", edit=StateEdit(strip_prefix="module."))
    assert result.renamed == 97
    original = torch.load(SAMPLE, map_location="cpu", weights_only=True)
    out = torch.load(tmp_path / "resnet20.pt", weights_only=True)  # no map_location needed
    assert out["best_prec1"] == original["best_prec1"]
    for key, value in original["state_dict"].items():
        assert torch.equal(out["state_dict"][key[len("module.") :]], value)


def test_inspect_reads_structure_without_data(tmp_path: Path) -> None:
    ckpt, _ = _checkpoints()["lightning"]
    src = tmp_path / "l.pt"
    torch.save(ckpt, src)
    info = inspect_file(src)
    assert info.format == formats.TORCH_ZIP and info.state_dict_path == "state_dict"
    assert info.prefixes == ("model.",)
    structure = dict(info.structure)
    assert structure["state_dict"].startswith(
        f"model state dict: {len(ckpt['state_dict'])} tensors"
    )
    assert structure["optimizer_states"].startswith("optimizer states")
    assert structure["epoch"] == "int 3"
    assert [t.name for t in info.tensors] == list(ckpt["state_dict"])
    assert sum(info.dtype_bytes.values()) == info.tensor_bytes and "int64" in info.dtype_bytes
    # Data records zeroed: inspect does not read them, so it does not notice.
    raw = bytearray(src.read_bytes())
    start, size = data_offset(src, "data/0")
    raw[start : start + size] = bytes(size)
    src.write_bytes(bytes(raw))
    assert inspect_file(src).tensor_count == info.tensor_count
    assert not verify_file(src).ok  # verify does read them


def test_diff_reports_keys_shapes_and_values(tmp_path: Path) -> None:
    a = {"module.w": torch.ones(3), "module.b": torch.zeros(2), "module.only_a": torch.ones(1),
         "module.nan": torch.tensor([float("nan"), 1.0])}  # fmt: skip
    b = {"w": torch.ones(3) + 1e-4, "b": torch.zeros(3), "only_b": torch.ones(1),
         "nan": torch.tensor([float("nan"), 1.0])}  # fmt: skip
    torch.save(a, tmp_path / "a.pt")
    safetensors.torch.save_file(b, tmp_path / "b.safetensors")
    result = diff_files(tmp_path / "a.pt", tmp_path / "b.safetensors", atol=1e-3)
    assert result.only_a == ("only_a",) and result.only_b == ("only_b",)
    assert result.mismatched == (("b", "tensor float32 [2]", "tensor float32 [3]"),)
    assert result.max_abs_diff["nan"] == 0.0
    assert 0 < result.max_abs_diff["w"] < 1e-3 and not result.equal
    strict = diff_files(tmp_path / "a.pt", tmp_path / "b.safetensors")
    assert strict.different_values == ("w",)
    raw = diff_files(tmp_path / "a.pt", tmp_path / "b.safetensors", raw_keys=True)
    assert len(raw.only_a) == 4 and not raw.max_abs_diff


def test_verify_finds_damage(tmp_path: Path) -> None:
    src = tmp_path / "v.pt"
    torch.save({"w": torch.arange(100.0)}, src)
    assert verify_file(src).ok
    raw = bytearray(src.read_bytes())
    raw[data_offset(src, "data/0")[0] + 5] ^= 0xFF
    (tmp_path / "flipped.pt").write_bytes(bytes(raw))
    bad = verify_file(tmp_path / "flipped.pt")
    assert not bad.ok and "CRC-32" in bad.problems[0]

    (tmp_path / "cut.pt").write_bytes(src.read_bytes()[:-200])
    assert not verify_file(tmp_path / "cut.pt").ok
    safetensors.torch.save_file({"w": torch.arange(100.0)}, tmp_path / "w.safetensors")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "w.safetensors").read_bytes()[:-8])
    cut = verify_file(tmp_path / "cut.safetensors")
    assert not cut.ok and "ends at" in " ".join(cut.problems)
    if SAMPLE.exists():
        (tmp_path / "cut.th").write_bytes(SAMPLE.read_bytes()[:-1000])
        assert "damaged legacy" in " ".join(verify_file(tmp_path / "cut.th").problems)
        with pytest.raises(CheckpointCorruptError):
            convert_file(tmp_path / "cut.th", edit=StateEdit(strip_prefix="module."))
        assert not (tmp_path / "cut.converted.th").exists()
    with pytest.raises(CheckpointFormatError, match="folder"):
        verify_file(tmp_path)


def test_unsafe_pickles_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    src = tmp_path / "evil.pt"
    torch.save({"state_dict": {"module.w": torch.ones(2)}, "x": RunsCommand(str(marker))}, src)
    with pytest.raises(UnsafeCheckpointError, match="weights_only=False") as info:
        inspect_file(src)
    assert info.value.unsafe_globals == (f"{os.system.__module__}.system",)
    for refused in (verify_file, lambda p: diff_files(p, p), convert_file):
        with pytest.raises(UnsafeCheckpointError):
            refused(src)
    assert not marker.exists()
    # weights_only=False (--unsafe) is torch's full unpickler: it runs what the file names.
    result = convert_file(src, edit=StateEdit(strip_prefix="module."), weights_only=False)
    assert marker.exists()
    assert inspect_file(result.dst).tensors[0].name == "w"


def test_pickled_whole_module_is_named_and_read_with_unsafe(tmp_path: Path) -> None:
    net, _ = _trained()
    src = tmp_path / "whole.pt"
    torch.save(nn.DataParallel(net), src)
    with pytest.raises(UnsafeCheckpointError, match=r"whole pickled nn\.Module"):
        inspect_file(src)
    info = inspect_file(src, weights_only=False)
    assert "pickled whole nn.Module" in info.notes[0]
    assert [t.name for t in info.tensors] == list(nn.DataParallel(net).state_dict())
    result = convert_file(
        src, edit=StateEdit(strip_prefix="module."), format="safetensors", weights_only=False
    )
    for key, value in net.state_dict().items():
        assert torch.equal(read_safetensors(result.dst)[key], value)


def test_torchscript_and_non_checkpoints_are_named(tmp_path: Path) -> None:
    scripted = tmp_path / "net.ts"
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), scripted)
    with pytest.raises(CheckpointFormatError, match="TorchScript"):
        inspect_file(scripted)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(CheckpointFormatError, match="not a checkpoint"):
        convert_file(text, edit=StateEdit(strip_prefix="module."))
    assert sorted(os.listdir(tmp_path)) == ["net.ts", "notes.txt"]


def test_read_checkpoint_dispatches_folders_and_files(tmp_path: Path) -> None:
    """The opener: a file goes to the single-file reader, a folder holding a
    Hugging Face index to the sharded reader, a DCP folder and a plain folder are refused."""
    weights = {"w": torch.arange(4.0), "b": torch.ones(2)}
    single = tmp_path / "m.safetensors"
    safetensors.torch.save_file(weights, single)
    ckpt = read_checkpoint(str(single))
    assert (ckpt.format, sorted(ckpt.obj)) == ("safetensors", ["b", "w"])
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    safetensors.torch.save_file(weights, sharded / "model.safetensors")
    (sharded / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"w": "model.safetensors", "b": "model.safetensors"}}'
    )
    for where in (sharded, sharded / "model.safetensors.index.json"):
        ckpt = read_checkpoint(str(where))
        assert (ckpt.format, sorted(ckpt.obj)) == (formats.HF_SHARDED, ["b", "w"])
    dcp_folder = tmp_path / "dcp"
    dcp_folder.mkdir()
    (dcp_folder / ".metadata").write_bytes(b"")
    refused = r"torch\.distributed\.checkpoint folder; this command"
    with pytest.raises(CheckpointFormatError, match=refused):
        read_checkpoint(str(dcp_folder))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointFormatError, match="a folder, not a checkpoint file"):
        read_checkpoint(str(empty))


def test_format_tables_match_torch_and_safetensors() -> None:
    from ddpstate._io import safetensors_io as formats

    assert formats.ALIASES_KEY == ALIASES_KEY
    assert formats.STATE_DICT_METADATA_KEY == STATE_DICT_METADATA_KEY
    for code, (name, itemsize) in DTYPES.items():
        dtype = getattr(torch, name)
        assert torch.empty((), dtype=dtype).element_size() == itemsize, code
        # The reference implementation writes the same code for the dtype.
        raw = safetensors.torch.save({"t": torch.zeros(1, dtype=dtype)})
        assert f'"dtype":"{code}"'.encode() in raw, code


def test_remote_urls_go_through_fsspec() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    buffer = io.BytesIO()
    torch.save({"state_dict": {"module.w": torch.arange(5.0)}, "opt": {"lr": 0.1}}, buffer)
    with fs.open("/convert-test/a.pt", "wb") as f:
        f.write(buffer.getvalue())
    try:
        edit = StateEdit(strip_prefix="module.", drop_optimizer=True)
        result = convert_file("memory://convert-test/a.pt", edit=edit)
        assert result.dst == "memory://convert-test/a.converted.pt" and result.dropped == ()
        with fs.open("/convert-test/a.converted.pt", "rb") as f:
            out = torch.load(io.BytesIO(f.read()), weights_only=True)
        assert_same(out, {"state_dict": {"w": torch.arange(5.0)}, "opt": {"lr": 0.1}})
        assert verify_file(result.dst).ok
    finally:
        fs.rm("/convert-test", recursive=True)


def test_progress_bar_only_for_slow_work_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpstate import _progress as _progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    quick = Terminal()
    bar = _progress.Progress(100, "convert", stream=quick)
    bar.update(100)
    bar.close()
    assert quick.getvalue() == ""  # done within the first second: nothing drawn
    monkeypatch.setattr(_progress, "_DELAY_S", 0.0)
    slow = Terminal()
    bar = _progress.Progress(2 << 20, "convert", stream=slow)
    bar.update(1 << 20)
    bar.close()
    assert "convert [" in slow.getvalue() and "100.0%" not in slow.getvalue()
    assert slow.getvalue().endswith("\n")
    piped = io.StringIO()
    bar = _progress.Progress(10, "convert", stream=piped)
    bar.update(10)
    bar.close()
    assert piped.getvalue() == ""


def test_old_argument_names_still_work_and_name_the_new_ones(tmp_path: Path) -> None:
    src = tmp_path / "dp.pt"
    optimizer = {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    torch.save({"state_dict": {"module.w": torch.ones(2)}, "optimizer": optimizer}, src)
    with pytest.warns(DeprecationWarning) as caught:
        old = convert_file(
            src, tmp_path / "old.pt", strip_prefix="module.", drop_optimizer=True, to="pt",
            unsafe=False,
        )  # fmt: skip
    said = " ".join(str(w.message) for w in caught)
    for new in ("edit=StateEdit(strip_prefix='module.')", "format='pt'", "weights_only=True"):
        assert new in said, said
    edit = StateEdit(strip_prefix="module.", drop_optimizer=True)
    new_result = convert_file(src, tmp_path / "new.pt", edit=edit, format="pt")
    assert (
        (old.renamed, old.dropped)
        == (new_result.renamed, new_result.dropped)
        == (1, ("optimizer",))
    )
    assert (tmp_path / "old.pt").read_bytes() == (tmp_path / "new.pt").read_bytes()
    with pytest.warns(DeprecationWarning, match=r"inspect_file\(unsafe=...\).*weights_only=False"):
        assert inspect_file(src, unsafe=True).state_dict_path == "state_dict"
    with pytest.warns(DeprecationWarning, match=r"verify_file\(unsafe=...\).*weights_only=False"):
        assert verify_file(src, unsafe=True).ok
    with pytest.warns(DeprecationWarning, match=r"diff_files\(unsafe=...\).*weights_only=False"):
        assert diff_files(src, src, unsafe=True).equal
    with pytest.raises(TypeError, match="unexpected keyword argument 'strip'"):
        convert_file(src, strip="module.")
    with pytest.raises(TypeError, match="unexpected keyword argument 'to'"):
        inspect_file(src, to="pt")
    with pytest.warns(DeprecationWarning), pytest.raises(InvalidArgumentError, match="not both"):
        convert_file(src, edit=StateEdit(), key="state_dict")
    with pytest.raises(InvalidArgumentError, match="pass format= only"):
        convert_file(src, format="pt", to="pt")
    with pytest.raises(InvalidArgumentError, match="at most one of strip_prefix"):
        StateEdit(strip_prefix="module.", normalize=True)
