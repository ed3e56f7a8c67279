"""One implementation of every fault the campaign injects, shared by the CI tests and the runner.

* sample checkpoints (torch zip, legacy, safetensors, a CheckpointManager folder) and
  the exact objects they must load back as;
* corrupters (truncation, bit flips) and :func:`corrupt_trial`, which runs ``load``,
  ``inspect``, ``diff``, ``convert`` and ``verify`` on one damaged copy and classifies
  what happened;
* :func:`crash_trial`: a forked writer killed with SIGKILL after a random delay or at
  the k-th file-system system call, and the checks that nothing was lost;
* :class:`FaultyFileSystem`: a real fsspec filesystem (``faulty://``) whose files fail
  with ENOSPC/EIO at a byte budget, on close (where fsync would fail) or on rename;
* malicious pickles, fuzz generators (driven by a ``random.Random``, so hypothesis can
  drive them through ``st.randoms()``), and the outcome tally the campaign prints.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import hashlib
import io
import itertools
import json
import os
import pickle
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
import warnings
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Optional

import fsspec
import psutil
import torch
from fsspec.implementations.local import LocalFileSystem

import ddpstate
from ddpstate import storage
from ddpstate.convert import convert_file, diff_files, inspect_file, verify_file
from ddpstate.errors import DDPStateError
from ddpstate.manager import CheckpointManager, verify_checkpoint

FORMATS = ("torch_zip", "torch_legacy", "safetensors", "manager")
SUFFIX = {"torch_zip": ".pt", "torch_legacy": ".pt", "safetensors": ".safetensors"}
#: Seconds any single operation on a damaged file may take before it counts as a hang.
OP_DEADLINE = 30.0
#: Resident memory an operation on a small damaged or fuzzed file may add.
RSS_LIMIT = 256 << 20

# ---------------------------------------------------------------------------- basics


def sha256(path: Path | str) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def same(a: Any, b: Any) -> bool:
    """Exact structural equality; tensors must agree in dtype, shape and every byte."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        ab = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return bool(torch.equal(ab, bb))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and bool(a == b)


class Hang(BaseException):
    """Raised by :func:`deadline` when an operation runs past its time (a BaseException,
    so no ``except Exception`` inside the code under test can swallow it)."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`Hang` in the main thread if the block runs longer than ``seconds``."""

    def fire(signum: int, frame: Optional[FrameType]) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def rss() -> int:
    """This process's resident set size in bytes."""
    return int(psutil.Process().memory_info().rss)


def reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS count (VmHWM) for this process (Linux >= 4.0)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    """The highest resident set size since :func:`reset_peak_rss` (or process start)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass
class OpResult:
    """What one call did: returned a value, raised a DDPStateError, or misbehaved."""

    kind: str  # "ok", "refused", "unhandled", "hang"
    value: Any = None
    error: str = ""
    seconds: float = 0.0
    rss_growth: int = 0


def run_op(fn: Callable[[], Any], limit: float = OP_DEADLINE) -> OpResult:
    """Run ``fn`` under a deadline and classify how it ended; ``rss_growth`` is the peak
    resident memory during the call above the resident memory before it."""
    before = rss()
    reset_peak_rss()
    start = time.monotonic()
    try:
        with deadline(limit), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = fn()
        kind, error = "ok", ""
    except Hang as exc:
        value, kind, error = None, "hang", str(exc)
    except DDPStateError as exc:
        value, kind, error = None, "refused", f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        value, kind, error = None, "unhandled", f"{type(exc).__name__}: {exc}"
    return OpResult(kind, value, error, time.monotonic() - start, max(0, peak_rss() - before))


# ---------------------------------------------------------------------------- samples


def sample_state(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    """A small model state dict (a few KB at scale 1), different for every seed."""
    gen = torch.Generator().manual_seed(seed)
    n = 8 * scale
    return {
        "encoder.weight": torch.randn(n, n, generator=gen),
        "encoder.bias": torch.randn(n, generator=gen),
        "head.weight": torch.randn(4, n, generator=gen).to(torch.float16),
        "steps": torch.arange(16 * scale, dtype=torch.int64) + seed,
        "mask": torch.rand(n, generator=gen) > 0.5,
    }


def write_sample(fmt: str, path: Path, seed: int) -> Any:
    """Write a checkpoint of ``fmt`` at ``path``; return what ``ddpstate.load`` must give back.

    For ``"manager"``, ``path`` is a directory holding steps 1 and 2 and the return
    value maps each step to the state it must restore.
    """
    sd = sample_state(seed)
    if fmt == "torch_zip":
        obj: Any = {"state_dict": sd, "epoch": seed, "tag": "sample"}
        torch.save(obj, path)
        return obj
    if fmt == "torch_legacy":
        obj = {"state_dict": sd, "epoch": seed, "tag": "sample"}
        torch.save(obj, path, _use_new_zipfile_serialization=False)
        return obj
    if fmt == "safetensors":
        ddpstate.save(sd, path, format="safetensors")
        return sd
    if fmt == "manager":
        expected = {}
        with CheckpointManager(path, keep_last=None) as manager:
            for step in (1, 2):
                state = {"weights": sample_state(seed + step), "epoch": step}
                manager.save(step, state)
                expected[step] = state
        return expected
    raise ValueError(fmt)


def payload_ranges(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of raw tensor data in a single checkpoint file (from the undamaged file)."""
    from ddpstate._streaming.opener import read_checkpoint

    with read_checkpoint(str(path)) as ckpt:
        return [
            (s.data_offset, s.data_offset + s.stored_size)
            for s in ckpt.storages
            if s.data_offset >= 0
        ]


# ---------------------------------------------------------------------------- corrupters


def truncate(data: bytes, rng: random.Random) -> tuple[bytes, str, int]:
    """Cut ``data`` at a random offset (strictly shorter than the original)."""
    offset = rng.randrange(0, len(data))
    return data[:offset], "truncate", offset


def flip(data: bytes, rng: random.Random) -> tuple[bytes, str, int]:
    """Flip one random bit of one random byte."""
    offset = rng.randrange(0, len(data))
    damaged = bytearray(data)
    damaged[offset] ^= 1 << rng.randrange(8)
    return bytes(damaged), "flip", offset


CORRUPTERS = (truncate, flip)


@dataclasses.dataclass
class Original:
    """An undamaged sample: where it is, its bytes, what it loads as, where its tensor data lies."""

    fmt: str
    path: Path
    expected: Any
    data: bytes = b""
    payload: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def make_original(fmt: str, folder: Path, seed: int) -> Original:
    """Write one undamaged sample of ``fmt`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "manager":
        path = folder / "run"
        return Original(fmt, path, write_sample(fmt, path, seed))
    path = folder / f"original{SUFFIX[fmt]}"
    expected = write_sample(fmt, path, seed)
    return Original(fmt, path, expected, path.read_bytes(), payload_ranges(path))


@dataclasses.dataclass
class Trial:
    """The outcome of one damaged input: one verdict per operation, and the defects found."""

    category: str
    fmt: str
    damage: str
    offset: int
    target: str = ""
    verdicts: dict[str, str] = dataclasses.field(default_factory=dict)
    defects: list[str] = dataclasses.field(default_factory=list)
    hangs: int = 0
    unhandled: int = 0
    data_lost: int = 0
    max_rss_growth: int = 0
    #: Measured durations worth reporting (lost-rank trials: seconds until the error).
    seconds: list[float] = dataclasses.field(default_factory=list)

    def note(self, op: str, res: OpResult) -> None:
        self.max_rss_growth = max(self.max_rss_growth, res.rss_growth)
        if res.kind == "hang":
            self.hangs += 1
            self.defects.append(f"{op}: hang ({res.error})")
        elif res.kind == "unhandled":
            self.unhandled += 1
            self.defects.append(f"{op}: unhandled {res.error}")
        if res.rss_growth > RSS_LIMIT:
            self.defects.append(f"{op}: resident memory grew by {res.rss_growth >> 20} MiB")

    @property
    def ok(self) -> bool:
        return not self.defects


def _in_payload(original: Original, offset: int) -> bool:
    return any(lo <= offset < hi for lo, hi in original.payload)


def _classify_value(
    trial: Trial, op: str, value: Any, expected: Any, original: Original, verify_caught: bool
) -> str:
    """Name what a successful call on damaged input returned; record a defect if it is wrong.

    Exact values: "exact". Different values without an error are acceptable only when
    nothing but a checksum could tell: torch zip flips must then be caught by ``verify``
    ("undetected payload flip, caught by verify"); legacy and safetensors files carry no
    checksum at all ("undetectable: no checksum in the format"). A truncated file that
    loads as something else is always a defect.
    """
    if same(value, expected):
        return "exact"
    if trial.damage == "flip" and original.fmt == "torch_zip":
        if verify_caught:
            return "undetected payload flip, caught by verify"
        trial.defects.append(f"{op}: silently wrong result and verify passed")
        return "WRONG"
    if trial.damage == "flip" and original.fmt in ("torch_legacy", "safetensors"):
        where = "payload" if _in_payload(original, trial.offset) else "structure"
        return f"undetectable {where} flip (no checksum in the format)"
    trial.defects.append(f"{op}: silently wrong result from a {trial.damage}d file")
    return "WRONG"


def corrupt_trial(original: Original, workdir: Path, rng: random.Random) -> Trial:
    """Damage a copy of ``original`` once (truncate or flip) and run every operation on it."""
    if original.fmt == "manager":
        return _corrupt_manager_trial(original, workdir, rng)
    damaged_bytes, damage, offset = rng.choice(CORRUPTERS)(original.data, rng)
    trial = Trial("corrupt", original.fmt, damage, offset)
    workdir.mkdir(parents=True, exist_ok=True)
    bad = workdir / f"damaged{SUFFIX[original.fmt]}"
    bad.write_bytes(damaged_bytes)
    out = workdir / f"converted{SUFFIX[original.fmt]}"
    with contextlib.suppress(FileNotFoundError):
        out.unlink()

    ver = run_op(lambda: verify_file(str(bad)))
    trial.note("verify", ver)
    verify_caught = ver.kind == "refused" or (ver.kind == "ok" and not ver.value.ok)
    trial.verdicts["verify"] = (
        "caught" if verify_caught else ("passed" if ver.kind == "ok" else ver.kind)
    )
    loaded = run_op(lambda: ddpstate.load(str(bad), map_location="cpu"))
    trial.note("load", loaded)
    trial.verdicts["load"] = loaded.kind
    if loaded.kind == "ok":
        trial.verdicts["load"] = _classify_value(
            trial, "load", loaded.value, original.expected, original, verify_caught
        )
    ins = run_op(lambda: inspect_file(str(bad)))
    trial.note("inspect", ins)
    trial.verdicts["inspect"] = ins.kind
    dif = run_op(lambda: diff_files(str(original.path), str(bad)))
    trial.note("diff", dif)
    trial.verdicts["diff"] = dif.kind
    if dif.kind == "ok":
        exact = loaded.kind == "ok" and same(loaded.value, original.expected)
        if dif.value.equal and loaded.kind == "ok" and not exact:
            trial.verdicts["diff"] = "equal: " + trial.verdicts["load"]
        elif not dif.value.equal and exact:
            trial.defects.append("diff: reports a difference where load returns the original")
            trial.verdicts["diff"] = "WRONG"
        elif dif.value.equal:
            trial.verdicts["diff"] = "equal" + ("" if exact else " (load refused)")
        else:
            trial.verdicts["diff"] = "different" + (
                "" if loaded.kind == "ok" else " (load refused)"
            )
    con = run_op(lambda: convert_file(str(bad), str(out), overwrite=True))
    trial.note("convert", con)
    trial.verdicts["convert"] = con.kind
    if con.kind == "ok":
        reread = run_op(lambda: ddpstate.load(str(out), map_location="cpu"))
        trial.note("load converted", reread)
        if reread.kind != "ok":
            trial.defects.append(f"convert wrote a file that does not load: {reread.error}")
            trial.verdicts["convert"] = "WRONG"
        else:
            trial.verdicts["convert"] = _classify_value(
                trial, "convert", reread.value, original.expected, original, verify_caught
            )
    if damage == "truncate" and not verify_caught:
        trial.defects.append("verify passed a truncated file")
    if ver.kind == "ok" and ver.value.ok and loaded.kind == "refused":
        trial.defects.append(f"verify passed a file load refuses: {loaded.error[:200]}")
    return trial


def _manager_files(run: Path) -> list[Path]:
    return sorted(p for p in run.rglob("*") if p.is_file())


def _corrupt_manager_trial(original: Original, workdir: Path, rng: random.Random) -> Trial:
    """Damage one file of a two-step manager folder; ``verify`` must fail and ``restore``
    must give back exactly one of the committed steps (the older one if the newer is hit)."""
    run = workdir / "run"
    if run.exists():
        shutil.rmtree(run)
    shutil.copytree(original.path, run)
    files = _manager_files(run)
    victim = rng.choice(files)
    damaged, damage, offset = rng.choice(CORRUPTERS)(victim.read_bytes() or b"\0", rng)
    victim.write_bytes(damaged)
    rel = str(victim.relative_to(run))
    trial = Trial("corrupt", "manager", damage, offset, target=rel)

    ver = run_op(lambda: verify_file(str(run)))
    trial.note("verify", ver)
    caught = ver.kind == "refused" or (ver.kind == "ok" and not ver.value.ok)
    trial.verdicts["verify"] = "caught" if caught else "passed"
    if not caught:
        trial.defects.append(f"verify passed a manager folder with {rel} damaged")
    step_folder = run / rel.split(os.sep)[0]
    if step_folder.is_dir():
        step_ver = run_op(lambda: verify_checkpoint(str(step_folder)))
        trial.note("verify step", step_ver)
        if step_ver.kind == "ok" and step_ver.value.ok:
            trial.defects.append(f"verify_checkpoint passed {step_folder.name} with {rel} damaged")

    state: dict[str, Any] = {"weights": None, "epoch": None}
    res = run_op(lambda: CheckpointManager(run, keep_last=None).restore(state))
    trial.note("restore", res)
    trial.verdicts["restore"] = res.kind
    if res.kind == "ok":
        step = res.value
        hit_step = int(rel.split("_")[1].split(os.sep)[0]) if rel.startswith("step_") else None
        if step not in original.expected:
            trial.data_lost += 1
            trial.defects.append(f"restore returned {step!r} with {rel} damaged")
        elif step == hit_step:
            trial.defects.append(f"restore accepted step {step} although {rel} is damaged")
        elif not same(state, original.expected[step]):
            trial.defects.append(f"restore of step {step} gave different values")
        else:
            trial.verdicts["restore"] = f"step {step} exact"
    if victim.suffix == ".pt":
        for op, fn in (
            ("load", lambda: ddpstate.load(str(victim), map_location="cpu")),
            ("inspect", lambda: inspect_file(str(victim))),
        ):
            r = run_op(fn)
            trial.note(op, r)
            trial.verdicts[op] = r.kind
    return trial


def zip_data_offset(data: bytes, suffix: str) -> tuple[int, int]:
    """(offset, size) of the stored bytes of the zip entry whose name ends with ``suffix``,
    read from its local header (torch pads local headers, unlike the central directory)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len, info.compress_size


# ---------------------------------------------------------------------------- the CLI


def ddpstate_command() -> list[str]:
    """The installed console script (falls back to ``python -m ddpstate``)."""
    found = shutil.which("ddpstate")
    return [found] if found else [sys.executable, "-m", "ddpstate"]


@dataclasses.dataclass
class CliResult:
    """One run of the ``ddpstate`` command."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    defect: str = ""


def run_cli(args: list[str], timeout: float = 120.0) -> CliResult:
    """Run ``ddpstate ARGS``; a defect is a hang, a traceback, an "unexpected" error,
    an exit status other than 0/1/2, or an error that is not one ``ddpstate: error:`` line."""
    env = {**os.environ, "DDPSTATE_DEBUG": "0"}
    try:
        done = subprocess.run(
            [*ddpstate_command(), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return CliResult(args, -1, "", "", defect=f"hang: ddpstate {' '.join(args)}")
    res = CliResult(args, done.returncode, done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode not in (0, 1, 2):
        res.defect = f"exit status {done.returncode}: {done.stderr[-300:]}"
    elif "Traceback" in done.stderr or "ddpstate: error: unexpected " in done.stderr:
        # the CLI's wording for an exception that is not a DDPStateError
        res.defect = f"unhandled: {done.stderr[-300:]}"
    elif done.returncode == 2 and (len(lines) != 1 or not lines[0].startswith("ddpstate: error:")):
        res.defect = f"error is not one 'ddpstate: error:' line: {done.stderr[-300:]}"
    return res


def cli_corrupt_trial(original: Original, workdir: Path, rng: random.Random) -> list[CliResult]:
    """Damage a copy once and run ``verify``, ``inspect``, ``diff`` and ``convert`` on it."""
    workdir.mkdir(parents=True, exist_ok=True)
    if original.fmt == "manager":
        run = workdir / "run"
        if run.exists():
            shutil.rmtree(run)
        shutil.copytree(original.path, run)
        victim = rng.choice(_manager_files(run))
        victim.write_bytes(rng.choice(CORRUPTERS)(victim.read_bytes() or b"\0", rng)[0])
        res = run_cli(["verify", "-q", str(run)])
        if not res.defect and res.returncode != 1:
            res.defect = f"verify exit {res.returncode} for a damaged manager folder"
        return [res]
    bad = workdir / f"damaged{SUFFIX[original.fmt]}"
    bad.write_bytes(rng.choice(CORRUPTERS)(original.data, rng)[0])
    out = workdir / f"cli-out{SUFFIX[original.fmt]}"
    return [
        run_cli(["verify", "-q", str(bad)]),
        run_cli(["inspect", str(bad)]),
        run_cli(["diff", "-q", str(original.path), str(bad)]),
        run_cli(["convert", "-q", "--force", str(bad), str(out)]),
    ]


# ---------------------------------------------------------------------------- crashes

CRASH_KINDS = (
    "save_torch",
    "save_safetensors",
    "manager_sync",
    "manager_async",
    "convert_in_place",
)
#: os functions counted (and killed at) in "syscall" crash trials.
HOOKED_CALLS = ("open", "fsync", "replace", "rename", "link", "unlink", "rmdir", "mkdir")
#: Object-store requests that change a bucket (every PUT, copy and delete, multipart parts
#: included), counted and killed at like the os calls when ``object_store=True``.
HOOKED_S3_CALLS = (
    "put_object",
    "copy_object",
    "delete_object",
    "delete_objects",
    "create_multipart_upload",
    "upload_part",
    "upload_part_copy",
    "complete_multipart_upload",
    "abort_multipart_upload",
)


def _install_kill_hooks(
    kill_at: int,
    when: str,
    counts: Counter[str],
    extra: Sequence[tuple[Any, str]] = (),
    log: Optional[list[tuple[int, str, str]]] = None,
    *,
    object_store: bool = False,
) -> None:
    """Make this (child) process SIGKILL itself at the ``kill_at``-th hooked call.

    The os calls of :data:`HOOKED_CALLS` always count. ``extra``: more ``(owner, name)``
    callables to count and kill at alike (writers in C, such as ``(torch, "save")``, whose
    own system calls Python cannot see). With ``object_store`` the S3 requests of
    :data:`HOOKED_S3_CALLS` that s3fs sends count in the same sequence (hooked at
    ``S3FileSystem._call_s3`` and its blocking twin ``call_s3``, through which s3fs sends
    every request). ``log``, when given, gets ``(number, name, path)`` of each call (its
    first path argument, or "").
    """
    numbers = itertools.count(1)  # next() is atomic: calls from threads (a seal's fsyncs)

    def arrive(name: str, args: Sequence[Any]) -> int:
        n = next(numbers)
        counts[name] += 1
        if log is not None:
            paths = (os.fspath(a) for a in args if isinstance(a, (str, os.PathLike)))
            log.append((n, name, next(paths, "")))
        if n == kill_at and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        return n

    def leave(n: int) -> None:
        if n == kill_at and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)

    for owner, name in [*((os, n) for n in HOOKED_CALLS), *extra]:
        real = getattr(owner, name)

        def hook(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            n = arrive(_name, args)
            try:
                return _real(*args, **kwargs)
            finally:  # also after a call that raised (os.makedirs(exist_ok=True)'s mkdir)
                leave(n)

        setattr(owner, name, hook)
    if object_store:
        import s3fs

        real_call = s3fs.S3FileSystem._call_s3

        async def call_s3(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
            name = method if isinstance(method, str) else getattr(method, "__name__", "")
            if name not in HOOKED_S3_CALLS:
                return await real_call(self, method, *args, **kwargs)
            n = arrive(f"s3:{name}", ())
            try:
                return await real_call(self, method, *args, **kwargs)
            finally:
                leave(n)

        s3fs.S3FileSystem._call_s3 = call_s3  # type: ignore[method-assign]
        # Files (S3File) send through the blocking twin, bound to the original at import.
        s3fs.S3FileSystem.call_s3 = fsspec.asyn.sync_wrapper(call_s3)  # type: ignore[attr-defined]


def _crash_paths(kind: str, folder: Path) -> Path:
    if kind == "save_safetensors":
        return folder / "model.safetensors"
    if kind in ("manager_sync", "manager_async"):
        return folder / "run"
    return folder / "model.pt"


def _crash_old(kind: str, target: Path, scale: int) -> Any:
    """Write the previous content a crash must not lose; return what it loads as."""
    if kind in ("manager_sync", "manager_async"):
        state = {"weights": sample_state(1, scale), "epoch": 1}
        with CheckpointManager(target, keep_last=2) as manager:
            manager.save(1, state)
        return state
    if kind == "convert_in_place":
        sd = {f"module.{k}": v for k, v in sample_state(1, scale).items()}
        obj = {"state_dict": sd, "epoch": 1}
        torch.save(obj, target)
        return obj
    sd = sample_state(1, scale)
    ddpstate.save(sd, target)
    return sd


def _crash_new(kind: str, scale: int) -> Any:
    if kind in ("manager_sync", "manager_async"):
        return {"weights": sample_state(2, scale), "epoch": 2}
    if kind == "convert_in_place":
        return {"state_dict": sample_state(1, scale), "epoch": 1}
    return sample_state(2, scale)


def _crash_write(kind: str, target: Path, new: Any) -> None:
    """The write that gets killed (runs in the forked child)."""
    if kind in ("manager_sync", "manager_async"):
        manager = CheckpointManager(target, keep_last=2, async_save=kind == "manager_async")
        manager.save(2, new)
        manager.close()
    elif kind == "convert_in_place":
        convert_file(str(target), strip_prefix="module.", in_place=True)
    else:
        ddpstate.save(new, target)


def _fork(body: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:  # the child: never return into the caller's stack (pytest, the campaign)
        code = 0
        try:
            # The parent's intra-op thread pool did not survive the fork; using it
            # would deadlock (a harness artifact, not ddpstate's), so stay on one thread.
            torch.set_num_threads(1)
            body()
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    return pid


def _wait(pid: int, limit: float) -> Optional[int]:
    """waitpid with a time limit; returns the raw status, or None if it is still running."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.002)
    return None


@dataclasses.dataclass
class CrashCalibration:
    """How long the write takes uninterrupted, how many hooked calls it makes, its result."""

    kind: str
    seconds: float
    calls: int
    new_sha: str


def calibrate_crash(kind: str, workdir: Path, scale: int = 16, runs: int = 3) -> CrashCalibration:
    """Run the write to completion in forked children: the median time the write itself
    takes (measured in the child), the hooked os calls it makes, and the new file's hash."""
    durations: list[float] = []
    calls = 0
    new_sha = ""
    for _ in range(runs):
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        target = _crash_paths(kind, workdir)
        _crash_old(kind, target, scale)
        new = _crash_new(kind, scale)
        read_fd, write_fd = os.pipe()

        def body(target: Path = target, new: Any = new, write_fd: int = write_fd) -> None:
            counts: Counter[str] = Counter()
            _install_kill_hooks(0, "never", counts)
            start = time.monotonic()
            _crash_write(kind, target, new)
            seconds = time.monotonic() - start
            os.write(write_fd, json.dumps([seconds, sum(counts.values())]).encode())

        pid = _fork(body)
        os.close(write_fd)
        status = _wait(pid, 120)
        with os.fdopen(read_fd, "rb") as pipe:
            text = pipe.read()
        if status is None or os.waitstatus_to_exitcode(status) != 0 or not text:
            raise RuntimeError(f"the uninterrupted {kind} write failed (status {status})")
        seconds, calls = json.loads(text)
        durations.append(seconds)
        new_sha = "" if kind.startswith("manager") else sha256(target)
    return CrashCalibration(kind, sorted(durations)[len(durations) // 2], calls, new_sha)


def crash_trial(
    kind: str,
    workdir: Path,
    rng: random.Random,
    cal: CrashCalibration,
    scale: int = 16,
    kill_point: Optional[tuple[int, str]] = None,
) -> Trial:
    """Kill a writer with SIGKILL (random delay, or at a chosen os call) and check no loss.

    ``kill_point=(k, "before"|"after")`` kills at the k-th hooked os call instead
    of a random choice.

    Afterwards the target must be the complete old or the complete new content
    (by hash for files, by restored values for manager folders), temp files must
    be hidden from listings, and the next save must leave none behind.
    """
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    target = _crash_paths(kind, workdir)
    old = _crash_old(kind, target, scale)
    new = _crash_new(kind, scale)
    old_sha = "" if kind.startswith("manager") else sha256(target)
    mode = "syscall" if kill_point else rng.choice(("delay", "syscall"))
    kill_at, when, delay = 0, "", 0.0
    if kill_point:
        kill_at, when = kill_point
        offset = kill_at
    elif mode == "syscall":
        kill_at = rng.randint(1, max(1, cal.calls))
        when = rng.choice(("before", "after"))
        offset = kill_at
    else:
        delay = rng.uniform(0.0, cal.seconds)
        offset = int(delay * 1e6)
    trial = Trial("crash", kind, f"{mode}:{when}" if when else mode, offset)

    def body() -> None:
        if mode == "syscall":
            _install_kill_hooks(kill_at, when, Counter())
        _crash_write(kind, target, new)

    pid = _fork(body)
    if mode == "delay":
        time.sleep(delay)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    status = _wait(pid, 60)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        trial.hangs += 1
        trial.defects.append("the writer neither finished nor died within 60 s")
        return trial
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    trial.verdicts["killed"] = "mid-write" if killed else "finished first"
    if not killed and os.waitstatus_to_exitcode(status) != 0:
        trial.defects.append(f"the uninterrupted writer failed (status {status})")
    if kind.startswith("manager"):
        _check_manager_after_crash(trial, target, old, new)
    else:
        _check_file_after_crash(trial, target, old, new, old_sha, cal.new_sha)
    return trial


def _temps(folder: Path) -> list[str]:
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if storage.is_temp_name(p.name)
    )


def _check_file_after_crash(
    trial: Trial, target: Path, old: Any, new: Any, old_sha: str, new_sha: str
) -> None:
    folder = target.parent
    digest = sha256(target) if target.exists() else "missing"
    if digest == old_sha:
        expected, trial.verdicts["target"] = old, "old"
    elif digest == new_sha:
        expected, trial.verdicts["target"] = new, "new"
    else:
        trial.data_lost += 1
        trial.defects.append(f"{target.name} is neither the old nor the new content ({digest})")
        return
    res = run_op(lambda: ddpstate.load(str(target), map_location="cpu"))
    trial.note("load", res)
    if res.kind != "ok" or not same(res.value, expected):
        trial.data_lost += 1
        trial.defects.append(f"load after the crash: {res.kind} {res.error}")
    listed = storage.listdir(folder)
    if listed != [target.name]:
        trial.defects.append(f"listdir shows {listed}: a temp file is taken for a checkpoint")
    trial.verdicts["temps"] = str(len(_temps(folder)))
    ddpstate.save(sample_state(3), target)
    left = _temps(folder)
    if left:
        trial.defects.append(f"the next save left temp files: {left}")


def _check_manager_after_crash(trial: Trial, run: Path, old: Any, new: Any) -> None:
    expected = {1: old, 2: new}
    state: dict[str, Any] = {"weights": None, "epoch": None}
    with CheckpointManager(run, keep_last=2) as manager:
        res = run_op(lambda: manager.restore(state))
        trial.note("restore", res)
        if res.kind != "ok" or res.value not in expected:
            trial.data_lost += 1
            trial.defects.append(f"restore after the crash: {res.kind} {res.value!r} {res.error}")
            return
        step = res.value
        trial.verdicts["target"] = "old" if step == 1 else "new"
        if not same(state, expected[step]):
            trial.data_lost += 1
            trial.defects.append(f"restored step {step} differs from what was saved")
        if not verify_checkpoint(str(run / f"step_{step:010d}")).ok:
            trial.defects.append(f"restored step {step} does not verify")
        steps = manager.steps()
        if any(s not in expected for s in steps):
            trial.defects.append(f"steps() lists {steps}")
        trial.verdicts["temps"] = str(len(_temps(run)))
        manager.save(3, {"weights": sample_state(3), "epoch": 3})
    left = _temps(run)
    uncommitted = [
        p.name
        for p in run.iterdir()
        if p.is_dir() and p.name.startswith("step_") and not (p / "manifest.json").exists()
    ]
    if left or uncommitted:
        trial.defects.append(f"the next save left {left} and uncommitted {uncommitted}")


# ---------------------------------------------------------------------------- write failures


class _FaultyFile:
    """Wraps a writable file: fails with ``error`` once ``budget`` bytes are written,
    or on close (the moment a buffered file system reports a failed fsync)."""

    def __init__(self, raw: Any, budget: Optional[int], error: int, fail_close: bool) -> None:
        self._raw = raw
        self._budget = budget
        self._error = error
        self._fail_close = fail_close
        self.written = 0

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if self._budget is not None and self.written + size > self._budget:
            room = self._budget - self.written
            if room > 0:
                self._raw.write(memoryview(data).cast("B")[:room])
                self.written += room
            raise OSError(self._error, os.strerror(self._error))
        self.written += size
        return int(self._raw.write(data))

    def close(self) -> None:
        self._raw.close()
        if self._fail_close:
            self._fail_close = False
            raise OSError(errno.EIO, "fsync failed: " + os.strerror(errno.EIO))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FaultyFileSystem(LocalFileSystem):  # type: ignore[misc]
    """``faulty://<local path>``: the local disk, with failures injected through fsspec.

    Storage options: ``fail_after`` (bytes a file may take before writes raise
    ``error``), ``error`` ("ENOSPC" or "EIO"), ``fail_on`` ("write", "close" or "mv").
    ddpstate treats this protocol like any non-object-store fsspec filesystem:
    a hidden temp name, then ``fs.mv`` onto the target.
    """

    protocol = ("faulty",)
    cachable = False

    def __init__(
        self,
        fail_after: Optional[int] = None,
        error: str = "ENOSPC",
        fail_on: str = "write",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.fail_after = fail_after
        self.error = getattr(errno, error)
        self.fail_on = fail_on

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        raw = super()._open(path, mode, **kwargs)
        if "w" not in mode:
            return raw
        budget = self.fail_after if self.fail_on == "write" else None
        return _FaultyFile(raw, budget, self.error, self.fail_on == "close")

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        if self.fail_on == "mv":
            raise OSError(errno.EIO, f"rename {path1} -> {path2}: {os.strerror(errno.EIO)}")
        super().mv(path1, path2, **kwargs)


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)


def faulty_url(path: Path | str) -> str:
    """The ``faulty://`` URL of a local path."""
    return "faulty://" + os.path.abspath(path)


# ---------------------------------------------------------------------------- malicious pickles


class Reduce:
    """Pickles as ``func(*args)``: whatever unpickles it for real runs the call."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func = func
        self.args = args

    def __reduce__(self) -> Any:
        return (self.func, self.args)


class MarkerModule(torch.nn.Module):
    """A whole ``nn.Module``, pickled as such; unpickling it touches the marker file."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self.fc = torch.nn.Linear(2, 2)

    def __setstate__(self, state: dict[str, Any]) -> None:
        Path(state["marker"]).touch()
        super().__setstate__(state)  # type: ignore[no-untyped-call]


def malicious_payloads(marker: Path) -> dict[str, Any]:
    """Objects whose unpickling creates ``marker``, by every route the issue names."""
    m = str(marker)
    return {
        "os.system": Reduce(os.system, f"touch {m}"),
        "builtins.exec": Reduce(builtins.exec, f"open({m!r}, 'w').close()"),
        "subprocess.Popen": Reduce(subprocess.Popen, ["touch", m]),
        "subprocess.call": Reduce(subprocess.call, ["touch", m]),
        "nn.Module": MarkerModule(m),
    }


MALICIOUS_CONTAINERS = ("torch_zip", "torch_legacy")


def write_malicious(container: str, name: str, path: Path, marker: Path) -> None:
    """A checkpoint holding a real state dict next to the ``name`` payload."""
    payload = malicious_payloads(marker)[name]
    obj = {"state_dict": sample_state(0), "extra": payload}
    if name == "nn.Module":
        obj = payload  # the whole module is the checkpoint, as torch.save(model) makes it
    torch.save(obj, path, _use_new_zipfile_serialization=container == "torch_zip")


MALICIOUS_CLI = ("inspect", "diff", "convert", "verify")


def malicious_trial(
    container: str, name: str, workdir: Path, cli: tuple[str, ...] = MALICIOUS_CLI
) -> Trial:
    """Every operation refuses the payload file with UnsafeCheckpointError (the API) or exit
    2 and one line (the ``cli`` commands of the console script); with the explicit opt-in
    (``unsafe=True``) inspect, verify and convert read and copy it without running it. The
    marker file must never appear."""
    workdir.mkdir(parents=True, exist_ok=True)
    marker = workdir / "marker"
    src = workdir / f"{container}-{name.replace('.', '_')}.pt"
    write_malicious(container, name, src, marker)
    clean = workdir / "clean.pt"
    if not clean.exists():
        torch.save({"state_dict": sample_state(0)}, clean)
    out = workdir / "out.pt"
    trial = Trial("malicious", container, name, 0)
    from ddpstate.errors import UnsafeCheckpointError

    refused_ops: list[tuple[str, Callable[[], Any]]] = [
        ("load", lambda: ddpstate.load(str(src), map_location="cpu")),
        ("inspect", lambda: inspect_file(str(src))),
        ("diff", lambda: diff_files(str(clean), str(src))),
        ("convert", lambda: convert_file(str(src), str(out), overwrite=True)),
        ("verify", lambda: verify_file(str(src))),
    ]
    for op, fn in refused_ops:
        with contextlib.suppress(FileNotFoundError):
            out.unlink()
        try:
            with deadline(OP_DEADLINE), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn()
            trial.defects.append(f"{op}: accepted the payload file without unsafe=True")
            trial.verdicts[op] = "accepted"
        except UnsafeCheckpointError as exc:
            trial.verdicts[op] = "UnsafeCheckpointError"
            if name == "nn.Module" and op == "load" and "nn.Module" not in str(exc):
                trial.defects.append(f"{op}: the message does not name the pickled nn.Module")
        except Hang:
            trial.hangs += 1
            trial.defects.append(f"{op}: hang")
        except Exception as exc:
            trial.unhandled += not isinstance(exc, DDPStateError)
            trial.defects.append(f"{op}: {type(exc).__name__}: {exc}")
        if op == "convert" and out.exists():
            trial.defects.append("convert left an output file behind")
    opted_in: list[tuple[str, Callable[[], Any]]] = [
        ("inspect --unsafe", lambda: inspect_file(str(src), unsafe=True).unsafe_globals),
        ("verify --unsafe", lambda: verify_file(str(src), unsafe=True).ok),
        (
            "convert --unsafe",
            lambda: (
                inspect_file(
                    convert_file(str(src), str(out), overwrite=True, unsafe=True).dst, unsafe=True
                ).unsafe_globals
            ),
        ),
    ]
    for op, fn in opted_in:
        res = run_op(fn)
        trial.note(op, res)
        trial.verdicts[op] = res.kind
        if res.kind != "ok" or not res.value:
            trial.defects.append(f"{op}: {res.kind} {res.value!r} {res.error}")
    for command in cli:
        args = {
            "inspect": ["inspect", str(src)],
            "diff": ["diff", "-q", str(clean), str(src)],
            "convert": ["convert", "-q", "--force", str(src), str(out)],
            "verify": ["verify", "-q", str(src)],
        }[command]
        ran = run_cli(args)
        trial.verdicts[f"cli {command}"] = f"exit {ran.returncode}"
        if ran.defect:
            trial.defects.append(f"cli {command}: {ran.defect}")
        elif ran.returncode != 2 or "--unsafe" not in ran.stderr:
            trial.defects.append(f"cli {command}: exit {ran.returncode}, {ran.stderr.strip()!r}")
    if "inspect" in cli:  # the console script's explicit opt-in reads, never runs
        ran = run_cli(["inspect", "--unsafe", str(src)])
        trial.verdicts["cli inspect --unsafe"] = f"exit {ran.returncode}"
        if ran.defect or ran.returncode != 0 or "unsafe" not in ran.stdout:
            trial.defects.append(f"cli inspect --unsafe: exit {ran.returncode} {ran.defect}")
    if marker.exists():
        trial.defects.append("THE PAYLOAD RAN: the marker file exists")
    return trial


# ---------------------------------------------------------------------------- failing saves

WRITE_FAULTS = ("ENOSPC", "EIO", "close", "mv", "EFBIG-rlimit")
_NEW_SIZE: dict[str, int] = {}


def _new_file_size(fmt: str, workdir: Path) -> int:
    if fmt not in _NEW_SIZE:
        scratch = workdir / f"size-probe.{fmt}"
        ddpstate.save(sample_state(2, 4), scratch, format=fmt)
        _NEW_SIZE[fmt] = scratch.stat().st_size
        scratch.unlink()
    return _NEW_SIZE[fmt]


def _save_under_fsize_limit(target: Path, fmt: str, limit: int) -> tuple[str, str]:
    """In a forked child with RLIMIT_FSIZE=limit (SIGXFSZ ignored, so writes fail with a
    real EFBIG from the kernel), save; return the raised class name and message."""
    import resource

    read_fd, write_fd = os.pipe()

    def body() -> None:
        os.close(read_fd)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        try:
            ddpstate.save(sample_state(2, 4), target, format=fmt)
            outcome = ("returned", "")
        except BaseException as exc:
            outcome = (type(exc).__name__, str(exc))
        os.write(write_fd, json.dumps(outcome).encode())

    pid = _fork(body)
    os.close(write_fd)
    status = _wait(pid, 60)
    with os.fdopen(read_fd, "rb") as pipe:
        text = pipe.read()
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "hang", ""
    name, message = json.loads(text or b'["died", ""]')
    return str(name), str(message)


def write_failure_trial(rng: random.Random, workdir: Path) -> Trial:
    """One save that fails part-way (ENOSPC/EIO at a random byte, a failing close/fsync, a
    failing rename, or a real EFBIG from RLIMIT_FSIZE): it must raise CheckpointWriteError
    naming the file, leave the previous checkpoint byte-identical and leave no temp file."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    fmt = rng.choice(("torch", "safetensors"))
    fault = rng.choice(WRITE_FAULTS)
    target = workdir / ("model.pt" if fmt == "torch" else "model.safetensors")
    ddpstate.save(sample_state(1), target, format=fmt)
    old = sha256(target)
    budget = rng.randrange(0, _new_file_size(fmt, workdir))
    trial = Trial("write-failure", fmt, fault, budget)
    if fault == "EFBIG-rlimit":
        name, message = _save_under_fsize_limit(target, fmt, budget)
    else:
        opts: dict[str, Any] = {"fail_after": budget, "error": "ENOSPC", "fail_on": "write"}
        if fault in ("ENOSPC", "EIO"):
            opts["error"] = fault
        else:
            opts["fail_on"] = fault
        res = run_op(
            lambda: ddpstate.save(
                sample_state(2, 4), faulty_url(target), format=fmt, storage_options=opts
            )
        )
        trial.note("save", res)
        name = res.error.split(":", 1)[0] if res.error else res.kind
        message = res.error
    trial.verdicts["raised"] = name
    if name != "CheckpointWriteError":
        trial.defects.append(f"save raised {name}: {message[:200]}")
    elif target.name not in message:
        trial.defects.append(f"the error does not name {target.name}: {message[:200]}")
    if sha256(target) != old:
        trial.data_lost += 1
        trial.defects.append("the previous checkpoint changed")
    left = [p.name for p in workdir.iterdir() if p.name != target.name]
    if left:
        trial.defects.append(f"left behind: {left}")
    return trial


# ---------------------------------------------------------------------------- lost and late ranks

LOST_RANK_OPS = ("save", "load", "restore")


def lost_and_late_rank(rank: int, world: int, op: str, folder: str, timeout: float) -> Any:
    """Run under ``tests.multiproc.run_ranks`` with 3 ranks: rank 1 exits before ``op``,
    rank 2 reaches it only after ``timeout``; ranks 0 and 2 report how their call ended."""
    Path(folder, f"pid-{rank}").write_text(str(os.getpid()))
    if rank == 1:
        os._exit(0)  # gone without a word, as a crashed or killed rank is
    if rank == 2:
        time.sleep(timeout * 1.5)
    start = time.monotonic()
    try:
        if op == "save":
            ddpstate.save(sample_state(rank), Path(folder, "model.pt"), timeout=timeout)
        elif op == "load":
            ddpstate.load(Path(folder, "existing.pt"), map_location="cpu", timeout=timeout)
        else:
            state: dict[str, Any] = {"weights": None}
            CheckpointManager(Path(folder, "run"), timeout=timeout).restore(state)
        return ("returned", time.monotonic() - start, (), "")
    except DDPStateError as exc:
        missing = tuple(getattr(exc, "missing_ranks", ()))
        return (type(exc).__name__, time.monotonic() - start, missing, str(exc))


#: Allowed lateness of a BarrierTimeoutError: 10 % of the timeout plus a fixed 0.3 s for
#: the store's polling and process scheduling on a loaded two-core machine.
def timeout_bound(timeout: float) -> float:
    """The latest a BarrierTimeoutError may arrive, in seconds after the call."""
    return timeout * 1.1 + 0.3


def lost_rank_trial(op: str, folder: Path, timeout: float = 2.0) -> Trial:
    """Three real gloo ranks (tests.multiproc.run_ranks): rank 1 exits before ``op``, rank
    2 arrives 1.5 x ``timeout`` late. Rank 0 must raise BarrierTimeoutError naming ranks 1
    and 2, and rank 2 one naming rank 1, each between 0.95 x timeout and
    :func:`timeout_bound`; no rank process may survive."""
    from tests.multiproc import RankFailed, run_ranks

    folder.mkdir(parents=True, exist_ok=True)
    prepare_lost_rank_folder(folder)
    trial = Trial("lost-rank", op, "exit+late", int(timeout * 1000))
    try:
        results = run_ranks(
            lost_and_late_rank, 3, args=(op, str(folder), timeout), expect_failure=True, timeout=60
        )
    except RankFailed as exc:
        trial.hangs += 1
        trial.defects.append(f"a rank hung: {exc}")
        return trial
    if results[1] is not None:
        trial.defects.append(f"rank 1 reported {results[1]!r} although it exited")
    for rank, missing in ((0, (1, 2)), (2, (1,))):
        if not isinstance(results[rank], tuple):
            trial.unhandled += 1
            trial.defects.append(f"rank {rank} failed: {str(results[rank])[-500:]}")
            continue
        name, elapsed, named, message = results[rank]
        trial.verdicts[f"rank {rank}"] = f"{name} naming {list(named)}"
        trial.seconds.append(elapsed)
        if name != "BarrierTimeoutError" or tuple(named) != missing:
            trial.defects.append(f"rank {rank}: {name} naming {named}: {message[:200]}")
        elif not all(f"{r}" in message for r in missing):
            trial.defects.append(f"rank {rank}: message does not name {missing}: {message}")
        if not timeout * 0.95 <= elapsed <= timeout_bound(timeout):
            trial.hangs += elapsed > timeout_bound(timeout)
            trial.defects.append(f"rank {rank} raised after {elapsed:.2f} s (timeout {timeout})")
    pids = [int((folder / f"pid-{r}").read_text()) for r in range(3)]
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    if alive:
        trial.hangs += 1
        trial.defects.append(f"rank processes still running: {alive}")
    return trial


def prepare_lost_rank_folder(folder: Path) -> None:
    """The files ``load`` and ``restore`` need before the ranks start."""
    ddpstate.save(sample_state(0), folder / "existing.pt")
    with CheckpointManager(folder / "run") as manager:
        manager.save(1, {"weights": sample_state(1)})


# ---------------------------------------------------------------------------- fuzzing

_ST_DTYPES = ("F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3")
_ST_BAD_DTYPES = ("XX", "", "f32", "U64x", "F8_E5M2", "C64")
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2}
_HUGE = (2**31, 2**32 + 1, 2**38, 2**40, 2**62, 2**64, 10**30, -1, -(2**63))


def _fuzz_int(rng: random.Random, small: int = 8) -> Any:
    roll = rng.random()
    if roll < 0.75:
        return rng.randint(0, small)
    if roll < 0.93:
        return rng.choice(_HUGE)
    return rng.choice(("1", 1.5, None, True, [], {}))


def fuzz_safetensors(rng: random.Random) -> bytes:
    """A safetensors-like file: plausible headers, with lies in sizes, offsets and types."""
    header: dict[str, Any] = {}
    offset = 0
    payload_len = 0
    for i in range(rng.randint(0, 4)):
        dtype = rng.choice(_ST_DTYPES) if rng.random() < 0.85 else rng.choice(_ST_BAD_DTYPES)
        shape = [_fuzz_int(rng) for _ in range(rng.randint(0, 3))]
        numel = 1
        for d in shape:
            numel *= d if isinstance(d, int) and not isinstance(d, bool) and d > 0 else 1
        nbytes = min(numel * _ITEMSIZE.get(dtype, 1), 1 << 16)
        begin, end = offset, offset + nbytes
        if rng.random() < 0.3:
            begin, end = _fuzz_int(rng, 64), _fuzz_int(rng, 64)
        entry: dict[str, Any] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        if rng.random() < 0.1:
            entry.pop(rng.choice(list(entry)))
        name = rng.choice((f"layer{i}.weight", f"module.l{i}", "", "é\u2028x", "__metadata__"))
        header[name] = entry
        if isinstance(end, int) and not isinstance(end, bool) and 0 <= end <= 1 << 16:
            offset = max(offset, end)
            payload_len = max(payload_len, end)
    if rng.random() < 0.3:
        header["__metadata__"] = rng.choice(
            ({"format": "pt"}, {"k": 1}, "text", {"ddpstate.aliases": "{not json"}, None)
        )
    text = json.dumps(header).encode()
    if rng.random() < 0.1:
        text = text[: rng.randint(0, len(text))]
    length = len(text)
    if rng.random() < 0.15:
        length = rng.choice((0, 1, len(text) + 1, len(text) - 1, 2**40, 2**64 - 1))
    payload = bytes(rng.getrandbits(8) for _ in range(min(payload_len, 4096)))
    if rng.random() < 0.2:
        payload = payload[: rng.randint(0, len(payload))]
    return struct.pack("<Q", length % 2**64) + text + payload


class _StorageStub:
    def __init__(self, key: str, storage_type: Any, numel: Any, location: str) -> None:
        self.key, self.storage_type, self.numel, self.location = key, storage_type, numel, location


class _TensorStub:
    def __init__(self, storage: _StorageStub, offset: Any, size: Any, stride: Any) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

    def __reduce__(self) -> Any:
        return (
            torch._utils._rebuild_tensor_v2,
            (self.storage, self.offset, self.size, self.stride, False, OrderedDict()),
        )


class _StubPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageStub):
            return ("storage", obj.storage_type, obj.key, obj.location, obj.numel)
        return None


_STORAGE_TYPES = (torch.FloatStorage, torch.HalfStorage, torch.LongStorage, torch.ByteStorage)


def _fuzz_tuple(rng: random.Random, n: int) -> Any:
    if rng.random() < 0.1:
        return rng.choice(("x", None, 3))
    return tuple(_fuzz_int(rng) for _ in range(n))


def _fuzz_data_pkl(rng: random.Random, valid: bytes) -> tuple[bytes, dict[str, int]]:
    """A data.pkl: stub tensors with lying storage sizes, or mutated torch output."""
    roll = rng.random()
    records: dict[str, int] = {}
    if roll < 0.55:
        obj: dict[str, Any] = {}
        for i in range(rng.randint(0, 3)):
            key = str(i) if rng.random() < 0.9 else rng.choice(("../x", "", "99"))
            numel = _fuzz_int(rng, 64)
            storage_obj = _StorageStub(
                key, rng.choice(_STORAGE_TYPES), numel, rng.choice(("cpu", "cuda:7", "meta", "?"))
            )
            dims = rng.randint(0, 3)
            obj[f"t{i}"] = _TensorStub(
                storage_obj, _fuzz_int(rng, 16), _fuzz_tuple(rng, dims), _fuzz_tuple(rng, dims)
            )
            records[key] = rng.choice((0, 4, 16, 64, 256))
        buf = io.BytesIO()
        _StubPickler(buf, protocol=rng.choice((2, 3, 4))).dump(obj)
        return buf.getvalue(), records
    data = bytearray(valid)
    for _ in range(rng.randint(1, 6)):
        op = rng.random()
        if op < 0.5 and data:
            data[rng.randrange(len(data))] = rng.getrandbits(8)
        elif op < 0.75:
            pos = rng.randint(0, len(data))
            data[pos:pos] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 8)))
        elif data:
            pos = rng.randrange(len(data))
            del data[pos : pos + rng.randint(1, 8)]
    return bytes(data), {"0": rng.choice((0, 16, 64, 4096))}


_VALID_ZIP: dict[str, bytes] = {}


def _valid_zip_parts() -> dict[str, bytes]:
    if not _VALID_ZIP:
        buf = io.BytesIO()
        torch.save({"w": torch.arange(4, dtype=torch.float32)}, buf)
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as archive:
            for name in archive.namelist():
                _VALID_ZIP[name.split("/", 1)[1]] = archive.read(name)
    return _VALID_ZIP


def fuzz_torch_zip(rng: random.Random) -> bytes:
    """A torch.save-like zip: a fuzzed data.pkl with data records of random sizes."""
    parts = _valid_zip_parts()
    pkl, records = _fuzz_data_pkl(rng, parts["data.pkl"])
    prefix = rng.choice(("archive", "model", "a/b"))
    buf = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if rng.random() < 0.1 else zipfile.ZIP_STORED
    with zipfile.ZipFile(buf, "w", compression=method) as archive:
        archive.writestr(f"{prefix}/data.pkl", pkl)
        if rng.random() < 0.9:
            archive.writestr(f"{prefix}/byteorder", rng.choice((b"little", b"big", b"odd")))
        for key, size in records.items():
            if rng.random() < 0.9:
                archive.writestr(
                    f"{prefix}/data/{key}", bytes(rng.getrandbits(8) for _ in range(size))
                )
        if rng.random() < 0.9:
            archive.writestr(f"{prefix}/version", rng.choice((b"3\n", b"1\n", b"99\n", b"x")))
    data = buf.getvalue()
    if rng.random() < 0.15:
        data = flip(data, rng)[0]
    return data


_VALID_LEGACY: list[bytes] = []


def fuzz_legacy(rng: random.Random) -> bytes:
    """A legacy (pre-1.6) torch file with random bytes changed, inserted, removed or cut."""
    if not _VALID_LEGACY:
        buf = io.BytesIO()
        torch.save({"w": torch.arange(4.0), "n": 3}, buf, _use_new_zipfile_serialization=False)
        _VALID_LEGACY.append(buf.getvalue())
    data = bytearray(_VALID_LEGACY[0])
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        pos = rng.randrange(len(data)) if data else 0
        if op < 0.5 and data:
            data[pos] = rng.getrandbits(8)
        elif op < 0.7:
            data[pos:pos] = struct.pack("<Q", rng.choice(_HUGE[:6]) % 2**64)
        elif op < 0.85:
            del data[pos : pos + rng.randint(1, 16)]
        else:
            del data[pos:]
    return bytes(data)


FUZZERS: dict[str, Callable[[random.Random], bytes]] = {
    "safetensors": fuzz_safetensors,
    "torch_zip": fuzz_torch_zip,
    "torch_legacy": fuzz_legacy,
}


def fuzz_case(kind: str, rng: random.Random, workdir: Path) -> Trial:
    """Generate one fuzzed file and feed it to ``inspect``, ``convert`` and ``load``."""
    data = FUZZERS[kind](rng)
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / ("fuzz.safetensors" if kind == "safetensors" else "fuzz.pt")
    src.write_bytes(data)
    out = workdir / ("fuzz-out.safetensors" if kind == "safetensors" else "fuzz-out.pt")
    trial = Trial("fuzz", kind, "generated", len(data))
    for op, fn in (
        ("inspect", lambda: inspect_file(str(src))),
        ("convert", lambda: convert_file(str(src), str(out), overwrite=True)),
        ("load", lambda: ddpstate.load(str(src), map_location="cpu")),
    ):
        res = run_op(fn)
        trial.note(op, res)
        trial.verdicts[op] = res.kind
    if trial.defects:
        trial.defects.append(f"input (hex, first 512 bytes): {data[:512].hex()}")
    return trial


def huge_safetensors(path: Path, claimed_bytes: int = 1 << 40) -> None:
    """A safetensors header claiming a ``claimed_bytes`` tensor, followed by 16 bytes of data."""
    numel = claimed_bytes // 4
    header = {"w": {"dtype": "F32", "shape": [numel], "data_offsets": [0, claimed_bytes]}}
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 16)


def huge_torch_zip(path: Path, claimed_numel: int = 1 << 38) -> None:
    """A torch.save zip claiming a ``claimed_numel`` float storage (1 TiB); 16 bytes stored."""
    stub = _StorageStub("0", torch.FloatStorage, claimed_numel, "cpu")
    buf = io.BytesIO()
    _StubPickler(buf, protocol=2).dump({"w": _TensorStub(stub, 0, (claimed_numel,), (1,))})
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", buf.getvalue())
        archive.writestr("archive/byteorder", b"little")
        archive.writestr("archive/data/0", b"\0" * 16)
        archive.writestr("archive/version", b"3\n")


# ---------------------------------------------------------------------------- tally


@dataclasses.dataclass
class Tally:
    """Per-category counts for the campaign's summary table."""

    trials: int = 0
    data_lost: int = 0
    hangs: int = 0
    unhandled: int = 0
    other: int = 0
    outcomes: Counter[str] = dataclasses.field(default_factory=Counter)
    examples: list[str] = dataclasses.field(default_factory=list)
    max_rss_growth: int = 0
    max_seconds: float = 0.0

    def add(self, trial: Trial) -> None:
        self.trials += 1
        self.max_seconds = max([self.max_seconds, *trial.seconds])
        self.data_lost += trial.data_lost
        self.hangs += trial.hangs
        self.unhandled += trial.unhandled
        self.max_rss_growth = max(self.max_rss_growth, trial.max_rss_growth)
        if trial.defects and not (trial.data_lost or trial.hangs or trial.unhandled):
            self.other += 1
        for op, verdict in trial.verdicts.items():
            self.outcomes[f"{op}: {verdict}"] += 1
        if trial.defects and len(self.examples) < 10:
            self.examples.append(
                f"{trial.fmt} {trial.damage}@{trial.offset} {trial.target}: {trial.defects}"
            )

    def add_cli(self, result: CliResult) -> None:
        self.trials += 1
        self.outcomes[f"{result.args[0]}: exit {result.returncode}"] += 1
        if result.defect:
            if result.defect.startswith("hang"):
                self.hangs += 1
            elif result.defect.startswith("unhandled"):
                self.unhandled += 1
            else:
                self.other += 1
            if len(self.examples) < 10:
                self.examples.append(f"{result.args}: {result.defect}")
