"""Fuzzed safetensors headers and torch zip / pickle structures: only DDPStateError escapes."""

from __future__ import annotations

import io
import random
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddpstate
from ddpstate.convert import convert_file, diff_files, inspect_file, verify_file
from ddpstate.errors import CheckpointCorruptError
from tests.faults import _harness as h

# CI runs a fixed, small sample (derandomize: the same examples every run);
# `python -m tests.faults.campaign --fuzz-cases N` runs the same fuzz_case at scale.
_CI = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("kind", sorted(h.FUZZERS))
@_CI
@given(rng=st.randoms(use_true_random=False))
def test_fuzzed_files_raise_only_ddpstate_errors(
    kind: str, rng: random.Random, tmp_path: Path
) -> None:
    """inspect, convert and load on generated files return or raise DDPStateError only."""
    trial = h.fuzz_case(kind, rng, tmp_path)
    assert not trial.defects, trial.defects
    assert trial.max_rss_growth < h.RSS_LIMIT


@pytest.mark.parametrize(
    "maker", [h.huge_safetensors, h.huge_torch_zip], ids=["safetensors", "zip"]
)
def test_a_header_claiming_a_terabyte_tensor_is_refused_not_allocated(
    maker: object, tmp_path: Path
) -> None:
    """A file whose header claims a 1 TiB tensor (16 bytes stored) is refused by convert,
    load and diff, failed by verify and flagged by inspect, without the process growing
    by more than 64 MiB."""
    src = tmp_path / ("huge.safetensors" if maker is h.huge_safetensors else "huge.pt")
    maker(src)  # type: ignore[operator]
    out = tmp_path / ("out" + src.suffix)
    # inspect describes headers only: it may answer, but must name the damage.
    ins = h.run_op(lambda: inspect_file(str(src)))
    assert ins.kind == "refused" or (ins.kind == "ok" and ins.value.problems), ins
    assert ins.rss_growth < 64 << 20
    for op, fn in (
        ("convert", lambda: convert_file(str(src), str(out), overwrite=True)),
        ("load", lambda: ddpstate.load(str(src), map_location="cpu")),
        ("diff", lambda: diff_files(str(src), str(src))),
    ):
        res = h.run_op(fn)
        assert res.kind == "refused", (op, res)
        assert res.rss_growth < 64 << 20, (op, res.rss_growth)
    ver = h.run_op(lambda: verify_file(str(src)))
    assert ver.kind == "refused" or (ver.kind == "ok" and not ver.value.ok), ver
    assert ver.rss_growth < 64 << 20
    assert not out.exists()


def _deflated_zip_with_bad_stream() -> bytes:
    """A torch.save zip rewritten with deflated records, one of whose streams zlib rejects."""
    buf = io.BytesIO()
    torch.save({"w": torch.arange(64, dtype=torch.float32)}, buf)
    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst,
    ):
        for name in src.namelist():
            dst.writestr(name, src.read(name))
    data = out.getvalue()
    start, size = h.zip_data_offset(data, "/data.pkl")
    for pos in range(start, start + size):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[pos] ^= 1 << bit
            try:
                with zipfile.ZipFile(io.BytesIO(bytes(damaged))) as archive:
                    archive.read("archive/data.pkl")
            except zlib.error:
                return bytes(damaged)
            except Exception:
                continue
    raise AssertionError("no single bit flip makes zlib fail")


def test_a_damaged_deflate_stream_is_a_corrupt_error(tmp_path: Path) -> None:
    """Regression: a compressed zip record whose deflate stream is damaged made inspect,
    convert and verify raise a bare zlib.error; now CheckpointCorruptError naming the entry
    (verify: a problem in its result)."""
    src = tmp_path / "deflated.pt"
    src.write_bytes(_deflated_zip_with_bad_stream())
    for fn in (
        lambda: inspect_file(str(src)),
        lambda: convert_file(str(src), str(tmp_path / "out.pt")),
    ):
        with pytest.raises(CheckpointCorruptError, match=r"data\.pkl"):
            fn()
    result = verify_file(str(src))
    assert not result.ok
    assert any("data.pkl" in p for p in result.problems), result.problems


def _zip_with_pickle(path: Path, pickle_bytes: bytes) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle_bytes)
        archive.writestr("archive/byteorder", b"little")
        archive.writestr("archive/version", b"3\n")


@pytest.mark.parametrize(
    "opcode", [b"r\x00\x00\x00\x02", b"p33554432\n"], ids=["LONG_BINPUT", "PUT"]
)
def test_a_pickle_naming_a_huge_memo_slot_is_refused_in_bounded_memory(
    opcode: bytes, tmp_path: Path
) -> None:
    """Regression: one flipped byte of a LONG_BINPUT argument in data.pkl made inspect,
    convert, diff and verify allocate and zero index x 16 bytes (CPython's C unpickler
    sizes its memo table by the largest index; a 1.3e9 index took 20 GB). Now a memo
    index costs nothing: torch's weights_only unpickler keeps its memo in a dict, so the
    file reads (as torch reads it) in bounded memory. Here slot 2**25 (512 MiB of memo
    table before the fix)."""
    src = tmp_path / "memo.pt"
    _zip_with_pickle(src, b"\x80\x02}" + opcode + b".")
    for fn in (
        lambda: inspect_file(str(src)),
        lambda: convert_file(str(src), str(tmp_path / "out.pt")),
        lambda: diff_files(str(src), str(src)),
    ):
        res = h.run_op(fn)
        assert res.kind in ("ok", "refused"), res
        assert res.rss_growth < 64 << 20, res.rss_growth
    res = h.run_op(lambda: verify_file(str(src)))
    assert res.kind == "ok" and res.rss_growth < 64 << 20, res
