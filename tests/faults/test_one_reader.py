"""Issue 40: the crafted files of tests/hostile.py against every reader of a torch file.

Container damage (a second data.pkl, a duplicated or shared tensor record, a compressed
record, an archive layout torch refuses) is a ``CheckpointCorruptError`` naming the file
from ``verify``, ``inspect``, ``convert``, ``diff`` and ``ddpstate.load``; on the command line
an exit status of 2 (``verify``: 1 or 2) with one ``ddpstate: error:`` line, or verify's
``BAD:`` report, naming the file. A file that asks for memory it does not hold (a zip bomb,
``builtins.bytes(8 GiB)``, a stride-0 view materialized) is refused before the memory is
taken: those run in a child process with the address space capped
(tests/faults/_one_reader_probe.py), so a reader that obeys the file fails there instead of
swapping the machine.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ddpstate
import ddpstate.cli
from ddpstate.convert import convert_file, diff_files, inspect_file, verify_file
from ddpstate.errors import CheckpointCorruptError, CheckpointFormatError, DDPStateError
from tests import hostile

_COMMANDS = ("verify", "inspect", "convert", "diff")
_DUPLICATES = [(n, first) for n in range(1, 7) for first in (True, False)]


def _clean(folder: Path) -> Path:
    path = folder / "clean.pt"
    torch.save(hostile.state(2), path)
    return path


def _cli_args(command: str, src: Path, folder: Path) -> list[str]:
    if command == "convert":
        return ["convert", str(src), str(folder / "out.pt"), "--strip-module"]
    if command == "diff":
        return ["diff", str(src), str(folder / "clean.pt")]
    return [command, "--quiet", str(src)] if command == "verify" else [command, str(src)]


def assert_cli_refuses(rc: int, out: str, err: str, command: str, src: Path) -> None:
    """Exit 2 with one ``ddpstate: error:`` line naming the file (no traceback, nothing
    "unexpected"); ``verify`` may instead exit 1 with its ``BAD: <file>`` report."""
    assert "Traceback" not in err and "unexpected" not in err, err
    if command == "verify" and rc == 1:
        assert out.startswith(f"BAD: {src}"), out
        return
    assert rc == 2, (command, rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpstate: error: "), err
    assert src.name in lines[0], lines[0]


def assert_corrupt_everywhere(src: Path, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every API reader raises CheckpointCorruptError naming ``src`` (``verify_file`` may
    report it instead); every command refuses it; no output file is written."""
    _clean(folder)
    calls: dict[str, Callable[[], Any]] = {
        "load": lambda: ddpstate.load(src, map_location="cpu"),
        "inspect": lambda: inspect_file(src),
        "convert": lambda: convert_file(src, folder / "out.pt"),
        "diff": lambda: diff_files(src, folder / "clean.pt"),
    }
    for name, call in calls.items():
        with pytest.raises(CheckpointCorruptError) as caught:
            call()
        assert src.name in str(caught.value), (name, str(caught.value))
    try:
        result = verify_file(src)
    except CheckpointCorruptError as exc:
        assert src.name in str(exc)
    else:
        assert not result.ok and result.problems, result
    for command in _COMMANDS:
        rc = ddpstate.cli.main(_cli_args(command, src, folder))
        captured = capsys.readouterr()
        assert_cli_refuses(rc, captured.out, captured.err, command, src)
    assert not (folder / "out.pt").exists()


# --------------------------------------------------------------------------- duplicates


@pytest.mark.parametrize(("n_tensors", "evil_first"), _DUPLICATES)
def test_a_second_data_pkl_is_refused_everywhere(
    n_tensors: int, evil_first: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second <archive>/data.pkl reducing to os.system, before or after the real one,
    with 1..6 tensors (torch's reader picks one copy or the other by entry count): refused
    by verify, inspect, convert, diff and load; the payload never runs."""
    src, marker = tmp_path / "dup.pt", tmp_path / "marker"
    hostile.duplicate_data_pkl(src, marker, n_tensors, evil_first)
    assert_corrupt_everywhere(src, tmp_path, capsys)
    assert not marker.exists()


@pytest.mark.parametrize("other_first", [True, False])
def test_a_duplicated_tensor_record_is_refused(
    other_first: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """<archive>/data/0 twice with different bytes: which values are "the" tensor depends
    on the reader, so every reader refuses the file."""
    src = tmp_path / "dup_record.pt"
    hostile.duplicate_tensor_record(src, other_first)
    assert_corrupt_everywhere(src, tmp_path, capsys)


def test_two_names_on_one_local_header_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """data/1's directory entry points at data/0's bytes: torch loads t1 with t0's values
    (checked here), silently wrong; ddpstate refuses the file."""
    src = tmp_path / "shared.pt"
    hostile.shared_local_header(src)
    loaded = torch.load(src, weights_only=True)
    assert torch.equal(loaded["module.t1"], loaded["module.t0"])  # the wrong answer
    assert_corrupt_everywhere(src, tmp_path, capsys)


@pytest.mark.parametrize("mutant", sorted(hostile.LAYOUT_MUTANTS))
def test_archive_layouts_torch_refuses_are_refused(
    mutant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Folder names ../../x/, /abs/, a/b/c/, none, backslashes, a missing version or
    data.pkl, two archive folders: torch.load refuses each (checked), so does every
    ddpstate reader, as container damage."""
    src = tmp_path / f"{mutant}.pt"
    hostile.layout_mutant(src, mutant)
    with pytest.raises(RuntimeError):
        torch.load(src, weights_only=True)
    assert_corrupt_everywhere(src, tmp_path, capsys)


# --------------------------------------------------------------------------- deep nesting


@pytest.mark.slow
def test_deep_nesting_loads_or_is_a_format_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """{"deep": 100,000 nested lists, "module.w": tensor}: torch loads it; ddpstate loads
    it too or raises CheckpointFormatError naming the file, never RecursionError; each
    command succeeds or prints one error line (nothing "unexpected")."""
    src = tmp_path / "deep.pt"
    hostile.deep_nesting(src)
    _clean(tmp_path)
    assert torch.equal(torch.load(src, weights_only=True)["module.w"], torch.arange(3.0))
    try:
        loaded = ddpstate.load(src, map_location="cpu")
    except CheckpointFormatError as exc:
        assert src.name in str(exc)
    else:
        assert torch.equal(loaded["module.w"], torch.arange(3.0))
    for call in (
        lambda: verify_file(src),
        lambda: inspect_file(src),
        lambda: convert_file(src, tmp_path / "api_out.pt"),
        lambda: diff_files(src, tmp_path / "clean.pt"),
    ):
        try:
            call()
        except CheckpointFormatError as exc:
            assert src.name in str(exc)
    for command in _COMMANDS:
        rc = ddpstate.cli.main(_cli_args(command, src, tmp_path))
        captured = capsys.readouterr()
        if rc == 2:
            assert_cli_refuses(rc, captured.out, captured.err, command, src)
        else:
            assert rc in (0, 1) and not captured.err.strip(), (command, rc, captured)
    if (tmp_path / "out.pt").exists():
        out = torch.load(tmp_path / "out.pt", weights_only=True)
        assert torch.equal(out["w"], torch.arange(3.0))


# --------------------------------------------------------------------------- resources


def probe(src: Path, work: Path, *ops: str) -> dict[str, dict[str, Any]]:
    """Run ``ops`` on ``src`` in a capped child (tests/faults/_one_reader_probe.py)."""
    _clean(work)
    done = subprocess.run(
        [sys.executable, "-m", "tests.faults._one_reader_probe", str(src), str(work), *ops],
        capture_output=True,
        text=True,
        timeout=60 + 15 * len(ops),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {r["op"]: r for r in reports}


_PROBE_OPS = (
    "load",
    "inspect",
    "verify",
    "convert",
    "diff",
    *(f"cli:{'|'.join(_cli_args(c, Path('{src}'), Path('{dir}')))}" for c in _COMMANDS),
)


def assert_refused_cheaply(
    reports: dict[str, dict[str, Any]],
    src: Path,
    *,
    error: type[DDPStateError],
    seconds: float,
    growth_mib: float,
) -> None:
    """Each API op raised ``error`` naming the file (verify: or reported it), each
    command refused it, every op within ``seconds`` and ``growth_mib`` of peak RSS."""
    for op, r in reports.items():
        assert r["seconds"] <= seconds, (op, r)
        assert r["growth_mib"] <= growth_mib, (op, r)
        if op.startswith("cli:"):
            cli = r.get("returned")
            assert cli is not None, (op, r)
            command = op[4:].split("|")[0]
            assert_cli_refuses(cli["rc"], cli["stdout"], cli["stderr"], command, src)
        elif op == "verify" and "returned" in r:
            assert not r["returned"]["ok"] and r["returned"]["problems"], r
        else:
            assert error.__name__ in r.get("raised", []), (op, r)
            assert src.name in r["message"], (op, r)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["data.pkl", "tensor"])
def test_a_zip_bomb_is_refused_fast_and_small(where: str, tmp_path: Path) -> None:
    """~2 MB deflating to 2 GiB (data.pkl, or a tensor record): every reader and command
    refuses it as CheckpointCorruptError within 2 s and 256 MiB of RSS growth."""
    src = tmp_path / "bomb.pt"
    hostile.zip_bomb(src, where)
    assert src.stat().st_size < 4 << 20
    reports = probe(src, tmp_path, *_PROBE_OPS)
    assert_refused_cheaply(
        reports, src, error=CheckpointCorruptError, seconds=2.0, growth_mib=256.0
    )
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("container", ["torch_zip", "legacy"])
def test_builtins_bytes_asking_for_8_gib_is_refused_without_allocating(
    container: str, tmp_path: Path
) -> None:
    """builtins.bytes(8 GiB) in a file of a few hundred bytes (torch's weights_only refuses
    the global): every reader refuses it with a DDPStateError naming the file, growing RSS
    by less than 64 MiB; never a MemoryError."""
    src = tmp_path / "bytes.pt"
    hostile.bytes_bomb(src, container)
    assert src.stat().st_size < 1024
    reports = probe(src, tmp_path, *_PROBE_OPS)
    assert_refused_cheaply(reports, src, error=DDPStateError, seconds=10.0, growth_mib=64.0)


@pytest.mark.slow
def test_a_stride0_tensor_is_refused_before_allocating(tmp_path: Path) -> None:
    """4 floats viewed as 100000 x 100000 (40 GB materialized): ``convert --to
    safetensors`` refuses it with a DDPStateError naming the file and writes nothing;
    ``load`` refuses it or returns torch's view without materializing it; nothing grows
    RSS by more than 64 MiB."""
    src = tmp_path / "stride0.pt"
    hostile.stride0(src)
    st_cli = "cli:convert|{src}|{dir}/cli.safetensors"
    reports = probe(src, tmp_path, "convert_st", "load", st_cli, "inspect", "verify")
    for op, r in reports.items():
        assert r["growth_mib"] <= 64.0, (op, r)
        # what escapes is a DDPStateError (never MemoryError, RuntimeError, a timeout) or nothing
        assert "raised" not in r or "DDPStateError" in r["raised"], (op, r)
    refused = reports["convert_st"]
    assert "DDPStateError" in refused.get("raised", []) and src.name in refused["message"], refused
    cli = reports[st_cli]["returned"]
    assert_cli_refuses(cli["rc"], cli["stdout"], cli["stderr"], "convert", src)
    assert not list(tmp_path.glob("*.safetensors"))


# --------------------------------------------------------------------------- console script


def _console(args: list[str]) -> subprocess.CompletedProcess[str]:
    """The installed ``ddpstate`` script, its address space capped at 4 GiB."""
    exe = shutil.which("ddpstate")
    assert exe is not None, "the ddpstate console script is not installed (pip install -e .)"

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    env = {k: v for k, v in os.environ.items() if k != "DDPSTATE_DEBUG"}
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=120, env=env, preexec_fn=cap
    )


def _hostile_files(folder: Path) -> dict[str, Path]:
    files = {
        "dup_pkl": folder / "dup_pkl.pt",
        "dup_record": folder / "dup_record.pt",
        "bomb": folder / "bomb.pt",
        "bytes": folder / "bytes.pt",
        "no_version": folder / "no_version.pt",
    }
    hostile.duplicate_data_pkl(files["dup_pkl"], folder / "marker", 4, True)
    hostile.duplicate_tensor_record(files["dup_record"], False)
    hostile.zip_bomb(files["bomb"], "tensor")
    hostile.bytes_bomb(files["bytes"], "legacy")
    hostile.layout_mutant(files["no_version"], "no_version")
    _clean(folder)
    return files


@pytest.mark.slow
def test_the_console_script_refuses_each_kind(tmp_path: Path) -> None:
    """One ``ddpstate`` run per kind of crafted file, the four commands in turn."""
    files = _hostile_files(tmp_path)
    for i, src in enumerate(files.values()):
        command = _COMMANDS[i % len(_COMMANDS)]
        done = _console(_cli_args(command, src, tmp_path))
        assert_cli_refuses(done.returncode, done.stdout, done.stderr, command, src)
    assert not (tmp_path / "marker").exists() and not (tmp_path / "out.pt").exists()


@pytest.mark.slow
def test_the_console_script_refuses_every_kind_in_every_command(tmp_path: Path) -> None:
    """Every kind of crafted file through all four ``ddpstate`` commands."""
    files = _hostile_files(tmp_path)
    for src in files.values():
        for command in _COMMANDS:
            done = _console(_cli_args(command, src, tmp_path))
            assert_cli_refuses(done.returncode, done.stdout, done.stderr, command, src)
    assert not (tmp_path / "marker").exists() and not (tmp_path / "out.pt").exists()
