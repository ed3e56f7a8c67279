"""One format vocabulary: aliases in, one name out, at every API edge and in every result."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch

import ddpstate
from ddpstate import formats
from ddpstate.cli import main
from ddpstate.convert import convert_file, inspect_file, verify_file
from ddpstate.errors import InvalidArgumentError
from ddpstate.formats import FORMATS, FormatName, detect_format, parse_format


def test_format_name_lists_every_constant() -> None:
    assert set(typing.get_args(FormatName)) == set(FORMATS)
    assert FORMATS == (
        "pt",
        "pt_legacy",
        "safetensors",
        "torchscript",
        "dcp",
        "manager",
        "hf_sharded",
        "accelerate",
        "hf_trainer",
    )
    assert (formats.PT, formats.PT_LEGACY) == (formats.TORCH_ZIP, formats.LEGACY)
    assert set(formats.DESCRIPTIONS) == set(FORMATS)


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("pt", "pt"),
        ("torch", "pt"),
        ("torch_zip", "pt"),
        ("PTH", "pt"),
        (" Torch ", "pt"),
        ("pt_legacy", "pt_legacy"),
        ("torch_legacy", "pt_legacy"),
        ("safetensors", "safetensors"),
        ("SafeTensors", "safetensors"),
        ("torchscript", "torchscript"),
        ("dcp", "dcp"),
        ("manager", "manager"),
        ("hf_sharded", "hf_sharded"),
    ],
)
def test_aliases_in_one_name_out(alias: str, name: str) -> None:
    assert parse_format(alias) == name


@pytest.mark.parametrize("alias", ["bin", "st", "", "zip", None, 3])
def test_unknown_names_are_refused_listing_the_known(alias: object) -> None:
    with pytest.raises(InvalidArgumentError, match="'pt', 'pt_legacy', 'safetensors'"):
        parse_format(alias)


def test_a_known_name_a_call_cannot_handle_says_so() -> None:
    with pytest.raises(InvalidArgumentError, match=r"to='dcp'.*not one this call handles.*'pt'"):
        parse_format("dcp", allowed=(formats.PT, formats.SAFETENSORS), what="to")


def test_every_api_edge_takes_aliases_and_results_say_one_name(tmp_path: Path) -> None:
    sd = {"w": torch.ones(3)}
    ddpstate.save(sd, tmp_path / "a.bin", format="torch")
    ddpstate.save(sd, tmp_path / "b.bin", format="pth")
    ddpstate.save(sd, tmp_path / "c.bin", format="SafeTensors")
    assert detect_format(tmp_path / "a.bin") == detect_format(tmp_path / "b.bin") == formats.PT
    assert detect_format(tmp_path / "c.bin") == formats.SAFETENSORS
    with pytest.raises(InvalidArgumentError, match="format='dcp'"):
        ddpstate.save(sd, tmp_path / "d.bin", format="dcp")

    result = convert_file(tmp_path / "a.bin", tmp_path / "out.data", to="safetensors")
    assert (result.src_format, result.dst_format) == (formats.PT, formats.SAFETENSORS)
    back = convert_file(tmp_path / "out.data", tmp_path / "back.data", to="torch")
    assert (back.src_format, back.dst_format) == (formats.SAFETENSORS, formats.PT)
    assert inspect_file(tmp_path / "back.data").format == formats.PT
    assert verify_file(tmp_path / "back.data").format == formats.PT
    with pytest.raises(InvalidArgumentError, match="to='bin'"):
        convert_file(tmp_path / "a.bin", tmp_path / "x.data", to="bin")

    manager = ddpstate.CheckpointManager(tmp_path / "run", format="torch")
    assert manager.format == formats.PT
    manager.save(1, {"model": sd})
    assert verify_file(tmp_path / "run").format == formats.MANAGER
    with pytest.raises(InvalidArgumentError, match="CheckpointManager format='onnx'"):
        ddpstate.CheckpointManager(tmp_path / "run2", format="onnx")


def test_the_cli_takes_the_same_aliases(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ddpstate.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    src = str(tmp_path / "a.pt")
    assert main(["convert", src, str(tmp_path / "o.data"), "--to", "torch", "-q"]) == 0
    assert detect_format(tmp_path / "o.data") == formats.PT
    assert main(["convert", src, str(tmp_path / "s.data"), "--to", "SafeTensors", "-q"]) == 0
    assert detect_format(tmp_path / "s.data") == formats.SAFETENSORS
    assert main(["convert", src, "--to", "bin"]) == 2
    assert "--to='bin' is not a format here" in capsys.readouterr().err
