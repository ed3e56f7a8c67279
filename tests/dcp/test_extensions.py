"""DurableWriter / VerifiedReader take every FileSystemWriter / FileSystemReader argument.

DCP's stream transforms (``_extensions``: torch's ZStandard, a custom one read back
through ``_extension_registry``) and ``serialization_format``; the manifest's CRC-32s
are over the bytes as stored. Real files, real zstandard, the real safetensors library.
"""

from __future__ import annotations

import inspect
import io
import json
import os
import warnings
import zlib
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import (
    ExtensionRegistry,
    StreamTransformExtension,
    ZStandard,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import SerializationFormat

from ddpstate import storage
from ddpstate.convert import verify_file
from ddpstate.dcp import DurableWriter, VerifiedReader
from ddpstate.errors import CheckpointCorruptError
from tests.s3server import S3Server, s3_server  # noqa: F401 - the fixture


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    return {
        "zeros": torch.zeros(256, 64),  # compresses to almost nothing
        "w": torch.randn(300, 40, generator=gen),
        "extra": {"epoch": 3, "name": "run" * 50},
    }


def _blank() -> dict[str, Any]:
    return {
        "zeros": torch.ones(256, 64),
        "w": torch.zeros(300, 40),
        "extra": {"epoch": 0, "name": ""},
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        torch.equal(a["zeros"], b["zeros"])
        and torch.equal(a["w"], b["w"])
        and a["extra"] == b["extra"]
    )


def _save(path: Path | str, **kw: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group" notes
        dcp.save(_state(), storage_writer=DurableWriter(str(path), **kw), no_dist=True)


def _load(reader: Any) -> dict[str, Any]:
    state = _blank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dcp.load(state, storage_reader=reader, no_dist=True)
        except CheckpointException as exc:
            raise exc.failures[0][0] from exc
    return state


class _Xor(StreamTransformExtension):
    """A custom transform: every stored byte XOR 0x5A (so stored != logical bytes)."""

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> _Xor:
        return _Xor()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        class Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b: Any) -> int:
                data = bytes(memoryview(b))
                output.write(bytes(x ^ 0x5A for x in data))
                return len(data)

        return Writer()  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(bytes(x ^ 0x5A for x in input.read()))


def _signature_check(ours: Any, theirs: Any) -> None:
    mine = inspect.signature(ours).parameters
    torch_params = inspect.signature(theirs).parameters
    # Every parameter torch has, in torch's order and kind, with torch's default: a drop-in.
    assert list(mine)[: len(torch_params)] == list(torch_params), (
        f"{ours.__name__} lacks or reorders {theirs.__name__}'s parameters"
    )
    for name, param in torch_params.items():
        assert (mine[name].kind, mine[name].default) == (param.kind, param.default), name
    assert set(mine) - set(torch_params) == {"storage_options"}  # ours: keyword-only, last


def test_the_drop_ins_take_every_parameter_torchs_classes_take() -> None:
    _signature_check(DurableWriter, dcp.FileSystemWriter)
    _signature_check(VerifiedReader, dcp.FileSystemReader)


def test_a_zstandard_folder_round_trips_with_its_crcs_over_the_compressed_bytes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ckpt"
    _save(path, _extensions=[ZStandard()])
    shard = (path / "__0_0.distcp").read_bytes()
    entry = json.loads((path / "manifest.json").read_text())["files"]["__0_0.distcp"]
    assert entry["size"] == len(shard) < 256 * 64 * 4  # stored compressed
    for offset, length, crc in entry["chunks"]:  # each CRC-32 is of the bytes on disk
        assert f"{zlib.crc32(shard[offset : offset + length]):08x}" == crc
    assert f"{zlib.crc32(shard):08x}" == entry["crc32"]
    assert _same(_load(VerifiedReader(str(path))), _state())
    assert _same(_load(dcp.FileSystemReader(str(path))), _state())  # torch reads it too


@pytest.mark.parametrize("where", ["tensor", "bytes"])
def test_a_flipped_byte_in_a_compressed_folder_is_refused_naming_the_file(
    tmp_path: Path, where: str
) -> None:
    path = tmp_path / "ckpt"
    _save(path, _extensions=[ZStandard()])
    entry = json.loads((path / "manifest.json").read_text())["files"]["__0_0.distcp"]
    chunks = entry["chunks"]  # DCP writes the bytes items first, then the tensors
    offset, length, _ = chunks[0] if where == "bytes" else chunks[-1]
    data = bytearray((path / "__0_0.distcp").read_bytes())
    data[offset + length // 2] ^= 0x04
    (path / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: bytes .*rank 0"):
        _load(VerifiedReader(str(path)))


def test_a_custom_transform_is_read_back_through_the_registry(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path, _extensions=[_Xor()], thread_count=2)
    registry = ExtensionRegistry()
    registry.register(_Xor)
    assert _same(_load(VerifiedReader(str(path), _extension_registry=registry)), _state())
    manifest = json.loads((path / "manifest.json").read_text())
    for name in ("__0_0.distcp", "__0_1.distcp"):
        stored = (path / name).read_bytes()
        assert manifest["files"][name]["crc32"] == f"{zlib.crc32(stored):08x}"
    with pytest.raises(ValueError, match="Unknown extension"):  # torch's own refusal, as is
        _load(VerifiedReader(str(path)))


def test_a_safetensors_format_folder_is_committed_with_its_bytes_checksummed(
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file

    path = tmp_path / "ckpt"
    tensors = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.int16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            tensors,
            storage_writer=DurableWriter(
                str(path), serialization_format=SerializationFormat.SAFETENSORS
            ),
            no_dist=True,
        )
    shard = path / "__0_0.distcp"
    entry = json.loads((path / "manifest.json").read_text())["files"]["__0_0.distcp"]
    assert (entry["size"], entry["crc32"]) == (
        shard.stat().st_size,
        f"{zlib.crc32(shard.read_bytes()):08x}",
    )
    loaded = load_file(os.fspath(shard))  # the file is the safetensors blob torch wrote
    assert torch.equal(loaded["a"], tensors["a"]) and torch.equal(loaded["b"], tensors["b"])


def test_a_compressed_folder_on_s3_round_trips_and_verifies(s3_server: S3Server) -> None:  # noqa: F811
    """Twice to one URL (the second save goes to a version folder), read back and verified."""
    opts, url = s3_server.storage_options, f"s3://{s3_server.new_bucket()}/zstd"
    for _ in range(2):
        _save(url, _extensions=[ZStandard()], storage_options=opts)
    assert _same(_load(VerifiedReader(url, storage_options=opts)), _state())
    version = storage.committed_folder(url, storage_options=opts)
    assert version != url  # the second save's version folder
    # `ddpstate verify <url>`: the pointer is followed to the stored bytes (regression: the
    # URL itself was refused with CheckpointNotFoundError).
    result = verify_file(url, storage_options=opts)
    assert result.ok and result.format == "dcp", result.problems
    # ...and they are checked: a flipped byte in the version folder's shard is found.
    shard = storage.join(version, "__0_0.distcp")
    fs = s3_server.filesystem()
    data = bytearray(fs.cat_file(shard.removeprefix("s3://")))
    data[len(data) // 2] ^= 0x80
    fs.pipe_file(shard.removeprefix("s3://"), bytes(data))
    damaged = verify_file(url, storage_options=opts)
    assert not damaged.ok and any("__0_0.distcp" in p for p in damaged.problems), damaged.problems


def test_ddpstate_verify_checks_a_compressed_folder_as_stored(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path, _extensions=[ZStandard()], thread_count=2)
    assert verify_file(str(path)).ok
    shard = path / "__0_1.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x80
    shard.write_bytes(bytes(data))
    found = verify_file(str(path))
    assert not found.ok and "__0_1.distcp" in " ".join(found.problems)


def test_more_threads_than_items_leaves_no_unlisted_empty_file(tmp_path: Path) -> None:
    """torch makes one file per thread; one no item went into is not left unlisted."""
    path = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"w": torch.ones(3)},
            storage_writer=DurableWriter(str(path), thread_count=3),
            no_dist=True,
        )
    listed = json.loads((path / "manifest.json").read_text())["files"]
    assert sorted(os.listdir(path)) == sorted([*listed, "manifest.json"])
    assert verify_file(str(path)).ok
