"""Streaming ``ddpstate convert`` against ``cp`` (with equal durability) and the naive script.

For each size and tensor count, a DataParallel-style checkpoint
(``{"epoch", "state_dict"}``, every key ``module.``-prefixed) is written as a
torch.save file and as safetensors. Each command then runs in its own process
(wall time and its own peak RSS, see :func:`harness.run_command`), round-robin,
median of ``--repeats``; before each run the source is evicted from the page
cache (every command reads it cold), the previous output is removed and
``os.sync`` runs.

Pairs of equal durability (ddpstate fsyncs its output and its folder; ``cp``
does not):

* ``ddpstate convert --strip-module`` (torch zip, and safetensors) against
  ``cp`` + fsync of the copy; ``ddpstate convert --no-fsync`` against plain ``cp``
  (target <= 1.5x, peak RSS <= 128 MiB whatever the size);
* ``ddpstate convert --to safetensors --strip-module`` against ``cp`` + fsync
  (target <= 2x: it rewrites the layout, issue 7);
* for information, the naive script (``torch.load``, rename, ``torch.save``).

At the smallest point the streaming outputs are loaded and compared, tensor
for tensor, with the naive output.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import MIB, Results, Settings, timing

SIZE_TENSORS = 600
RSS_TARGET_MIB = 128.0

_NAIVE = """
import sys, torch
ckpt = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
ckpt["state_dict"] = {k[len("module."):] if k.startswith("module.") else k: v
                      for k, v in ckpt["state_dict"].items()}
torch.save(ckpt, sys.argv[2])
"""

# cp, then fsync of the copy: the durability ddpstate gives (without the folder fsync,
# which is one small metadata write).
_CP_FSYNC = 'cp "$0" "$1" && sync "$1"'


def ddpstate_command() -> list[str]:
    """The console script installed beside this interpreter, else ``python -m ddpstate``.

    Beside ``sys.executable`` first: a ``ddpstate`` found on PATH may be a
    version manager's shim (pyenv's adds ~60 ms of bash per call).
    """
    beside = Path(sys.executable).with_name("ddpstate")
    script = str(beside) if os.access(beside, os.X_OK) else shutil.which("ddpstate")
    return [script] if script else [sys.executable, "-m", "ddpstate"]


def has_no_fsync(ddpstate: Sequence[str]) -> bool:
    """Whether this ``ddpstate convert`` has ``--no-fsync``."""
    out = subprocess.run([*ddpstate, "convert", "--help"], capture_output=True, text=True)
    return "--no-fsync" in out.stdout


def _make(folder: Path, size_mib: int, count: int) -> tuple[Path, Path, float]:
    import safetensors.torch
    import torch

    state = harness.make_state(size_mib * MIB, count, prefix="module.")
    pt, st = folder / "src.pt", folder / "src.safetensors"
    torch.save({"epoch": 12, "state_dict": state}, pt)
    safetensors.torch.save_file(state, st)
    largest = max(t.numel() * t.element_size() for t in state.values()) / MIB
    return pt, st, largest


def _check_equal(naive: Path, outputs: dict[str, Path]) -> None:
    import torch
    from safetensors.torch import load_file

    reference = torch.load(naive, mmap=True, weights_only=True)["state_dict"]
    for name, path in outputs.items():
        if path.suffix == ".safetensors":
            got = load_file(path)
        else:
            got = torch.load(path, mmap=True, weights_only=True)["state_dict"]
        assert list(got) == list(reference) or set(got) == set(reference), name
        for key, value in reference.items():
            assert torch.equal(value, got[key]), f"{name}: {key} differs"


def run_point(
    results: Results, settings: Settings, axis: str, x: int, size_mib: int, count: int,
    no_fsync: bool, check: bool,
) -> None:  # fmt: skip
    """Time every convert command on one checkpoint."""
    folder = settings.work / f"convert-{axis}-{x}"
    folder.mkdir(parents=True, exist_ok=True)
    pt, st, largest_mib = _make(folder, size_mib, count)
    out = {
        name: folder / name
        for name in ("cp.pt", "strip.pt", "strip.safetensors", "to_st.safetensors", "naive.pt")
    }
    dd = [*settings.ddpstate_cmd, "convert"]
    commands: dict[str, tuple[list[str], Path, Path]] = {
        "cp": (["cp", str(pt), str(out["cp.pt"])], pt, out["cp.pt"]),
        "cp + fsync": (["sh", "-c", _CP_FSYNC, str(pt), str(out["cp.pt"])], pt, out["cp.pt"]),
        "ddpstate convert --strip-module (pt)": (
            [*dd, str(pt), str(out["strip.pt"]), "--strip-module", "-q"], pt, out["strip.pt"],
        ),
        "ddpstate convert --strip-module (safetensors)": (
            [*dd, str(st), str(out["strip.safetensors"]), "--strip-module", "-q"],
            st, out["strip.safetensors"],
        ),
        "ddpstate convert --to safetensors": (
            [*dd, str(pt), str(out["to_st.safetensors"]), "--to", "safetensors",
             "--strip-module", "-q"],
            pt, out["to_st.safetensors"],
        ),
        "naive load/rename/save": (
            [sys.executable, "-c", _NAIVE, str(pt), str(out["naive.pt"])], pt, out["naive.pt"],
        ),
        # The fixed cost inside every ddpstate row: interpreter start and imports.
        "ddpstate --version (process start)": (
            [*settings.ddpstate_cmd, "--version"], pt, out["cp.pt"],
        ),
    }  # fmt: skip
    if no_fsync:
        commands["ddpstate convert --strip-module --no-fsync (pt)"] = (
            [*dd, str(pt), str(out["strip.pt"]), "--strip-module", "--no-fsync", "-q"],
            pt,
            out["strip.pt"],
        )
        commands["ddpstate convert --strip-module --no-fsync (safetensors)"] = (
            [*dd, str(st), str(out["strip.safetensors"]), "--strip-module", "--no-fsync", "-q"],
            st,
            out["strip.safetensors"],
        )

    def prepare(name: str) -> None:
        _, source, target = commands[name]
        harness.remove(target)
        harness.evict(source, drop_all=settings.drop_caches)

    measured = harness.interleave_commands(
        {name: cmd for name, (cmd, _, _) in commands.items()},
        settings.repeats_at(size_mib, count),
        prepare,
    )
    t = {
        name: results.add(timing("convert", axis, x, name, m, name.startswith("ddpstate convert")))
        for name, m in measured.items()
    }
    for kind in ("pt", "safetensors"):
        ours = t[f"ddpstate convert --strip-module ({kind})"]
        ours.case = f"convert strip-module {kind}"
        results.compare(ours, t["cp + fsync"], 1.5, RSS_TARGET_MIB)
        fast = t.get(f"ddpstate convert --strip-module --no-fsync ({kind})")
        if fast is not None:
            fast.case = ours.case
            results.compare(fast, t["cp"], 1.5, RSS_TARGET_MIB)
        results.compare(ours, t["naive load/rename/save"])
    to_st = t["ddpstate convert --to safetensors"]
    to_st.case = "convert to safetensors"
    results.compare(to_st, t["cp + fsync"], 2.0, RSS_TARGET_MIB + largest_mib)
    for name in (
        "cp",
        "cp + fsync",
        "naive load/rename/save",
        "ddpstate --version (process start)",
    ):
        t[name].case = "convert baselines"
    if check:
        _check_equal(
            out["naive.pt"],
            {k: out[k] for k in ("strip.pt", "strip.safetensors", "to_st.safetensors")},
        )
        results.notes.append(
            f"convert: streaming outputs at {axis}={x} load equal, tensor for tensor, "
            "to the naive output"
        )
    harness.remove(folder)


def compile_ddpstate() -> str:
    """Byte-compile the ddpstate being measured, as ``pip install`` does for a wheel.

    An editable install is compiled on first import only where Python may write
    ``__pycache__``; under ``PYTHONDONTWRITEBYTECODE=1`` every ``ddpstate``
    process would compile its modules again (about 0.1 s of start-up here),
    which no installed copy pays.
    """
    import compileall

    import ddpstate

    folder = Path(ddpstate.__file__).parent
    compileall.compile_dir(str(folder), quiet=1)
    return f"convert: {folder} byte-compiled first, as an installed package is"


def run(results: Results, settings: Settings) -> None:
    """Every size, then every tensor count at the fixed size."""
    results.notes.append(compile_ddpstate())
    no_fsync = has_no_fsync(settings.ddpstate_cmd)
    if not no_fsync:
        results.notes.append(
            "convert: this ddpstate has no `convert --no-fsync`; only the durable pair "
            "(convert vs cp + fsync) was measured"
        )
    for i, size in enumerate(settings.sizes_mib):
        run_point(results, settings, "size_mib", size, size, SIZE_TENSORS, no_fsync, i == 0)
    for count in settings.counts:
        run_point(
            results, settings, "tensors", count, settings.count_size_mib, count, no_fsync, False
        )
