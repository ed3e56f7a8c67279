"""SIGKILL the Hugging Face Trainer with DDPStateCallback at every call of its saves.

A 1-layer GPT-2 trains 6 steps with a checkpoint every 2 (``checkpoint-2``, ``-4``, ``-6``)
and ``save_total_limit`` 1 or 2, in a forked child that kills itself just before or just
after its k-th counted call (``tests/faults/_harness.py``'s kill hooks): every
``os.open/fsync/replace/rename/link/unlink/rmdir/mkdir`` (the seal, the manifest's commit,
the rotation's deletes), and each whole-file write done in C or Rust, whose own system
calls Python cannot see (``torch.save``, the safetensors ``save_file`` of the model) or in
Python (``open``). A calibration run lists those calls and the one that commits each
checkpoint (the rename of its ``manifest.json``). After each kill a new process must find:

- ``last_verified_checkpoint`` returning the newest checkpoint committed before the kill
  (None before the first), and the ``save_total_limit`` newest committed ones verifying
  (nothing older than the newest lost);
- the Trainer resuming from it: global step N, weights bitwise equal to its
  ``model.safetensors``, 6 - N steps run, and the final weights bitwise equal to those of the
  uninterrupted run.

The CI runs a fixed-seed sample (marked slow); the whole enumeration, with its counts:

    python -m tests.faults.test_kill_hf_trainer --limit 1 --limit 2

Local disk only: the Trainer writes ``checkpoint-N/`` with local file calls, so it cannot
write to the S3 server.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from tests.faults import _harness as h

MAX_STEPS, SAVE_STEPS = 6, 2
#: Kill points drawn per save_total_limit in CI (of about 2 x 160).
CI_SAMPLES = 4
_COMMIT = re.compile(r"checkpoint-(\d+)/\.manifest\.json\.")


def _writers() -> list[tuple[Any, str]]:
    """The whole-file writes counted besides the os calls: torch's, the model's, Python's."""
    import transformers.modeling_utils  # the module that bound safetensors' save_file

    return [(torch, "save"), (transformers.modeling_utils, "safe_save_file"), (builtins, "open")]


def _train(out: Path, limit: int) -> Any:
    from tests.integrations import hf_run

    return hf_run.train(out, max_steps=MAX_STEPS, save_steps=SAVE_STEPS, save_total_limit=limit)


@dataclasses.dataclass
class Calibration:
    """The uninterrupted run: how many calls it counts, which commits each checkpoint, its end."""

    limit: int
    calls: int
    commits: dict[int, int]  # checkpoint step -> number of the call that commits it
    final: str  # hf_run.digest of the final weights
    seconds: float


def calibrate(workdir: Path, limit: int) -> Calibration:
    """Run the training to the end in a forked child with the hooks counting, killing never."""
    from tests.integrations import hf_run

    if workdir.exists():
        shutil.rmtree(workdir)
    out = workdir / "out"

    def counted() -> tuple[list[tuple[int, str, str]], str, float]:
        log: list[tuple[int, str, str]] = []
        h._install_kill_hooks(0, "never", Counter(), extra=_writers(), log=log)
        start = time.monotonic()
        trainer, _ = _train(out, limit)
        seconds = time.monotonic() - start
        return list(log), hf_run.digest(trainer.model.state_dict()), seconds

    log, final, seconds = hf_run.in_new_process(counted)
    commits = {
        int(m.group(1)): n
        for n, name, path in log
        if name in ("replace", "rename") and (m := _COMMIT.search(path))
    }
    assert sorted(commits) == list(range(SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS)), commits
    return Calibration(limit, len(log), commits, final, seconds)


def _after_kill(out: Path, limit: int, required: list[int]) -> dict[str, Any]:
    """In a new process: which folders verify, then the Trainer's resume to the end."""
    from ddpstate._manifest import verify_checkpoint
    from tests.integrations import hf_run

    verified = [s for s in required if verify_checkpoint(out / f"checkpoint-{s}").ok]
    report = hf_run.resume_report(out, max_steps=MAX_STEPS, save_steps=SAVE_STEPS,
                                  save_total_limit=limit)  # fmt: skip
    report["verified"] = verified
    left = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    report["left"] = left
    report["left_verified"] = [s for s in left if verify_checkpoint(out / f"checkpoint-{s}").ok]
    return report


def kill_trial(workdir: Path, cal: Calibration, k: int, when: str) -> h.Trial:
    """Kill the run just ``when`` ("before"/"after") its ``k``-th counted call; check the resume."""
    from tests.integrations import hf_run

    if workdir.exists():
        shutil.rmtree(workdir)
    out = workdir / "out"
    trial = h.Trial("hf-trainer-kill", f"save_total_limit={cal.limit}", when, k)

    def body() -> None:
        h._install_kill_hooks(k, when, Counter(), extra=_writers())
        _train(out, cal.limit)

    pid = h._fork(body)
    status = h._wait(pid, 300)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        trial.hangs += 1
        trial.defects.append("the training neither finished nor died within 300 s")
        return trial
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        trial.defects.append(f"the run was not killed at call {k} (wait status {status})")
        return trial
    committed = sorted(s for s, n in cal.commits.items() if n < k or (n == k and when == "after"))
    newest = committed[-1] if committed else 0
    required = committed[-cal.limit :] if committed else []
    trial.verdicts["resume from"] = f"checkpoint-{newest}" if newest else "a fresh start"
    try:
        got = hf_run.in_new_process(_after_kill, out, cal.limit, required)
    except RuntimeError as exc:
        trial.unhandled += 1
        trial.defects.append(f"the resume failed: {str(exc)[-2000:]}")
        return trial
    expected_resume = str(out / f"checkpoint-{newest}") if newest else None
    if got["resume"] != expected_resume or got["verified"] != required:
        trial.data_lost += 1
        trial.defects.append(
            f"committed {committed}: last_verified_checkpoint gave {got['resume']}, "
            f"{got['verified']} of {required} verify"
        )
    wanted: dict[str, Any] = {"start_step": newest, "weights_equal": True if newest else None}
    # Resumed at its last step, the Trainer runs one step more (as it does without ddpstate:
    # transformers 5.24 goes on to step 7 and saves checkpoint-7), so only the start is checked.
    if newest < MAX_STEPS:
        wanted.update(steps=MAX_STEPS - newest, global_step=MAX_STEPS, final=cal.final)
    wrong = {key: got[key] for key, value in wanted.items() if got[key] != value}
    if wrong:
        trial.data_lost += 1
        trial.defects.append(f"resumed from {got['resume']}: {wrong}, wanted {wanted}")
    kept = list(range(MAX_STEPS, 0, -SAVE_STEPS))[: cal.limit]
    if newest < MAX_STEPS and not set(kept) <= set(got["left_verified"]):
        left, verified = got["left"], got["left_verified"]
        trial.defects.append(f"after the resumed run: {left}, of them verified {verified}")
    return trial


def kill_points(cal: Calibration) -> list[tuple[int, str]]:
    """Every (k, when) of the calibrated run."""
    return [(k, when) for k in range(1, cal.calls + 1) for when in ("before", "after")]


@pytest.mark.slow
@pytest.mark.parametrize("limit", [1, 2])
def test_a_kill_at_sampled_calls_resumes_from_the_newest_committed_checkpoint(
    limit: int, tmp_path: Path
) -> None:
    """A fixed-seed sample of the kill points, and the two that matter most: the first
    call of the second checkpoint's seal, and just before its manifest's rename."""
    pytest.importorskip("transformers")
    cal = calibrate(tmp_path / "calibrate", limit)
    points = random.Random(f"hf-trainer-{limit}").sample(kill_points(cal), CI_SAMPLES)
    commit = cal.commits[2 * SAVE_STEPS]
    points += [(commit, "before"), (commit, "after")]
    for k, when in points:
        trial = kill_trial(tmp_path / "trial", cal, k, when)
        assert not trial.defects, (k, when, trial.defects)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run every kill point for each ``--limit``; print the counts (exit 1 on any defect)."""
    parser = argparse.ArgumentParser(prog="python -m tests.faults.test_kill_hf_trainer")
    parser.add_argument("--limit", type=int, action="append", help="save_total_limit (repeat)")
    parser.add_argument("--json", type=Path, help="write the counts and defects here")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="ddpstate-hf-kill-"))
    results: dict[str, Any] = {}
    started = time.monotonic()
    for limit in args.limit or [1]:
        cal = calibrate(workdir / "calibrate", limit)
        tally = h.Tally()
        points = kill_points(cal)
        for i, (k, when) in enumerate(points, 1):
            tally.add(kill_trial(workdir / "trial", cal, k, when))
            if i % 20 == 0 or i == len(points):
                print(f"  save_total_limit={limit}: {i}/{len(points)}", file=sys.stderr, flush=True)
        results[f"save_total_limit={limit}"] = {
            "calls": cal.calls,
            "commits": cal.commits,
            "kill points": tally.trials,
            "checkpoints lost": tally.data_lost,
            "hangs": tally.hangs,
            "unhandled": tally.unhandled,
            "other": tally.other,
            "outcomes": dict(tally.outcomes),
            "examples": tally.examples,
        }
    results["seconds"] = round(time.monotonic() - started)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    shutil.rmtree(workdir, ignore_errors=True)
    bad = sum(
        r[key]
        for r in results.values()
        if isinstance(r, dict)
        for key in ("checkpoints lost", "hangs", "unhandled", "other")
    )
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
