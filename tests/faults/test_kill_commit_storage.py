"""SIGKILL at every step of a folder commit, on local disk and on the S3 server on 127.0.0.1.

Two writers of a DCP folder: ``ddpstate.save`` of sharded (DTensor) state and plain
``dcp.save`` with :class:`ddpstate.dcp.DurableWriter`. A checkpoint is committed at the
target; a forked writer saving the next one over it is killed just before each step
of its save (local: every ``os.open/fsync/replace/rename/link/unlink/rmdir/mkdir``;
on S3 also every bucket-changing request: each PUT, part, copy and delete) and just after
the last. Then a NEW process (a fresh fork that never saw the writer) restores the
target: it must be bitwise the old checkpoint or the new one (the new one whenever the
writer finished), never an error and never a mix; and the save after it must succeed
and leave nothing of the killed one behind.

CI tries the first and last kill points and a fixed-seed few between them; all of them:

    DDPSTATE_KILL_EVERY_CALL=1 python -m pytest -q -n 0 tests/faults/test_kill_commit_storage.py -s

Also here: two saves to one ``checkpoint_id`` at once (an un-awaited ``dcp.async_save``,
then a second save), which must fail loudly instead of wiping each other.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ddpstate
from ddpstate import storage
from ddpstate.dcp import DurableWriter, VerifiedReader
from ddpstate.errors import CheckpointWriteError
from tests.faults import _harness as h
from tests.s3server import S3Server, s3_server  # noqa: F401 - the fixture

KINDS = ("save_folder", "durable_dcp")
#: Kill points CI tries between the first and the last (an S3 trial takes ~4 s); the
#: full enumeration (about 5 min on 2 cores, counts in docs/reliability.md) runs with
#: DDPSTATE_KILL_EVERY_CALL=1, as tests/faults/test_kill_manager.py's does.
SAMPLE = 2
EVERY_CALL = "DDPSTATE_KILL_EVERY_CALL"
#: What the campaign found, by (kind, where): kill points tried and checkpoints lost.
TALLY: dict[tuple[str, str], Counter[str]] = {}
#: On S3 the old checkpoint was committed in place (the first save there) or as a version.
OVER = ("in place", "version")


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 32, generator=gen),
        "b": torch.randn(32, generator=gen).to(torch.bfloat16),
        "step": torch.tensor([seed]),
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(h.same(a[k], b[k]) for k in a)


def _write(kind: str, target: str, seed: int, opts: Optional[dict[str, Any]]) -> None:
    """One save of ``_state(seed)`` (runs in a forked child)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group" notes
        if kind == "durable_dcp":
            writer = DurableWriter(target, storage_options=opts)
            dcp.save(_state(seed), storage_writer=writer, no_dist=True)
            return
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _state(seed).items()}
        ddpstate.save(state, target, storage_options=opts)
        dist.destroy_process_group()


def _restore(kind: str, target: str, opts: Optional[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """What a new process reads back from ``target`` (runs in a forked child)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "save_folder":
            loaded = ddpstate.load(target, storage_options=opts, map_location="cpu")
            return {k: torch.as_tensor(v) for k, v in loaded.items()}
        state = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        dcp.load(state, storage_reader=VerifiedReader(target, storage_options=opts), no_dist=True)
        return state


def _in_child(body: Callable[[], Any], limit: float = 120.0) -> tuple[str, Any]:
    """Run ``body`` in a new forked process: ("ok", its JSON result), ("killed", None) or
    ("failed", the error's text)."""
    read_fd, write_fd = os.pipe()

    def run() -> None:
        try:
            result: Any = ["ok", body()]
        except BaseException as exc:
            result = ["failed", f"{type(exc).__name__}: {exc}"]
        os.write(write_fd, json.dumps(result).encode())

    pid = h._fork(run)
    os.close(write_fd)
    status = h._wait(pid, limit)
    with os.fdopen(read_fd, "rb") as pipe:
        text = pipe.read()
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "failed", f"still running after {limit} s"
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed", None
    if not text:
        return "failed", f"exited with status {status} and no result"
    verdict, value = json.loads(text)
    return str(verdict), value


def _killed_save(
    kind: str, target: str, opts: Optional[dict[str, Any]], kill_at: int, when: str
) -> tuple[str, Any]:
    """Save seed 2 over ``target`` in a child that kills itself at the ``kill_at``-th step.

    ``kill_at=0`` counts the steps instead: the result is their number.
    """
    counts: Counter[str] = Counter()

    def body() -> int:
        # On S3 every bucket-changing request counts too, in one sequence with the os calls.
        h._install_kill_hooks(kill_at, when or "never", counts, object_store=opts is not None)
        _write(kind, target, 2, opts)
        return sum(counts.values())

    return _in_child(body)


def _which(kind: str, target: str, opts: Optional[dict[str, Any]]) -> str:
    """In a new process: restore ``target`` and tell which save it is ("old"/"new"/why not)."""

    def body() -> str:
        got = _restore(kind, target, opts)
        return "old" if _same(got, _state(1)) else "new" if _same(got, _state(2)) else "mixed"

    verdict, value = _in_child(body)
    return str(value) if verdict == "ok" else f"{verdict}: {value}"


def _leftovers(target: str, opts: Optional[dict[str, Any]]) -> list[str]:
    """What lies at the target's place beyond the one committed checkpoint there."""
    if opts is None:
        return sorted(p.name for p in Path(target).parent.iterdir() if p.name != "ckpt")

    def manifest(folder: str) -> dict[str, Any]:
        with storage.open_read(storage.join(folder, "manifest.json"), storage_options=opts) as f:
            return dict(json.loads(f.read()))

    # The documented layout: the top manifest, or a pointer naming the version folder.
    version = str(manifest(target).get("committed_version", ""))
    committed = storage.join(target, version) if version else target
    listed = set(manifest(committed)["files"]) | {"manifest.json"}
    names = storage.listdir(target, storage_options=opts, include_temp=True)
    extra = [
        n for n in names if n not in {"manifest.json", version} and (version or n not in listed)
    ]
    if version:
        inner = storage.listdir(committed, storage_options=opts, include_temp=True)
        extra += [f"{version}/{n}" for n in inner if n not in listed]
    return sorted(extra)


def _fresh_target(base: str, n: int, opts: Optional[dict[str, Any]]) -> str:
    if opts is None:
        folder = Path(base) / f"t{n}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return str(folder / "ckpt")
    return f"{base}/t{n}/ckpt"


def _committed_old(kind: str, target: str, opts: Optional[dict[str, Any]], over: str) -> None:
    """Commit the old checkpoint (seed 1) at ``target``: saved in place on an empty target,
    or (``over="version"``) over another one, so that on S3 it is a version folder."""
    for seed in (9, 1) if over == "version" else (1,):
        done = _in_child(lambda seed=seed: _write(kind, target, seed, opts))  # type: ignore[misc]
        assert done[0] == "ok", done


def _campaign(
    kind: str, base: str, opts: Optional[dict[str, Any]], over: str = "in place"
) -> Counter[str]:
    """Every kill point of one kind of save at one place; returns the tally."""
    tally: Counter[str] = Counter()
    problems: list[str] = []
    # How many steps the save over a committed checkpoint takes, uninterrupted.
    target = _fresh_target(base, 0, opts)
    _committed_old(kind, target, opts, over)
    verdict, steps = _killed_save(kind, target, opts, 0, "")
    assert verdict == "ok" and steps > 0, (verdict, steps)
    points = [(k, "before") for k in range(1, steps + 1)] + [(steps, "after")]
    if os.environ.get(EVERY_CALL) != "1":  # CI: the first, the last and a fixed-seed few
        middle = random.Random(41).sample(points[1:-1], min(SAMPLE, len(points) - 2))
        points = [points[0], *sorted(middle), points[-1]]
    for n, (k, when) in enumerate(points, start=1):
        target = _fresh_target(base, n, opts)
        _committed_old(kind, target, opts, over)
        outcome, _ = _killed_save(kind, target, opts, k, when)
        tally["kill points tried"] += 1
        tally["killed"] += outcome == "killed"
        found = _which(kind, target, opts)
        tally[f"restored {found}"] += 1
        if found not in ("old", "new") or (outcome != "killed" and found != "new"):
            tally["checkpoints lost"] += 1
            problems.append(f"killed {when} step {k}/{steps} ({outcome}): restore gave {found}")
            continue
        # The next save succeeds and removes what the killed one left.
        nxt = _in_child(lambda target=target: _write(kind, target, 3, opts))  # type: ignore[misc]
        left = _leftovers(target, opts) if nxt[0] == "ok" else []
        if nxt[0] != "ok" or left:
            problems.append(
                f"killed {when} step {k}/{steps}: the next save gave {nxt}, left {left}"
            )
    where = "local" if opts is None else f"s3, over a checkpoint committed {over}"
    TALLY[(kind, where)] = tally
    print(f"{kind} at {where}: {dict(tally)}")
    assert not problems, problems
    assert tally["killed"] == len(points)  # every kill landed
    return tally


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_kill_at_every_step_of_a_local_commit_loses_nothing(kind: str, tmp_path: Path) -> None:
    tally = _campaign(kind, str(tmp_path), None)
    assert tally["checkpoints lost"] == 0 and tally["restored old"] and tally["restored new"]


@pytest.mark.slow
@pytest.mark.parametrize("over", OVER)
@pytest.mark.parametrize("kind", KINDS)
def test_a_kill_at_every_step_of_an_s3_commit_loses_nothing(
    kind: str,
    over: str,
    s3_server: S3Server,  # noqa: F811
) -> None:
    base = f"s3://{s3_server.new_bucket()}/run"
    tally = _campaign(kind, base, s3_server.storage_options, over)
    assert tally["checkpoints lost"] == 0 and tally["restored old"] and tally["restored new"]


# ---------------------------------------------------------------------------- two saves at once


class _Gated(DurableWriter):
    """A DurableWriter whose save writes nothing until ``gate`` opens (the first save)."""

    def __init__(self, path: str, gate: threading.Event, **kw: Any) -> None:
        super().__init__(path, **kw)
        self.gate = gate

    def write_data(self, plan: Any, planner: Any) -> Any:
        assert self.gate.wait(60), "the second save never started"
        return super().write_data(plan, planner)


class _AfterFirst(DurableWriter):
    """The second save: planned while the first is in flight, it writes once the first is done."""

    def __init__(self, path: str, gate: threading.Event, **kw: Any) -> None:
        super().__init__(path, **kw)
        self.gate = gate
        self.first: Any = None

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.gate.set()  # this save is planned: let the first one write and commit
        self.first.result(timeout=60)
        return super().write_data(plan, planner)


def _inner(exc: BaseException) -> BaseException:
    """The error a rank raised inside DCP's CheckpointException."""
    failures = getattr(exc, "failures", None)  # rank -> (error, traceback)
    return failures[0][0] if failures else exc


def _overlapping_saves(target: str, opts: Optional[dict[str, Any]]) -> None:
    """An un-awaited ``dcp.async_save`` to ``target``, then a second save to it meanwhile."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            _state(1), storage_writer=DurableWriter(target, storage_options=opts), no_dist=True
        )
        gate = threading.Event()
        second = _AfterFirst(target, gate, storage_options=opts)
        first = dcp.async_save(
            _state(2), storage_writer=_Gated(target, gate, storage_options=opts), no_dist=True
        )
        second.first = first
        with pytest.raises(BaseException) as raised:
            dcp.save(_state(3), storage_writer=second, no_dist=True)
        first.result(timeout=60)  # the first save, planned first and committed first, stands
    error = _inner(raised.value)
    assert isinstance(error, CheckpointWriteError), repr(error)
    assert target in str(error) and "in flight" in str(error)
    assert _same(_restore("durable_dcp", target, opts), _state(2))
    assert ddpstate.verify_checkpoint(target, storage_options=opts).ok


def test_a_second_save_to_a_checkpoint_in_flight_fails_naming_it_local(tmp_path: Path) -> None:
    target = str(tmp_path / "ckpt")
    _overlapping_saves(target, None)
    second_staging = [p.name for p in tmp_path.iterdir() if p.name != "ckpt"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(4), storage_writer=DurableWriter(target), no_dist=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], second_staging  # cleaned up


def test_a_second_save_to_a_checkpoint_in_flight_fails_naming_it_s3(
    s3_server: S3Server,  # noqa: F811
) -> None:
    opts = s3_server.storage_options
    target = f"s3://{s3_server.new_bucket()}/run/ckpt"
    _overlapping_saves(target, opts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            _state(4), storage_writer=DurableWriter(target, storage_options=opts), no_dist=True
        )
    assert _leftovers(target, opts) == []
    assert _same(_restore("durable_dcp", target, opts), _state(4))
