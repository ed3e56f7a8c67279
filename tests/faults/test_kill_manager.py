"""SIGKILL at every step of a CheckpointManager commit, on local disk and on an S3 server.

A forked child runs ``CheckpointManager.save`` (sync or async; a new step above two
committed ones, or a re-save of the newest) and kills itself just before or just
after its k-th file-system call (``_harness.HOOKED_CALLS``: open, fsync, replace,
rename, link, unlink, rmdir, mkdir) or object-store request
(``_harness.HOOKED_S3_CALLS``: every PUT, copy and delete). The parent (another
process) then restores the newest committed step and checks it bitwise against what
was saved, checks every older step that ``keep_last`` keeps is still there and
bitwise intact, and that the next save succeeds and leaves nothing behind.

CI runs a fixed-seed sample of the kill points of each configuration; the slow test
enumerates all of them when asked to (its counts are in docs/reliability.md):

    DDPSTATE_KILL_EVERY_CALL=1 python -m pytest -q -n 0 -m slow tests/faults/test_kill_manager.py -s
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import secrets
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import pytest
from fsspec.core import url_to_fs

from ddpstate import storage
from ddpstate.errors import DDPStateError
from ddpstate.manager import CheckpointManager
from tests.faults import _harness as h
from tests.s3server import S3Server, s3_server  # noqa: F401 - the fixture

#: Kill points each configuration tries in CI (fixed seed; an S3 trial takes ~3 s, most
#: of it a new s3fs session in the forked child); the full enumeration tries all.
SAMPLE = {"local": 4, "s3": 1}
#: Set to 1 to run the full enumeration (12 min on 2 cores), which CI does not run.
EVERY_CALL = "DDPSTATE_KILL_EVERY_CALL"
KEEP = 2  # keep_last: saving step 3 rotates step 1 out


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration of the campaign."""

    where: str  # "local" or "s3"
    mode: str  # "sync" or "async"
    save: str  # "new" (step 3 above steps 1 and 2) or "resave" (step 2 again)
    # False: a filesystem without renameat2(RENAME_EXCHANGE), where a re-save's
    # replace_folder renames the old step aside, then the new one into its name.
    swap: bool = True

    @property
    def name(self) -> str:
        return f"{self.where}-{self.mode}-{self.save}" + ("" if self.swap else "-two-renames")


CONFIGS = [
    Config(where, mode, save)
    for where in ("local", "s3")
    for mode in ("sync", "async")
    for save in ("new", "resave")
]


def _param(config: Config) -> Any:
    marks = [pytest.mark.slow] if config.where == "s3" else []  # 4-6 s with the S3 server
    return pytest.param(config, id=config.name, marks=marks)


def _state(step: int, version: int = 0) -> dict[str, Any]:
    return {"weights": h.sample_state(10 * step + version), "epoch": step}


@dataclasses.dataclass
class Run:
    """A manager folder with steps 1 and 2 committed, and where to reach it."""

    config: Config
    directory: str
    options: Optional[dict[str, Any]]

    def manager(self, **kwargs: Any) -> CheckpointManager:
        return CheckpointManager(
            self.directory, keep_last=KEEP, storage_options=self.options, **kwargs
        )

    def the_save(self) -> tuple[int, dict[str, Any]]:
        """The step the killed child saves, and its state."""
        return (3, _state(3)) if self.config.save == "new" else (2, _state(2, version=1))

    def leftovers(self) -> list[str]:
        """Temp names and uncommitted step folders under the run (after a later save)."""
        if self.config.where == "local":
            root = Path(self.directory)
            names = [str(p.relative_to(root)) for p in root.rglob("*")]
        else:
            fs, base = url_to_fs(self.directory, **(self.options or {}))
            names = [p[len(base) + 1 :] for p in fs.find(base, withdirs=True)]
        temps = [n for n in names if any(storage.is_temp_name(part) for part in n.split("/"))]
        steps = {n.split("/")[0] for n in names if n.startswith("step_")}
        uncommitted = [s for s in steps if f"{s}/manifest.json" not in names]
        return sorted(temps + uncommitted)


def _new_run(config: Config, tmp_path: Path, server: Optional[S3Server], n: int) -> Run:
    if config.where == "local":
        directory, options = str(tmp_path / f"run-{n}"), None
    else:
        assert server is not None
        bucket = _BUCKETS.setdefault(server.endpoint_url, server.new_bucket())
        # Listings are read fresh: the killed child changed the bucket behind any cache.
        options = {**server.storage_options, "use_listings_cache": False}
        directory = f"s3://{bucket}/run-{n}-{secrets.token_hex(3)}"
    run = Run(config, directory, options)
    with run.manager() as manager:
        for step in (1, 2):
            manager.save(step, _state(step))
    return run


_BUCKETS: dict[str, str] = {}


def _child_save(run: Run, kill_at: int, when: str, report: Optional[int]) -> None:
    counts: Counter[str] = Counter()
    log: list[tuple[int, str, str]] = []
    h._install_kill_hooks(kill_at, when, counts, log=log, object_store=run.config.where == "s3")
    if not run.config.swap:  # this forked child only
        storage._rename_exchange = lambda first, second: False  # type: ignore[attr-defined]
    step, state = run.the_save()
    manager = run.manager(async_save=run.config.mode == "async")
    manager.save(step, state)
    manager.close()
    if report is not None:
        # Only the renames' paths: the pipe is read once the child has exited.
        renames = [entry for entry in log if entry[1] == "rename"]
        os.write(report, json.dumps([dict(counts), renames]).encode())


def count_calls(run: Run) -> Counter[str]:
    """The hooked calls an uninterrupted save makes (in a forked child, as the trials)."""
    return Counter(_uninterrupted(run)[0])


def _uninterrupted(run: Run) -> tuple[dict[str, int], list[tuple[int, str, str]]]:
    """An uninterrupted save's hooked calls, counted, and its renames (number, name, path)."""
    read_fd, write_fd = os.pipe()
    pid = h._fork(lambda: _child_save(run, 0, "never", write_fd))
    os.close(write_fd)
    status = h._wait(pid, 120)
    with os.fdopen(read_fd, "rb") as pipe:
        text = pipe.read()
    if status is None or os.waitstatus_to_exitcode(status) != 0 or not text:
        raise RuntimeError(f"the uninterrupted {run.config.name} save failed ({status})")
    counts, renames = json.loads(text)
    return counts, [tuple(r) for r in renames]


@dataclasses.dataclass
class Outcome:
    """What one kill left: the step restored, and each way a checkpoint was lost."""

    killed: bool
    restored: str = ""  # "new" (the killed save had committed) or "old"
    lost: list[str] = dataclasses.field(default_factory=list)


def _restores(
    run: Run, step: Optional[int], wanted: dict[str, Any], steps: tuple[int, ...] = ()
) -> tuple[int, str, str]:
    """Restore ``step`` (None: the newest, one of ``steps``) in this process: (step, which
    of ``wanted`` it equals bitwise, "" or why it is wrong)."""
    state: dict[str, Any] = {"weights": None, "epoch": None}
    try:
        with run.manager() as manager:
            got = manager.restore(state, step=step)
    except DDPStateError as exc:
        return -1, "", f"restore(step={step}) failed: {type(exc).__name__}: {exc}"
    if got is None:
        return -1, "", f"restore(step={step}) found no checkpoint"
    if step is None and got not in steps:
        return got, "", f"restore() took step {got}: a newer committed step was lost"
    same = [label for label, w in wanted.items() if h.same(state, w)]
    if not same:
        return got, "", f"step {got} restored other values than were saved"
    return got, same[0], ""


def kill_trial(run: Run, kill_at: int, when: str) -> Outcome:
    """Kill the save at ``(kill_at, when)``, then check what a new process restores."""
    pid = h._fork(lambda: _child_save(run, kill_at, when, None))
    status = h._wait(pid, 120)
    if status is None:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return Outcome(False, lost=["the writer neither finished nor died within 120 s"])
    outcome = Outcome(os.WIFSIGNALED(status))
    if not outcome.killed and os.waitstatus_to_exitcode(status) != 0:
        outcome.lost.append(f"the uninterrupted save failed (status {status})")
    step, new = run.the_save()
    old = {1: _state(1), 2: _state(2)}
    # The newest committed step is the new save or, before its commit, the old step 2,
    # each bitwise what was saved as that step.
    allowed = {"new": (step, new), "old": (2, old[2])}
    steps = tuple(s for s, _ in allowed.values())
    got, label, problem = _restores(run, None, {k: v for k, (_, v) in allowed.items()}, steps)
    if not problem and allowed[label][0] != got:
        problem = f"restore() took step {got}, holding what step {allowed[label][0]} saved"
    outcome.restored = label
    if problem:
        outcome.lost.append(problem)
        return outcome
    for older in range(got - KEEP + 1, got):  # what keep_last still keeps below it
        _, _, problem = _restores(run, older, {"old": old[older]})
        if problem:
            outcome.lost.append(f"older step {older}: {problem}")
    with run.manager() as manager:
        manager.save(5, _state(5))
    left = run.leftovers()
    if left:
        outcome.lost.append(f"the next save left {left}")
    return outcome


def _server(config: Config, request: pytest.FixtureRequest) -> Optional[S3Server]:
    if config.where != "s3":
        return None
    server: S3Server = request.getfixturevalue("s3_server")
    return server


def _points(calls: int) -> list[tuple[int, str]]:
    return [(k, when) for k in range(1, calls + 1) for when in ("before", "after")]


@pytest.mark.parametrize("config", [_param(c) for c in CONFIGS])
def test_kills_at_sampled_calls_lose_no_checkpoint(
    config: Config, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    server = _server(config, request)
    calls = sum(count_calls(_new_run(config, tmp_path, server, 0)).values())
    points = random.Random(f"kill-manager-{config.name}").sample(
        _points(calls), SAMPLE[config.where]
    )
    for i, (k, when) in enumerate(points, start=1):
        outcome = kill_trial(_new_run(config, tmp_path, server, i), k, when)
        assert not outcome.lost, (config.name, k, when, outcome.lost)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get(EVERY_CALL) != "1", reason=f"the full enumeration: {EVERY_CALL}=1 runs it"
)
@pytest.mark.parametrize("config", [_param(c) for c in CONFIGS])
def test_a_kill_at_every_call_loses_no_checkpoint(
    config: Config, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Every kill point: just before and just after each hooked call of the save."""
    server = _server(config, request)
    counts = count_calls(_new_run(config, tmp_path, server, 0))
    points = _points(sum(counts.values()))
    lost: list[Any] = []
    restored: Counter[str] = Counter()
    for i, (k, when) in enumerate(points, start=1):
        outcome = kill_trial(_new_run(config, tmp_path, server, i), k, when)
        restored[outcome.restored] += 1
        if outcome.lost:
            lost.append((k, when, outcome.lost))
    print(
        f"\n{config.name}: {len(points)} kill points ({dict(counts)}), restored "
        f"{dict(restored)}, checkpoints lost: {len(lost)}"
    )
    assert not lost, lost[:5]
    assert set(restored) == {"old", "new"}, f"every kill landed on one side: {restored}"


def test_a_re_save_killed_between_its_two_renames_restores_the_step_it_replaced(
    tmp_path: Path,
) -> None:
    """Without RENAME_EXCHANGE, a re-save of step 2 renames the committed step 2 aside
    (.step_2.ddpstate-old-<hex>) before the new copy takes its name. Killed between the two,
    restore() took step 1 although step 2 was committed; it must take the retired step 2."""
    config = Config("local", "sync", "resave", swap=False)
    _, renames = _uninterrupted(_new_run(config, tmp_path, None, 0))
    target = os.path.basename(CheckpointManager(tmp_path).checkpoint_path(2))
    aside = [i for i, (_, _, path) in enumerate(renames) if os.path.basename(path) == target]
    assert len(aside) == 1, renames  # the committed step 2 renamed aside, once
    kill_at = renames[aside[0]][0]
    # The rename right after it puts the new copy, still under its temporary name, in place.
    assert renames[aside[0] + 1][0] == kill_at + 1, renames
    assert storage.is_temp_name(renames[aside[0] + 1][2]), renames
    outcome = kill_trial(_new_run(config, tmp_path, None, 1), kill_at, "after")
    assert outcome.killed and outcome.restored == "old" and not outcome.lost, outcome
