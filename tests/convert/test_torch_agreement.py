"""Issue 40: ddpstate agrees with torch's own reader, on generated files (hypothesis).

1. ``ddpstate convert --strip-module``'s output, loaded by plain ``torch.load(weights_only=
   True)``, equals torch's own load of the input with the prefix stripped: every dtype torch
   saves, views with offsets, non-contiguous and 0-dim tensors, tied storages, pickle
   protocols 2-5 and legacy files; values bitwise, dtype, shape, stride, and which keys share
   a storage. An input torch's weights_only load refuses, convert refuses.
2. ``verify`` passes exactly the files ``torch.load(weights_only=True)`` loads, over the same
   files truncated, with a byte flipped, or rewritten into the archive layouts torch refuses.
   Where verify is stricter by design (a record whose CRC-32 no longer matches, which torch
   does not check), only "verify ok implies torch loads" is required.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddpstate.cli
from ddpstate.convert import verify_file
from ddpstate.errors import DDPStateError
from tests import hostile


def _roundtrips(dtype: torch.dtype, legacy: bool) -> bool:
    """Whether torch.save/torch.load keep a tensor of ``dtype`` (and a view of it)."""
    try:
        t = torch.arange(16, dtype=torch.uint8).view(dtype)
        buf = io.BytesIO()
        torch.save({"x": t, "y": t[1:]}, buf, _use_new_zipfile_serialization=not legacy)
        buf.seek(0)
        back = torch.load(buf, weights_only=True)
        return bool(torch.equal(_bits(back["x"]), _bits(t)))
    except Exception:  # torch has no storage for it (sub-byte, quantized): not a case
        return False


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width: compares NaNs and bit types bitwise."""
    if t.is_complex():
        t = torch.view_as_real(t)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width)


# Every dtype torch declares, kept where torch.save round-trips it (derived, not listed).
_ALL = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=lambda d: str(d))
DTYPES = [d for d in _ALL if _roundtrips(d, legacy=False)]
LEGACY_DTYPES = [d for d in DTYPES if _roundtrips(d, legacy=True)]


def test_the_generated_dtypes_cover_what_the_issue_names() -> None:
    names = {str(d).removeprefix("torch.") for d in DTYPES}
    assert {"bool", "complex64", "complex128", "bfloat16", "float16", "uint8"} <= names
    assert {"float8_e4m3fn", "float8_e5m2"} <= names
    assert {"uint16", "uint32", "uint64"} <= names  # this torch has them


@st.composite
def tensors(draw: st.DrawFn, dtype: torch.dtype) -> list[torch.Tensor]:
    """One or two tensors over one storage of ``dtype``: whole, offset view, strided,
    transposed, 0-dim, or a tied pair (the same tensor twice, or two views)."""
    n = draw(st.integers(1, 24))
    size = n * torch.empty(0, dtype=dtype).element_size()
    raw = bytearray(draw(st.binary(min_size=size, max_size=size)))
    if dtype == torch.bool:
        raw = bytearray(b & 1 for b in raw)
    base = torch.frombuffer(raw, dtype=torch.uint8).clone().view(dtype)
    kind = draw(st.sampled_from(["whole", "offset", "strided", "transposed", "scalar", "tied"]))
    if kind == "offset" and n > 1:
        k = draw(st.integers(1, n - 1))
        return [base[k:]]
    if kind == "strided" and n > 2:
        return [base[:: draw(st.integers(2, 3))]]
    if kind == "transposed" and n >= 4:
        rows = draw(st.integers(2, n // 2))
        return [base[: rows * (n // rows)].view(rows, n // rows).t()]
    if kind == "scalar":
        return [base[n - 1]]
    if kind == "tied":
        return [base, base] if n == 1 or draw(st.booleans()) else [base, base[1:]]
    return [base]


@st.composite
def checkpoints(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A state dict with every key ``module.``-prefixed, and the torch.save options."""
    legacy = draw(st.booleans())
    pool = LEGACY_DTYPES if legacy else DTYPES
    state: dict[str, torch.Tensor] = {}
    for i in range(draw(st.integers(1, 4))):
        for j, t in enumerate(draw(tensors(draw(st.sampled_from(pool))))):
            state[f"module.layer{i}.w{j}"] = t
    options = {
        "pickle_protocol": draw(st.integers(2, 5)),
        "_use_new_zipfile_serialization": not legacy,
    }
    return state, options


def _torch_loads(path: Path) -> bool:
    try:
        torch.load(path, weights_only=True)
    except Exception:  # any refusal of torch's counts as "does not load"
        return False
    return True


def _storage_groups(state: dict[str, torch.Tensor]) -> set[frozenset[str]]:
    """Which keys share a storage."""
    groups: dict[int, set[str]] = {}
    for key, t in state.items():
        groups.setdefault(t.untyped_storage().data_ptr(), set()).add(key)
    return {frozenset(g) for g in groups.values()}


def _assert_same(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert list(out) == list(ref)
    for key, want in ref.items():
        got = out[key]
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), key
        assert torch.equal(_bits(got), _bits(want)), key
    assert _storage_groups(out) == _storage_groups(ref)


def _convert_agrees(state: dict[str, torch.Tensor], options: dict[str, Any], folder: Path) -> None:
    """Where torch's weights_only load refuses the input (torch 2.13 refuses every pickle
    protocol 4/5 file: it has no FRAME opcode), convert refuses it too and writes nothing."""
    src, dst = folder / "src.pt", folder / "dst.pt"
    dst.unlink(missing_ok=True)
    torch.save(state, src, **options)
    rc = ddpstate.cli.main(["convert", str(src), str(dst), "--strip-module", "-q"])
    if not _torch_loads(src):
        assert rc == 2 and not dst.exists(), "convert copied a file torch's weights_only refuses"
        return
    assert rc == 0
    ref = {k.removeprefix("module."): v for k, v in torch.load(src, weights_only=True).items()}
    _assert_same(torch.load(dst, weights_only=True), ref)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=checkpoints())
def test_convert_strip_module_equals_torchs_own_load(
    case: tuple[dict[str, torch.Tensor], dict[str, Any]], tmp_path: Path
) -> None:
    _convert_agrees(*case, tmp_path)


@pytest.mark.slow
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=checkpoints())
def test_convert_strip_module_equals_torchs_own_load_many(
    case: tuple[dict[str, torch.Tensor], dict[str, Any]], tmp_path: Path
) -> None:
    _convert_agrees(*case, tmp_path)


# --------------------------------------------------------------------------- verify


def _verify_passes(path: Path) -> bool:
    try:
        return verify_file(path).ok
    except DDPStateError:
        return False


def _crcs_hold(path: Path) -> bool:
    """A well-formed zip whose every record still matches its CRC-32 (torch never checks)."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        return True  # not a zip (legacy, or no directory left): nothing for verify to add
    try:
        with archive:
            for info in archive.infolist():
                if zlib.crc32(archive.read(info)) != info.CRC:
                    return False
    except Exception:  # zipfile's own CRC check, or a record it cannot read back
        return False
    return True


Mutation = Callable[[Path, Path], None]


def _truncate(at: float) -> Mutation:
    def cut(src: Path, dst: Path) -> None:
        raw = src.read_bytes()
        dst.write_bytes(raw[: int(len(raw) * at)])

    return cut


def _flip(at: float, bit: int) -> Mutation:
    def flip(src: Path, dst: Path) -> None:
        raw = bytearray(src.read_bytes())
        raw[min(int(len(raw) * at), len(raw) - 1)] ^= 1 << bit
        dst.write_bytes(bytes(raw))

    return flip


def _layout(name: str) -> Mutation:
    def rewrite(src: Path, dst: Path) -> None:
        if not zipfile.is_zipfile(src):
            dst.write_bytes(src.read_bytes())
            return
        with zipfile.ZipFile(src) as z:
            records = [hostile.stored(i.filename, z.read(i)) for i in z.infolist()]
        hostile.write_zip(dst, hostile.LAYOUT_MUTANTS[name](records))

    return rewrite


mutations = st.one_of(
    st.just(lambda src, dst: dst.write_bytes(src.read_bytes())),
    st.builds(_truncate, st.floats(0.0, 0.999)),
    st.builds(_flip, st.floats(0.0, 1.0), st.integers(0, 7)),
    st.builds(_layout, st.sampled_from(sorted(hostile.LAYOUT_MUTANTS))),
)


def _verify_agrees(
    state: dict[str, torch.Tensor], options: dict[str, Any], mutate: Mutation, folder: Path
) -> None:
    src, dst = folder / "src.pt", folder / "mutant.pt"
    torch.save(state, src, **options)
    mutate(src, dst)
    torch_ok, verify_ok = _torch_loads(dst), _verify_passes(dst)
    if verify_ok:
        assert torch_ok, "verify passed a file torch.load(weights_only=True) refuses"
    if torch_ok and _crcs_hold(dst):
        assert verify_ok, "verify failed a file torch loads whose records are intact"


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=checkpoints(), mutate=mutations)
def test_verify_passes_exactly_the_files_torch_loads(
    case: tuple[dict[str, torch.Tensor], dict[str, Any]], mutate: Mutation, tmp_path: Path
) -> None:
    _verify_agrees(*case, mutate, tmp_path)


@pytest.mark.parametrize("mutant", sorted(hostile.LAYOUT_MUTANTS))
def test_verify_fails_each_layout_torch_refuses(mutant: str, tmp_path: Path) -> None:
    """The fixed cases of the property above: every layout mutant of a plain file."""
    _verify_agrees(hostile.state(2), {"pickle_protocol": 2}, _layout(mutant), tmp_path)


@pytest.mark.slow
@settings(
    max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=checkpoints(), mutate=mutations)
def test_verify_passes_exactly_the_files_torch_loads_many(
    case: tuple[dict[str, torch.Tensor], dict[str, Any]], mutate: Mutation, tmp_path: Path
) -> None:
    _verify_agrees(*case, mutate, tmp_path)
