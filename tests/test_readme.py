"""README's commands are the ones CI and users run: keep them in step with .ci/run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    head = text.split("\n## ", 2)  # the commands come before the second section
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", "\n## ".join(head[:2]), flags=re.S)
    return [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip() and not line.startswith("#")
    ]


def test_readme_opens_with_the_main_job_then_the_tests() -> None:
    commands = _readme_commands()
    assert len(commands) == 2, commands
    main_job, tests = commands
    assert "examples/train_ddp.py" in main_job and main_job.startswith("pip install")
    assert "pytest" in tests and tests.startswith("pip install")


def test_ci_runs_readme_test_command_verbatim() -> None:
    tests = _readme_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in [line.strip() for line in ci], f"{tests!r} not in .ci/run"


def test_ci_runs_readme_main_job_verbatim_in_a_fresh_environment() -> None:
    main_job = _readme_commands()[0]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    # The main job's output is kept (| tee) so CI can check it printed its accuracy.
    assert any(line == main_job or line.startswith(main_job + " 2>&1 |") for line in ci), ci
    # A new virtual environment on every run, created before anything is installed.
    venv = next(i for i, line in enumerate(ci) if line.startswith("python3 -m venv "))
    first_install = next(i for i, line in enumerate(ci) if line.startswith("pip install"))
    assert venv < first_install
