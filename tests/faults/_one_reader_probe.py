"""Run reads of one hostile file in a child process and report each one's cost as JSON.

``python -m tests.faults._one_reader_probe SRC WORKDIR OP...`` prints one JSON object per
line: the op, what it raised (class names of its MRO) or returned, its message, seconds,
and peak RSS growth (VmHWM, reset before each op, minus RSS before it). The address space
is capped at its size after the imports + ``DDPSTATE_PROBE_AS`` bytes (default 3 GiB), so
a reader that obeys a file's request for 8 or 40 GiB fails here instead of swapping the
machine; each op also has a 10 s alarm. OPs: ``load``, ``inspect``, ``verify``,
``convert`` (to .pt), ``convert_st`` (to .safetensors), ``diff`` (against WORKDIR/clean.pt),
and ``cli:ARGS`` (``ddpstate.cli.main`` with the ``|``-separated ARGS; ``{src}`` and
``{dir}`` are filled in).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import ddpstate
import ddpstate.cli
from ddpstate.convert import convert_file, diff_files, inspect_file, verify_file

_ALARM_S = 10


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _call(op: str, src: Path, work: Path) -> Any:
    if op == "load":
        return type(ddpstate.load(src, map_location="cpu")).__name__
    if op == "inspect":
        return len(inspect_file(src).tensors)
    if op == "verify":
        result = verify_file(src)
        return {"ok": result.ok, "problems": list(result.problems)}
    if op == "convert":
        return str(convert_file(src, work / "out.pt", overwrite=True).dst)
    if op == "convert_st":
        return str(convert_file(src, work / "out.safetensors", overwrite=True).dst)
    if op == "diff":
        return diff_files(src, work / "clean.pt").equal
    assert op.startswith("cli:"), op
    args = [a.format(src=src, dir=work) for a in op[4:].split("|")]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = ddpstate.cli.main(args)
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}


def _timeout(signum: int, frame: Any) -> None:
    raise TimeoutError(f"still running after {_ALARM_S} s")


def main(argv: list[str]) -> None:
    src, work, ops = Path(argv[0]), Path(argv[1]), argv[2:]
    cap = _status("VmSize") + int(os.environ.get("DDPSTATE_PROBE_AS", 3 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    signal.signal(signal.SIGALRM, _timeout)
    warm = work / "warm-up"
    warm.mkdir(exist_ok=True)
    shutil.copyfile(work / "clean.pt", warm / "clean.pt")
    for op in ops:  # warm-up on the clean file: lazy imports and first-call caches
        with (
            contextlib.suppress(Exception),
            open(os.devnull, "w") as sink,
            contextlib.redirect_stdout(sink),
            contextlib.redirect_stderr(sink),
        ):
            _call(op, warm / "clean.pt", warm)
    shutil.rmtree(warm)
    for op in ops:
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM restarts from the current RSS
        start = time.perf_counter()
        signal.alarm(_ALARM_S)
        report: dict[str, Any] = {"op": op}
        try:
            report["returned"] = _call(op, src, work)
        except BaseException as exc:  # what escapes is what the test judges
            report["raised"] = [c.__name__ for c in type(exc).__mro__]
            report["message"] = str(exc)
        finally:
            signal.alarm(0)
        report["seconds"] = time.perf_counter() - start
        report["growth_mib"] = (_status("VmHWM") - before) / (1 << 20)
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
