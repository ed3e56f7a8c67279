"""safetensors onto a device through two reused host pieces (``_io/device_copy``), never whole.

The piece logic runs the same on the CPU as on CUDA (plain buffers, synchronous copies),
so its bytes and its host-memory bound are tested here; the CUDA test itself is skipped
on a machine without a GPU.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import ddpstate
from ddpstate._io import safetensors_io
from ddpstate._io.device_copy import read_into_tensors
from ddpstate._io.safetensors_io import DTYPE_NAMES, read_safetensors, read_safetensors_header
from ddpstate.errors import CheckpointCorruptError

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
# _odd_state ties two keys on purpose; the save says so each time.
pytestmark = pytest.mark.filterwarnings("ignore:.*share memory with another entry")


def _odd_state() -> dict[str, Any]:
    """Every dtype both know, odd sizes (so offsets are never aligned), 0-d, empty, a tie."""
    gen = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {}
    for i, dtype in enumerate(DTYPE_NAMES):
        raw = torch.randint(0, 256, (7 + 13 * i,), dtype=torch.uint8, generator=gen)
        size = raw.numel() - raw.numel() % dtype.itemsize
        state[f"t{i}"] = raw[:size].view(dtype).reshape(-1, 1)  # any bit pattern, NaNs too
    state["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    state["empty"] = torch.empty(0, 3)
    state["big"] = torch.randn(1001, 3, generator=gen)
    state["tied"] = state["big"]
    return state


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    for key, w in want.items():
        g = got[key]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), key
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), key


@pytest.mark.parametrize("piece", [1, 3, 7, 64, 4093, 1 << 20])
def test_pieces_fill_every_tensor_bit_for_bit_whatever_the_piece_size(
    tmp_path: Path, piece: int
) -> None:
    path = tmp_path / "odd.safetensors"
    ddpstate.save(_odd_state(), path)
    header = read_safetensors_header(path)
    want = safetensors.torch.load_file(path)
    got = {k: torch.empty(e.shape, dtype=e.dtype) for k, e in header.tensors.items()}
    spans = [(header.data_start + e.begin, got[k]) for k, e in header.tensors.items()]
    with open(path, "rb", buffering=0) as f:
        assert read_into_tensors(f, spans, piece=piece) == len(spans)
    _same(got, {k: want[k] for k in got})


def test_the_piece_reader_gives_what_the_library_reader_gives(tmp_path: Path) -> None:
    """Ties, ddpstate's key order and metadata restored, from a path, bytes or a stream."""
    path, plain = tmp_path / "odd.safetensors", tmp_path / "plain.safetensors"
    state = _odd_state()
    ddpstate.save(state, path)
    want = read_safetensors(path)
    assert want["tied"] is want["big"]
    for source in (path, path.read_bytes(), io.BytesIO(path.read_bytes())):
        got = safetensors_io._read_in_pieces(source, CPU, str(path))
        _same(got, want)
        assert got["tied"] is got["big"]
    del state["tied"]
    safetensors.torch.save_file(state, plain)  # no ddpstate key order: the file's order
    _same(safetensors_io._read_in_pieces(plain, CPU, str(plain)), read_safetensors(plain))


def test_a_file_ending_inside_a_tensor_is_named() -> None:
    a, b = torch.empty(4, dtype=torch.uint8), torch.empty(4, dtype=torch.uint8)
    assert read_into_tensors(io.BytesIO(bytes(6)), [(0, a), (4, b)], piece=3) == 1


def test_the_library_still_judges_a_local_file_first(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    safetensors.torch.save_file({"a": torch.ones(8)}, path)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(CheckpointCorruptError, match=r"bad\.safetensors"):
        safetensors_io._read_in_pieces(path, CPU, str(path))


_PEAK = """
import sys, torch
from ddpstate._io.device_copy import read_into_tensors

def rss_anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith("RssAnon:"))

class Watched:
    "The real file, with host memory sampled at every read (the moments of the peak)."
    def __init__(self, f):
        self.f, self.peak = f, 0
    def seek(self, at):
        return self.f.seek(at)
    def readinto(self, b):
        n = self.f.readinto(b)
        self.peak = max(self.peak, rss_anon())
        return n

path, size, piece = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
# The tensors on the meta device take no memory: what grows is the reader's own.
tensors = [torch.empty(size // 4, dtype=torch.uint8, device="meta") for _ in range(4)]
before = rss_anon()
with open(path, "rb", buffering=0) as f:
    watched = Watched(f)
    assert read_into_tensors(watched, [(i * size // 4, t) for i, t in enumerate(tensors)],
                             piece=piece) == 4
print(watched.peak - before)
"""


@pytest.mark.slow
def test_host_memory_stays_at_two_pieces_for_a_large_file(tmp_path: Path) -> None:
    size, piece = 512 << 20, 16 << 20
    path = tmp_path / "large.bin"
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: read as zeros without writing 512 MiB here
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK, str(path), str(size), str(piece)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    growth = int(proc.stdout)
    assert growth <= 2 * piece + (16 << 20), f"{growth >> 20} MiB of host memory for pieces"


_CUDA_PEAK = """
import sys, threading, time, torch, ddpstate

def rss_anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith("RssAnon:"))

path, mmap = sys.argv[1], sys.argv[2] == "1"
torch.zeros(1, device="cuda:0")  # the CUDA context's own host memory, before the baseline
before, peak, done = rss_anon(), [0], threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.001)

watcher = threading.Thread(target=sample)
watcher.start()
try:
    got = ddpstate.load(path, map_location="cuda:0", mmap=mmap)
finally:
    done.set()
    watcher.join()
want = ddpstate.load(path, map_location="cpu")  # the library's reader, onto the CPU
assert list(got) == list(want)
for k, w in want.items():
    g = got[k]
    assert g.device == torch.device("cuda:0") and g.dtype == w.dtype and g.shape == w.shape, k
    assert torch.equal(g.cpu().reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), k
print(peak[0] - before)
"""


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")
@pytest.mark.parametrize("mmap", [False, True])
def test_safetensors_onto_cuda_bit_for_bit_without_staging_in_host_memory(
    tmp_path: Path, mmap: bool
) -> None:
    path = tmp_path / "gpu.safetensors"
    gen = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(1 << 20 | i, generator=gen) for i in range(128)}  # 512 MiB
    state.update({k: v for k, v in _odd_state().items() if k != "tied"})
    ddpstate.save(state, path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CUDA_PEAK), str(path), str(int(mmap))],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    growth = int(proc.stdout)
    # Two 32 MiB pieces, and room for the allocator: far below the file's 512 MiB.
    assert growth <= 160 << 20, f"{growth >> 20} MiB of host memory for a 512 MiB file"
