"""``diff`` with convert's key options (--key, --strip-prefix, --normalize) and ambiguous files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import ddpstate
from ddpstate import keys
from ddpstate.cli import main
from ddpstate.convert import diff_files
from ddpstate.errors import AmbiguousStateDictError, InvalidArgumentError, StateDictNotFoundError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)


@pytest.fixture()
def pair(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """A Lightning-style checkpoint (LightningModule.model -> 'model.' keys) and a plain .pt."""
    torch.manual_seed(0)
    sd = Net().state_dict()
    lightning = tmp_path / "lightning.ckpt"
    torch.save(
        {
            "epoch": 3,
            "global_step": 120,
            "state_dict": keys.add_prefix(sd, "model."),
            "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        },
        lightning,
    )
    plain = tmp_path / "plain.pt"
    torch.save(sd, plain)
    return lightning, plain, sd


def test_without_options_every_key_differs(
    pair: tuple[Path, Path, dict[str, torch.Tensor]],
) -> None:
    lightning, plain, sd = pair
    result = diff_files(lightning, plain)
    assert len(result.only_a) == len(result.only_b) == len(sd)


def test_key_and_strip_prefix_make_them_equal(
    pair: tuple[Path, Path, dict[str, torch.Tensor]], capsys: pytest.CaptureFixture[str]
) -> None:
    lightning, plain, sd = pair
    result = diff_files(lightning, plain, key="state_dict", strip_prefix="model.")
    assert result.equal and len(result.max_abs_diff) == len(sd)
    assert any("bare state dict" in n for n in result.notes), result.notes
    # the same through the command line, in both orders
    argv = ["diff", "-q", "--key", "state_dict", "--strip-prefix", "model."]
    assert main([*argv, str(lightning), str(plain)]) == 0
    assert main([*argv, str(plain), str(lightning)]) == 0
    out = capsys.readouterr().out
    assert f"equal: {len(sd)} shared tensors compared" in out


def test_normalize_and_strip_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    sd = Net().state_dict()
    torch.save({"state_dict": keys.add_prefix(sd, "module._orig_mod.")}, tmp_path / "a.ckpt")
    torch.save(sd, tmp_path / "b.pt")
    assert diff_files(tmp_path / "a.ckpt", tmp_path / "b.pt", normalize=True, raw_keys=True).equal
    raw = diff_files(tmp_path / "a.ckpt", tmp_path / "b.pt", raw_keys=True)
    assert len(raw.only_a) == len(sd)
    assert main(["diff", "-q", "--raw-keys", "--normalize", str(tmp_path / "a.ckpt"),
                 str(tmp_path / "b.pt")]) == 0  # fmt: skip
    with pytest.raises(InvalidArgumentError):
        diff_files(tmp_path / "a.ckpt", tmp_path / "b.pt", normalize=True, strip_prefix="x.")


def test_ambiguous_checkpoint_is_refused_like_load_model_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    sd = Net().state_dict()
    ema = {k: v + 1 for k, v in sd.items()}
    both = tmp_path / "both.pt"
    torch.save({"model": sd, "state_dict": ema}, both)
    torch.save(sd, tmp_path / "plain.pt")
    with pytest.raises(AmbiguousStateDictError) as by_load:
        ddpstate.load_model_state(Net(), both, map_location="cpu")
    with pytest.raises(AmbiguousStateDictError) as by_diff:
        diff_files(both, tmp_path / "plain.pt")
    # one message: the file named, then exactly what load_model_state says
    assert str(by_diff.value) == f"{both}: {by_load.value}"
    assert isinstance(by_diff.value, StateDictNotFoundError)
    assert diff_files(both, tmp_path / "plain.pt", key="model").equal
    assert not diff_files(both, tmp_path / "plain.pt", key="state_dict").equal
    assert main(["diff", "-q", str(both), str(tmp_path / "plain.pt")]) == 2
    err = capsys.readouterr().err
    assert "several state dicts" in err and "--key" in err and "both.pt" in err


def test_key_missing_everywhere_is_an_error(
    pair: tuple[Path, Path, dict[str, torch.Tensor]],
) -> None:
    lightning, plain, _ = pair
    with pytest.raises(StateDictNotFoundError, match=r"lightning\.ckpt.*'ema'"):
        diff_files(lightning, plain, key="ema")
