"""Run torch's own FileSystemWriter/FileSystemReader tests with ddpstate's drop-ins in their place.

torch's tests of its file-system storage (``test/distributed/checkpoint`` in the
PyTorch repository, e.g. ``test_file_system_checkpoint_cpu.py``) are not part of
the torch wheel and are not copied into this repository. Given a folder holding
some of them::

    T=<pytorch>/test/distributed/checkpoint/test_file_system_checkpoint_cpu.py
    python -m tests.dcp.torch_suite $T
    python -m tests.dcp.torch_suite --plain $T   # torch's own classes: the baseline

runs them with pytest after putting :class:`ddpstate.dcp.DurableWriter` and
:class:`ddpstate.dcp.VerifiedReader` wherever ``torch.distributed.checkpoint`` and
its modules name ``FileSystemWriter`` / ``FileSystemReader`` (so ``from
torch.distributed.checkpoint import FileSystemWriter`` in a test module, and
``dcp.save(checkpoint_id=...)``'s default storage, get ddpstate's), and prints
each test's outcome and the counts. Modules that subclass torch's classes
(``FsspecWriter``, the Hugging Face storage) keep the original name.

torch's multi-rank tests start their ranks with multiprocessing's ``spawn``, which
runs this module again in each rank (as ``__mp_main__``) before it loads the test
class: the patch is made there too, from the environment variable this runner
sets, before the test module is imported.

``--json PATH`` writes ``{nodeid: outcome}`` for tests/dcp/test_torch_suite.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

#: Set by the runner (inherited by every rank it spawns): "1" puts ddpstate's classes in.
PATCH_ENV = "_DDPSTATE_TORCH_SUITE_PATCH"
_PREFIX = "torch.distributed.checkpoint"


def patch_torch() -> list[str]:
    """Put ddpstate's drop-ins in place of torch's in every loaded DCP module; the names patched."""
    import torch.distributed.checkpoint as dcp

    from ddpstate.dcp import DurableWriter, VerifiedReader

    swaps = {dcp.FileSystemWriter: DurableWriter, dcp.FileSystemReader: VerifiedReader}
    patched = []
    for name, module in sorted(sys.modules.items()):
        if module is None or not (name == _PREFIX or name.startswith(_PREFIX + ".")):
            continue
        defines_one = any(  # torch's own module, or one building on torch's class
            isinstance(v, type) and v.__module__ == name and any(c in swaps for c in v.__mro__)
            for v in vars(module).values()
        )
        if defines_one:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value in swaps:
                setattr(module, attr, swaps[value])
                patched.append(f"{name}.{attr}")
    return patched


class _Outcomes:
    """A pytest plugin that keeps each test's outcome (a failed setup or teardown counts)."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:  # a test file that does not import (a missing test dependency)
            self.outcomes[report.nodeid] = "error"

    def pytest_runtest_logreport(self, report: Any) -> None:
        first_problem = self.outcomes.get(report.nodeid) in (None, "passed")
        if (report.when == "call" or report.outcome != "passed") and first_problem:
            self.outcomes[report.nodeid] = report.outcome


def run(tests: list[str], *, plain: bool, pytest_args: list[str]) -> dict[str, str]:
    """Run torch's test files with pytest in this process; each test's outcome by node id."""
    import pytest

    os.environ[PATCH_ENV] = "0" if plain else "1"
    if not plain:
        import torch.distributed.checkpoint  # noqa: F401 - its modules load before patching

        print("patched:", ", ".join(patch_torch()), flush=True)
    outcomes = _Outcomes()
    folder = os.path.dirname(os.path.abspath(tests[0])) if tests else os.getcwd()
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:xdist", f"--rootdir={folder}"]
    pytest.main([*args, *pytest_args, *tests], plugins=[outcomes])
    return outcomes.outcomes


def main(argv: list[str] | None = None) -> int:
    """Command line: run the tests, print the counts, write ``--json``; 0 unless none ran."""
    parser = argparse.ArgumentParser(prog="python -m tests.dcp.torch_suite", description=__doc__)
    parser.add_argument("tests", nargs="+", help="torch's test files (or folders of them)")
    parser.add_argument("--plain", action="store_true", help="torch's own classes (baseline)")
    parser.add_argument("--json", help="write {nodeid: outcome} here")
    parser.add_argument("-k", help="pytest's -k expression")
    args = parser.parse_args(argv)
    outcomes = run(args.tests, plain=args.plain, pytest_args=["-k", args.k] if args.k else [])
    counts: dict[str, int] = {}
    for nodeid, outcome in sorted(outcomes.items()):
        counts[outcome] = counts.get(outcome, 0) + 1
        print(f"{outcome:8} {nodeid}")
    which = "torch's FileSystemWriter/Reader" if args.plain else "ddpstate's DurableWriter/Reader"
    print(f"{which}: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items())), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(outcomes, f, indent=1, sort_keys=True)
    return 0 if outcomes else 1


if os.environ.get(PATCH_ENV) == "1" and __name__ == "__mp_main__":
    # A rank that torch's test spawned: this module runs first (as __mp_main__), so the
    # names are replaced before the test module is imported and its class unpickled.
    patch_torch()

if __name__ == "__main__":
    sys.exit(main())
