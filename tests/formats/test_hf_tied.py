"""Tied weights in the Hugging Face sharded layout: left out of the index as transformers does."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

import ddpstate
from ddpstate.cli import main
from ddpstate.convert import convert_file, diff_files, verify_file
from ddpstate.errors import CheckpointCorruptError

INDEX = "model.safetensors.index.json"


class TiedLM(nn.Module):
    """An LLM's shape: the head's weight is the embedding's (GPT-2, Llama with tied embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight


def _index_keys_in_their_shards(folder: Path) -> dict[str, Any]:
    """Every key the index names, read by ``safe_open`` from the shard it names; the index."""
    index = json.loads((folder / INDEX).read_text())
    for key, shard in index["weight_map"].items():
        with safetensors.safe_open(str(folder / shard), "pt") as f:
            f.get_tensor(key)  # "File does not contain tensor ..." when the index lies
    return dict(index)


def _save_sharded(sd: dict[str, torch.Tensor], folder: Path, limit: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tie is reported; here it is expected
        ddpstate.save(sd, folder, max_shard_size=limit)


def test_tied_key_is_left_out_of_the_index_and_loads_back_tied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = TiedLM()
    sd = net.state_dict()
    _save_sharded(sd, tmp_path / "out", 1500)
    index = _index_keys_in_their_shards(tmp_path / "out")
    assert "head.weight" not in index["weight_map"]
    assert len(set(index["weight_map"].values())) > 1
    assert index["metadata"]["ddpstate.aliases"] == {"head.weight": "embed.weight"}
    # ddpstate's reader gives the tied key back, as the very tensor of its canonical key
    loaded = ddpstate.load(tmp_path / "out", map_location="cpu")
    assert list(loaded) == list(sd)
    assert loaded["head.weight"] is loaded["embed.weight"]
    fresh = TiedLM()
    ddpstate.load_model_state(fresh, tmp_path / "out", map_location="cpu")
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, net.embed.weight)
    assert verify_file(tmp_path / "out").ok


def test_convert_tells_the_tie_in_its_notes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    sd = TiedLM().state_dict()
    torch.save(sd, tmp_path / "tied.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told in the result, not warned mid-output
        result = convert_file(tmp_path / "tied.pt", tmp_path / "out", max_shard_size=1500)
    assert result.tensors == len(sd) - 1  # the tied tensor is stored once
    assert any(
        "left out of the index" in n and "head.weight -> embed.weight" in n for n in result.notes
    ), result.notes


def test_a_recorded_tie_the_shards_do_not_hold_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    sd = TiedLM().state_dict()
    out = tmp_path / "out"
    _save_sharded(sd, out, 10**6)
    index = json.loads((out / INDEX).read_text())
    # the index names a tie the shard does not give back: never a silently missing key
    index["metadata"]["ddpstate.aliases"] = {"head.weight": "embed.weight", "x": "embed.weight"}
    (out / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointCorruptError, match="tied key 'x'"):
        ddpstate.load(out)
    assert not verify_file(out).ok
    # a tie naming a key the weight map does not list is a damaged index
    index["metadata"]["ddpstate.aliases"] = {"head.weight": "nowhere"}
    (out / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointCorruptError, match="'nowhere'"):
        ddpstate.load(out)


def test_a_recorded_tie_to_another_key_than_the_shard_ties_is_refused(tmp_path: Path) -> None:
    """The index tied head.weight to one key, the shard's header to another (both in that
    shard): load gave the shard's tie and verify said ok, the index's claim unchecked."""
    torch.manual_seed(0)
    out = tmp_path / "out"
    _save_sharded(TiedLM().state_dict(), out, 10**6)
    index = json.loads((out / INDEX).read_text())
    assert index["weight_map"]["blocks.0.weight"] == index["weight_map"]["embed.weight"]
    index["metadata"]["ddpstate.aliases"] = {"head.weight": "blocks.0.weight"}
    (out / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointCorruptError, match=r"tied key 'head\.weight'.*another tensor"):
        ddpstate.load(out)
    result = verify_file(out)
    assert not result.ok and "'blocks.0.weight'" in " ".join(result.problems)


def test_diff_counts_a_tied_key_the_other_side_leaves_out(tmp_path: Path) -> None:
    torch.manual_seed(0)
    sd = TiedLM().state_dict()
    torch.save(sd, tmp_path / "tied.pt")
    # what transformers writes: the tied key left out
    safetensors.torch.save_file(
        {k: v for k, v in sd.items() if k != "head.weight"}, str(tmp_path / "hf.safetensors")
    )
    result = diff_files(tmp_path / "tied.pt", tmp_path / "hf.safetensors")
    assert result.equal and not result.only_a
    assert any("head.weight is tied to embed.weight" in n for n in result.notes)
    # an untied key missing from the other side is still a difference
    untied = {k: v.clone() for k, v in sd.items()}
    torch.save(untied, tmp_path / "untied.pt")
    result = diff_files(tmp_path / "untied.pt", tmp_path / "hf.safetensors")
    assert not result.equal and result.only_a == ("head.weight",)


@pytest.mark.slow
def test_transformers_gpt2_sharded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_embd=64, n_head=2, vocab_size=1000, n_positions=64
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf", max_shard_size="50KB")
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    convert = ["convert", "-q", str(tmp_path / "sd.pt"), str(tmp_path / "cli"), "--to"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*convert, "safetensors", "--max-shard-size", "50KB"]) == 0
    _save_sharded(model.state_dict(), tmp_path / "api", "50KB")
    theirs = _index_keys_in_their_shards(tmp_path / "hf")["weight_map"]
    for out in ("cli", "api"):
        ours = _index_keys_in_their_shards(tmp_path / out)["weight_map"]
        assert set(ours) == set(theirs)
        assert main(["diff", str(tmp_path / out), str(tmp_path / "hf")]) == 0
        assert main(["diff", str(tmp_path / "hf"), str(tmp_path / out)]) == 0
        assert main(["verify", str(tmp_path / out)]) == 0
        # transformers loads ddpstate's output (with the model's config) to the same weights
        shutil.copy(tmp_path / "hf" / "config.json", tmp_path / out)
        back = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / out, dtype=torch.bfloat16
        )
        assert back.lm_head.weight is back.transformer.wte.weight
        want = model.state_dict()
        assert all(torch.equal(v, want[k]) for k, v in back.state_dict().items())
    capsys.readouterr()
