"""Writing the Hugging Face sharded layout: convert --max-shard-size and save(max_shard_size=)."""

from __future__ import annotations

import json
import os
import warnings
import zipfile
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import ddpstate
from ddpstate import formats
from ddpstate._layout.hf_write import parse_size
from ddpstate.cli import main
from ddpstate.convert import convert_file, verify_file
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    InvalidArgumentError,
)
from tests.samples import data_offset


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)  # 4 KiB
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(6)])  # 1,088 B each
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight  # tied


def _model() -> LM:
    torch.manual_seed(0)
    return LM()


def check_layout(folder: Path, limit: int, want: dict[str, torch.Tensor]) -> dict[str, str]:
    """The layout's rules, read with plain json and safetensors; returns the weight map."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(os.listdir(folder)) == sorted([*shards, "model.safetensors.index.json"])
    held: dict[str, str] = {}
    total = 0
    for shard in shards:
        tensors = safetensors.torch.load_file(str(folder / shard))  # plain safetensors reads it
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= limit or len(tensors) == 1, (shard, size)
        total += size
        for key, tensor in tensors.items():
            assert key not in held, f"{key} in {held[key]} and {shard}"  # exactly one shard
            held[key] = shard
            assert weight_map[key] == shard
            assert torch.equal(tensor, want[key])
    # every key the index names is in the shard it names (what a loader following it does);
    # a tied key is left out, as transformers leaves it out, and recorded in the metadata
    for key, shard in weight_map.items():
        with safetensors.safe_open(str(folder / shard), "pt") as f:
            assert torch.equal(f.get_tensor(key), want[key])
    tied = index["metadata"].get("ddpstate.aliases", {})
    assert set(weight_map) == set(want) - set(tied)
    for key, canonical in tied.items():
        assert want[key] is want[canonical] or torch.equal(want[key], want[canonical])
    assert index["metadata"]["total_size"] == total
    return weight_map


def test_parse_size() -> None:
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("10kib") == 10240
    assert parse_size("4096") == parse_size(4096) == 4096
    for bad in ("2 parsecs", "", "-1GB", "0", 0, "GB"):
        with pytest.raises(InvalidArgumentError):
            parse_size(bad)  # type: ignore[arg-type]


def test_convert_writes_the_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    net = _model()
    sd = net.state_dict()
    torch.save({"epoch": 1, "state_dict": sd}, tmp_path / "ckpt.pt")
    out = tmp_path / "hf"
    argv = ["convert", "-q", str(tmp_path / "ckpt.pt"), str(out), "--to", "safetensors"]
    assert main([*argv, "--max-shard-size", "3000"]) == 0
    assert "Hugging Face sharded checkpoint" in capsys.readouterr().out
    weight_map = check_layout(out, 3000, dict(sd))
    assert len(set(weight_map.values())) > 2
    assert "head.weight" not in weight_map
    loaded = ddpstate.load(out, map_location="cpu")
    assert list(loaded) == list(sd)
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())
    assert verify_file(out).ok
    fresh = LM()
    ddpstate.load_model_state(fresh, out, map_location="cpu")
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, net.embed.weight)
    # an existing sharded folder is replaced only with --force; one shard when it all fits
    assert main([*argv, "--max-shard-size", "1MB"]) == 2
    assert "--force" in capsys.readouterr().err
    assert main([*argv, "--max-shard-size", "1MB", "--force", "--dtype", "bf16"]) == 0
    half = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
    assert set(check_layout(out, 10**6, half).values()) == {"model-00001-of-00001.safetensors"}


def test_convert_refuses_other_outputs(tmp_path: Path) -> None:
    torch.save(_model().state_dict(), tmp_path / "a.pt")
    with pytest.raises(InvalidArgumentError, match="to='pt'"):
        convert_file(tmp_path / "a.pt", tmp_path / "o", to="pt", max_shard_size="1MB")
    with pytest.raises(InvalidArgumentError, match="output folder"):
        convert_file(tmp_path / "a.pt", max_shard_size="1MB")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "config.json").write_text("{}")
    with pytest.raises(CheckpointExistsError, match=r"config\.json"):
        convert_file(tmp_path / "a.pt", busy, max_shard_size="1MB", overwrite=True)
    assert os.listdir(busy) == ["config.json"]


def test_failure_midway_keeps_the_old_folder(tmp_path: Path) -> None:
    sd = _model().state_dict()
    out = tmp_path / "hf"
    torch.save(sd, tmp_path / "good.pt")
    convert_file(tmp_path / "good.pt", out, max_shard_size=3000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # A source whose last tensor record is deflated and damaged: shards before it get
    # written, then reading it fails.
    bad = tmp_path / "bad.pt"
    with zipfile.ZipFile(tmp_path / "good.pt") as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    last = max(
        (n for n in zipfile.ZipFile(bad).namelist() if "/data/" in n and n[-1].isdigit()),
        key=lambda n: int(n.rsplit("/", 1)[1]),
    )
    offset, _ = data_offset(bad, last.split("/", 1)[1])
    raw = bytearray(bad.read_bytes())
    raw[offset : offset + 8] = b"\xff" * 8
    bad.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError):
        convert_file(bad, out, max_shard_size=3000, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["bad.pt", "good.pt", "hf"]  # no staging left


def test_save_model_state_sharded(tmp_path: Path) -> None:
    net = _model()
    out = tmp_path / "saved"
    with pytest.warns(UserWarning, match="head.weight -> embed.weight"):  # tied: stored once
        ddpstate.save_model_state(nn.DataParallel(net), out, max_shard_size="2.5KB")
    assert ddpstate.detect_format(out) == formats.HF_SHARDED
    check_layout(out, 2500, dict(net.state_dict()))
    fresh = LM()
    ddpstate.load_model_state(fresh, out / "model.safetensors.index.json", map_location="cpu")
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), net.state_dict().values(), strict=True)
    )
    # saving again replaces it (the same tied model: the ties are not reported twice);
    # a folder holding other files is refused and kept
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddpstate.save_model_state(net, out, max_shard_size=10**6)
    assert not [w for w in caught if "share memory" in str(w.message)]
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match=r"notes\.txt"):
        ddpstate.save_model_state(net, out, max_shard_size=10**6)
    assert (out / "notes.txt").read_text() == "mine"
    with pytest.raises(InvalidArgumentError):
        ddpstate.save_model_state(net, tmp_path / "x", max_shard_size="lots")
    assert not (tmp_path / "x").exists()
