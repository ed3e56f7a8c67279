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


_DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    headings = re.findall(r"^#+ (.*)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_is_a_user_guide_not_a_diary() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 350, "README.md over 350 lines: move detail to docs/"
    assert "last green run" not in text.lower(), "CI timings belong in .ci/run's output"
    # Benchmark tables live in docs/benchmarks.md: no table row with a ratio column here.
    assert not re.search(r"^\|.*\bratio\b.*\|$", text, flags=re.M | re.I)
    for page in ("cli", "mistakes", "benchmarks", "reliability", "local-tier", "architecture"):
        assert f"](docs/{page}.md)" in text, f"README does not link docs/{page}.md"


def test_relative_links_in_readme_and_docs_resolve() -> None:
    broken = []
    for name in _DOCS:
        page = ROOT / name
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists() or (anchor and anchor not in _anchors(dest)):
                broken.append(f"{name}: {target}")
    assert not broken, broken


def test_benchmark_figures_keep_their_commands_in_docs() -> None:
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    for command in (
        "python -m benchmarks --full",
        "python -m benchmarks --only safetensors",
        "python -m benchmarks --only hf_sharded",
        "python -m benchmarks.dcp --size-mib 1024 --worlds 2,4 --repeats 3",
        "python -m benchmarks.scale --rounds 9",
        "python -m benchmarks.local_tier --restarts 3",
    ):
        assert command in bench, f"docs/benchmarks.md lost the command {command!r}"
