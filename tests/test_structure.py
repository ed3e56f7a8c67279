"""The shape of the code: public API pinned, small modules, layers without cycles.

These tests read the source with :mod:`ast` (nothing is imported but the public API):

- every public name (``ddpstate.__all__``, at most 40), every name that left it (still
  importable from ``ddpstate`` and its submodule) and every CLI option still exists, so a
  refactor cannot drop one silently;
- no module over 800 lines, no class over 500;
- no import cycle among ddpstate modules, counting imports inside functions (a lazy
  import is still a dependency; only ``if TYPE_CHECKING:`` imports are left out);
- no ``_private`` name of one module used by another, except between the files of
  one sub-package (``ddpstate/_convert/...``), which share their internals.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ddpstate

PACKAGE = Path(ddpstate.__file__).parent
MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 500

# ``ddpstate.__all__``: what README's "Using it" needs, at most 40 names.
PUBLIC_API = {
    # checkpoint
    "load",
    "load_model_state",
    "save",
    "save_model_state",
    # manager, sampler, rng
    "CheckpointManager",
    "RestoreSource",
    "verify_checkpoint",
    "ResumableDistributedSampler",
    "capture_rng_state",
    "restore_rng_state",
    # dist
    "barrier",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
    "main_process_first",
    "rank_zero_only",
    # batchnorm
    "convert_sync_batchnorm",
    "explain_ddp_errors",
    "revert_sync_batchnorm",
    "sync_batchnorm_stats",
    "wrap_ddp",
    # keys
    "adapt_state_dict",
    "add_prefix",
    "find_state_dict",
    "normalize_keys",
    "replace_state_dict",
    "strip_prefix",
    "unwrap_model",
    # formats, convert
    "convert_file",
    "detect_format",
    # errors
    "DDPStateError",
    "BarrierTimeoutError",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "InvalidArgumentError",
    "KeyMismatchError",
    "UnsafeCheckpointError",
}

# Names that left ``ddpstate.__all__``: still ``ddpstate.NAME`` and ``from ddpstate
# import NAME``, and each in its public submodule's ``__all__``.
STILL_IMPORTABLE = {
    # checkpoint, manager
    "IncompatibleKeys",
    "CheckpointVerification",
    "KeepBest",
    "NodeLocal",
    # keys
    "KNOWN_PREFIXES",
    "STATE_DICT_NAMES",
    "KeyMatch",
    "OnCollision",
    "detect_prefixes",
    "match_keys",
    # batchnorm
    "BatchNormNd",
    "BatchNormPolicy",
    # formats, storage, location
    "FormatName",
    "MapLocation",
    "atomic_write",
    "parse_format",
    "open_read",
    "resolve_map_location",
    # convert
    "ConvertResult",
    "DiffResult",
    "InspectResult",
    "VerifyResult",
    "diff_files",
    "inspect_file",
    "verify_file",
    # dist
    "DistContext",
    "all_gather_object",
    "broadcast_object",
    "default_timeout",
    "is_distributed",
    "is_local_main_process",
    # errors
    "BatchNormBufferSyncError",
    "BatchNormPolicyError",
    "CheckpointExistsError",
    "CheckpointWriteError",
    "KeyCollisionError",
    "StateDictNotFoundError",
    "AmbiguousStateDictError",
    "RankFailedError",
    "CheckpointAccessError",
    "ShapeMismatchError",
    "DTypeMismatchError",
    "OptimizerStateMismatchError",
    "ShardedStateError",
    "DeviceMapError",
    "StoreConnectionError",
}

# The public submodules (``dir(ddpstate)`` lists them; ``ddpstate.<name>`` imports one).
PUBLIC_SUBMODULES = [
    "batchnorm",
    "checkpoint",
    "cli",
    "convert",
    "dcp",
    "dist",
    "errors",
    "formats",
    "keys",
    "location",
    "manager",
    "rng",
    "sampler",
    "storage",
]

# Where each public name is documented to live (``from ddpstate.<module> import <name>``).
PUBLIC_HOMES = {
    "checkpoint": [
        "IncompatibleKeys",
        "LoadOptions",
        "load",
        "load_model_state",
        "save",
        "save_model_state",
    ],
    "manager": [
        "CheckpointManager",
        "CheckpointVerification",
        "KeepBest",
        "NodeLocal",
        "RestoreSource",
        "verify_checkpoint",
    ],
    "rng": ["capture_rng_state", "restore_rng_state"],
    "sampler": ["ResumableDistributedSampler"],
    "keys": [
        "KNOWN_PREFIXES",
        "STATE_DICT_NAMES",
        "KeyMatch",
        "adapt_state_dict",
        "add_prefix",
        "detect_prefixes",
        "find_state_dict",
        "match_keys",
        "normalize_keys",
        "replace_state_dict",
        "strip_prefix",
        "unwrap_model",
    ],
    "batchnorm": [
        "BatchNormNd",
        "BatchNormPolicy",
        "convert_sync_batchnorm",
        "explain_ddp_errors",
        "revert_sync_batchnorm",
        "sync_batchnorm_stats",
        "wrap_ddp",
    ],
    "formats": ["FormatName", "detect_format", "parse_format"],
    "storage": ["atomic_write", "open_read"],
    "location": ["MapLocation", "resolve_map_location"],
    "convert": [
        "ConvertResult",
        "DiffResult",
        "InspectResult",
        "StateEdit",
        "VerifyResult",
        "convert_file",
        "diff_files",
        "inspect_file",
        "verify_file",
    ],
    "dist": [
        "DistContext",
        "all_gather_object",
        "barrier",
        "broadcast_object",
        "default_timeout",
        "get_local_rank",
        "get_rank",
        "get_world_size",
        "init_distributed",
        "is_distributed",
        "is_local_main_process",
        "is_main_process",
        "main_process_first",
        "rank_zero_only",
        "gather_object",
        "gather_and_decide",
        "share_outcome",
        "compare_across_ranks",
        "all_reduce_flag",
    ],
    "cli": ["main"],
    "integrations.accelerate": ["load_state", "save_state"],
    "dcp": ["DurableWriter", "VerifiedReader"],
}

# Every option of every subcommand (``ddpstate <command> --help``).
CLI_OPTIONS = {
    "convert": [
        "--strip-module",
        "--add-module",
        "--strip-prefix",
        "--add-prefix",
        "--normalize",
        "--on-collision",
        "--key",
        "--to",
        "--max-shard-size",
        "--dtype",
        "--drop-optimizer",
        "--in-place",
        "--force",
        "--no-fsync",
        "--unsafe",
        "--quiet",
        "--storage-option",
    ],
    "inspect": ["--json", "--unsafe", "--storage-option"],
    "diff": [
        "--strip-module",
        "--add-module",
        "--strip-prefix",
        "--add-prefix",
        "--normalize",
        "--on-collision",
        "--key",
        "--raw-keys",
        "--atol",
        "--json",
        "--unsafe",
        "--quiet",
        "--storage-option",
    ],
    "verify": ["--json", "--unsafe", "--quiet", "--storage-option"],
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _package_of(module: str) -> str:
    """The package a module's file sits in (``ddpstate`` or ``ddpstate._convert``...)."""
    if MODULES[module].name == "__init__.py":
        return module
    return module.rsplit(".", 1)[0]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(sub) for sub in ast.walk(node))
    return inside


def _imports(module: str) -> list[tuple[ast.AST, str, list[ast.alias], bool]]:
    """``(node, imported module, names, type-checking only)`` for every ddpstate import."""
    tree = ast.parse(MODULES[module].read_text())
    type_only = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module).split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target == "ddpstate" or target.startswith("ddpstate."):
                found.append((node, target, node.names, id(node) in type_only))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ddpstate"):
                    found.append((node, alias.name, [], id(node) in type_only))
    return found


def _dependencies() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for module in MODULES:
        for _node, target, names, type_only in _imports(module):
            if type_only:
                continue
            if not names:
                graph[module].add(target)
            for alias in names:
                sub = f"{target}.{alias.name}"
                graph[module].add(sub if sub in MODULES else target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in graph or nxt == node:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(module: str) -> list[str]:
    """Private names of other ddpstate modules this module imports or reaches into."""
    tree = ast.parse(MODULES[module].read_text())
    own_package = _package_of(module)
    problems = []
    module_aliases: dict[str, str] = {}
    for node, target, names, _type_only in _imports(module):
        if not names:
            continue
        for alias in names:
            sub = f"{target}.{alias.name}"
            if sub in MODULES:
                module_aliases[alias.asname or alias.name] = sub
                continue
            if target not in MODULES or not _is_private(alias.name):
                continue
            if _package_of(target) == own_package and own_package != "ddpstate":
                continue
            problems.append(f"{module}:{node.lineno} imports {target}.{alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in module_aliases
            and _is_private(node.attr)
        ):
            target = module_aliases[node.value.id]
            if target == module:
                continue
            if _package_of(target) == own_package and own_package != "ddpstate":
                continue
            problems.append(f"{module}:{node.lineno} uses {target}.{node.attr}")
    return problems


def test_every_public_name_is_still_exported_and_importable() -> None:
    assert set(ddpstate.__all__) == PUBLIC_API
    assert len(ddpstate.__all__) == len(PUBLIC_API) <= 40
    for name in sorted(PUBLIC_API):
        assert getattr(ddpstate, name) is not None, name
    assert isinstance(ddpstate.__version__, str)


@pytest.mark.parametrize("name", sorted(STILL_IMPORTABLE))
def test_names_outside_all_still_import_from_ddpstate_and_their_submodule(name: str) -> None:
    import importlib

    assert name not in ddpstate.__all__
    value = getattr(ddpstate, name)
    namespace: dict[str, object] = {}
    exec(f"from ddpstate import {name}", namespace)
    assert namespace[name] is value
    homes = [
        module
        for module in PUBLIC_SUBMODULES
        if name in getattr(importlib.import_module(f"ddpstate.{module}"), "__all__", ())
    ]
    assert homes, f"{name} is in no public submodule's __all__"
    for module in homes:
        assert getattr(importlib.import_module(f"ddpstate.{module}"), name) is value


def test_dir_lists_the_public_names_and_submodules() -> None:
    listed = set(dir(ddpstate))
    assert listed >= PUBLIC_API
    assert listed >= set(PUBLIC_SUBMODULES)
    assert not listed & STILL_IMPORTABLE
    for module in PUBLIC_SUBMODULES:
        assert getattr(ddpstate, module).__name__ == f"ddpstate.{module}"


def test_import_and_dir_do_not_import_torch() -> None:
    code = "import sys, ddpstate; dir(ddpstate); print('torch' in sys.modules)"
    shown = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert shown.strip() == "False"


def test_help_shows_the_public_names() -> None:
    import pydoc

    text = pydoc.render_doc(ddpstate, renderer=pydoc.plaintext)
    for name in ("save", "load", "CheckpointManager", "load_model_state", "DDPStateError"):
        assert f" {name}" in text, name


@pytest.mark.parametrize("module", sorted(PUBLIC_HOMES))
def test_public_names_import_from_their_documented_module(module: str) -> None:
    import importlib

    loaded = importlib.import_module(f"ddpstate.{module}")
    for name in PUBLIC_HOMES[module]:
        value = getattr(loaded, name)
        if name in PUBLIC_API | STILL_IMPORTABLE:
            assert value is getattr(ddpstate, name), f"ddpstate.{module}.{name}"


@pytest.mark.parametrize("command", sorted(CLI_OPTIONS))
def test_every_cli_option_is_still_accepted(command: str) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "ddpstate", command, "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    offered = {word.strip(",[]") for word in shown.split() if word.startswith("-")}
    missing = [option for option in CLI_OPTIONS[command] if option not in offered]
    assert not missing, f"ddpstate {command} lost {missing}"


def test_no_module_is_longer_than_800_lines() -> None:
    long = {
        module: count
        for module, path in MODULES.items()
        if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"split these modules (lines): {long}"


@pytest.mark.slow
def test_no_class_is_longer_than_500_lines() -> None:
    long = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    long[f"{module}.{node.name}"] = lines
    assert not long, f"split these classes (lines): {long}"


def test_no_import_cycle_among_ddpstate_modules() -> None:
    cycles = _cycles(_dependencies())
    assert not cycles, f"import cycles (lazy imports count): {cycles}"


def _top(module: str) -> str:
    """ddpstate.x.y -> ddpstate.x: the top-level module or sub-package a module sits in."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_among_ddpstate_packages() -> None:
    """Layers: the package graph (each sub-package one node, lazy imports counted) is a DAG."""
    packages: dict[str, set[str]] = {}
    for module, targets in _dependencies().items():
        node = _top(module)
        packages.setdefault(node, set())
        for target in targets:
            if _top(target) not in (node, "ddpstate"):
                packages[node].add(_top(target))
    cycles = _cycles(packages)
    assert not cycles, f"import cycles between packages (lazy imports count): {cycles}"


def test_few_function_local_imports_each_with_a_reason() -> None:
    """A ddpstate import inside a function hides a dependency: at most 10, each explained."""
    local = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    targets = [node.module or ""] if not node.level else ["ddpstate."]
                elif isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                else:
                    continue
                if any(t == "ddpstate" or t.startswith("ddpstate.") for t in targets):
                    said = lines[node.lineno - 1] + lines[node.lineno - 2]
                    local.append((f"{module}:{node.lineno}", "#" in said))
    assert len(local) <= 10, f"function-local ddpstate imports: {[m for m, _ in local]}"
    unexplained = [m for m, explained in local if not explained]
    assert not unexplained, (
        f"function-local ddpstate imports without a reason comment: {unexplained}"
    )


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.slow
def test_no_private_name_crosses_modules_outside_a_package() -> None:
    problems = [problem for module in MODULES for problem in _private_uses(module)]
    assert not problems, "\n".join(problems)


# ``ddpstate.storage.__all__``: what users need; the writers' internals left it in 0.x
# and still import from ``ddpstate.storage``.
STORAGE_ALL = {
    "StagedFolder",
    "atomic_write",
    "committed_folder",
    "exists",
    "is_temp_name",
    "isdir",
    "join",
    "listdir",
    "makedirs",
    "open_read",
    "remove",
    "replace_folder",
    "staged_folder",
    "trust_protocol",
}
STORAGE_LEFT_ALL = {
    "OBJECT_STORE_PROTOCOLS",
    "TEMP_MARKER",
    "fsync_dir",
    "retired_original",
    "temp_path_for",
    "wait_for_freed",
    "write_by_name",
}


def test_storage_all_is_small_and_the_names_that_left_still_import() -> None:
    from ddpstate import storage

    assert set(storage.__all__) == STORAGE_ALL
    for name in sorted(STORAGE_LEFT_ALL):
        namespace: dict[str, object] = {}
        exec(f"from ddpstate.storage import {name}", namespace)
        assert namespace[name] is getattr(storage, name), name


# ``ddpstate.integrations``: each framework module's ``__all__``, read from its source
# (importing it imports the framework, seconds); the package's ``__init__`` imports none.
INTEGRATIONS = {
    "ddpstate.integrations.lightning": {"DDPStateCheckpointIO", "last_verified_checkpoint"},
    "ddpstate.integrations.transformers": {"DDPStateCallback", "last_verified_checkpoint"},
}


def _all_of(module: str) -> set[str]:
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


@pytest.mark.parametrize("module", sorted(INTEGRATIONS))
def test_integration_modules_keep_their_public_names(module: str) -> None:
    assert _all_of(module) == INTEGRATIONS[module]
    defined = {
        node.name
        for node in ast.parse(MODULES[module].read_text()).body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
    }
    assert INTEGRATIONS[module] <= defined


def test_the_integrations_package_imports_no_framework() -> None:
    code = (
        "import sys, ddpstate.integrations; "
        "print(sorted({'torch', 'lightning', 'transformers', 'accelerate'} & set(sys.modules)))"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert shown.strip() == "[]"
    shared = ast.parse(MODULES["ddpstate.integrations._common"].read_text())
    imported = {
        (node.module or "").split(".")[0]
        for node in ast.walk(shared)
        if isinstance(node, ast.ImportFrom)
    } | {
        a.name.split(".")[0] for n in ast.walk(shared) if isinstance(n, ast.Import) for a in n.names
    }
    assert not imported & {"lightning", "transformers", "accelerate"}
