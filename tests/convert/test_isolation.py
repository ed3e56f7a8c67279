"""The suite's global-state guard (tests/conftest.py) fails a test that leaks, and only that one."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]

LEAKY_TESTS = """
import signal

import torch
from torch.utils.serialization import config


class Mine:
    pass


def test_tidy():
    with config.patch({"load.calculate_storage_offsets": True}):
        assert config.load.calculate_storage_offsets


def test_leaks_torch_config():
    config.load.calculate_storage_offsets = True


def test_leaks_default_dtype():
    torch.set_default_dtype(torch.float64)


def test_leaks_threads():
    torch.set_num_threads(1)


def test_leaks_safe_globals():
    torch.serialization.add_safe_globals([Mine])


def test_leaks_a_signal_handler():
    signal.signal(signal.SIGUSR1, lambda *args: None)


def test_after_the_leaks():
    assert True
"""


@pytest.mark.slow
def test_guard_fails_each_leaking_test_by_name(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_leaky=LEAKY_TESTS)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = pytester.runpytest_subprocess("-q", "-p", "no:randomly", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    # Each leak is an error at its own teardown; the tidy tests pass.
    assert outcomes.get("errors") == 5, result.stdout.str()
    assert outcomes.get("passed") == 7, result.stdout.str()  # 7 calls pass; 5 teardowns fail
    text = result.stdout.str()
    for name, what in [
        ("test_leaks_torch_config", "torch.utils.serialization.config"),
        ("test_leaks_default_dtype", "torch.get_default_dtype()"),
        ("test_leaks_threads", "torch.get_num_threads()"),
        ("test_leaks_safe_globals", "torch.serialization.get_safe_globals()"),
        ("test_leaks_a_signal_handler", "signal handlers"),
    ]:
        assert f"ERROR at teardown of {name}" in text, text
        assert what in text, text
    assert "ERROR at teardown of test_tidy" not in text
    assert "ERROR at teardown of test_after_the_leaks" not in text
