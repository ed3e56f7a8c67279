"""What every benchmark family shares: timing, memory, the page cache, test data, results.

* Timing: :func:`median_time` runs a prepare step (untimed) and the measured
  call ``repeats`` times and keeps the median. :func:`interleave` runs several
  implementations round-robin, so drift on a shared machine hits them alike.
* Memory, in-process: :class:`PeakRss` resets the kernel's high-water mark of
  this process (``/proc/self/clear_refs``) before a call and reads ``VmHWM``
  after it, so the figure is the call's own peak above what was resident
  before (the state dict the caller already holds is not counted).
* Memory and time, subprocess: :func:`run_command` runs a command in a wrapper
  whose only child it is, so ``getrusage(RUSAGE_CHILDREN)`` is the command's
  own peak RSS.
* The page cache: :func:`evict` makes the next read of a file come from disk
  (fsync, then ``posix_fadvise(DONTNEED)``: no privileges needed, and only the
  benchmark's files lose their pages, not the interpreter's or torch's).
  :func:`check_eviction` proves it works on this machine with ``mincore``.
  ``--drop-caches`` drops the whole cache instead, where permitted.
* Data: :func:`make_state` builds N float32 tensors totalling S bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import json
import mmap
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

MIB = 1 << 20

# ---------------------------------------------------------------------------- settings


@dataclass
class Settings:
    """One run's choices, shared by every family."""

    sizes_mib: Sequence[int]
    counts: Sequence[int]
    count_size_mib: int
    repeats: int
    work: Path
    # Repeats at the points that take minutes each (4 GiB, 100,000 tensors), so
    # the full run fits in 20 minutes.
    heavy_repeats: int = 2
    peers: bool = True
    drop_caches: bool = False
    ddpstate_cmd: Sequence[str] = ()
    dist_size_mib: int = 256
    async_saves: int = 4

    def repeats_at(self, size_mib: float, count: int) -> int:
        """Timed runs for a point: fewer at the heaviest ones."""
        heavy = size_mib >= 4096 or count >= 100_000
        return min(self.repeats, self.heavy_repeats) if heavy else self.repeats


# ------------------------------------------------------------------------------ results


@dataclass
class Timing:
    """One implementation's median time for one case at one point of a scaling axis."""

    case: str
    axis: str  # "size_mib" or "tensors"
    x: float
    impl: str
    seconds: float
    peak_rss_mib: Optional[float] = None
    runs: list[float] = field(default_factory=list)
    ddpstate: bool = False


@dataclass
class Comparison:
    """A ratio ddpstate / baseline, with the target it must meet (None: for information)."""

    case: str
    axis: str
    x: float
    ours: str
    baseline: str
    ours_s: float
    baseline_s: float
    ratio: float
    target: Optional[float]
    passed: Optional[bool]
    peak_rss_mib: Optional[float]
    rss_target_mib: Optional[float] = None


@dataclass
class Results:
    """Everything a run measured, plus notes on how."""

    timings: list[Timing] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, timing: Timing) -> Timing:
        self.timings.append(timing)
        return timing

    def compare(
        self,
        ours: Timing,
        baseline: Optional[Timing],
        target: Optional[float] = None,
        rss_target_mib: Optional[float] = None,
        label: Optional[str] = None,
    ) -> None:
        """Record ours / baseline; pass means the time ratio and the RSS meet their targets."""
        if baseline is None:
            return
        ratio = ours.seconds / baseline.seconds if baseline.seconds > 0 else float("inf")
        passed: Optional[bool] = None
        if target is not None:
            passed = ratio <= target
        if rss_target_mib is not None and ours.peak_rss_mib is not None:
            passed = (passed is not False) and ours.peak_rss_mib <= rss_target_mib
        self.comparisons.append(
            Comparison(
                case=label or ours.case,
                axis=ours.axis,
                x=ours.x,
                ours=ours.impl,
                baseline=baseline.impl,
                ours_s=ours.seconds,
                baseline_s=baseline.seconds,
                ratio=ratio,
                target=target,
                passed=passed,
                peak_rss_mib=ours.peak_rss_mib,
                rss_target_mib=rss_target_mib,
            )
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "notes": self.notes,
            "comparisons": [asdict(c) for c in self.comparisons],
            "timings": [asdict(t) for t in self.timings],
        }


# ------------------------------------------------------------------------------- timing


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a benchmark's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def crc32_in_use() -> str:
    """The CRC-32 library ddpstate checksums with in this run (every figure depends on it)."""
    from ddpstate import _crc

    return f"crc32: {_crc.IMPLEMENTATION}"


def settle() -> None:
    """Start a timed run with no disk work pending from the previous one.

    Dirty pages of earlier writes, or ddpstate freeing a replaced file in a
    background thread, would otherwise be billed to whichever run came next.
    """
    from ddpstate import storage

    storage.wait_for_freed()
    os.sync()


def interleave(
    fns: Mapping[str, Callable[[], Any]],
    repeats: int,
    prepare: Optional[Mapping[str, Callable[[], Any]]] = None,
    rss: bool = True,
) -> dict[str, tuple[list[float], Optional[float]]]:
    """Time each callable ``repeats`` times, round-robin, rotating who goes first.

    ``prepare[name]`` runs untimed before each run of ``name`` (e.g. evict the
    file it reads); :func:`settle` runs after it. Returns, per name, the run
    times and the largest peak-RSS increase (MiB) over the runs.
    """
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    peaks: dict[str, Optional[float]] = {name: None for name in names}
    for i in range(repeats):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            if prepare and name in prepare:
                prepare[name]()
            settle()
            with PeakRss(enabled=rss) as probe:
                start = time.perf_counter()
                result = fns[name]()
                elapsed = time.perf_counter() - start
            del result  # free a loaded state before the next run
            times[name].append(elapsed)
            if probe.peak_mib is not None:
                peaks[name] = max(peaks[name] or 0.0, probe.peak_mib)
    return {name: (times[name], peaks[name]) for name in names}


def timing(
    case: str,
    axis: str,
    x: float,
    impl: str,
    measured: tuple[list[float], Optional[float]],
    ddpstate: bool = False,
) -> Timing:
    runs, peak = measured
    return Timing(case, axis, x, impl, statistics.median(runs), peak, runs, ddpstate)


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field_name} in /proc/self/status")


class PeakRss:
    """Peak resident memory of the block, above what was resident when it began (MiB).

    Writing 5 to ``/proc/self/clear_refs`` resets ``VmHWM`` to the current RSS
    (Linux >= 4.0), so one process can measure call after call. Where that is
    not possible, ``peak_mib`` stays None and the table shows no figure.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.peak_mib: Optional[float] = None
        self._before = 0

    def __enter__(self) -> PeakRss:
        if self.enabled:
            # Give freed heap memory back first: glibc keeps freed blocks resident
            # (its mmap threshold grows to 32 MiB), which would hide a new peak.
            gc.collect()
            _libc().malloc_trim(0)
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                self._before = _status_kib("VmRSS")
            except (OSError, RuntimeError):
                self.enabled = False
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.peak_mib = max(0, _status_kib("VmHWM") - self._before) / 1024


# Runs one command and reports its wall time and its own peak RSS: the wrapper
# has no other children, so RUSAGE_CHILDREN's maximum is that command's.
_WRAPPER = """
import json, resource, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
elapsed = time.perf_counter() - start
peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"rc": proc.returncode, "seconds": elapsed, "peak_mib": peak_kib / 1024,
                  "stderr": proc.stderr.decode(errors="replace")[-2000:]}))
"""


def run_command(command: Sequence[str]) -> tuple[float, float]:
    """Run ``command`` in a fresh process; return (seconds, its peak RSS in MiB)."""
    out = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *command], capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout)
    if result["rc"] != 0:
        raise RuntimeError(f"command failed ({result['rc']}): {command}\n{result['stderr']}")
    return float(result["seconds"]), float(result["peak_mib"])


def interleave_commands(
    commands: Mapping[str, Sequence[str]],
    repeats: int,
    prepare: Callable[[str], Any],
) -> dict[str, tuple[list[float], Optional[float]]]:
    """Like :func:`interleave`, each command in its own process (peak RSS: the largest)."""
    names = list(commands)
    times: dict[str, list[float]] = {name: [] for name in names}
    peaks: dict[str, Optional[float]] = {name: None for name in names}
    for i in range(repeats):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            prepare(name)
            settle()
            seconds, peak = run_command(commands[name])
            times[name].append(seconds)
            peaks[name] = max(peaks[name] or 0.0, peak)
    return {name: (times[name], peaks[name]) for name in names}


# --------------------------------------------------------------------------- page cache

_DROP_CACHES = "/proc/sys/vm/drop_caches"


def can_drop_caches() -> bool:
    """Whether this process may drop the whole page cache (root, writable /proc/sys)."""
    try:
        with open(_DROP_CACHES, "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def _files(path: Path) -> Iterable[Path]:
    if path.is_dir():
        yield from (p for p in sorted(path.rglob("*")) if p.is_file())
    elif path.exists():
        yield path


def evict(*paths: Path, drop_all: bool = False) -> None:
    """Make the next read of ``paths`` (files or folders) come from the disk.

    fsync first: ``POSIX_FADV_DONTNEED`` only drops clean pages. With
    ``drop_all`` (``--drop-caches``), the whole page cache is dropped instead.
    """
    for path in paths:
        for file in _files(path):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                if not drop_all:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    if drop_all:
        with open(_DROP_CACHES, "w") as f:
            f.write("3")


def resident_fraction(path: Path) -> float:
    """Fraction of ``path``'s pages in the page cache (``mincore`` on a mapping)."""
    size = path.stat().st_size
    if size == 0:
        return 0.0
    libc = _libc()
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = ctypes.create_string_buffer(pages)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw) / pages


def check_eviction(folder: Path, drop_all: bool) -> str:
    """Write 8 MiB, read it, evict it; say how much stayed cached (proves the method works)."""
    probe = folder / "evict-probe.bin"
    with open(probe, "wb") as f:
        f.write(os.urandom(8 * MIB))
    probe.read_bytes()
    before = resident_fraction(probe)
    evict(probe, drop_all=drop_all)
    after = resident_fraction(probe)
    probe.unlink()
    how = "echo 3 > /proc/sys/vm/drop_caches" if drop_all else "fsync + posix_fadvise(DONTNEED)"
    return (
        f"cold reads: {how} before each timed read; checked with mincore on an 8 MiB file: "
        f"{before:.0%} cached after reading it, {after:.0%} after eviction"
    )


# --------------------------------------------------------------------------------- data


def make_state(
    total_bytes: int, count: int, prefix: str = "", seed: int = 0
) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors totalling about ``total_bytes``, log-uniformly mixed sizes.

    Sizes span about four decades, like a real model's weights, biases and norms.
    The values are uniform noise (their content does not matter: nothing compresses).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    weights = torch.exp(torch.rand(count, generator=gen) * 9.0)
    total = total_bytes // 4
    numels = (weights / weights.sum() * total).long().clamp(min=1).tolist()
    state: dict[str, torch.Tensor] = {}
    for i, n in enumerate(numels):
        cols = 256 if n >= 4096 and n % 256 == 0 else 1
        state[f"{prefix}layers.{i}.weight"] = torch.empty(n // cols, cols).uniform_(generator=gen)
    return state


def nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def fsync_path(path: Path) -> None:
    """fsync a file (or every file of a folder, and the folder)."""
    for file in _files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove(path: Path) -> None:
    import shutil

    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
