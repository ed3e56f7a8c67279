"""``convert --dtype``: floating tensors cast exactly as ``t.to(dtype)``, everything else kept."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from ddpstate import formats
from ddpstate.cli import main
from ddpstate.convert import StateEdit, convert_file
from ddpstate.errors import InvalidArgumentError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight  # tied, as in language models
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("table", torch.arange(5, dtype=torch.float64))


def _checkpoint() -> tuple[Any, Tied]:
    torch.manual_seed(0)
    net = Tied()
    net.bn(torch.randn(3, 4))  # num_batches_tracked becomes 1, an int64 buffer
    opt = torch.optim.Adam(net.parameters())
    net.head(net.embed(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    wide = torch.randn(4, 6)
    ckpt = {
        "epoch": 2,
        "state_dict": net.state_dict(),
        "optimizer": opt.state_dict(),
        "view": wide.t(),  # a non-contiguous view of a larger storage
        "half": wide[1:3],  # a slice of the same storage
        "param": nn.Parameter(torch.randn(3)),
    }
    return ckpt, net


def _expect(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, nn.Parameter):
        return nn.Parameter(value.detach().to(dtype), requires_grad=value.requires_grad)
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _expect(v, dtype) for k, v in value.items()}
    if isinstance(value, list):
        return [_expect(v, dtype) for v in value]
    return value


def _assert_bitwise(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert got.shape == want.shape, where
        assert torch.equal(
            got.contiguous().reshape(-1).view(torch.uint8),
            want.contiguous().reshape(-1).view(torch.uint8),
        ), where
        assert type(got) is type(want), where  # Parameters stay Parameters
        return
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            _assert_bitwise(got[k], want[k], f"{where}.{k}")
        return
    if isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_bitwise(g, w, f"{where}[{i}]")
        return
    assert got == want, where


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_pt_output_is_bitwise_to_dtype(tmp_path: Path, name: str) -> None:
    ckpt, _ = _checkpoint()
    src = tmp_path / "ckpt.pt"
    torch.save(ckpt, src)
    result = convert_file(src, tmp_path / "out.pt", edit=StateEdit(dtype=name))
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    _assert_bitwise(loaded, _expect(ckpt, DTYPES[name]))
    sd = loaded["state_dict"]
    assert sd["bn.num_batches_tracked"].dtype == torch.int64 and sd["bn.num_batches_tracked"] == 1
    assert sd["mask"].dtype == torch.bool
    # tied weights stay one tensor sharing one storage
    assert sd["head.weight"].data_ptr() == sd["embed.weight"].data_ptr()
    assert result.dst_format == "pt"
    if DTYPES[name] == torch.float32:
        # only the float64 buffer (in the state dict) needed a cast
        assert result.cast == 1
    else:
        assert result.cast > 0 and any("cast" in n for n in result.notes)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_safetensors_output_is_bitwise_to_dtype(tmp_path: Path, name: str) -> None:
    ckpt, net = _checkpoint()
    src = tmp_path / "ckpt.pt"
    torch.save(ckpt, src)
    out = tmp_path / "model.safetensors"
    assert main(["convert", "-q", str(src), str(out), "--dtype", name]) == 0
    want = _expect(dict(net.state_dict()), DTYPES[name])
    # plain safetensors reads the file; the tied head is an alias ddpstate restores
    plain = safetensors.torch.load_file(str(out))
    for k, v in plain.items():
        _assert_bitwise(v, want[k], k)
    back = convert_file(out, tmp_path / "back.pt")
    assert back.src_format == formats.SAFETENSORS
    loaded = torch.load(tmp_path / "back.pt", weights_only=True)
    _assert_bitwise(dict(loaded), want)


def test_without_dtype_nothing_is_cast(tmp_path: Path) -> None:
    sd = {"w": torch.randn(3, 3), "n": torch.tensor(4)}
    torch.save(sd, tmp_path / "a.pt")
    plain = convert_file(
        tmp_path / "a.pt", tmp_path / "b.pt", edit=StateEdit(strip_prefix="module.")
    )
    assert plain.cast == 0
    _assert_bitwise(torch.load(tmp_path / "b.pt", weights_only=True), sd)
    cast = convert_file(tmp_path / "a.pt", tmp_path / "c.pt", edit=StateEdit(dtype="fp16"))
    got = torch.load(tmp_path / "c.pt", weights_only=True)
    _assert_bitwise(got, {"w": sd["w"].half(), "n": sd["n"]})
    assert cast.cast == 1


def test_bad_dtype_is_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "a.pt")
    with pytest.raises(InvalidArgumentError, match="bf16, fp16, fp32"):
        convert_file(tmp_path / "a.pt", tmp_path / "b.pt", edit=StateEdit(dtype="int8"))
    assert not (tmp_path / "b.pt").exists()


def _rss_anon() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("RssAnon"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's RssAnon")
def test_large_casts_are_made_in_mapped_files_not_anonymous_memory(tmp_path: Path) -> None:
    """--dtype on the torch reader: cast tensors of 1 MiB and more are made in files mapped
    beside the output (unlinked at once), so anonymous memory stays flat while the output is
    still bitwise tensor.to(dtype)."""
    torch.manual_seed(0)
    sd = {f"module.w{i}": torch.randn(1 << 20) for i in range(8)}  # 8 x 4 MiB -> 8 x 2 MiB
    src = tmp_path / "big.pt"
    torch.save(sd, src)
    peak = [_rss_anon()]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            peak.append(_rss_anon())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        convert_file(src, tmp_path / "out.pt", edit=StateEdit(strip_prefix="module.", dtype="bf16"))
    finally:
        stop.set()
        sampler.join()
    assert max(peak) - peak[0] < 6 << 20, (max(peak) - peak[0]) >> 20
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    for i in range(8):
        assert torch.equal(out[f"w{i}"], sd[f"module.w{i}"].to(torch.bfloat16))
    assert sorted(os.listdir(tmp_path)) == ["big.pt", "out.pt"]  # no cast file left behind
