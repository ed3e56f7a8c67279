"""The documentation site is built and checked like code.

- ``test_site_builds_without_a_warning``: README's command (``sphinx -W``, ``nitpicky``: an
  unresolved cross-reference or a broken link between pages fails), then every name of
  ``ddpstate.__all__`` and of each public submodule's ``__all__`` has an entry in the built
  inventory (``objects.inv``).
- ``test_guide_code_runs``: each guide's code, in page order, in a fresh folder. A ```python
  block runs in one interpreter per page (blocks share their names, as in a notebook); one
  whose first line is ``# file: NAME`` is written to ``NAME`` instead; each line of a
  ```bash block is a ``python ...`` or ``torchrun ...`` command, run there and then. A block
  whose first line is ``# illustrative: tests/<file>`` is skipped: it shows code that runs
  in that test (which must exist), where the guide would repeat a launch or needs an older
  torch. Python written under another fence (```py, a code-block directive) fails the test.
- ``help(ddpstate)`` lists the public names, which load lazily.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pydoc
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ddpstate

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDES = sorted((DOCS / "guides").glob("*.md"))

_FENCE = re.compile(r"^```(python|bash)\n(.*?)^```$", flags=re.S | re.M)

# Runs one page's events (written by the test as JSON) in a fresh folder.
_RUNNER = """
import json, shlex, subprocess, sys
namespace = {"__name__": "__main__"}
for kind, where, text in json.load(open(sys.argv[1])):
    if kind == "file":
        name, body = text
        with open(name, "w") as f:
            f.write(body)
    elif kind == "python":
        exec(compile(text, where, "exec"), namespace)
    else:
        args = shlex.split(text)
        torchrun = [sys.executable, "-m", "torch.distributed.run"]
        head = {"python": [sys.executable], "torchrun": torchrun}
        if args[0] not in head:
            sys.exit(f"{where}: only python and torchrun commands run: {text!r}")
        print(f"$ {text}", flush=True)
        subprocess.run(head[args[0]] + args[1:], check=True, timeout=120)
"""


def _events(page: Path) -> list[tuple[str, str, object]]:
    text = page.read_text()
    hidden = re.findall(r"^```(?:py|python3|\{code-block\} *python)\s*$", text, flags=re.M)
    assert not hidden, f"{page.name}: write ```python, so the code runs: {hidden}"
    events: list[tuple[str, str, object]] = []
    for match in _FENCE.finditer(text):
        lang, body = match.groups()
        line = text.count("\n", 0, match.start()) + 2  # the block's first line
        where = f"{page.relative_to(ROOT)}:{line}"
        first = body.split("\n", 1)[0]
        if lang == "bash":
            events += [
                ("bash", where, cmd.strip())
                for cmd in body.splitlines()
                if cmd.strip() and not cmd.startswith("#")
            ]
        elif first.startswith("# illustrative:"):
            test = first.removeprefix("# illustrative:").split()[0].split("::")[0]
            assert (ROOT / test).is_file(), f"{where}: {test} does not exist"
        elif first.startswith("# file:"):
            events.append(("file", where, (first.removeprefix("# file:").strip(), body)))
        else:
            # Blank lines before the block's code keep the page's line numbers in tracebacks.
            events.append(("python", str(page.relative_to(ROOT)), "\n" * (line - 1) + body))
    return events


@pytest.mark.slow
@pytest.mark.parametrize("page", GUIDES, ids=[p.stem for p in GUIDES])
def test_guide_code_runs(page: Path, tmp_path: Path) -> None:
    events = _events(page)
    assert any(kind != "file" for kind, _, _ in events), f"{page.name} runs nothing"
    (tmp_path / "events.json").write_text(json.dumps(events))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MASTER_", "RANK", "WORLD_", "LOCAL_", "TORCHELASTIC"))
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, "events.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"{page.name}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def _inventory(html: Path) -> set[str]:
    from sphinx.util.inventory import InventoryFile

    with open(html / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    # Sphinx 8.2 made the loaded inventory an object; before, a dict of dicts.
    data = getattr(inventory, "data", inventory)
    return {
        name for objtype, entries in data.items() if objtype.startswith("py:") for name in entries
    }


def _undocumented(documented: set[str]) -> list[str]:
    """Public names without an entry: each object is documented once, under a public module."""
    missing = [
        f"ddpstate.{name}" for name in ddpstate.__all__ if f"ddpstate.{name}" not in documented
    ]
    modules = sorted(ddpstate._SUBMODULES - {"cli"})  # the command line: docs/cli.md
    for module_name in modules:
        module = importlib.import_module(f"ddpstate.{module_name}")
        for name in module.__all__:
            homes = ["ddpstate", *(f"ddpstate.{m}" for m in modules)]
            obj = getattr(module, name)
            if not any(
                f"{home}.{name}" in documented
                and getattr(importlib.import_module(home), name, None) is obj
                for home in homes
            ):
                missing.append(f"ddpstate.{module_name}.{name}")
    return missing


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The site built once for this module's tests: ``(html folder, the build's result)``."""
    tmp_path = tmp_path_factory.mktemp("site")
    html = tmp_path / "html"
    # README's command, into a fresh folder (a stale build would hide a page's warnings).
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(DOCS), str(html)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    return html, done


@pytest.mark.slow
def test_site_builds_without_a_warning(
    site: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    html, done = site
    assert done.returncode == 0 and "WARNING" not in done.stderr, done.stderr[-6000:]
    assert not _undocumented(_inventory(html)), _undocumented(_inventory(html))
    # Every guide is in the site's navigation.
    index = (html / "index.html").read_text()
    for page in GUIDES:
        assert f'href="guides/{page.stem}.html"' in index, f"{page.name} is not in the toctree"


def test_help_lists_the_public_names() -> None:
    text = pydoc.render_doc(ddpstate, renderer=pydoc.plaintext)
    # The names by group in the module docstring, then each one documented in full.
    for name in ("save", "load", "load_model_state", "init_distributed", "wrap_ddp"):
        assert re.search(rf"^    {name}\(", text, flags=re.M), f"help(ddpstate) lacks {name}()"
    for name in ("CheckpointManager", "ResumableDistributedSampler", "DDPStateError"):
        assert f"class {name}(" in text, f"help(ddpstate) lacks class {name}"
    assert set(ddpstate.__all__) <= set(dir(ddpstate))
    assert "_EXPORTS" not in dir(ddpstate)


def _block_after(page: str, marker: str) -> tuple[str, str]:
    """``(highlight class, inner HTML)`` of the code block whose text holds ``marker``."""
    for lang, body in re.findall(
        r'<div class="highlight-(\w+) notranslate"><div class="highlight"><pre>(.*?)</pre>',
        page,
        flags=re.S,
    ):
        if marker in re.sub(r"<[^>]+>", "", body):
            return lang, body
    raise AssertionError(f"no code block holds {marker!r}")


def _class_section(page: str, name: str) -> str:
    """The HTML of one class's entry: from its signature to the next module-level entry."""
    start = page.index(f'descname"><span class="pre">{name}</span>')
    end = re.search(r'<dl class="py (class|function|exception|data)">', page[start:])
    return page[start : start + end.start()] if end else page[start:]


@pytest.mark.slow
def test_site_renders_the_reference_as_written(
    site: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    html, done = site
    assert done.returncode == 0, done.stderr[-6000:]
    package = (html / "reference" / "ddpstate.html").read_text()
    manager = (html / "reference" / "manager.html").read_text()
    # The package overview and the manager's folder tree are text, not Python to colour
    # (keywords in bold, an apostrophe opening a string).
    for page, marker in (
        (package, "Save and load (every rank calls"),
        (manager, "step_0000001100/"),
    ):
        lang, body = _block_after(page, marker)
        assert lang in ("text", "none") and "<span class=" not in body, (lang, body[:300])
    # Each field of a dataclass is documented once: in its docstring's Attributes (the
    # "Variables" list), not again as a bare attribute entry.
    section = _class_section(manager, "CheckpointVerification")
    for field in dataclasses.fields(ddpstate.manager.CheckpointVerification):
        listed = section.count(f"<strong>{field.name}</strong>")
        entries = section.count(f'id="ddpstate.manager.CheckpointVerification.{field.name}"')
        assert (listed, entries) == (1, 0), (field.name, listed, entries)
    # The manager page documents CheckpointManager itself, methods and all.
    cm = _class_section(manager, "CheckpointManager")
    for method in ("save", "restore", "should_stop", "close"):
        assert f'<span class="pre">{method}</span>' in cm, method
    # The index says how to install without a made-up URL, with README's torch advice.
    index = (html / "index.html").read_text()
    assert "&lt;this repository&gt;" not in index
    assert "torch==2.13.0" in index and "drop the" in index


# The extras a user installs with the library (the others need a checkout: tests, docs...).
_LIBRARY_EXTRAS = ("lightning", "transformers", "accelerate", "integrations")


def test_install_lines_give_the_published_and_the_checkout_form() -> None:
    """`pip install "ddpstate[X]"` fails until ddpstate is on PyPI: each paragraph that names
    an extra's install gives both that form and the checkout's `pip install -e ".[X]"`."""
    files = [
        ROOT / "README.md",
        *sorted(DOCS.rglob("*.md")),
        *sorted((ROOT / "examples").glob("*.py")),
    ]
    missing = []
    for path in files:
        for paragraph in re.split(r"\n\s*\n", path.read_text()):
            if "pip install" not in paragraph:
                continue
            for extra in _LIBRARY_EXTRAS:
                published = f"ddpstate[{extra}]" in paragraph
                checkout = f'".[{extra}]"' in paragraph
                if published != checkout:
                    missing.append(f"{path.relative_to(ROOT)}: [{extra}] {paragraph[:120]!r}")
    assert not missing, "\n".join(missing)
