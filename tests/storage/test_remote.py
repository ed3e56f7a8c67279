"""save/load through fsspec: memory:// and a real S3 server (moto) on 127.0.0.1."""

from __future__ import annotations

import gc
import hashlib
import io
import secrets
import warnings
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import _registry as fsspec_protocols

from ddpstate import storage
from ddpstate._storage import remote
from ddpstate.checkpoint import load, save
from ddpstate.errors import CheckpointFormatError, CheckpointWriteError
from tests.multiproc import run_ranks
from tests.s3server import S3Server, s3_server  # noqa: F401 - the fixture

# --------------------------------------------------------------------------- memory://


class ExplodesWhenPickled:
    def __reduce__(self) -> Any:
        raise RuntimeError("this object refuses to be pickled")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture()
def mem_root() -> Iterator[str]:
    root = f"memory://ddpstate-test-{secrets.token_hex(4)}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _raw(url: str, options: Any = None) -> bytes:
    with storage.open_read(url, storage_options=options) as f:
        return f.read()


def test_memory_save_load_round_trip(mem_root: str) -> None:
    state = {"model": {"w": torch.randn(5, 3)}, "step": 3}
    save(state, f"{mem_root}/ckpt.pt")
    save(state["model"], f"{mem_root}/model.safetensors")
    back = load(f"{mem_root}/ckpt.pt")
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["step"] == 3
    flat = load(f"{mem_root}/model.safetensors")
    assert torch.equal(flat["w"], state["model"]["w"])
    assert storage.listdir(mem_root, include_temp=True) == ["ckpt.pt", "model.safetensors"]
    with pytest.raises(CheckpointFormatError, match="mmap=True"):
        load(f"{mem_root}/ckpt.pt", mmap=True)


def test_memory_write_is_invisible_until_renamed(mem_root: str) -> None:
    target = f"{mem_root}/ckpt.bin"
    with storage.atomic_write(target) as f:
        f.write(b"old")
    with storage.atomic_write(target) as f:
        f.write(b"new, half written")
        assert _raw(target) == b"old"
        names = storage.listdir(mem_root, include_temp=True)
        assert len(names) == 2 and storage.is_temp_name(names[0])
        assert storage.listdir(mem_root) == ["ckpt.bin"]
    assert _raw(target) == b"new, half written"
    assert storage.listdir(mem_root, include_temp=True) == ["ckpt.bin"]


def test_memory_failed_save_keeps_previous(mem_root: str) -> None:
    target = f"{mem_root}/ckpt.pt"
    save({"good": torch.ones(2)}, target)
    before = _sha(_raw(target))
    with pytest.raises(CheckpointWriteError, match="refuses to be pickled"):
        save({"big": torch.randn(1 << 18), "bad": ExplodesWhenPickled()}, target)
    assert _sha(_raw(target)) == before
    assert storage.listdir(mem_root, include_temp=True) == ["ckpt.pt"]


def test_memory_dcp_folder(mem_root: str) -> None:
    import torch.distributed.checkpoint as dcp

    try:  # the public name, where torch exports one
        from torch.distributed.checkpoint import FsspecWriter  # type: ignore[attr-defined,unused-ignore]
    except ImportError:  # torch 2.13 has none: its private module, deprecated later
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0), "step": 2}, storage_writer=FsspecWriter(f"{mem_root}/d"))
    back = load(f"{mem_root}/d")
    assert torch.equal(back["w"], torch.arange(4.0)) and back["step"] == 2


# --------------------------------------------------------------------------- S3 (moto)


def _pending_uploads(server: S3Server, bucket: str) -> list[Any]:
    fs = server.filesystem()
    return list(fs.list_multipart_uploads(bucket))


@pytest.mark.slow
def test_s3_save_load_and_atomic_upload(s3_server: S3Server) -> None:  # noqa: F811
    opts = s3_server.storage_options
    bucket = s3_server.new_bucket()
    target = f"s3://{bucket}/run/ckpt.pt"
    state = {"w": torch.randn(4, 4), "step": 1}
    save(state, target, storage_options=opts)
    back = load(target, storage_options=opts)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 1
    save({"w": state["w"]}, f"s3://{bucket}/run/w.safetensors", storage_options=opts)
    assert torch.equal(
        load(f"s3://{bucket}/run/w.safetensors", storage_options=opts)["w"], state["w"]
    )
    before = _sha(_raw(target, opts))

    # Mid-upload the object still holds the old bytes: one object, committed at the end.
    small_parts = {**opts, "default_block_size": 5 << 20}
    with storage.atomic_write(target, storage_options=small_parts) as f:
        f.write(b"x" * (6 << 20))  # past the 5 MiB block: a multipart upload is running
        f.flush()
        assert _sha(_raw(target, opts)) == before
        assert len(_pending_uploads(s3_server, bucket)) == 1
    assert _raw(target, opts) == b"x" * (6 << 20)

    # A failure half-way aborts the upload: old object untouched, nothing pending.
    save(state, target, storage_options=opts)
    before = _sha(_raw(target, opts))
    halfway = {"big": torch.randn(3 << 20), "bad": ExplodesWhenPickled()}  # 12 MB first
    with pytest.raises(CheckpointWriteError, match="refuses to be pickled"):
        save(halfway, target, storage_options=small_parts)
    assert _sha(_raw(target, opts)) == before
    assert _pending_uploads(s3_server, bucket) == []
    assert storage.listdir(f"s3://{bucket}/run", storage_options=opts, include_temp=True) == [
        "ckpt.pt",
        "w.safetensors",
    ]


def _s3_worker(rank: int, world: int, base: str, opts: dict[str, Any]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank)
    mine = {"w": torch.randn(8, 8, generator=gen), "rank": rank}
    expected = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    save(mine, f"{base}/ckpt.pt", storage_options=opts)
    back = load(f"{base}/ckpt.pt", storage_options=opts)
    assert back["rank"] == 0 and torch.equal(back["w"], expected)
    save({"w": mine["w"]}, f"{base}/w.safetensors", storage_options=opts)
    assert torch.equal(load(f"{base}/w.safetensors", storage_options=opts)["w"], expected)
    shared = load(f"{base}/ckpt.pt", storage_options=opts, src_rank=1)
    assert torch.equal(shared["w"], expected)
    before = _raw(f"{base}/ckpt.pt", opts)
    try:
        save({"bad": ExplodesWhenPickled()}, f"{base}/ckpt.pt", storage_options=opts)
    except CheckpointWriteError as exc:
        error = str(exc)
    else:
        error = ""
    assert _raw(f"{base}/ckpt.pt", opts) == before
    return {"error": error}


@pytest.mark.slow
def test_s3_two_ranks_save_load_and_shared_failure(s3_server: S3Server) -> None:  # noqa: F811
    bucket = s3_server.new_bucket()
    results = run_ranks(
        _s3_worker,
        2,
        args=(f"s3://{bucket}/job", s3_server.storage_options),
        timeout=90,
    )
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and "refuses to be pickled" in errors.pop()
    listing = storage.listdir(
        f"s3://{bucket}/job", storage_options=s3_server.storage_options, include_temp=True
    )
    assert listing == ["ckpt.pt", "w.safetensors"]
    assert _pending_uploads(s3_server, bucket) == []


# --------------------------------------------------------------------------- publishing


class _PublishesOnClose(fsspec.spec.AbstractBufferedFile):  # type: ignore[misc]
    """An upload from a backend that ignores ``autocommit=False``: closing it publishes it."""

    def _upload_chunk(self, final: bool = False) -> bool:
        if final:  # whatever was buffered becomes the object, committed or not
            self.fs.published[self.path] = self.buffer.getvalue()
        return final

    def commit(self) -> None:
        pass

    def discard(self) -> None:
        self.buffer = io.BytesIO()


class _LeakyStore(fsspec.AbstractFileSystem):  # type: ignore[misc]
    protocol = "ddpstate-leaky-test"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.published: dict[str, bytes] = {}

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        return _PublishesOnClose(self, path, mode, **kwargs)


def test_a_failed_upload_is_discarded_never_closed() -> None:
    # A backend that ignores autocommit=False publishes whatever a close() flushes: a
    # failed write must only be discarded, or its truncated bytes replace the good object.
    fs = _LeakyStore(skip_instance_cache=True)
    fs.published["bucket/model.pt"] = b"the good checkpoint"
    url = "ddpstate-leaky-test://bucket/model.pt"
    upload = remote.atomic_write_object_store(fs, url, "bucket/model.pt")
    with pytest.raises(RuntimeError, match="died mid-write"), upload as f:
        f.write(b"trunc")
        raise RuntimeError("died mid-write")
    gc.collect()  # the abandoned upload's finaliser must not publish it either
    assert fs.published == {"bucket/model.pt": b"the good checkpoint"}


class _CopyThenDeleteFileSystem(MemoryFileSystem):  # type: ignore[misc]
    """A filesystem whose mv is a copy and a delete, as on most non-POSIX backends."""

    protocol = ("ddpstate-copymv-test",)

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.copy(path1, path2)
        self.rm(path1)


def test_a_protocol_without_a_known_atomic_publish_is_refused_until_trusted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(fsspec_protocols, "ddpstate-copymv-test", _CopyThenDeleteFileSystem)
    monkeypatch.setattr(remote, "_trusted", {}, raising=False)
    url = f"ddpstate-copymv-test://ddpstate-{secrets.token_hex(4)}/model.pt"
    fs = _CopyThenDeleteFileSystem()
    try:
        with pytest.raises(CheckpointWriteError) as refused, storage.atomic_write(url) as f:
            f.write(b"weights")
        message = str(refused.value)
        assert "'ddpstate-copymv-test'" in message and "trust_protocol" in message
        assert not fs.exists(url)  # nothing was written
        with pytest.raises(CheckpointWriteError, match="trust_protocol"):
            storage.stage_folder(url.rsplit("/", 1)[0] + "/step_1")  # folders too
        storage.trust_protocol("ddpstate-copymv-test", "rename")  # the user accepts the risk
        with storage.atomic_write(url) as f:
            f.write(b"weights")
        assert fs.cat(url) == b"weights"
    finally:
        root = url.split("://", 1)[1].split("/", 1)[0]
        if fs.exists(root):
            fs.rm(root, recursive=True)


def test_a_manager_step_resaved_on_s3_stays_committed_until_the_new_copy_is(
    s3_server: S3Server,  # noqa: F811
) -> None:
    from ddpstate.manager import CheckpointManager, verify_checkpoint

    opts = s3_server.storage_options
    run = f"s3://{s3_server.new_bucket()}/run"
    first = {"weights": {"w": torch.randn(64)}, "epoch": 1}
    with CheckpointManager(run, storage_options=opts) as manager:
        manager.save(1, first)
        step = manager.checkpoint_path(1)
        # Re-saving the step fails midway (a value that cannot be written): the step
        # committed before must still be there, whole.
        with pytest.raises(CheckpointWriteError, match="refuses to be pickled"):
            manager.save(1, {"weights": {"w": torch.randn(64)}, "epoch": ExplodesWhenPickled()})
        state: dict[str, Any] = {"weights": None, "epoch": None}
        assert manager.restore(state) == 1
        assert torch.equal(state["weights"]["w"], first["weights"]["w"]) and state["epoch"] == 1
        second = {"weights": {"w": torch.randn(64)}, "epoch": 2}
        manager.save(1, second)
    # The new copy lives in a version folder the step's manifest points to; the old one is gone.
    committed = storage.committed_folder(step, storage_options=opts)
    assert committed.startswith(f"{step}/v-")
    assert storage.listdir(step, storage_options=opts) == [
        "manifest.json",
        committed[len(step) + 1 :],
    ]
    assert verify_checkpoint(step, storage_options=opts).ok
    with CheckpointManager(run, storage_options=opts) as manager:
        state = {"weights": None, "epoch": None}
        assert manager.restore(state) == 1
        assert torch.equal(state["weights"]["w"], second["weights"]["w"]) and state["epoch"] == 2
