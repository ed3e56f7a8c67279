"""Pickles that would run a command: never executed without the explicit unsafe opt-in."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import ddpstate
from ddpstate.convert import inspect_file
from ddpstate.errors import DDPStateError
from tests.faults import _harness as h

_PAYLOADS = sorted(h.malicious_payloads(Path("marker")))


@pytest.mark.parametrize("container", h.MALICIOUS_CONTAINERS)
@pytest.mark.parametrize("payload", _PAYLOADS)
def test_payloads_are_refused_and_never_run(container: str, payload: str, tmp_path: Path) -> None:
    """os.system, builtins.exec, subprocess.Popen/call and a whole nn.Module, in torch zip
    and legacy files: load/inspect/diff/convert/verify raise UnsafeCheckpointError; one
    `ddpstate` command per case exits 2 with one line; the marker file never appears."""
    command = h.MALICIOUS_CLI[_PAYLOADS.index(payload) % len(h.MALICIOUS_CLI)]
    trial = h.malicious_trial(container, payload, tmp_path, cli=(command,))
    assert not trial.defects, trial.defects
    assert not (tmp_path / "marker").exists()


@pytest.mark.slow
def test_every_command_refuses_the_os_system_payload(tmp_path: Path) -> None:
    """All four `ddpstate` commands, both containers, on the os.system payload."""
    for container in h.MALICIOUS_CONTAINERS:
        trial = h.malicious_trial(container, "os.system", tmp_path / container)
        assert not trial.defects, trial.defects
        assert {trial.verdicts[f"cli {c}"] for c in h.MALICIOUS_CLI} == {"exit 2"}


def test_a_plain_pickle_is_not_a_checkpoint(tmp_path: Path) -> None:
    """A bare pickle (no torch container) of the os.system payload is refused as not a
    checkpoint format by every operation; the marker never appears."""
    marker = tmp_path / "marker"
    src = tmp_path / "plain.pkl"
    src.write_bytes(pickle.dumps(h.malicious_payloads(marker)["os.system"], protocol=2))
    for fn in (
        lambda: ddpstate.load(src, map_location="cpu"),
        lambda: inspect_file(str(src)),
        lambda: inspect_file(str(src), unsafe=True),
    ):
        with pytest.raises(DDPStateError):
            fn()
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("container", h.MALICIOUS_CONTAINERS)
def test_the_payloads_are_live_under_the_explicit_opt_in(container: str, tmp_path: Path) -> None:
    """Control: ddpstate.load(weights_only=False), the documented unsafe opt-in, DOES run
    the payload (in a child process); so the marker checks above can see execution."""
    marker = tmp_path / "marker"
    src = tmp_path / "payload.pt"
    h.write_malicious(container, "os.system", src, marker)
    code = (
        "import sys, ddpstate; ddpstate.load(sys.argv[1], map_location='cpu', weights_only=False)"
    )
    subprocess.run([sys.executable, "-c", code, str(src)], check=True, timeout=120)
    assert marker.exists()
