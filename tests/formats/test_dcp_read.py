"""Reading torch.distributed.checkpoint folders: load_model_state (plain and FSDP2, resharded),
``ddpstate.load``, and the CLI's inspect/verify/convert on DCP folders.

Folders are made by FSDP2 (``fully_shard`` on CPU with gloo) on real 2- and 4-rank
groups with plain ``dcp.save``, the way a user's training job makes them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ddpstate
from ddpstate import formats
from ddpstate.cli import main
from ddpstate.errors import KeyMismatchError, ShapeMismatchError
from ddpstate.keys import add_prefix, normalize_keys, strip_prefix
from tests.multiproc import run_ranks

EPOCH = 7
BEST = np.float64(0.25)  # an everyday value: loads with weights_only through ddpstate


def _model(out: int = 5) -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, out))


def reference() -> dict[str, torch.Tensor]:
    """The full state every folder holds (deterministic, different from a fresh model's)."""
    torch.manual_seed(0)
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3).add_(0.5)
        model[1].running_mean.uniform_()
        model[1].running_var.uniform_(1, 2)
        model[1].num_batches_tracked.fill_(11)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _shard(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _save_fsdp2(rank: int, world: int, folder: str) -> None:
    import torch.distributed.checkpoint as dcp

    model = _model()
    model.load_state_dict(reference())
    _shard(model, world)
    # Saved through torch.compile's wrapper, so every key carries "_orig_mod.".
    state = {"model": torch.compile(model).state_dict(), "epoch": EPOCH}
    dcp.save(state, checkpoint_id=folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """DCP folders saved by FSDP2 on 2 and on 4 ranks."""
    out = {}
    for world in (2, 4):
        folder = tmp_path_factory.mktemp("dcp") / f"fsdp2_{world}ranks"
        run_ranks(_save_fsdp2, world, args=(str(folder),), timeout=240)
        out[world] = folder
    return out


def assert_bitwise(got: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        g = got[k]
        assert isinstance(g, torch.Tensor), k
        assert g.dtype == v.dtype and g.shape == v.shape, k
        assert torch.equal(g.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def assert_same_tree(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert_bitwise({"t": got}, {"t": want})
    elif isinstance(want, Mapping):
        assert isinstance(got, Mapping) and list(got) == list(want), (list(got), list(want))
        for k in want:
            assert_same_tree(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same_tree(g, w)
    else:
        assert got == want and type(got) is type(want), (got, want)


# --------------------------------------------------------------------------- load_model_state


@pytest.mark.slow
def test_plain_model_loads_a_sharded_folder_whatever_its_wrapping(folders: dict[int, Path]) -> None:
    folder = folders[2]
    want = reference()
    for wrap in (lambda m: m, nn.DataParallel, torch.compile):
        torch.manual_seed(1)
        model = _model()
        target = wrap(model)
        assert ddpstate.load_model_state(target, folder) == ([], [])
        assert_bitwise(model.state_dict(), want)
    # ddpstate.load keeps reading the whole checkpoint into this process.
    whole = ddpstate.load(folder, map_location="cpu")
    assert whole["epoch"] == EPOCH
    assert_bitwise(normalize_keys(whole["model"]), want)
    # Shapes are checked, and ignore_mismatched skips the resized head.
    with pytest.raises(
        ShapeMismatchError, match=r"'3.weight' \(saved \[5, 16\], model \[3, 16\]\)"
    ):
        ddpstate.load_model_state(_model(out=3), folder)
    head = _model(out=3)
    with pytest.warns(UserWarning, match="ignore_mismatched"):
        skipped = ddpstate.load_model_state(head, folder, ignore_mismatched=True)
    assert skipped.missing_keys == ["3.weight", "3.bias"]
    assert torch.equal(head[0].weight, want["0.weight"])


def _load_fsdp2(rank: int, world: int, folder: str, wrap: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)  # different values from the saved ones
    model = _shard(_model(), world)
    target = torch.compile(model) if wrap else model
    result = ddpstate.load_model_state(target, folder)
    assert result == ([], []), result
    local_shapes = {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()
                    if hasattr(v, "to_local")}  # fmt: skip
    assert local_shapes["0.weight"] == (16 // world, 8)  # really sharded over this world
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


@pytest.mark.slow
@pytest.mark.parametrize(("saved_on", "loaded_on"), [(2, 4), (4, 2)])
def test_fsdp2_model_loads_resharded_bitwise(
    folders: dict[int, Path], saved_on: int, loaded_on: int
) -> None:
    results = run_ranks(
        _load_fsdp2, loaded_on, args=(str(folders[saved_on]), saved_on == 2), timeout=240
    )
    for rank, got in enumerate(results):
        assert got is not None, rank
        assert_bitwise(got, reference())


def _mismatch_fsdp2(rank: int, world: int, folder: str, whole_file: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(1)
    model = _shard(_model(), world)
    # A whole (consolidated, DDP-prefixed) file into a sharded model: each rank keeps its shard.
    out["from_file"] = ddpstate.load_model_state(model, whole_file)
    out["file_state"] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                         for k, v in model.state_dict().items()}  # fmt: skip
    no_bn = _shard(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5), nn.ReLU()), world)
    head = _shard(_model(out=3), world)
    for case, model in (("keys", no_bn), ("shape", head)):
        try:
            ddpstate.load_model_state(model, folder)
            out[case] = ("", "")
        except (KeyMismatchError, ShapeMismatchError) as exc:
            out[case] = (type(exc).__name__, str(exc))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["ignored"] = ddpstate.load_model_state(head, folder, ignore_mismatched=True)
    out["warned"] = [w.filename for w in caught if "ignore_mismatched" in str(w.message)]
    out["0.weight"] = head.state_dict()["0.weight"].full_tensor()
    return out


@pytest.mark.slow
def test_fsdp2_mismatches_fail_on_every_rank_or_are_skipped_and_whole_files_load(
    folders: dict[int, Path], tmp_path: Path
) -> None:
    whole = tmp_path / "ddp.pt"
    torch.save({"model": add_prefix(reference(), "module.")}, whole)
    args = (str(folders[2]), str(whole))
    for rank, out in enumerate(run_ranks(_mismatch_fsdp2, 2, args=args, timeout=240)):
        assert out["from_file"] == ([], [])
        assert_bitwise(out["file_state"], reference())
        kind, message = out["keys"]
        assert kind == "KeyMismatchError" and "running_mean" in message, message
        kind, message = out["shape"]
        assert kind == "ShapeMismatchError", message
        assert "'3.weight' (saved [5, 16], model [3, 16])" in message
        assert out["ignored"] == (["3.weight", "3.bias"], [])
        # The warning points at the caller, and is said once per job: by rank 0.
        assert out["warned"] == ([__file__] if rank == 0 else [])
        assert torch.equal(out["0.weight"], reference()["0.weight"])


def test_remote_dcp_folder_inspect_verify_and_load(folders: dict[int, Path]) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    url = "memory://dcp_read/fsdp2"
    for p in folders[2].iterdir():
        fs.pipe(f"/dcp_read/fsdp2/{p.name}", p.read_bytes())
    try:
        info = ddpstate.inspect_file(url)
        assert info.format == formats.DCP and info.file_size == sum(
            p.stat().st_size for p in folders[2].iterdir()
        )
        assert ddpstate.verify_file(url).ok
        model = _model()
        ddpstate.load_model_state(model, url)
        assert_bitwise(model.state_dict(), reference())
        fs.rm(f"/dcp_read/fsdp2/{sorted(p.name for p in folders[2].iterdir())[-1]}")
        bad = ddpstate.verify_file(url)
        assert not bad.ok and "missing" in bad.problems[0]
    finally:
        fs.rm("/dcp_read", recursive=True)


# --------------------------------------------------------------------------- CLI


def test_cli_consolidates_a_dcp_folder_into_pt_and_safetensors(
    folders: dict[int, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    want = reference()
    folder = folders[2]
    pt = tmp_path / "full.pt"
    assert main(["convert", str(folder), str(pt), "--strip-prefix", "_orig_mod.", "-q"]) == 0
    assert "torch.distributed.checkpoint" not in capsys.readouterr().err
    ckpt = torch.load(pt, weights_only=True)  # plain torch, no ddpstate
    assert ckpt["epoch"] == EPOCH
    assert_bitwise(ckpt["model"], want)
    st = tmp_path / "model.safetensors"
    assert main(["convert", str(folder), str(st), "--normalize", "-q"]) == 0
    out = capsys.readouterr().out
    assert "left out of the safetensors file" in out and "epoch" in out
    assert_bitwise(load_file(st), want)
    # Outputs are never overwritten silently, and nothing is left half-written.
    before = pt.read_bytes()
    assert main(["convert", str(folder), str(pt), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists; pass --force" in err
    assert pt.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt", "model.safetensors"]


@pytest.mark.slow
def test_console_script_converts_a_dcp_folder(folders: dict[int, Path], tmp_path: Path) -> None:
    exe = shutil.which("ddpstate")
    assert exe is not None
    out = tmp_path / "model.pt"
    proc = subprocess.run(
        [exe, "convert", str(folders[4]), str(out), "--normalize", "--key", "model", "-q"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "torch.distributed.checkpoint folder" not in proc.stdout
    assert_bitwise(torch.load(out, weights_only=True)["model"], reference())


def _checkpoint() -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.DataParallel(_model())
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.randn(4, 8)).sum().backward()
    opt.step()
    return {
        "model": net.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": EPOCH,
        "when": Path("runs/exp1"),
        "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    }


def test_pt_to_dcp_to_pt_round_trip_is_bitwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint()
    src = tmp_path / "ckpt.pt"
    torch.save(ckpt, src)
    folder = tmp_path / "as_dcp"
    # DCP keeps every key as a string: the optimizer's int-keyed state would come back
    # keyed "0", "1"... and silently not load, so it is refused (nothing written)...
    assert main(["convert", str(src), str(folder), "--to", "dcp", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'optimizer.state' has the non-string key 0" in err
    assert "--drop-optimizer" in err and not folder.exists()
    # ...and the rest round-trips bitwise.
    del ckpt["optimizer"]
    torch.save(ckpt, src)
    assert main(["convert", str(src), str(folder), "--to", "dcp", "-q"]) == 0
    assert "torch.distributed.checkpoint folder" in capsys.readouterr().out
    assert formats.detect_format(str(folder)) == formats.DCP
    back = tmp_path / "back.pt"
    assert main(["convert", str(folder), str(back), "-q"]) == 0
    # ddpstate.load, since plain torch.load(weights_only=True) refuses the Path value.
    assert_same_tree(ddpstate.load(back, map_location="cpu"), ckpt)
    # The folder loads into a model as any checkpoint does (module. keys adapted).
    net = _model()
    ddpstate.load_model_state(net, folder)
    assert_bitwise(net.state_dict(), strip_prefix(ckpt["model"], "module."))
    # Key rules apply on the way in; --force replaces a DCP folder, atomically.
    assert main(["convert", str(src), str(folder), "--to", "dcp", "-q"]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert (
        main(["convert", str(src), str(folder), "--to", "dcp", "--strip-module", "--force", "-q"])
        == 0
    )
    assert next(iter(ddpstate.load(folder)["model"])) == "0.weight"
    assert not [p for p in tmp_path.iterdir() if ddpstate.storage.is_temp_name(p.name)]


def test_safetensors_to_dcp(tmp_path: Path) -> None:
    want = reference()
    src = tmp_path / "m.safetensors"
    ddpstate.save(want, src)
    folder = tmp_path / "m_dcp"
    assert main(["convert", str(src), str(folder), "--to", "dcp", "-q"]) == 0
    assert_bitwise(ddpstate.load(folder, map_location="cpu"), want)
    # Without DST the file goes next to the folder, named after it (never inside it).
    assert main(["convert", f"{folder}{os.sep}", "-q"]) == 0
    assert_bitwise(torch.load(tmp_path / "m_dcp.pt", weights_only=True), want)
    assert sorted(p.name for p in folder.iterdir())[0] == ".metadata"


def test_to_dcp_never_replaces_a_folder_that_is_not_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(2)}, src)
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    assert main(["convert", str(src), str(mine), "--to", "dcp", "--force", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a torch.distributed.checkpoint folder" in err
    assert (mine / "todo.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "notes"]


def test_inspect_reads_the_metadata_only(
    folders: dict[int, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    want = reference()
    assert main(["inspect", str(folders[2])]) == 0
    text = capsys.readouterr().out
    assert "torch.distributed.checkpoint folder" in text
    assert "_orig_mod." in text  # the prefix every model key carries
    assert "_orig_mod.0.weight" in text and "[16, 8]" in text and "float32" in text
    assert main(["inspect", str(folders[4]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == formats.DCP and info["state_dict_path"] == "model"
    rows = {t["name"]: t for t in info["tensors"]}
    assert set(rows) == {f"_orig_mod.{k}" for k in want}
    for k, v in want.items():
        row = rows[f"_orig_mod.{k}"]
        assert row["shape"] == list(v.shape) and row["dtype"] == str(v.dtype)[6:], k
        assert row["bytes"] == v.numel() * v.element_size()
    assert info["tensor_bytes"] == sum(v.numel() * v.element_size() for v in want.values())
    assert info["tensor_count"] == len(want)
    assert {s["key"] for s in info["structure"]} == {"model", "epoch"}


def test_verify_names_a_damaged_or_missing_shard_file(
    folders: dict[int, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(folders[2], folder)
    assert main(["verify", str(folder), "-q"]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {folder} (torch.distributed.checkpoint")
    shards = sorted(p for p in folder.iterdir() if p.suffix == ".distcp")
    assert len(shards) == 2
    with open(shards[1], "r+b") as f:
        f.truncate(shards[1].stat().st_size - 3)
    assert main(["verify", str(folder), "-q"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("BAD:") and f"{shards[1]}:" in out and "truncated" in out
    shards[0].unlink()
    assert main(["verify", str(folder), "--json", "-q"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert len(problems) == 2 and any(f"{shards[0]}: missing" in p for p in problems)
    # convert on the damaged folder: one line, exit 2, nothing written.
    assert main(["convert", str(folder), str(tmp_path / "out.pt"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a shard file may be missing or damaged" in err
    assert not (tmp_path / "out.pt").exists()


def test_damaged_metadata_is_one_line_and_exit_2(
    folders: dict[int, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(folders[2], folder)
    (folder / ".metadata").write_bytes(b"\x80\x04garbage")
    for argv in (["inspect", str(folder)], ["convert", str(folder), str(tmp_path / "o.pt")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ".metadata" in err and "damaged" in err, err
    assert main(["verify", str(folder), "-q"]) == 1
    assert "damaged" in capsys.readouterr().out
    assert not (tmp_path / "o.pt").exists()


def test_dcp_items_allow_everyday_values_and_refuse_others(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "values"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"best": BEST, "path": Path("a/b"), "w": torch.ones(2)}, checkpoint_id=folder)
    got = ddpstate.load(folder, map_location="cpu")
    assert got["best"] == BEST and got["path"] == Path("a/b")
    bad = tmp_path / "bad"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"f": _model}, checkpoint_id=bad)
    with pytest.raises(ddpstate.UnsafeCheckpointError, match="item 'f'"):
        ddpstate.load(bad)
    assert os.listdir(bad)  # untouched
