"""torch's own FileSystemWriter/FileSystemReader tests pass with ddpstate's drop-ins in their place.

Needs a copy of torch's test files (``test/distributed/checkpoint`` of the PyTorch
repository, e.g. ``test_file_system_checkpoint_cpu.py``; they are not in the wheel)
and ``expecttest``, which torch's test utilities import::

    DDPSTATE_TORCH_TESTS=<pytorch>/test/distributed/checkpoint/test_file_system_checkpoint_cpu.py \\
        python -m pytest -n 0 tests/dcp/test_torch_suite.py

Skipped without ``DDPSTATE_TORCH_TESTS``. torch's tests run twice through
``tests/dcp/torch_suite.py``: with torch's own classes (the baseline: a test that
needs a newer torch or CUDA fails or skips there) and with ddpstate's; every test
that passes on torch's classes must pass on ddpstate's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = os.environ.get("DDPSTATE_TORCH_TESTS", "")
ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, plain: bool) -> tuple[dict[str, str], str]:
    out = tmp_path / ("plain.json" if plain else "patched.json")
    args = [sys.executable, "-m", "tests.dcp.torch_suite", *TESTS.split(os.pathsep)]
    args += ["--json", str(out)] + (["--plain"] if plain else [])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    if not out.exists():
        pytest.fail(f"torch_suite wrote no outcomes:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    outcomes: dict[str, str] = json.loads(out.read_text())
    return outcomes, done.stdout


@pytest.mark.slow
@pytest.mark.timeout(3600)  # torch's 17 tests twice, ranks spawned fresh: minutes
@pytest.mark.skipif(
    not TESTS, reason="set DDPSTATE_TORCH_TESTS to torch's test files (docs/dcp.md)"
)
def test_torchs_own_storage_tests_pass_with_the_drop_ins(tmp_path: Path) -> None:
    plain, _ = _run(tmp_path, plain=True)
    patched, log = _run(tmp_path, plain=False)
    swapped = [line for line in log.splitlines() if line.startswith("patched:")]
    assert swapped and "torch.distributed.checkpoint.FileSystemWriter" in swapped[0]
    passing = sorted(t for t, outcome in plain.items() if outcome == "passed")
    assert passing, f"no test of {TESTS} passes even on torch's own classes: {plain}"
    broken = {t: patched.get(t, "not run") for t in passing if patched.get(t) != "passed"}
    assert not broken, f"pass on torch's classes, not on ddpstate's: {broken}\n{log[-6000:]}"
