"""The scanner's tables are torch's own, name for name; a newer torch's types are named as such.

``ddpstate inspect``/``convert``/``verify`` never import torch, so the scanner
reads tables generated from torch (``torch_tables.json``, read by
:mod:`ddpstate._streaming.torch_tables`, written by
``python -m ddpstate._streaming.gen_tables``): the globals
``torch.load(weights_only=True)`` accepts by default, each dtype's element size
and each storage class's dtype. A copy drifts when torch changes; these tests
read the installed torch and name every difference, so the two only ever
differ on purpose, and a type only a newer torch has is reported as such, not
as damage.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._weights_only_unpickler as weights_only

from ddpstate._streaming import gen_tables, torch_tables
from ddpstate._streaming.pickle_scan import DTYPE_ITEMSIZE, SAFE_GLOBALS, STORAGE_DTYPE

ROOT = Path(__file__).resolve().parents[2]


def test_safe_globals_match_torchs_weights_only_allowlist() -> None:
    # _get_allowed_globals() is what torch's weights-only Unpickler consults for
    # every GLOBAL opcode (full "module.name" -> object); user-added safe globals
    # (torch.serialization.add_safe_globals) live elsewhere and stay out of it.
    torchs = set(weights_only._get_allowed_globals())
    only_torch = sorted(torchs - SAFE_GLOBALS)
    only_ddpstate = sorted(SAFE_GLOBALS - torchs)
    assert not only_torch and not only_ddpstate, (
        f"pickle_scan.SAFE_GLOBALS differs from torch {torch.__version__}'s weights-only "
        f"allowlist: torch accepts but ddpstate refuses {only_torch}; ddpstate accepts but "
        f"torch refuses {only_ddpstate}"
    )


def test_dtype_sizes_match_torchs() -> None:
    # Every dtype torch can pickle, by its canonical name, and its element size
    # as torch itself reports it (not the tables' generator's own reading).
    torchs = {
        str(dtype).removeprefix("torch."): dtype.itemsize
        for dtype in vars(torch).values()
        if isinstance(dtype, torch.dtype)
    }
    assert torchs == DTYPE_ITEMSIZE, sorted(set(DTYPE_ITEMSIZE.items()) ^ set(torchs.items()))


def test_storage_classes_match_torchs() -> None:
    with pytest.warns(UserWarning, match="TypedStorage is deprecated"):
        torchs = {
            cls.__name__: str(cls.dtype).removeprefix("torch.")
            for cls in torch._storage_classes
            if cls not in (torch.storage.TypedStorage, torch.storage.UntypedStorage)
        }
    assert {**torchs, "UntypedStorage": "uint8"} == STORAGE_DTYPE


def test_checked_in_tables_are_what_the_installed_torch_generates() -> None:
    checked_in = Path(torch_tables.PATH).read_text()
    assert checked_in == gen_tables.render(), (
        f"ddpstate/_streaming/torch_tables.json is not what torch {torch.__version__} gives: "
        f"run `python -m ddpstate._streaming.gen_tables` and review the diff"
    )


def _rewrite_pickle(src: Path, dst: Path, old: bytes, new: bytes) -> None:
    # The archive rewritten by torch's own zip writer (records aligned as
    # torch.save aligns them), only data.pkl changed: a file a newer torch wrote.
    reader = torch._C.PyTorchFileReader(str(src))
    writer = torch._C.PyTorchFileWriter(str(dst))
    for name in reader.get_all_records():
        data = bytes(reader.get_record(name))
        if name == "data.pkl":
            assert old in data
            data = data.replace(old, new)
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()


@pytest.mark.parametrize(
    ("dtype", "old", "new", "named"),
    [
        # torch 2.14's bcomplex32 (two bfloat16s, 4 bytes) pickles as complex32 does:
        # an UntypedStorage and the dtype global in _rebuild_tensor_v3.
        (torch.complex32, b"\ncomplex32\n", b"\nbcomplex32\n", "dtype"),
        (torch.float32, b"\nFloatStorage\n", b"\nFloat4Storage\n", "storage class"),
    ],
    ids=["dtype", "storage"],
)
def test_verify_calls_a_newer_torchs_type_a_format_error_not_damage(
    tmp_path: Path, dtype: torch.dtype, old: bytes, new: bytes, named: str
) -> None:
    saved, newer = tmp_path / "saved.pt", tmp_path / "newer.pt"
    torch.save({"w": torch.arange(3.0).to(dtype)}, saved)
    _rewrite_pickle(saved, newer, old, new)
    proc = subprocess.run(
        [sys.executable, "-m", "ddpstate", "verify", str(newer)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    glob = new.strip().decode()
    assert lines[0].startswith(f"ddpstate: error: {newer}: its pickle names {named} torch.{glob}")
    assert "newer torch" in lines[0] and "upgrade ddpstate" in lines[0]
    assert "damaged" not in lines[0]


class _Custom:
    pass


def test_the_private_allowlist_getter_agrees_with_torchs_public_check() -> None:
    # Legacy files are checked against torch's built-in allowlist through its private
    # getter (no public one); zip files through the public get_unsafe_globals_in_checkpoint.
    # The two must judge the same objects alike on this torch.
    import collections
    import io

    from ddpstate._io.torch_io import unsafe_globals

    for extra, expected in (({}, []), ({"c": _Custom()}, [f"{__name__}._Custom"])):
        obj = {"w": torch.ones(2), "od": collections.OrderedDict(a=1), **extra}
        zipped, legacy = io.BytesIO(), io.BytesIO()
        torch.save(obj, zipped)
        torch.save(obj, legacy, _use_new_zipfile_serialization=False)
        assert unsafe_globals(zipped, "pt") == expected
        assert unsafe_globals(legacy, "pt_legacy") == expected
