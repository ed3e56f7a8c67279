"""docs/architecture.md stays true to the tree: every module has a row, every name it cites exists.

- each module of the package is named in the module table (``## Modules`` up to
  ``<!-- MODULES-END -->``), and each file the table names exists;
- each ``path.py`` the document cites under ``ddpstate/`` exists;
- each private module reference such as ```_convert/source.read_checkpoint``` or
  ```_manifest.verify_checkpoint``` names a module that exists and a name that module
  defines (a function, class, constant, method or attribute written in it).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import ddpstate

PACKAGE = Path(ddpstate.__file__).parent
DOC = PACKAGE.parent / "docs" / "architecture.md"


def _module_files() -> dict[str, Path]:
    """``"_convert/source.py"`` style names (relative to the package) -> path."""
    return {
        path.relative_to(PACKAGE).as_posix(): path
        for path in sorted(PACKAGE.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def _defined_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def _module_table(text: str) -> str:
    start = text.index("## Modules")
    return text[start : text.index("<!-- MODULES-END -->", start)]


def _rows(text: str) -> dict[str, set[str]]:
    """First cell of each module-table row -> the files the row names.

    A package row (first cell ```_convert/```) names its files by their own
    name (```source.py```), which count as ``_convert/source.py``.
    """
    rows: dict[str, set[str]] = {}
    for line in _module_table(text).splitlines():
        cells = line.split("|")
        if len(cells) < 3 or not cells[1].strip().startswith("`"):
            continue
        first = cells[1].strip()
        package = first.strip("`") if first.endswith("/`") else ""
        named = set(re.findall(r"`([A-Za-z_][\w/]*\.py)`", line))
        rows[first] = {package + n if package and "/" not in n else n for n in named}
    return rows


def _cited_files(text: str) -> set[str]:
    """Files cited outside the module table (full paths relative to the package)."""
    table = _module_table(text)
    rest = text.replace(table, "")
    cited = set(re.findall(r"`(?:ddpstate/)?([A-Za-z_][\w/]*\.py)`", rest))
    for named in _rows(text).values():
        cited |= named
    return {name for name in cited if not name.startswith(("tests/", "benchmarks/", "examples/"))}


def test_every_module_has_a_row_in_the_module_table() -> None:
    rows = _rows(DOC.read_text())
    named = set().union(*rows.values())
    missing = [
        name
        for name in _module_files()
        if not name.endswith("__init__.py")
        and name not in ("__main__.py", "_version.py")
        and name not in named
    ]
    packages = [
        name.removesuffix("__init__.py")
        for name in _module_files()
        if name.endswith("/__init__.py") and f"`{name.removesuffix('__init__.py')}`" not in rows
    ]
    assert not missing and not packages, f"no row in docs/architecture.md: {missing + packages}"


def test_every_file_the_document_cites_exists() -> None:
    files = _module_files()
    root = PACKAGE.parent
    elsewhere = {  # benchmarks/harness.py, tests/faults/_harness.py: cited by their own name
        path.name for folder in ("benchmarks", "tests") for path in (root / folder).rglob("*.py")
    }
    stale = sorted(
        name
        for name in _cited_files(DOC.read_text())
        if name not in files and not ("/" not in name and name in elsewhere)
    )
    assert not stale, f"docs/architecture.md cites files that do not exist: {stale}"


def test_every_module_reference_names_something_real() -> None:
    files = _module_files()
    by_module = {name.removesuffix(".py").replace("/", "."): path for name, path in files.items()}
    stale = []
    text = DOC.read_text()
    for match in re.finditer(r"`(_?[a-z_]+(?:[./][a-z_]+)?)\.([A-Za-z_]\w*)[`(]", text):
        module, name = match.group(1).replace("/", "."), match.group(2)
        if name in ("py", "pt", "json"):  # a file name, checked above
            continue
        if module in by_module and name in _defined_names(by_module[module]):
            continue
        if module not in by_module and not module.startswith("_"):
            continue  # `torch.load`, `os.replace`...: not ours
        if f"{module}.{name}" in by_module:  # a module of a package: `_dcp.write`
            continue
        stale.append(f"{match.group(1)}.{name}")
    assert not stale, f"docs/architecture.md names what the code lacks: {sorted(set(stale))}"
