"""A FIFO passed as the checkpoint itself: every reader refuses it at once.

Names a checkpoint gives for files inside it are already refused when they are FIFOs
(``_fs.confined_file``); the file a user names must be refused too, not opened: opening a
FIFO blocks until a writer appears, so ``ddpstate verify`` and ``ddpstate.load`` hung.
Each call runs in a child process with a time limit, so a reader that blocks fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_LIMIT_S = 60
_API = (
    "import sys, ddpstate\n"
    "from ddpstate.errors import CheckpointFormatError\n"
    "try:\n"
    "    ddpstate.{call}(sys.argv[1])\n"
    "except CheckpointFormatError as exc:\n"
    "    print(exc)\n"
)


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=_LIMIT_S, env=env
    )


@pytest.mark.slow
@pytest.mark.parametrize("command", ["verify", "inspect", "convert"])
def test_a_fifo_given_on_the_command_line_is_refused(command: str, tmp_path: Path) -> None:
    """Exit 2 with one error line naming the FIFO, within the time limit."""
    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)
    extra = [str(tmp_path / "out.pt"), "--strip-module"] if command == "convert" else []
    done = _run(["-m", "ddpstate", command, str(fifo), *extra])
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert f"{fifo}: not a regular file" in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("call", ["load", "detect_format"])
def test_a_fifo_given_to_the_api_is_a_format_error(call: str, tmp_path: Path) -> None:
    """``ddpstate.load`` and ``detect_format`` raise CheckpointFormatError naming the FIFO."""
    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)
    done = _run(["-c", _API.format(call=call), str(fifo)])
    assert done.returncode == 0, done.stderr
    assert f"{fifo}: not a regular file" in done.stdout, done.stdout


def _fifo_inside(folder: Path, layout: str) -> Path:
    """A checkpoint folder whose own fixed-name file is a FIFO (as a crafted tar unpacks)."""
    if layout == "dcp":
        target = folder / "dcp"
        target.mkdir()
        os.mkfifo(target / ".metadata")
    elif layout == "manager_step":
        target = folder / "run" / "step_0000000001"
        target.mkdir(parents=True)
        os.mkfifo(target / "manifest.json")
    else:  # a manager folder whose latest pointer is a FIFO
        target = folder / "run"
        (target / "step_0000000001").mkdir(parents=True)
        os.mkfifo(target / "latest")
    return target


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "layout"),
    [(c, layout) for c in ("verify", "inspect") for layout in ("dcp", "manager_step")]
    + [("verify", "manager_latest")],  # inspect of a manager folder never reads latest
)
def test_a_fifo_inside_a_checkpoint_folder_is_refused(
    command: str, layout: str, tmp_path: Path
) -> None:
    """``.metadata``, ``manifest.json`` or ``latest`` a FIFO: reported as damage (exit 1 or
    2, naming the FIFO), within the time limit."""
    src = _fifo_inside(tmp_path, layout)
    done = _run(["-m", "ddpstate", command, str(src)])
    assert done.returncode in (1, 2), (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert "not a regular file" in done.stdout + done.stderr, (done.stdout, done.stderr)
