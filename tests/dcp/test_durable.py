"""ddpstate.dcp: DurableWriter and VerifiedReader under plain dcp.save / dcp.load.

Real gloo ranks (tests.multiproc.run_ranks), FSDP2 ``fully_shard`` on the CPU, real
files, and the real S3-compatible server of tests/s3server.py.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import ddpstate
from ddpstate import storage
from ddpstate.convert import convert_file, inspect_file, verify_file
from ddpstate.dcp import DurableWriter, VerifiedReader
from ddpstate.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)
from tests.multiproc import run_ranks
from tests.s3server import S3Server, s3_server  # noqa: F401 - the fixture


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group: one process" notes
        yield


def _save_one(path: str, state: dict[str, Any], **kw: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=DurableWriter(path, **kw), no_dist=True)


def _load_one(path: str, state: dict[str, Any], **kw: Any) -> None:
    """``dcp.load`` with a VerifiedReader; the error a rank raised inside DCP's, raised as is."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dcp.load(state, storage_reader=VerifiedReader(path, **kw), no_dist=True)
        except CheckpointException as exc:
            raise exc.failures[0][0] from exc


def _state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 32, generator=gen),
        "b": torch.arange(10, dtype=torch.int64) + seed,
        "extra": {"epoch": seed, "name": "run"},
    }


def _zeros() -> dict[str, Any]:
    extra = {"epoch": 0, "name": ""}
    return {"w": torch.zeros(64, 32), "b": torch.zeros(10, dtype=torch.int64), "extra": extra}


# --------------------------------------------------------------------------- one process


def test_round_trip_writes_a_manifest_last_and_metadata_plain_torch_reads(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    _save_one(path, _state(1), thread_count=2, single_file_per_rank=True)
    names = sorted(os.listdir(path))
    assert names == [".metadata", "__0_0.distcp", "__0_1.distcp", "manifest.json"]
    assert not [n for n in os.listdir(tmp_path) if n != "ckpt"]  # the staging folder went
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["format"] == "dcp" and set(manifest["files"]) == set(names) - {"manifest.json"}
    shard = manifest["files"]["__0_0.distcp"]
    assert shard["size"] == os.path.getsize(os.path.join(path, "__0_0.distcp"))
    assert sum(n for _, n, _ in shard["chunks"]) == shard["size"]
    metadata = (tmp_path / "ckpt" / ".metadata").read_bytes()
    assert b"ddpstate" not in metadata  # torch's own classes only: loads without ddpstate
    got = _zeros()
    _load_one(path, got)
    assert torch.equal(got["w"], _state(1)["w"]) and torch.equal(got["b"], _state(1)["b"])
    assert got["extra"] == {"epoch": 1, "name": "run"}
    plain = _zeros()
    with _quiet():
        dcp.load(plain, checkpoint_id=path, no_dist=True)  # plain torch reads it too
    assert torch.equal(plain["w"], got["w"])
    assert ddpstate.verify_checkpoint(path).ok


def test_a_resave_replaces_the_folder_whole(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    _save_one(path, _state(1), single_file_per_rank=False)
    _save_one(path, _state(2))
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "manifest.json"]
    got = _zeros()
    _load_one(path, got)
    assert torch.equal(got["w"], _state(2)["w"])
    with pytest.raises(CheckpointWriteError, match="overwrite=False"):
        _save_one(path, _state(3), overwrite=False)


def test_a_plain_dcp_folder_is_refused_clearly_and_still_loads_with_plain_dcp(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "plain")
    with _quiet():
        dcp.save(_state(1), checkpoint_id=path, no_dist=True)
    with pytest.raises(CheckpointFormatError, match="still loads with plain DCP") as info:
        VerifiedReader(path)
    assert path in str(info.value) and "manifest.json" in str(info.value)
    got = _zeros()
    with _quiet():
        dcp.load(got, checkpoint_id=path, no_dist=True)
    assert torch.equal(got["w"], _state(1)["w"])


def test_missing_and_uncommitted_folders_are_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no such"):
        VerifiedReader(str(tmp_path / "nothing"))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError, match="not committed"):
        VerifiedReader(str(tmp_path / "half"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "metadata"])
def test_damage_is_refused_naming_the_file(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "ckpt"
    _save_one(str(path), _state(1))
    name = ".metadata" if damage == "metadata" else "__0_0.distcp"
    data = bytearray((path / name).read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01
    (path / name).write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=rf"{name}: .*rank 0") as info:
        _load_one(str(path), _zeros())
    if damage == "truncate":
        assert "truncated" in str(info.value)


@pytest.mark.parametrize("where", ["head", "middle", "tail", "none"])
def test_a_large_item_is_checked_at_both_ends_and_in_between(tmp_path: Path, where: str) -> None:
    """Items over twice the reader's window: zip headers at each end, the tensor between."""
    path = tmp_path / "ckpt"
    big = torch.randn(1024, 160, generator=torch.Generator().manual_seed(3))  # 640 KiB
    _save_one(str(path), {"big": big, "small": torch.arange(5)})
    entry = json.loads((path / "manifest.json").read_text())["files"]["__0_0.distcp"]
    offset, length, _ = max(entry["chunks"], key=lambda c: c[1])
    assert length > 2 * 64 * 1024
    at = {"head": offset + 40, "middle": offset + length // 2, "tail": offset + length - 30}
    if where != "none":
        data = bytearray((path / "__0_0.distcp").read_bytes())
        data[at[where]] ^= 0x10
        (path / "__0_0.distcp").write_bytes(bytes(data))
    state = {"big": torch.zeros(1024, 160), "small": torch.zeros(5, dtype=torch.int64)}
    if where == "none":
        _load_one(str(path), state)
        assert torch.equal(state["big"], big) and torch.equal(state["small"], torch.arange(5))
        return
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: .*rank 0"):
        _load_one(str(path), state)


def test_one_writer_and_reader_reused_across_steps_by_checkpoint_id(tmp_path: Path) -> None:
    """torchtitan's way: one storage writer, each ``dcp.save`` naming its step folder."""
    writer = DurableWriter(tmp_path / "unused")
    for step in (10, 20):
        with _quiet():
            dcp.save(_state(step), storage_writer=writer, checkpoint_id=tmp_path / f"step-{step}")
    assert not (tmp_path / "unused").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-20"]
    for step in (10, 20):
        assert "manifest.json" in os.listdir(tmp_path / f"step-{step}")
    reader = VerifiedReader(tmp_path / "step-10")
    got = _zeros()
    with _quiet():
        dcp.load(got, storage_reader=reader, checkpoint_id=tmp_path / "step-20")
    assert torch.equal(got["w"], _state(20)["w"]) and got["extra"]["epoch"] == 20


def test_discard_after_a_failed_save_deletes_its_staging_folder(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save_one(str(path), _state(1))
    writer = DurableWriter(path)
    with pytest.raises(CheckpointException), _quiet():  # a lambda does not pickle
        dcp.save({"w": torch.ones(2), "f": lambda: 0}, storage_writer=writer, no_dist=True)
    assert [p.name for p in tmp_path.iterdir() if ddpstate.storage.is_temp_name(p.name)]
    writer.discard()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    state = _zeros()
    _load_one(str(path), state)  # the previous checkpoint, untouched
    assert torch.equal(state["w"], _state(1)["w"])


def test_verify_inspect_and_convert_read_the_new_folders(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    _save_one(path, _state(1))
    assert verify_file(path).ok
    assert "w" in json.dumps(inspect_file(path).to_dict(), default=str)
    out = str(tmp_path / "whole.pt")
    convert_file(path, out)
    whole = torch.load(out, weights_only=True)
    assert torch.equal(whole["w"], _state(1)["w"])
    loaded = ddpstate.load(path)  # map_location="auto": this rank's GPU where there is one
    assert torch.equal(loaded["w"].cpu(), _state(1)["w"])


def test_whole_folder_load_and_convert_check_the_bytes_they_read(tmp_path: Path) -> None:
    """ddpstate.load and convert read a committed folder through VerifiedReader."""
    path = tmp_path / "ckpt"
    _save_one(str(path), _state(1))
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: .*CRC"):
        ddpstate.load(str(path))
    out = tmp_path / "whole.pt"
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp"):
        convert_file(str(path), str(out))
    assert not out.exists()


# --------------------------------------------------------------------------- FSDP2, gloo ranks


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _fsdp(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = _net()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).pow(2).sum().backward()
    opt.step()
    return model, opt


def _app_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "step": 7}


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    return copy.deepcopy({"model": model_sd, "optim": optim_sd})


def _save_fsdp(
    rank: int, world: int, url: str, opts: Optional[dict[str, Any]], seed: int, how: str
) -> dict[str, Any]:
    model, opt = _fsdp(world, seed)
    writer = DurableWriter(url, storage_options=opts, thread_count=2)
    with _quiet():
        if how == "async":
            dcp.async_save(_app_state(model, opt), storage_writer=writer).result()
        else:
            dcp.save(_app_state(model, opt), storage_writer=writer)
    return _full(model, opt)


def _load_fsdp(
    rank: int, world: int, url: str, opts: Optional[dict[str, Any]], plain: bool
) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = _fsdp(world, seed=99)
    state = _app_state(model, opt)
    if plain:
        reader: Any = dcp.FileSystemReader(url)
    else:
        reader = VerifiedReader(url, storage_options=opts)
    with _quiet():
        dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"full": _full(model, opt), "step": state["step"]}


def _assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert sorted(map(str, a)) == sorted(map(str, b)), where
        for k in a:
            _assert_bitwise(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sync", "async"])
def test_fsdp2_round_trip_bitwise_resharded_2_to_4(tmp_path: Path, how: str) -> None:
    url = str(tmp_path / "ckpt")
    saved = run_ranks(_save_fsdp, 2, args=(url, None, 0, how), timeout=150)
    listed = sorted(os.listdir(url))
    shards = [f"__{r}_{n}.distcp" for r in (0, 1) for n in (0, 1)]  # 2 threads a rank
    assert listed == [".metadata", *shards, "manifest.json"]
    assert ddpstate.verify_checkpoint(url).ok
    for world, plain in ((4, False), (2, True)):
        loaded = run_ranks(_load_fsdp, world, args=(url, None, plain), timeout=150)
        assert [out["step"] for out in loaded] == [7] * world
        _assert_bitwise(saved[0], loaded[0]["full"])


@pytest.mark.slow
def test_fsdp2_round_trip_on_s3_resharded_2_to_4(s3_server: S3Server) -> None:  # noqa: F811
    opts = s3_server.storage_options
    url = f"s3://{s3_server.new_bucket()}/run/ckpt"
    run_ranks(_save_fsdp, 2, args=(url, opts, 0, "sync"), timeout=150)
    saved = run_ranks(_save_fsdp, 2, args=(url, opts, 1, "sync"), timeout=150)  # replaces it
    fs = s3_server.filesystem()
    # Saved over a committed checkpoint: a fresh version folder, committed by the pointer.
    top = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url))
    assert len(top) == 2 and top[0] == "manifest.json" and top[1].startswith("v-"), top
    version = storage.committed_folder(url, storage_options=opts)
    assert version == f"{url}/{top[1]}"
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(version))
    assert names[0] == ".metadata" and names[-1] == "manifest.json" and len(names) == 6
    assert ddpstate.verify_checkpoint(url, storage_options=opts).ok
    loaded = run_ranks(_load_fsdp, 4, args=(url, opts, False), timeout=150)
    _assert_bitwise(saved[0], loaded[0]["full"])


def _killed_mid_save(rank: int, world: int, url: str, opts: Optional[dict[str, Any]]) -> str:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    model, opt = _fsdp(world, seed=5)

    class DiesMidWrite(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            if rank == 1:  # rank 1 has begun its shard file: it dies mid-write
                os.kill(os.getpid(), signal.SIGKILL)
            return super().resolve_data(write_item)

    try:
        with _quiet():
            dcp.save(
                _app_state(model, opt),
                storage_writer=DurableWriter(url, storage_options=opts),
                planner=DiesMidWrite(),
            )
    except Exception as exc:
        return type(exc).__name__
    return "saved"


def _check_kill(url: str, opts: Optional[dict[str, Any]]) -> Any:
    saved = run_ranks(_save_fsdp, 2, args=(url, opts, 0, "sync"), timeout=150)
    out = run_ranks(_killed_mid_save, 2, args=(url, opts), timeout=120, expect_failure=True)
    assert out[1] is None  # killed
    loaded = run_ranks(_load_fsdp, 2, args=(url, opts, False), timeout=150)
    _assert_bitwise(saved[0], loaded[0]["full"])  # the previous checkpoint, intact
    return ddpstate.verify_checkpoint(url, storage_options=opts)


@pytest.mark.slow
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    assert _check_kill(url, None).ok
    staging = [n for n in os.listdir(tmp_path) if n != "ckpt"]
    assert len(staging) == 1 and ddpstate.storage.is_temp_name(staging[0])  # never committed


@pytest.mark.slow
def test_a_rank_killed_mid_save_on_s3_leaves_the_previous_checkpoint_intact(
    s3_server: S3Server,  # noqa: F811
) -> None:
    opts = s3_server.storage_options
    url = f"s3://{s3_server.new_bucket()}/ckpt"
    found = _check_kill(url, opts)
    # Object stores cannot stage a folder: the killed save's partial shard lies beside the
    # intact checkpoint under a fresh name, which verify names; the next save deletes it.
    assert all("is not listed in manifest.json" in p for p in found.problems), found.problems
    manifest = json.loads(s3_server.filesystem().cat(f"{url}/manifest.json"))
    assert len([n for n in manifest["files"] if n.endswith(".distcp")]) == 4  # 2 threads a rank


def _load_damaged(rank: int, world: int, url: str) -> str:
    model, opt = _fsdp(world, seed=99)
    try:
        with _quiet():
            dcp.load(_app_state(model, opt), storage_reader=VerifiedReader(url))
    except CheckpointCorruptError as exc:
        return f"direct: {exc}"
    except CheckpointException as exc:
        inner = [f[0] for f in exc.failures.values() if isinstance(f[0], CheckpointCorruptError)]
        assert inner, exc
        return f"wrapped: {inner[0]}"
    return "loaded"


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_shard_is_refused_on_every_rank_naming_the_file(
    tmp_path: Path, damage: str
) -> None:
    url = str(tmp_path / "ckpt")
    run_ranks(_save_fsdp, 2, args=(url, None, 0, "sync"), timeout=150)
    shard = tmp_path / "ckpt" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data = data[: len(data) - 100] if damage == "truncate" else data
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    out = run_ranks(_load_damaged, 2, args=(url,), timeout=150)
    for message in out:
        assert re.search(r"__1_0\.distcp: .* rank \d refused it", message), message


# --------------------------------------------------------------------------- CheckpointManager


def _manager_on_s3(
    rank: int, world: int, url: str, opts: dict[str, Any], seed: int
) -> dict[str, Any]:
    model, opt = _fsdp(world, seed)
    with ddpstate.CheckpointManager(url, keep_last=1, storage_options=opts) as manager:
        if seed == 0:
            manager.save(1, {"model": model, "optimizer": opt})
            model(torch.randn(4, 8)).pow(2).sum().backward()
            opt.step()
            manager.save(2, {"model": model, "optimizer": opt})
        else:
            assert manager.restore({"model": model, "optimizer": opt}) == 2
        steps = manager.steps()
    return {"full": _full(model, opt), "steps": steps}


@pytest.mark.slow
def test_the_manager_keeps_sharded_steps_on_s3(s3_server: S3Server) -> None:  # noqa: F811
    opts = s3_server.storage_options
    url = f"s3://{s3_server.new_bucket()}/run"
    saved = run_ranks(_manager_on_s3, 2, args=(url, opts, 0), timeout=150)
    assert saved[0]["steps"] == [2]  # rotation: step 1 deleted once step 2 committed
    assert s3_server.filesystem().cat(f"{url}/latest") == b"step_0000000002\n"
    assert ddpstate.verify_checkpoint(url, storage_options=opts).ok
    restored = run_ranks(_manager_on_s3, 2, args=(url, opts, 1), timeout=150)
    _assert_bitwise(saved[0]["full"], restored[0]["full"])


# --------------------------------------------------------------------------- ddpstate.save / load


def _ddpstate_on_s3(rank: int, world: int, url: str, opts: dict[str, Any]) -> bool:
    model, _ = _fsdp(world, seed=3)
    ddpstate.save({"model": model.state_dict()}, url, storage_options=opts)
    fresh, _ = _fsdp(world, seed=4)
    assert ddpstate.load_model_state(fresh, url, storage_options=opts) == ([], [])
    return all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )


@pytest.mark.slow
def test_ddpstate_save_and_load_of_sharded_state_on_s3(s3_server: S3Server) -> None:  # noqa: F811
    opts = s3_server.storage_options
    url = f"s3://{s3_server.new_bucket()}/model_dcp"
    assert run_ranks(_ddpstate_on_s3, 2, args=(url, opts), timeout=150) == [True, True]
    assert ddpstate.verify_checkpoint(url, storage_options=opts).ok


@pytest.mark.parametrize("where", ["local", "s3"])
def test_convert_to_dcp_writes_a_verified_folder(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    """``convert --to dcp`` writes through DurableWriter: a manifest, checked bytes, URLs too."""
    src = tmp_path / "ckpt.pt"
    torch.save({"w": _state(4)["w"], "b": _state(4)["b"]}, src)
    opts: Optional[dict[str, Any]] = None
    if where == "s3":
        server: S3Server = request.getfixturevalue("s3_server")
        opts, out = server.storage_options, f"s3://{server.new_bucket()}/as_dcp"
    else:
        out = str(tmp_path / "as_dcp")
    convert_file(src, out, format="dcp", storage_options=opts)
    assert ddpstate.storage.exists(f"{out}/manifest.json", storage_options=opts)
    got = {"w": torch.zeros(64, 32), "b": torch.zeros(10, dtype=torch.int64)}
    _load_one(out, got, storage_options=opts)
    assert torch.equal(got["w"], _state(4)["w"]) and torch.equal(got["b"], _state(4)["b"])
    assert verify_file(out, storage_options=opts).ok
    if where == "local":  # a flipped byte is found by verify, which reads the CRC-32s
        shard = tmp_path / "as_dcp" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        found = verify_file(out)
        assert not found.ok and "__0_0.distcp" in " ".join(found.problems)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["as_dcp", "ckpt.pt"]
