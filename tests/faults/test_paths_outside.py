"""Paths inside a checkpoint are claims: a DCP item, a manifest's file or an index's shard that
leads outside the folder (``..``, an absolute path, a symlink out) or to a FIFO is refused as
CheckpointCorruptError before anything opens it; ``verify`` checks DCP items' offsets and
lengths."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import shutil
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ddpstate
from ddpstate import _manifest
from ddpstate.convert import convert_file, inspect_file, verify_file
from ddpstate.dcp import DurableWriter, VerifiedReader
from ddpstate.errors import CheckpointCorruptError
from ddpstate.manager import CheckpointManager
from tests.formats.test_hf_sharded import write_hf

SHARD = "__0_0.distcp"
# How long a reader may block on a FIFO before the test releases it (then it has failed).
RELEASE_AFTER = 5.0


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 4), value), "b": torch.full((4,), value)}


def _dcp_folder(path: Path, value: float, *, durable: bool = False) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's no-process-group warning
        if durable:
            dcp.save(_state(value), storage_writer=DurableWriter(path), no_dist=True)
        else:
            dcp.save(_state(value), checkpoint_id=path, no_dist=True)
    return path


def _edit_items(folder: Path, edit: Callable[[Any, Any], Any]) -> None:
    """Rewrite ``.metadata``: each item's ``_StorageInfo`` replaced by ``edit(index, info)``."""
    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own file
    metadata.storage_data = {i: edit(i, info) for i, info in metadata.storage_data.items()}
    path.write_bytes(pickle.dumps(metadata))


def _rewrite_manifest(folder: Path, files: dict[str, Any]) -> None:
    """What an attacker does: new file entries, the manifest's own CRC recomputed."""
    path = folder / _manifest.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["files"].update(files)
    manifest[_manifest.MANIFEST_CRC_FIELD] = _manifest.manifest_crc(manifest)
    path.write_bytes(_manifest.manifest_bytes(manifest))


def _entry(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    return {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def _inner(exc: BaseException) -> BaseException:
    """The first rank's error inside DCP's CheckpointException, else ``exc``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return exc


@contextlib.contextmanager
def _released_after(fifo: Path, seconds: float = RELEASE_AFTER) -> Iterator[None]:
    """A reader blocked opening ``fifo`` is released (EOF) after ``seconds``: no test hangs."""
    stop = threading.Event()

    def release() -> None:
        if stop.wait(seconds):
            return
        while not stop.is_set():
            with contextlib.suppress(OSError):  # ENXIO until a reader waits
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            time.sleep(0.05)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def _refused_quickly(match: str) -> Iterator[None]:
    start = time.monotonic()
    with pytest.raises(CheckpointCorruptError, match=match):
        yield
    assert time.monotonic() - start < RELEASE_AFTER, "the reader blocked on the FIFO"


# --------------------------------------------------------------------------- DCP items


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_dcp_items_outside_the_folder_are_refused(tmp_path: Path, how: str) -> None:
    """A plain DCP folder whose .metadata points its items at another checkpoint's shard:
    load and convert read that outside file today (exit 0); verify calls it "missing"."""
    folder = _dcp_folder(tmp_path / "ckpt", 1.0)
    outside = _dcp_folder(tmp_path / "other", 7.0)
    target = f"../other/{SHARD}" if how == "relative" else str(outside / SHARD)
    _edit_items(folder, lambda _, info: dataclasses.replace(info, relative_path=target))
    why = "leaves the folder" if how == "relative" else "absolute path"
    with pytest.raises(CheckpointCorruptError, match=f"item 'w' names .*{why}"):
        ddpstate.load(folder)
    with pytest.raises(CheckpointCorruptError, match=why):
        convert_file(folder, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
    found = verify_file(folder)
    assert not found.ok and any(why in p for p in found.problems), found.problems


@pytest.mark.parametrize("how", ["relative", "absolute", "url"])
def test_dcp_items_outside_a_remote_folder_are_refused(tmp_path: Path, how: str) -> None:
    """fsspec (memory://): an item naming ``../``, an absolute key or another URL. The
    absolute key loaded the other folder's data today."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for name, value in (("ckpt", 1.0), ("other", 7.0)):
        for p in _dcp_folder(tmp_path / name, value).iterdir():
            fs.pipe(f"/paths_outside/{name}/{p.name}", p.read_bytes())
    target = {
        "relative": f"../other/{SHARD}",
        "absolute": f"/paths_outside/other/{SHARD}",
        "url": f"memory://paths_outside/other/{SHARD}",
    }[how]
    metadata = pickle.loads(fs.cat("/paths_outside/ckpt/.metadata"))
    metadata.storage_data = {
        i: dataclasses.replace(info, relative_path=target)
        for i, info in metadata.storage_data.items()
    }
    fs.pipe("/paths_outside/ckpt/.metadata", pickle.dumps(metadata))
    try:
        refused = r"names .* which (has a '\.\.'|is an abs)"
        with pytest.raises(CheckpointCorruptError, match=refused):
            ddpstate.load("memory://paths_outside/ckpt")
        assert not verify_file("memory://paths_outside/ckpt").ok
    finally:
        fs.rm("/paths_outside", recursive=True)


def test_a_symlink_out_in_place_of_a_dcp_shard_is_refused(tmp_path: Path) -> None:
    folder = _dcp_folder(tmp_path / "ckpt", 1.0)
    _dcp_folder(tmp_path / "other", 7.0)
    (folder / SHARD).unlink()
    (folder / SHARD).symlink_to(tmp_path / "other" / SHARD)
    with pytest.raises(CheckpointCorruptError, match="symlink that leads outside the folder"):
        ddpstate.load(folder)
    found = verify_file(folder)
    assert any("symlink" in p for p in found.problems), found.problems


@pytest.mark.parametrize("durable", [False, True])
def test_a_fifo_in_place_of_a_dcp_shard_is_refused_without_blocking(
    tmp_path: Path, durable: bool
) -> None:
    folder = _dcp_folder(tmp_path / "ckpt", 1.0, durable=durable)
    (folder / SHARD).unlink()
    os.mkfifo(folder / SHARD)
    with _released_after(folder / SHARD), _refused_quickly("FIFO"):
        ddpstate.load(folder)
    with _released_after(folder / SHARD):
        found = verify_file(folder)
    assert any("FIFO" in p for p in found.problems), found.problems


def test_verify_refuses_negative_offsets_and_items_sharing_bytes(tmp_path: Path) -> None:
    """Both pass today's verify: it only compares each file's size with the largest end."""
    folder = _dcp_folder(tmp_path / "ckpt", 1.0)
    assert verify_file(folder).ok
    _edit_items(
        folder,
        lambda index, info: dataclasses.replace(info, offset=-8) if index.fqn == "b" else info,
    )
    found = verify_file(folder)
    assert any("offset -8" in p and "'b'" in p for p in found.problems), found.problems

    folder = _dcp_folder(tmp_path / "again", 1.0)
    items = pickle.loads((folder / ".metadata").read_bytes()).storage_data
    w = next(info for index, info in items.items() if index.fqn == "w")
    # 'b' read from 'w''s bytes: both are small zips of float32 tensors, so torch loads it.
    _edit_items(
        folder,
        lambda index, info: (
            dataclasses.replace(info, offset=w.offset, length=w.length)
            if index.fqn == "b"
            else info
        ),
    )
    found = verify_file(folder)
    assert any("the same bytes" in p for p in found.problems), found.problems


def test_verify_refuses_an_item_shorter_than_its_tensor(tmp_path: Path) -> None:
    folder = _dcp_folder(tmp_path / "ckpt", 1.0)
    _edit_items(
        folder,
        lambda index, info: dataclasses.replace(info, length=32) if index.fqn == "w" else info,
    )
    found = verify_file(folder)
    assert any("fewer than its 64 bytes" in p for p in found.problems), found.problems


def test_a_rewritten_manifest_does_not_lead_verified_reader_out(tmp_path: Path) -> None:
    """A manifest's CRC is no signature: .metadata and manifest.json both rewritten to send
    the shard's items to another durable checkpoint, with that shard's own chunks. Today
    VerifiedReader checks the outside bytes against those chunks and loads them (exit 0)."""
    folder = _dcp_folder(tmp_path / "ckpt", 1.0, durable=True)
    outside = _dcp_folder(tmp_path / "other", 7.0, durable=True)
    _edit_items(
        folder, lambda _, info: dataclasses.replace(info, relative_path=f"../other/{SHARD}")
    )
    theirs = json.loads((outside / _manifest.MANIFEST_NAME).read_text())["files"][SHARD]
    _rewrite_manifest(folder, {".metadata": _entry(folder / ".metadata"), SHARD: theirs})
    state = _state(0.0)
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException
        dcp.load(state, storage_reader=VerifiedReader(folder), no_dist=True)
    error = _inner(raised.value)
    assert isinstance(error, CheckpointCorruptError), error
    assert "leaves the folder" in str(error)
    assert torch.equal(state["w"], torch.zeros(4, 4))
    with pytest.raises(CheckpointCorruptError, match="leaves the folder"):
        ddpstate.load(folder)


# --------------------------------------------------------------------------- manager steps


def test_restore_refuses_a_step_file_that_is_a_symlink_out(tmp_path: Path) -> None:
    """A step's file replaced by a symlink to another file, the manifest rewritten with that
    file's size and CRC: restore loaded the outside file today."""
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, {"weights": _state(1.0)})
    step = next((tmp_path / "run").glob("step_*"))
    name = json.loads((step / _manifest.MANIFEST_NAME).read_text())["entries"]["weights"]["file"]
    outside = tmp_path / "outside.pt"
    torch.save(_state(7.0), outside)
    (step / name).unlink()
    (step / name).symlink_to(outside)
    _rewrite_manifest(step, {name: _entry(outside)})
    state: dict[str, Any] = {"weights": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # restore warns as it skips the step
        with pytest.raises(CheckpointCorruptError, match="symlink that leads outside"):
            CheckpointManager(tmp_path / "run").restore(state, step=1)
    assert state["weights"] is None


def test_a_manager_entry_naming_a_file_outside_is_refused(tmp_path: Path) -> None:
    """A rewritten step manifest whose model entry names ``../../outside.pt``: ``inspect`` and
    ``convert`` of the step folder read that file today."""
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, {"model": torch.nn.Linear(2, 2)})
    step = next((tmp_path / "run").glob("step_*"))
    torch.save(_state(7.0), tmp_path / "outside.pt")
    path = step / _manifest.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["entries"]["model"]["file"] = "../../outside.pt"
    manifest[_manifest.MANIFEST_CRC_FIELD] = _manifest.manifest_crc(manifest)
    path.write_bytes(_manifest.manifest_bytes(manifest))
    named = r"entry 'model' names '\.\./\.\./outside\.pt'"
    with pytest.raises(CheckpointCorruptError, match=named):
        inspect_file(step)
    with pytest.raises(CheckpointCorruptError, match="leaves the folder"):
        convert_file(step, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


# --------------------------------------------------------------------------- Hugging Face shards


def test_an_index_shard_that_is_a_symlink_out_is_refused(tmp_path: Path) -> None:
    sd = _state(1.0)
    index = write_hf(tmp_path / "m", sd, shards=2)
    write_hf(tmp_path / "other", _state(7.0), shards=2)
    shard = json.loads(index.read_text())["weight_map"]["w"]
    (tmp_path / "m" / shard).unlink()
    (tmp_path / "m" / shard).symlink_to(tmp_path / "other" / shard)
    with pytest.raises(CheckpointCorruptError, match="symlink that leads outside the folder"):
        ddpstate.load(index)
    with pytest.raises(CheckpointCorruptError, match="symlink"):
        convert_file(index, tmp_path / "out.pt")
    found = verify_file(index)
    assert any("symlink" in p for p in found.problems), found.problems


def test_an_index_shard_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    index = write_hf(tmp_path / "m", _state(1.0), shards=2)
    shard = tmp_path / "m" / json.loads(index.read_text())["weight_map"]["w"]
    shard.unlink()
    os.mkfifo(shard)
    with _released_after(shard), _refused_quickly("FIFO"):
        ddpstate.load(index)
    with _released_after(shard), _refused_quickly("FIFO"):
        convert_file(index, tmp_path / "out.pt")


def test_an_index_naming_a_parent_folder_is_refused(tmp_path: Path) -> None:
    """Refused before this change too (the index's own check, now the shared one): a guard."""
    index = write_hf(tmp_path / "m", _state(1.0), shards=2)
    data = json.loads(index.read_text())
    shutil.copy(tmp_path / "m" / data["weight_map"]["w"], tmp_path / "x.safetensors")
    data["weight_map"] = {k: "../x.safetensors" for k in data["weight_map"]}
    index.write_text(json.dumps(data))
    for read in (ddpstate.load, lambda p: convert_file(p, tmp_path / "out.pt")):
        with pytest.raises(CheckpointCorruptError, match="outside the index's folder"):
            read(index)
    assert any("outside the index's folder" in p for p in verify_file(index).problems)


def test_a_hugging_face_hub_cache_snapshot_still_loads(tmp_path: Path) -> None:
    """The Hub's cache links each snapshot file to ``<repo>/blobs/``: out of the folder, but
    into the one place the cache keeps files. Such a folder loads; a link elsewhere does not."""
    repo = tmp_path / "models--org--net"
    snapshot = repo / "snapshots" / "0123abcd"
    sd = _state(1.0)
    index = write_hf(snapshot, sd, shards=2)
    (repo / "blobs").mkdir()
    for i, file in enumerate(sorted(snapshot.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        file.rename(blob)
        file.symlink_to(os.path.relpath(blob, snapshot))
    loaded = ddpstate.load(index)
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())
    assert verify_file(index).ok
    shard = snapshot / json.loads(index.read_text())["weight_map"]["w"]
    shard.unlink()
    shard.symlink_to(tmp_path / "elsewhere.safetensors")
    (tmp_path / "elsewhere.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointCorruptError, match="symlink that leads outside the folder"):
        ddpstate.load(index)
