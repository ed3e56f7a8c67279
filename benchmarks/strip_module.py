"""Issue 40's targets: ``ddpstate convert --strip-module`` against ``cp`` + ``sync`` and the
load-rename-save script a user would write, timed inside each process after its start-up.

``python -m benchmarks --only strip_module`` (``--quick``: 16 and 64 MiB, 1,000 tensors).
For a 512 MiB and a 2 GiB DataParallel-style file (600 tensors, every key ``module.``) and a
256 MiB file of 20,000 tensors, on tmpfs (``/dev/shm``: the software's own cost) and on the
``--work`` disk, each implementation runs in its own process, round-robin, median of
``--repeats``; the source is evicted from the page cache before each disk run:

* ``cp + sync``: ``cp SRC DST && sync DST``, the whole command (cp has no start-up to speak of);
* ``ddpstate convert --strip-module``: ``ddpstate.cli.main([...])`` after ``import torch,
  ddpstate.cli``: the command's own work, fsync included, without the interpreter start-up
  and imports (``ddpstate --version`` in the convert family measures those);
* the script: ``torch.load(SRC, mmap=True, weights_only=True)``, rename the keys,
  ``torch.save`` (no fsync, as a user writes it), after ``import torch``.

Memory is anonymous memory only: the process's ``RssAnon`` (/proc/PID/status), sampled by
the parent every 5 ms during the timed call, the largest value minus the value before it
(mapped page cache of the file does not count; the kernel can take it back). Targets
(issue 40): <= 2.0x cp + sync and <= 1.2x the script at 512 MiB, RssAnon growth <= 128 MiB
at 512 MiB and 2 GiB, <= 1.2x the script at 20,000 tensors. The table's RSS column is
RssAnon growth here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import MIB, Results, Settings, timing

RSS_ANON_TARGET_MIB = 128.0
SIZE_TENSORS = 600
_SAMPLE_S = 0.005


@dataclass(frozen=True)
class Points:
    """The files one run converts: sizes (MiB, ``SIZE_TENSORS`` each), and a count point."""

    sizes_mib: tuple[int, ...]
    count: int
    count_size_mib: int


ISSUE = Points(sizes_mib=(512, 2048), count=20_000, count_size_mib=256)
QUICK = Points(sizes_mib=(16, 64), count=1000, count_size_mib=16)

# Runs one implementation in a fresh process: imports first, then it prints "start" with
# its RssAnon (bytes) and makes the timed call; the parent samples the child's RssAnon from
# outside while it runs (a thread inside would miss what one GIL-holding call allocates and
# frees). Prints {"seconds"} as JSON last.
_RUNNER = r"""
import json, sys, time
impl, src, dst = sys.argv[1:4]
import torch
if impl == "ddpstate":
    import ddpstate.cli
    import ddpstate.convert

def work():
    if impl == "ddpstate":
        rc = ddpstate.cli.main(["convert", src, dst, "--strip-module", "-q"])
        if rc != 0:
            raise SystemExit(f"ddpstate convert exited {rc}")
        return
    state = torch.load(src, mmap=True, weights_only=True)
    sd = state["state_dict"]
    state["state_dict"] = {k[len("module."):] if k.startswith("module.") else k: v
                           for k, v in sd.items()}
    torch.save(state, dst)

with open("/proc/self/status") as f:
    before = next(int(l.split()[1]) for l in f if l.startswith("RssAnon:")) * 1024
print("start", before, flush=True)
start = time.perf_counter()
work()
print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)
"""

_CP_SYNC = 'cp "$0" "$1" && sync "$1"'
CP = "cp + sync"
OURS = "ddpstate convert --strip-module (timed after start-up)"
SCRIPT = "load(mmap)/rename/save script (timed after import torch)"


def points_for(settings: Settings) -> Points:
    """The issue's points, or the quick ones when the run's sizes are small (``--quick``)."""
    return QUICK if max(settings.sizes_mib, default=0) < 256 else ISSUE


def _make(folder: Path, size_mib: int, count: int) -> Path:
    import torch

    state = harness.make_state(size_mib * MIB, count, prefix="module.")
    src = folder / "src.pt"
    torch.save({"epoch": 12, "state_dict": state}, src)
    return src


def _run_timed(impl: str, src: Path, dst: Path) -> tuple[float, float | None]:
    """(seconds, RssAnon growth in MiB or None) of one run of ``impl``."""
    if impl == CP:
        seconds, _ = harness.run_command(["sh", "-c", _CP_SYNC, str(src), str(dst)])
        return seconds, None
    which = "ddpstate" if impl == OURS else "script"
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUNNER, which, str(src), str(dst)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    started = proc.stdout.readline().split()
    before = peak = int(started[1]) if started[:1] == ["start"] else 0
    while proc.poll() is None:
        anon = _rss_anon(proc.pid)
        if anon is None:  # exited between poll and read
            break
        peak = max(peak, anon)
        time.sleep(_SAMPLE_S)
    out, err = proc.communicate()
    if proc.returncode != 0 or not started:
        raise RuntimeError(f"{impl} failed ({proc.returncode}) on {src}:\n{err[-2000:]}")
    report = json.loads(out.strip().splitlines()[-1])
    return float(report["seconds"]), (peak - before) / MIB


def _rss_anon(pid: int) -> int | None:
    """RssAnon of a running process in bytes; None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
    except (OSError, StopIteration):
        return None


def run_point(
    results: Results, repeats: int, place: str, folder: Path, axis: str, x: int, src: Path
) -> None:
    """Every implementation on ``src``, round-robin; then the ratios and targets."""
    impls = (CP, OURS, SCRIPT)
    runs: dict[str, list[float]] = {name: [] for name in impls}
    anon: dict[str, float | None] = {name: None for name in impls}
    disk = place != "tmpfs"
    for i in range(repeats):
        order = impls[i % len(impls) :] + impls[: i % len(impls)]
        for name in order:
            dst = folder / "dst.pt"
            harness.remove(dst)
            if disk:
                harness.evict(src)
            harness.settle()
            seconds, growth = _run_timed(name, src, dst)
            runs[name].append(seconds)
            if growth is not None:
                anon[name] = max(anon[name] or 0.0, growth)
    case = f"strip-module ({place})"
    t = {
        name: results.add(timing(case, axis, x, name, (runs[name], anon[name]), name == OURS))
        for name in impls
    }
    ours = t[OURS]
    at_size = axis == "size_mib"
    rss_target = RSS_ANON_TARGET_MIB if at_size else None
    results.compare(ours, t[SCRIPT], 1.2 if x in (512, ISSUE.count) else None, rss_target)
    if at_size:
        results.compare(ours, t[CP], 2.0 if x == 512 else None, rss_target)
    harness.remove(folder / "dst.pt")


def _places(settings: Settings) -> dict[str, Path]:
    places = {"disk": settings.work}
    if os.path.isdir("/dev/shm"):
        places["tmpfs"] = Path(tempfile.mkdtemp(prefix="ddpstate-strip-", dir="/dev/shm"))
    return places


def run(results: Results, settings: Settings) -> None:
    """The ``python -m benchmarks`` family: every point, on tmpfs and on disk."""
    points = points_for(settings)
    places = _places(settings)
    if "tmpfs" not in places:
        results.notes.append("strip_module: no /dev/shm here; disk only")
    results.notes.append(
        "strip_module: the RSS column is RssAnon growth during the timed call (sampled "
        "from outside every 5 ms); ddpstate and the script are timed inside their process "
        "after imports"
    )
    cases = [("size_mib", size, size, SIZE_TENSORS) for size in points.sizes_mib]
    cases.append(("tensors", points.count, points.count_size_mib, points.count))
    try:
        for axis, x, size_mib, count in cases:
            made = settings.work / f"strip-{axis}-{x}"
            made.mkdir(parents=True, exist_ok=True)
            src = _make(made, size_mib, count)
            for place, root in places.items():
                folder = made if place == "disk" else root / f"strip-{axis}-{x}"
                folder.mkdir(parents=True, exist_ok=True)
                here = src if place == "disk" else Path(shutil.copy(src, folder / "src.pt"))
                repeats = settings.repeats_at(size_mib, count)
                run_point(results, repeats, place, folder, axis, x, here)
                if place != "disk":
                    harness.remove(folder)
            harness.remove(made)
    finally:
        for place, root in places.items():
            if place != "disk":
                shutil.rmtree(root, ignore_errors=True)
