"""save/load as collectives on real 2- and 4-rank gloo groups.

Who writes is observed, not assumed: each rank installs an audit hook that
records every open-for-writing and rename under the test folder, and the
parent watches the folder with inotify, so the kernel itself reports how many
files were created and closed after writing.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno
import hashlib
import os
import shutil
import struct
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiproc import run_ranks

# --------------------------------------------------------------------------- inotify (Linux)

_IN_CLOSE_WRITE = 0x008
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_NONBLOCK = 0o4000


class _Inotify:
    """The kernel's record of files created, closed after writing, and renamed into a folder."""

    def __init__(self, folder: Path) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._fd = libc.inotify_init1(_IN_NONBLOCK)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        mask = _IN_CREATE | _IN_CLOSE_WRITE | _IN_MOVED_TO
        if libc.inotify_add_watch(self._fd, str(folder).encode(), mask) < 0:
            raise OSError(ctypes.get_errno(), "inotify_add_watch failed")

    def events(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        names = {_IN_CREATE: "create", _IN_CLOSE_WRITE: "close_write", _IN_MOVED_TO: "moved_to"}
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                break
            offset = 0
            while offset < len(data):
                _wd, mask, _cookie, length = struct.unpack_from("iIII", data, offset)
                raw = data[offset + 16 : offset + 16 + length]
                name = raw.split(b"\0", 1)[0].decode()
                offset += 16 + length
                for bit, label in names.items():
                    if mask & bit:
                        out.append((label, name))
        os.close(self._fd)
        return out


@pytest.fixture()
def watched(tmp_path: Path) -> Iterator[tuple[Path, _Inotify]]:
    if not sys.platform.startswith("linux"):
        pytest.skip("inotify is Linux-only")
    folder = tmp_path / "ckpts"
    folder.mkdir()
    yield folder, _Inotify(folder)


# --------------------------------------------------------------------------- rank-side helpers


def _spy_writes(folder: str) -> list[tuple[str, str]]:
    """Record, in this process, every open-for-writing and rename under ``folder``."""
    seen: list[tuple[str, str]] = []
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            mode, flags = args[1], args[2]
            writing = bool(flags & write_flags) or (
                isinstance(mode, str) and any(c in mode for c in "wax+")
            )
            if writing and path.startswith(folder):
                seen.append(("open", os.path.basename(path)))
        elif event == "os.rename" and os.fsdecode(args[1]).startswith(folder):
            seen.append(("rename", os.path.basename(os.fsdecode(args[1]))))

    sys.addaudithook(hook)
    return seen


def _make_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {f"layer{i}.weight": torch.randn(16, 8, generator=gen) for i in range(4)},
        "step": seed,
    }


def _flat(seed: int) -> dict[str, torch.Tensor]:
    return dict(_make_state(seed)["model"])


class ExplodesWhenPickled:
    def __reduce__(self) -> Any:
        raise RuntimeError("this object refuses to be pickled")


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _failure(fn: Any) -> dict[str, Any]:
    import ddpstate.dist as ddist

    ddist.barrier(name="test: start together", timeout=60)
    started = time.time()
    try:
        fn()
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "called": started,
            "raised": time.time(),
        }
    return {"type": None}


# --------------------------------------------------------------------------- rank workers


def _save_load_worker(rank: int, world: int, folder: str, ddp: bool = True) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from ddpstate.checkpoint import load, load_model_state, save, save_model_state

    writes = _spy_writes(folder)
    expected = _make_state(0)
    # Every rank passes its own object; only rank 0's may end up in the file.
    save(_make_state(rank), os.path.join(folder, "ckpt.pt"))
    back = load(os.path.join(folder, "ckpt.pt"))
    assert back["step"] == 0
    assert all(torch.equal(back["model"][k], v) for k, v in expected["model"].items())

    save(_flat(rank), os.path.join(folder, "model.safetensors"))
    flat = load(os.path.join(folder, "model.safetensors"))
    assert all(torch.equal(flat[k], v) for k, v in _flat(0).items())

    if not ddp:  # building DDP costs seconds of imports per rank; the 2-rank test does it
        return {"writes": list(writes)}
    # A DDP-wrapped model saved with clean keys, loaded into a plain one.
    torch.manual_seed(0)  # DDP also broadcasts rank 0's parameters at construction
    wrapped = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    save_model_state(wrapped, os.path.join(folder, "net.pt"))
    assert sorted(load(os.path.join(folder, "net.pt"))) == ["0.bias", "0.weight"]
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    assert load_model_state(plain, os.path.join(folder, "net.pt")) == ([], [])
    assert torch.equal(plain[0].weight, wrapped.module[0].weight)
    return {"writes": list(writes)}


class Custom:
    """Loading an instance needs arbitrary unpickling."""


def _outcome(fn: Any) -> tuple[str, str, tuple[str, ...]]:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc), tuple(getattr(exc, "unsafe_globals", ()))
    return "", "", ()


def _src_rank_worker(rank: int, world: int, folder: str, unsafe: str) -> dict[str, Any]:
    from ddpstate.checkpoint import load, save

    writes = _spy_writes(folder)
    emb = torch.arange(12.0).reshape(4, 3)
    sd: Any = collections.OrderedDict(
        embed=emb,
        head=emb,  # tied
        half=torch.randn(5, generator=torch.Generator().manual_seed(1)).bfloat16(),
        f8=torch.linspace(-2, 2, 8).to(torch.float8_e4m3fn),
        mask=torch.tensor([True, False, True]),
        scalar=torch.tensor(3, dtype=torch.int16),
        empty=torch.zeros(0, 2),
        transposed=torch.arange(6.0).reshape(2, 3).t(),
    )
    sd._metadata = {"": {"version": 1}}
    container = {"model": sd, "epoch": 9, "history": [torch.ones(2), (torch.zeros(1),)]}
    save(container if rank == 1 else None, os.path.join(folder, "src.pt"), src_rank=1)
    back = load(os.path.join(folder, "src.pt"), src_rank=1, map_location="cpu")
    model = back["model"]
    for key, value in sd.items():
        got = model[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(
            got.view(torch.uint8) if key == "f8" else got,
            value.view(torch.uint8) if key == "f8" else value,
        ), key
    assert model["head"] is model["embed"]
    assert model._metadata == {"": {"version": 1}}
    assert back["epoch"] == 9 and torch.equal(back["history"][1][0], torch.zeros(1))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied-weights notice
        save(sd if rank == 1 else None, os.path.join(folder, "src.safetensors"), src_rank=1)
    tied = load(os.path.join(folder, "src.safetensors"), src_rank=0)
    assert tied["head"] is tied["embed"] and torch.equal(tied["embed"], emb)
    # Only the reader can see what is wrong; every rank raises it.
    refused = _outcome(lambda: load(unsafe, src_rank=1))
    missing = _outcome(lambda: load(os.path.join(folder, "missing.pt"), src_rank=0))
    return {"writes": list(writes), "refused": refused, "missing": missing}


def _save_load_then_fail_worker(rank: int, world: int, folder: str, locked: str) -> dict[str, Any]:
    from ddpstate.checkpoint import save

    result = _save_load_worker(rank, world, folder, ddp=False)

    keep = os.path.join(folder, "keep.pt")
    before = _sha(keep)
    halfway = {"big": torch.randn(1 << 20), "bad": ExplodesWhenPickled()}
    pickle_failure = _failure(lambda: save(halfway, keep))
    assert _sha(keep) == before
    locked_before = _sha(os.path.join(locked, "prev.pt"))
    folder_failure = _failure(lambda: save(_flat(rank), os.path.join(locked, "prev.pt")))
    assert _sha(os.path.join(locked, "prev.pt")) == locked_before
    return {**result, "pickle": pickle_failure, "folder": folder_failure, "rank": rank}


# --------------------------------------------------------------------------- tests


_SAVED = ["ckpt.pt", "model.safetensors", "net.pt"]


def _assert_one_writer(
    results: list[dict[str, Any]], events: list[tuple[str, str]], targets: list[str], writer: int
) -> None:
    for rank, result in enumerate(results):
        if rank != writer:
            assert result["writes"] == [], f"rank {rank} opened files for writing"
    writes = results[writer]["writes"]
    # One temp file per save (created, then opened by its writer: one name).
    opened = list(dict.fromkeys(name for kind, name in writes if kind == "open"))
    renamed = [name for kind, name in writes if kind == "rename"]
    assert renamed == targets
    assert len(opened) == len(targets)
    for name, target in zip(opened, targets, strict=True):
        assert name.startswith(f".{target}.ddpstate-tmp-")
    # The kernel agrees: one file created and closed-after-writing per save, then renamed.
    for target in targets:
        created = [n for kind, n in events if kind == "create" and n.startswith(f".{target}.")]
        closed = [n for kind, n in events if kind == "close_write" and n.startswith(f".{target}.")]
        moved = [n for kind, n in events if kind == "moved_to" and n == target]
        assert len(created) == 1 and created == closed and len(moved) == 1, (target, events)
    assert not [n for kind, n in events if kind == "close_write" and n in targets]


@pytest.mark.slow
def test_two_ranks_save_then_load_with_one_writer(watched: tuple[Path, _Inotify]) -> None:
    folder, inotify = watched
    results = run_ranks(_save_load_worker, 2, args=(str(folder),), timeout=90)
    _assert_one_writer(results, inotify.events(), _SAVED, writer=0)


@pytest.mark.slow
def test_two_ranks_src_rank_save_and_broadcast_load(
    watched: tuple[Path, _Inotify], tmp_path: Path
) -> None:
    folder, inotify = watched
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"opt": Custom()}, unsafe)
    results = run_ranks(_src_rank_worker, 2, args=(str(folder), str(unsafe)), timeout=90)
    _assert_one_writer(results, inotify.events(), ["src.pt", "src.safetensors"], writer=1)
    refused = {r["refused"] for r in results}
    assert len(refused) == 1
    kind, message, names = refused.pop()
    assert kind == "UnsafeCheckpointError" and names == (f"{__name__}.Custom",)
    assert "rank 1 (the reader)" in message and "weights_only=False" in message
    missing = {r["missing"][:2] for r in results}
    assert len(missing) == 1 and missing.pop()[0] == "CheckpointNotFoundError"


def _lock(folder: Path) -> bool:
    """Make a folder unwritable even for root (immutable attribute); False if impossible."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return True
    if shutil.which("chattr") is None:
        return False
    done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    return done.returncode == 0


def _unlock(folder: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    folder.chmod(0o755)


@pytest.mark.slow
def test_four_ranks_save_load_and_failures_reach_every_rank(
    watched: tuple[Path, _Inotify], tmp_path: Path
) -> None:
    folder, inotify = watched
    locked = tmp_path / "locked"
    locked.mkdir()
    torch.save({"prev": torch.ones(2)}, locked / "prev.pt")
    torch.save({"keep": torch.ones(2)}, folder / "keep.pt")
    inotify.events()  # forget the set-up writes
    inotify = _Inotify(folder)
    if not _lock(locked):
        pytest.skip("cannot make a folder unwritable here (root without chattr)")
    try:
        probe = locked / "probe"
        try:
            probe.write_bytes(b"")
        except OSError as exc:
            assert exc.errno in (errno.EPERM, errno.EACCES)
        else:
            pytest.skip("the folder stayed writable (filesystem without immutable attribute)")
        results = run_ranks(
            _save_load_then_fail_worker, 4, args=(str(folder), str(locked)), timeout=120
        )
    finally:
        _unlock(locked)
    # The failed save into this folder made (and removed) a temporary file of its own.
    good = [e for e in inotify.events() if not e[1].startswith(".keep.pt.")]
    _assert_one_writer(results, good, _SAVED[:2], writer=0)
    for case, needle in (("pickle", "refuses to be pickled"), ("folder", "locked")):
        outcomes = [r[case] for r in results]
        assert {o["type"] for o in outcomes} == {"CheckpointWriteError"}, outcomes
        assert len({o["message"] for o in outcomes}) == 1, "every rank raises the same error"
        message = outcomes[0]["message"]
        assert needle in message and "rank 0 (the writer)" in message
        writer_raised = outcomes[0]["raised"]
        for o in outcomes:
            assert o["raised"] - max(writer_raised, o["called"]) < 1.0, outcomes
    assert sorted(os.listdir(locked)) == ["prev.pt"]
    assert sorted(os.listdir(folder)) == sorted([*_SAVED[:2], "keep.pt"])
