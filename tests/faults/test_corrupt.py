"""Truncated and bit-flipped checkpoints: a DDPStateError, the exact original, or a documented miss.

Per operation, "never silently wrong" means (see ``_harness._classify_value``):
``load``/``convert``/``diff`` on a damaged torch zip may only return something other
than the original when ``verify`` flags the file (a flip in tensor bytes that only the
zip's CRC-32 can reveal); legacy and safetensors files carry no checksum, so a flip
that keeps them well-formed is reported as undetectable, never counted as caught; a
truncated file must always be refused (or, for ``verify``, failed).
"""

from __future__ import annotations

import io
import pickletools
import random
import re
import zipfile
from pathlib import Path

import pytest
import torch

import ddpstate
from ddpstate.convert import convert_file, diff_files, inspect_file, verify_file
from ddpstate.errors import CheckpointCorruptError, DDPStateError
from tests.faults import _harness as h

TRIALS_PER_FORMAT = 25


@pytest.fixture(scope="module")
def originals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, h.Original]:
    """One undamaged sample per format (a manager folder holds steps 1 and 2)."""
    base = tmp_path_factory.mktemp("originals")
    return {fmt: h.make_original(fmt, base / fmt, seed=7) for fmt in h.FORMATS}


@pytest.mark.parametrize("fmt", h.FORMATS)
def test_damaged_files_are_refused_or_exact_never_a_crash_or_a_lie(
    fmt: str, originals: dict[str, h.Original], tmp_path: Path
) -> None:
    """25 random truncations and bit flips per format: no unhandled exception, no hang,
    no silently wrong result; verify fails every truncation (and, for a manager folder,
    every damaged file) and restore falls back to an intact step."""
    rng = random.Random(f"ci-corrupt-{fmt}")
    tally = h.Tally()
    for _ in range(TRIALS_PER_FORMAT):
        trial = h.corrupt_trial(originals[fmt], tmp_path, rng)
        assert not trial.defects, (trial.damage, trial.offset, trial.target, trial.defects)
        tally.add(trial)
    assert tally.trials == TRIALS_PER_FORMAT
    # The sample really exercised refusals (not only harmless flips).
    assert any(k.endswith("refused") or k == "verify: caught" for k in tally.outcomes)


def test_a_flip_in_tensor_bytes_of_a_zip_is_missed_by_load_but_caught_by_verify(
    originals: dict[str, h.Original], tmp_path: Path
) -> None:
    """The documented limit: load does not check CRCs, so a flipped tensor byte loads as a
    different value; verify compares every record's CRC-32 and names the record."""
    original = originals["torch_zip"]
    lo, hi = original.payload[0]
    damaged = bytearray(original.data)
    damaged[(lo + hi) // 2] ^= 0x01
    bad = tmp_path / "flipped.pt"
    bad.write_bytes(bytes(damaged))
    loaded = ddpstate.load(bad, map_location="cpu")
    assert not h.same(loaded, original.expected)
    result = verify_file(str(bad))
    assert not result.ok
    assert any("CRC-32" in p for p in result.problems), result.problems


@pytest.mark.parametrize("fmt", h.FORMATS)
def test_cli_on_a_damaged_file_exits_with_one_line(
    fmt: str, originals: dict[str, h.Original], tmp_path: Path
) -> None:
    """The installed `ddpstate` command on a damaged file: verify/inspect/diff/convert exit
    0, 1 or 2, and an error is exactly one `ddpstate: error:` line, never a traceback."""
    rng = random.Random(f"ci-cli-{fmt}")
    for result in h.cli_corrupt_trial(originals[fmt], tmp_path, rng):
        assert not result.defect, (result.args, result.defect)


def _legacy_with_mismatched_storage_key() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, buf, _use_new_zipfile_serialization=False)
    data = bytearray(buf.getvalue())
    # Storage keys are decimal strings (BINUNICODE: 'X', 4-byte length, text); the last
    # one sits in the key list torch reads after the pickle. Make it name no storage.
    last = list(re.finditer(rb"X(....)(\d{4,})", bytes(data)))[-1]
    data[last.end() - 1] = ord("_")
    return bytes(data)


def test_a_legacy_file_whose_storage_keys_do_not_match_is_a_corrupt_error(
    tmp_path: Path,
) -> None:
    """Regression: a legacy file whose storage key list names a storage the pickle never
    made leaked torch's bare AssertionError out of load; now CheckpointCorruptError."""
    bad = tmp_path / "legacy.pt"
    bad.write_bytes(_legacy_with_mismatched_storage_key())
    with pytest.raises(CheckpointCorruptError, match=r"legacy\.pt"):
        ddpstate.load(bad, map_location="cpu")


def test_convert_refuses_a_damaged_version_record(
    originals: dict[str, h.Original], tmp_path: Path
) -> None:
    """Regression: convert copied a damaged zip `version` record into its output without a
    word, so the converted file failed to load later; now it checks the record's CRC-32
    and digits and raises CheckpointCorruptError naming the record, writing nothing."""
    original = originals["torch_zip"]
    start, _ = h.zip_data_offset(original.data, "/version")
    damaged = bytearray(original.data)
    damaged[start] = ord("Z")
    bad = tmp_path / "bad-version.pt"
    bad.write_bytes(bytes(damaged))
    out = tmp_path / "out.pt"
    with pytest.raises(CheckpointCorruptError, match="version"):
        convert_file(str(bad), str(out))
    assert not out.exists()


@pytest.mark.slow
def test_every_bit_flip_of_a_zip_directory_is_a_ddpstate_error(
    originals: dict[str, h.Original], tmp_path: Path
) -> None:
    """Regression: flips in the central directory leaked NotImplementedError ("zip file
    version 12.8", a damaged version-needed field) and OSError EINVAL (a record offset
    that became negative, read with os.pread) from inspect/verify/convert/diff, which
    share the reader. Now every single-bit flip of the directory and end record of the
    sample and of a manager's one-value file gives a DDPStateError or a result."""
    small = tmp_path / "epoch.pt"
    torch.save(3, small)  # what CheckpointManager writes for a plain int entry
    bad = tmp_path / "flipped.pt"
    escaped = []
    for data in (originals["torch_zip"].data, small.read_bytes()):
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            last = max(archive.infolist(), key=lambda i: i.header_offset)
        end_of_records = h.zip_data_offset(data, last.filename)[0] + last.compress_size
        for pos in range(end_of_records, len(data)):
            for bit in range(8):
                damaged = bytearray(data)
                damaged[pos] ^= 1 << bit
                bad.write_bytes(bytes(damaged))
                res = h.run_op(lambda: inspect_file(str(bad)))
                if res.kind not in ("ok", "refused"):
                    escaped.append((pos, bit, res.error))
    assert not escaped, escaped[:5]


def test_convert_refuses_a_tensor_reaching_past_its_storage(tmp_path: Path) -> None:
    """Regression: a damaged shape/stride/offset that makes a tensor reach past its
    storage was copied through by convert, whose output then failed to load ("Trying to
    resize storage that is not resizable"); now torch's own load refuses it, so convert and
    diff raise CheckpointCorruptError naming the file, and verify lists the same problem."""
    src = tmp_path / "overreach.pt"
    storage = h._StorageStub("0", torch.FloatStorage, 4, "cpu")
    tensor = h._TensorStub(storage, 0, (8,), (1,))  # 8 floats from a 4-float storage
    buf = io.BytesIO()
    h._StubPickler(buf, protocol=2).dump({"w": tensor})
    with zipfile.ZipFile(src, "w") as archive:
        archive.writestr("archive/data.pkl", buf.getvalue())
        archive.writestr("archive/byteorder", b"little")
        archive.writestr("archive/data/0", b"\0" * 16)
        archive.writestr("archive/version", b"3\n")
    out = tmp_path / "out.pt"
    refused = r"overreach\.pt: damaged torch\.save file .*storage"
    with pytest.raises(CheckpointCorruptError, match=refused):
        convert_file(str(src), str(out))
    assert not out.exists()
    with pytest.raises(CheckpointCorruptError, match=refused):
        diff_files(str(src), str(src))
    problems = verify_file(str(src)).problems
    assert len([p for p in problems if re.search(refused, p)]) == 1, problems


def _legacy_with_main_pickle(main: bytes) -> bytes:
    buf = io.BytesIO()
    torch.save({}, buf, _use_new_zipfile_serialization=False)
    head = io.BytesIO(buf.getvalue())
    for _ in range(3):  # magic number, protocol version, system info
        for _op in pickletools.genops(head):
            pass
    return buf.getvalue()[: head.tell()] + main


def test_a_legacy_pickle_claiming_a_huge_bytes_argument_is_a_corrupt_error(
    tmp_path: Path,
) -> None:
    """Regression: a legacy file whose pickle holds a BINBYTES8 claiming 2**62 bytes made
    inspect, verify, diff and convert raise a bare MemoryError (the C unpickler asked the
    file for that many bytes); now CheckpointCorruptError, before any such read."""
    src = tmp_path / "legacy-huge.pt"
    src.write_bytes(
        _legacy_with_main_pickle(b"\x80\x02\x8e" + (2**62).to_bytes(8, "little") + b"xyz.")
    )
    for fn in (
        lambda: inspect_file(str(src)),
        lambda: convert_file(str(src), str(tmp_path / "out.pt")),
        lambda: diff_files(str(src), str(src)),
        lambda: ddpstate.load(str(src), map_location="cpu"),
    ):
        res = h.run_op(fn)
        assert res.kind == "refused", res
        assert res.rss_growth < 64 << 20
    assert not verify_file(str(src)).ok


@pytest.mark.parametrize(
    ("field", "where", "flip"),
    [
        ("encryption flag", 8, 0x01),
        ("compression method", 10, 0x01),
        ("disk number", 35, 0x01),
        ("name vs local header", 46 + 3, 0x01),
        ("name length", 28, 0x80),
    ],
)
def test_verify_fails_zip_directory_damage_that_torch_refuses(
    field: str, where: int, flip: int, originals: dict[str, h.Original], tmp_path: Path
) -> None:
    """Regression: flips in zip directory fields no CRC covers (flags, disk numbers, a
    name that no longer matches its local header, a length field) passed `verify` while
    torch.load refused the file. Now verify lists the damage (and convert refuses)."""
    data = bytearray(originals["torch_zip"].data)
    first_entry = data.find(b"PK\x01\x02", max(hi for _, hi in originals["torch_zip"].payload))
    data[first_entry + where] ^= flip
    bad = tmp_path / "directory.pt"
    bad.write_bytes(bytes(data))
    with pytest.raises(DDPStateError):
        ddpstate.load(bad, map_location="cpu")  # torch refuses: the damage is real
    result = verify_file(str(bad))
    assert not result.ok, field
    with pytest.raises(DDPStateError):
        convert_file(str(bad), str(tmp_path / "out.pt"))


@pytest.mark.parametrize(("where", "flip"), [(16, 0x01), (24, 0x01)])
def test_verify_fails_damaged_zip64_end_records(
    where: int, flip: int, originals: dict[str, h.Original], tmp_path: Path
) -> None:
    """Regression: the zip64 end-of-directory record's disk number (16) and entry count
    (24) are read by torch but ignored by Python's zipfile; verify now checks them."""
    data = bytearray(originals["torch_zip"].data)
    record = data.rfind(b"PK\x06\x06")
    assert record > 0, "torch no longer writes zip64 end records; adjust this test"
    data[record + where] ^= flip
    bad = tmp_path / "zip64.pt"
    bad.write_bytes(bytes(data))
    with pytest.raises(DDPStateError):
        ddpstate.load(bad, map_location="cpu")
    assert not verify_file(str(bad)).ok
