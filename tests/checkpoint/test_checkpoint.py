"""save/load in one process: formats by bytes, safety, damage, mmap, failures."""

from __future__ import annotations

import collections
import datetime
import hashlib
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpstate import formats
from ddpstate._io.safetensors_io import read_safetensors_header
from ddpstate.checkpoint import load, save
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    DDPStateError,
    InvalidArgumentError,
    UnsafeCheckpointError,
)
from ddpstate.formats import detect_format
from ddpstate.storage import listdir
from tests.samples import RESNET20

SAMPLE = RESNET20


class Custom:
    """A user class: loading it needs arbitrary unpickling."""

    def __init__(self) -> None:
        self.lr = 0.1


class ExplodesWhenPickled:
    """Pickling fails on this object, after the tensors before it were written."""

    def __reduce__(self) -> Any:
        raise RuntimeError("cannot pickle this half-way")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _file_backed(tensor: torch.Tensor, path: Path) -> bool:
    """True when the tensor's memory is a mapping of ``path`` (read from /proc/self/maps)."""
    ptr = tensor.untyped_storage().data_ptr()
    real = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= ptr < end:
                return len(fields) == 6 and fields[5].strip() == real
    return False


def _state() -> dict[str, Any]:
    return {
        "model": {"w": torch.randn(4, 3), "b": torch.zeros(3)},
        "step": 12,
        "lr": [0.1, 0.01],
        "name": "run-1",
    }


def test_torch_round_trip_and_no_leftovers(tmp_path: Path) -> None:
    state = _state()
    path = tmp_path / "nested" / "ckpt.pt"  # missing parent folders are created
    save(state, path)
    back = load(path)
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert back["step"] == 12 and back["lr"] == [0.1, 0.01] and back["name"] == "run-1"
    assert listdir(path.parent, include_temp=True) == ["ckpt.pt"]


def test_format_is_chosen_by_suffix_or_argument_and_detected_by_bytes(tmp_path: Path) -> None:
    sd = {"w": torch.randn(3)}
    save(sd, tmp_path / "a.safetensors")
    save(sd, tmp_path / "b.bin", format="safetensors")
    save(sd, tmp_path / "c.safetensors.bak", format="torch")
    assert detect_format(tmp_path / "a.safetensors") == "safetensors"
    assert detect_format(tmp_path / "b.bin") == "safetensors"
    assert detect_format(tmp_path / "c.safetensors.bak") == formats.TORCH_ZIP
    for name in ("a.safetensors", "b.bin", "c.safetensors.bak"):
        assert torch.equal(load(tmp_path / name)["w"], sd["w"])
    # A name that is no format is a bad argument (parse_format's one error for all edges).
    with pytest.raises(InvalidArgumentError, match="format='onnx'"):
        save(sd, tmp_path / "d.pt", format="onnx")


def test_safetensors_metadata_and_ties_through_save_and_load(tmp_path: Path) -> None:
    emb = torch.nn.Embedding(10, 4)
    sd = collections.OrderedDict(embed=emb.weight.detach(), head=emb.weight.detach())
    path = tmp_path / "m.safetensors"
    with pytest.warns(UserWarning, match="written once"):
        save(sd, path, metadata={"epoch": "4"})
    assert read_safetensors_header(path).metadata["epoch"] == "4"
    back = load(path)
    assert back["head"] is back["embed"]
    with pytest.raises(CheckpointFormatError, match="safetensors headers only"):
        save(sd, tmp_path / "m.pt", metadata={"epoch": "4"})
    with pytest.raises(CheckpointFormatError, match="'step' is a int"):
        save({"w": torch.ones(1), "step": 3}, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()


def test_mmap_is_the_default_for_local_files(tmp_path: Path) -> None:
    sd = {"w": torch.randn(256, 256)}
    save(sd, tmp_path / "a.pt")
    save(sd, tmp_path / "a.safetensors")
    for name in ("a.pt", "a.safetensors"):
        assert _file_backed(load(tmp_path / name, map_location="cpu")["w"], tmp_path / name)
        assert not _file_backed(load(tmp_path / name, mmap=False)["w"], tmp_path / name)


@pytest.mark.skipif(not SAMPLE.exists(), reason="needs the shared legacy sample file")
def test_legacy_file_loads_weights_only_and_refuses_mmap() -> None:
    state = load(SAMPLE)
    assert "state_dict" in state
    with pytest.raises(CheckpointFormatError, match="mmap=True"):
        load(SAMPLE, mmap=True)


def test_unsafe_files_are_refused_with_their_globals(tmp_path: Path) -> None:
    torch.save({"opt": Custom()}, tmp_path / "zip.pt")
    torch.save({"opt": Custom()}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    for name in ("zip.pt", "old.pt"):
        with pytest.raises(UnsafeCheckpointError, match="weights_only=False") as info:
            load(tmp_path / name)
        assert info.value.unsafe_globals == (f"{__name__}.Custom",)
        assert f"{__name__}.Custom" in str(info.value)
        # The explicit opt-in works (this test module defines the class).
        assert load(tmp_path / name, weights_only=False)["opt"].lr == 0.1


def test_whole_pickled_module_is_named_as_such(tmp_path: Path) -> None:
    torch.save(torch.nn.Sequential(torch.nn.Linear(2, 2)), tmp_path / "model.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"whole pickled nn\.Module") as info:
        load(tmp_path / "model.pt")
    assert "state_dict()" in str(info.value)
    assert "torch.nn.modules.linear.Linear" in info.value.unsafe_globals


def test_torchscript_archive_gets_jit_advice(tmp_path: Path) -> None:
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(tmp_path / "ts.pt"))
    with pytest.raises(CheckpointFormatError, match=r"TorchScript archive.*torch\.jit\.load"):
        load(tmp_path / "ts.pt")
    with pytest.raises(CheckpointFormatError, match="TorchScript"):
        load(tmp_path / "ts.pt", weights_only=False)


def test_dcp_folder_is_read_with_torchs_reader(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(3, 2)}, "step": 7, "extra": {"lr": 0.5}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming one process"
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    back = load(tmp_path / "dcp")
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert back["step"] == 7 and back["extra"] == {"lr": 0.5}


def test_dcp_with_an_unsafe_item_is_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(1), "opt": Custom()}, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(UnsafeCheckpointError, match="'opt'"):
        load(tmp_path / "dcp")
    assert load(tmp_path / "dcp", weights_only=False)["opt"].lr == 0.1


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "legacy"])
@pytest.mark.parametrize("cut", [0.1, 0.5, 0.98])
def test_truncated_files_raise_corrupt(tmp_path: Path, fmt: str, cut: float) -> None:
    path = tmp_path / "x.ckpt"
    sd = {f"t{i}": torch.randn(64) for i in range(8)}
    if fmt == "legacy":
        torch.save(sd, path, _use_new_zipfile_serialization=False)
    else:
        save(sd, path, format=fmt)
    raw = path.read_bytes()
    path.write_bytes(raw[: max(16, int(len(raw) * cut))])
    with pytest.raises(CheckpointCorruptError, match=r"x\.ckpt"):
        load(path)


def test_damaged_pickle_inside_zip_raises_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"w": torch.randn(10)}, path)
    raw = bytearray(path.read_bytes())
    start = raw.index(b"\x80\x02", raw.index(b"data.pkl"))  # the pickle's protocol header
    raw[start + 4 : start + 14] = b"\xff" * 10
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError):
        load(path)


def test_not_a_checkpoint_and_missing(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_bytes(b"hello, this is text")
    with pytest.raises(CheckpointFormatError, match="not a checkpoint"):
        load(tmp_path / "notes.txt")
    with pytest.raises(CheckpointNotFoundError):
        load(tmp_path / "missing.pt")
    with pytest.raises(DDPStateError, match="src_rank=1"):
        load(tmp_path / "notes.txt", src_rank=1)


def test_failed_save_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save({"good": torch.ones(3)}, path)
    before = _sha(path)
    state = {"big": torch.randn(1 << 20), "bad": ExplodesWhenPickled()}
    with pytest.raises(CheckpointWriteError, match="cannot pickle this half-way") as info:
        save(state, path)
    assert "rank 0" in str(info.value) and str(path) in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert _sha(path) == before
    assert listdir(tmp_path, include_temp=True) == ["ckpt.pt"]
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(CheckpointWriteError, match="file"):
        save({"w": torch.ones(1)}, blocker / "x.pt")


# ------------------------------------------------------------------------------- model state


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.head = torch.nn.Linear(6, 20, bias=False)
        self.head.weight = self.embed.weight


def test_model_state_moves_between_wrappings(tmp_path: Path) -> None:
    from ddpstate.checkpoint import load_model_state, save_model_state

    trained = TiedLM()
    wrapped = torch.compile(torch.nn.DataParallel(trained), backend="eager")
    for name in ("m.pt", "m.safetensors"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # safetensors' tied-weights notice
            save_model_state(wrapped, tmp_path / name)
        saved = load(tmp_path / name)
        assert set(saved) == {
            "embed.weight",
            "norm.weight",
            "norm.bias",
            "norm.running_mean",
            "norm.running_var",
            "norm.num_batches_tracked",
            "head.weight",
        }
        for target in (TiedLM(), torch.nn.DataParallel(TiedLM())):
            assert load_model_state(target, tmp_path / name) == ([], [])
            inner = target.module if isinstance(target, torch.nn.DataParallel) else target
            assert torch.equal(inner.embed.weight, trained.embed.weight)
            assert inner.head.weight is inner.embed.weight


def test_load_model_state_finds_the_state_dict_and_reports(tmp_path: Path) -> None:
    from ddpstate.checkpoint import load_model_state
    from ddpstate.errors import KeyMismatchError

    source = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    ckpt = {"epoch": 4, "model": {"module." + k: v for k, v in source.state_dict().items()}}
    save(ckpt, tmp_path / "c.pt")
    target = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    assert load_model_state(target, tmp_path / "c.pt", key="model") == ([], [])
    assert torch.equal(target[1].weight, source[1].weight)

    smaller = torch.nn.Sequential(torch.nn.Linear(3, 3))
    with pytest.raises(KeyMismatchError, match="unexpected"):
        load_model_state(smaller, tmp_path / "c.pt")
    missing, unexpected = load_model_state(smaller, ckpt["model"], strict=False)
    assert missing == [] and sorted(unexpected) == ["module.1.bias", "module.1.weight"]
    assert torch.equal(smaller[0].weight, source[0].weight)

    wrong_shape = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    with pytest.raises(DDPStateError, match="size mismatch"):
        load_model_state(wrong_shape, tmp_path / "c.pt")


def test_save_refusal_keeps_the_unsafe_globals(tmp_path: Path) -> None:
    with pytest.raises(UnsafeCheckpointError) as info:
        save({"opt": Custom()}, tmp_path / "c.pt")
    assert info.value.unsafe_globals == (f"{__name__}.Custom",)
    assert str(tmp_path / "c.pt") in str(info.value) and not (tmp_path / "c.pt").exists()


def test_concurrent_loads_do_not_remove_each_others_globals(tmp_path: Path) -> None:
    import threading

    import numpy as np

    save({"best": np.float64(0.9), "when": datetime.date(2024, 1, 2)}, tmp_path / "n.pt")
    before = set(map(str, torch.serialization.get_safe_globals()))
    failures: list[str] = []

    def loads() -> None:
        for _ in range(150):
            try:
                assert load(tmp_path / "n.pt")["best"] == 0.9
            except Exception as exc:  # collected: a thread's exception would be lost
                failures.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=loads) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert set(map(str, torch.serialization.get_safe_globals())) == before


@pytest.mark.parametrize("value", [Ellipsis, NotImplemented], ids=["Ellipsis", "NotImplemented"])
def test_values_pickled_as_a_global_name_are_refused_at_save(value: Any, tmp_path: Path) -> None:
    # They pickle as a bare global (their reduce value is a name), which
    # weights_only loading refuses: the save must refuse them first.
    with pytest.raises(UnsafeCheckpointError, match=f"builtins.{value!r}") as info:
        save({"x": [value]}, tmp_path / "v.pt")
    assert info.value.unsafe_globals == (f"builtins.{value!r}",)
    assert "obj['x'][0]" in str(info.value) and not (tmp_path / "v.pt").exists()


def test_load_model_state_passes_load_options_and_refuses_unknown_ones(tmp_path: Path) -> None:
    """load()'s options reach load(); a misspelt one is a TypeError naming it, nothing loaded."""
    from ddpstate.checkpoint import load_model_state, save

    model = torch.nn.Linear(2, 2)
    path = tmp_path / "m.pt"
    save({"model": model.state_dict()}, path)
    target = torch.nn.Linear(2, 2)
    before = target.weight.detach().clone()
    with pytest.raises(TypeError, match="unexpected keyword argument 'weight_only'"):
        load_model_state(target, path, weight_only=True)  # type: ignore[call-arg]
    assert torch.equal(target.weight, before)
    load_model_state(target, path, map_location="cpu", mmap=True, weights_only=True)
    assert torch.equal(target.weight, model.weight)
