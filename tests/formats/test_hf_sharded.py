"""Hugging Face sharded checkpoints (index JSON + shards): load, inspect, diff, verify, convert."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

import ddpstate
from ddpstate import formats
from ddpstate.cli import main
from ddpstate.convert import convert_file, diff_files, inspect_file, verify_file
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    ShapeMismatchError,
    UnsafeCheckpointError,
)


class Net(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 2)


def _state() -> collections.OrderedDict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = Net()
    sd = net.state_dict()
    sd["norm.num_batches_tracked"] = torch.tensor(7)
    return collections.OrderedDict((k, v.clone()) for k, v in sd.items())


def write_hf(
    folder: Path, sd: dict[str, torch.Tensor], shards: int = 3, *, bin: bool = False
) -> Path:
    """Write ``sd`` the way transformers does: numbered shards and an index with weight_map."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = list(sd)
    per = -(-len(keys) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(shards):
        part = {k: sd[k] for k in keys[i * per : (i + 1) * per]}
        ext = "bin" if bin else "safetensors"
        stem = "pytorch_model" if bin else "model"
        name = f"{stem}-{i + 1:05d}-of-{shards:05d}.{ext}"
        if bin:
            torch.save(part, folder / name)
        else:
            safetensors.torch.save_file(part, str(folder / name), metadata={"format": "pt"})
        for k, v in part.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    index = "pytorch_model.bin.index.json" if bin else "model.safetensors.index.json"
    (folder / index).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return folder / index


def assert_equal_sd(got: Any, want: dict[str, torch.Tensor], *, ordered: bool = True) -> None:
    """Same keys (in the same order unless not ``ordered``), dtypes and values."""
    assert list(got) == list(want) if ordered else sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("bin", [False, True], ids=["safetensors", "bin"])
def test_load_folder_and_index(tmp_path: Path, bin: bool) -> None:
    sd = _state()
    index = write_hf(tmp_path / "m", sd, bin=bin)
    assert ddpstate.detect_format(tmp_path / "m") == formats.HF_SHARDED
    assert ddpstate.detect_format(index) == formats.HF_SHARDED
    for source in (tmp_path / "m", index):
        assert_equal_sd(ddpstate.load(source, map_location="cpu"), sd)
    net = Net()
    assert ddpstate.load_model_state(net, tmp_path / "m", map_location="cpu") == ([], [])
    assert_equal_sd(net.state_dict(), sd)
    # keys normalized as everywhere: a DDP-style wrapped model takes them too
    wrapped = nn.DataParallel(Net())
    ddpstate.load_model_state(wrapped, index, map_location="cpu")
    assert torch.equal(wrapped.module.head.weight, sd["head.weight"])


def test_load_model_state_shape_mismatch(tmp_path: Path) -> None:
    write_hf(tmp_path / "m", _state())
    with pytest.raises(ShapeMismatchError, match=r"size mismatch for 12 tensor.*embed\.weight"):
        ddpstate.load_model_state(Net(width=5), tmp_path / "m", map_location="cpu")


def test_bin_shards_are_loaded_weights_only(tmp_path: Path) -> None:
    sd = _state()
    write_hf(tmp_path / "m", sd, bin=True)
    shard = tmp_path / "m" / "pytorch_model-00002-of-00003.bin"
    part = torch.load(shard, weights_only=True)
    torch.save({**part, "layers.0.weight": Net()}, shard)  # a pickled module: unsafe
    with pytest.raises(UnsafeCheckpointError, match="00002-of-00003"):
        ddpstate.load(tmp_path / "m", map_location="cpu")


def test_folder_with_two_indexes_is_refused(tmp_path: Path) -> None:
    sd = _state()
    write_hf(tmp_path / "m", sd)
    write_hf(tmp_path / "m", sd, bin=True)
    for call in (
        lambda: ddpstate.load(tmp_path / "m"),
        lambda: inspect_file(tmp_path / "m"),
        lambda: verify_file(tmp_path / "m"),
    ):
        with pytest.raises(CheckpointFormatError) as info:
            call()
        assert "model.safetensors.index.json" in str(info.value)
        assert "pytorch_model.bin.index.json" in str(info.value)
    # naming the index itself is unambiguous
    assert_equal_sd(ddpstate.load(tmp_path / "m" / "pytorch_model.bin.index.json"), sd)


def test_index_and_shards_out_of_step(tmp_path: Path) -> None:
    sd = _state()
    index = write_hf(tmp_path / "m", sd)
    data = json.loads(index.read_text())
    data["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointCorruptError, match=r"'ghost\.weight'"):
        ddpstate.load(index, map_location="cpu")
    with pytest.raises(CheckpointCorruptError, match=r"'ghost\.weight'"):
        inspect_file(index)
    del data["weight_map"]["ghost.weight"]
    data["weight_map"]["head.bias"] = "../elsewhere.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointCorruptError, match="outside the index's folder"):
        ddpstate.load(index)
    data["weight_map"]["head.bias"] = "model-00003-of-00003.safetensors"
    index.write_text(json.dumps(data))
    (tmp_path / "m" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"00002-of-00003\.safetensors"):
        ddpstate.load(index)


def test_inspect_and_convert(tmp_path: Path) -> None:
    sd = _state()
    write_hf(tmp_path / "m", sd)
    info = inspect_file(tmp_path / "m")
    assert info.format == formats.HF_SHARDED
    assert [t.name for t in info.tensors] == list(sd)
    assert info.tensor_bytes == sum(v.numel() * v.element_size() for v in sd.values())
    for suffix in ("pt", "safetensors"):
        out = tmp_path / f"one.{suffix}"
        result = convert_file(tmp_path / "m", out)
        assert result.src_format == formats.HF_SHARDED and result.tensors == len(sd)
        # key order is the single-file reader's business, not this test's
        assert_equal_sd(ddpstate.load(out, map_location="cpu"), sd, ordered=suffix == "pt")
    assert_equal_sd(torch.load(tmp_path / "one.pt", weights_only=True), sd)


def test_diff_sharded_against_single_file(tmp_path: Path) -> None:
    sd = _state()
    write_hf(tmp_path / "m", sd)
    torch.save({"state_dict": sd}, tmp_path / "one.pt")
    assert diff_files(tmp_path / "m", tmp_path / "one.pt").equal
    changed = dict(sd)
    changed["layers.2.bias"] = sd["layers.2.bias"] + 0.5
    write_hf(tmp_path / "n", changed)
    result = diff_files(tmp_path / "m", tmp_path / "n" / "model.safetensors.index.json")
    assert result.different_values == ("layers.2.bias",)
    assert result.max_abs_diff["layers.2.bias"] == pytest.approx(0.5)


def test_verify(tmp_path: Path) -> None:
    sd = _state()
    index = write_hf(tmp_path / "m", sd)
    good = verify_file(tmp_path / "m")
    assert good.ok and good.format == formats.HF_SHARDED and good.tensors == len(sd)
    data = json.loads(index.read_text())

    data["metadata"]["total_size"] += 4
    index.write_text(json.dumps(data))
    (problem,) = verify_file(index).problems
    assert "total_size" in problem
    data["metadata"]["total_size"] -= 4

    # a key in two shards: the index names one, the other shard holds it too
    shard3 = tmp_path / "m" / "model-00003-of-00003.safetensors"
    part = safetensors.torch.load_file(str(shard3))
    safetensors.torch.save_file({**part, "embed.weight": sd["embed.weight"]}, str(shard3))
    index.write_text(json.dumps(data))
    problems = verify_file(index).problems
    assert any("'embed.weight'" in p and "00003-of-00003" in p for p in problems), problems
    safetensors.torch.save_file(part, str(shard3))

    # damaged tensor bytes: the safetensors shard is cut short
    shard2 = tmp_path / "m" / "model-00002-of-00003.safetensors"
    raw = shard2.read_bytes()
    shard2.write_bytes(raw[:-3])
    problems = verify_file(tmp_path / "m").problems
    assert problems and all("model-00002-of-00003.safetensors" in p for p in problems), problems
    shard2.unlink()
    problems = verify_file(tmp_path / "m").problems
    assert problems == ("shard model-00002-of-00003.safetensors is missing (the index names it)",)


def test_cli_reads_sharded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = _state()
    write_hf(tmp_path / "m", sd, bin=True)
    torch.save(sd, tmp_path / "one.pt")
    assert main(["inspect", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "Hugging Face sharded checkpoint" in out and "layers.2.weight" in out
    assert main(["verify", "-q", str(tmp_path / "m")]) == 0
    assert main(["diff", "-q", str(tmp_path / "m"), str(tmp_path / "one.pt")]) == 0
    assert main(["convert", "-q", str(tmp_path / "m"), str(tmp_path / "out.safetensors")]) == 0
    # plain safetensors returns the keys in file-offset order
    loaded = safetensors.torch.load_file(str(tmp_path / "out.safetensors"))
    assert_equal_sd(loaded, sd, ordered=False)
    assert os.path.exists(tmp_path / "out.safetensors")


def test_remote_sharded_checkpoint(tmp_path: Path) -> None:
    import fsspec

    sd = _state()
    local = write_hf(tmp_path / "m", sd)
    fs = fsspec.filesystem("memory")
    for path in local.parent.iterdir():
        fs.pipe(f"/hf-remote/m/{path.name}", path.read_bytes())
    try:
        assert ddpstate.detect_format("memory://hf-remote/m") == formats.HF_SHARDED
        assert_equal_sd(ddpstate.load("memory://hf-remote/m", map_location="cpu"), sd)
        assert verify_file("memory://hf-remote/m").ok
        assert diff_files("memory://hf-remote/m", local).equal
        with pytest.raises(CheckpointFormatError, match="remote"):
            ddpstate.load("memory://hf-remote/m", mmap=True)
    finally:
        fs.rm("/hf-remote", recursive=True)


def _two_rank_worker(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import ddpstate as ds

    torch.manual_seed(1)
    net = Net()
    ds.save_model_state(net, folder, max_shard_size=400)
    fresh = Net()
    ds.load_model_state(fresh, folder, map_location="cpu")
    broadcast = Net()
    ds.load_model_state(broadcast, folder, map_location="cpu", src_rank=1)
    same = all(
        torch.equal(a, b) and torch.equal(a, c)
        for a, b, c in zip(
            net.state_dict().values(),
            fresh.state_dict().values(),
            broadcast.state_dict().values(),
            strict=True,
        )
    )
    if rank == 0:
        with open(os.path.join(folder, "notes.txt"), "w") as f:
            f.write("mine")
    try:
        ds.save_model_state(net, folder, max_shard_size=400)
        refused = None
    except ds.CheckpointExistsError as exc:
        refused = str(exc)
    return {"same": same, "refused": refused}


@pytest.mark.slow
def test_two_ranks_save_and_load_sharded(tmp_path: Path) -> None:
    from tests.multiproc import run_ranks

    folder = tmp_path / "shared"
    results = run_ranks(_two_rank_worker, 2, args=(str(folder),), timeout=120)
    assert all(r["same"] for r in results)
    # the writer's refusal reaches both ranks, naming the file that would be lost
    assert all(r["refused"] and "notes.txt" in r["refused"] for r in results), results
    shards = sorted(p.name for p in folder.iterdir() if p.name.endswith(".safetensors"))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert (folder / "notes.txt").read_text() == "mine"


def test_convert_names_and_in_place(tmp_path: Path) -> None:
    sd = _state()
    index = write_hf(tmp_path / "m", sd)
    # the default output is named after the folder, whichever path was given
    assert convert_file(index).dst == str(tmp_path / "m.converted.pt")
    assert convert_file(tmp_path / "m", to="safetensors").dst == str(tmp_path / "m.safetensors")
    with pytest.raises(InvalidArgumentError, match="sharded"):
        convert_file(tmp_path / "m", in_place=True)
    assert_equal_sd(torch.load(tmp_path / "m.converted.pt", weights_only=True), sd)
