"""The reference trainer run for real under torchrun: train, kill -9 + resume, SIGTERM, 2 nodes."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "train_ddp.py"
pytest.importorskip("sklearn", reason="the trainer's data set ships with scikit-learn")

# Small, fast runs: 2 ranks x 16 samples per step, 1437 training samples -> 45 steps/epoch.
FAST = ["--batch-size=16", "--no-progress", "--deterministic"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(*args: str, nproc: int = 2, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        "--max-restarts=0",
        *extra,
        str(TRAINER),
        *args,
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc


def _accuracy(stdout: str) -> float:
    match = re.search(r"final validation accuracy: ([0-9.]+)%", stdout)
    assert match, stdout
    return float(match.group(1))


def _steps(out: Path) -> list[int]:
    return sorted(
        int(p.name.split("_")[1]) for p in out.glob("step_*") if (p / "manifest.json").exists()
    )


# 2 epochs, a checkpoint every 10 steps: the run the kill/resume tests must end equal to.
STRAIGHT = ["--epochs=2", "--save-every=10", *FAST]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One uninterrupted run of STRAIGHT, shared by this module's tests: (stdout, out dir)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    return _run(_torchrun(*STRAIGHT, f"--out-dir={out}")).stdout, out


@pytest.mark.slow
def test_trains_checkpoints_and_exports_a_plain_model(straight: tuple[str, Path]) -> None:
    stdout, out = straight
    acc = _accuracy(stdout)
    assert acc > 80.0, stdout  # 2 short epochs already learn the digits
    assert stdout.count("epoch ") >= 2  # only the main process prints
    assert stdout.count("final validation accuracy") == 1
    assert _steps(out)[-1] == 90  # 2 epochs x 45 steps, final checkpoint committed

    # A fresh process with torch + safetensors alone reproduces the printed accuracy.
    check = (
        "import sys, torch; from safetensors.torch import load_file\n"
        f"sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "from train_ddp import DigitsCNN, load_digits_split\n"
        "model = DigitsCNN(); model.load_state_dict(load_file(sys.argv[1])); model.eval()\n"
        "_, val = load_digits_split(0); x, y = val.tensors\n"
        "with torch.no_grad(): acc = (model(x).argmax(1) == y).float().mean().item()\n"
        "print(f'{100 * acc:.2f}')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", check, str(out / "model.safetensors")],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert res.returncode == 0, res.stderr
    assert float(res.stdout.strip()) == pytest.approx(acc, abs=1e-9)


def _start(cmd: list[str]) -> subprocess.Popen[str]:
    """Start a job in its own session, so _killpg reaches torchrun and every worker."""
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
        start_new_session=True,
    )


def _killpg(proc: subprocess.Popen[str], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_equal_to_uninterrupted(
    tmp_path: Path, straight: tuple[str, Path]
) -> None:
    args = STRAIGHT
    reference = load_file(str(straight[1] / "model.safetensors"))

    out = tmp_path / "killed"
    cmd = _torchrun(*args, f"--out-dir={out}")
    proc = _start(cmd)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not [s for s in _steps(out) if s >= 30]:
            time.sleep(0.05)
        # Kill the whole job mid-run, somewhere after the step-30 checkpoint.
        _killpg(proc, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        _killpg(proc, signal.SIGKILL)
    killed_at = _steps(out)
    assert killed_at and 30 <= killed_at[-1] < 90, killed_at

    resumed = _run(_torchrun(*args, f"--out-dir={out}"))
    assert "resumed from step" in resumed.stdout
    final = load_file(str(out / "model.safetensors"))
    assert final.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(final[key], tensor), key


@pytest.mark.slow
def test_sigterm_saves_a_final_checkpoint_and_exits_zero(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = _torchrun("--epochs=20", "--save-every=5", f"--out-dir={out}", *FAST)
    proc = _start(cmd)
    try:
        # Wait until both workers are training (the first epoch line is printed by rank 0).
        workers: list[psutil.Process] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            workers = [
                p
                for p in psutil.Process(proc.pid).children(recursive=True)
                if "train_ddp.py" in " ".join(p.cmdline())
            ]
            if len(workers) == 2:
                break
            time.sleep(0.2)
        assert len(workers) == 2
        while time.monotonic() < deadline and not _steps(out):
            time.sleep(0.05)  # the first checkpoint: training is under way, handlers installed
        workers[1].send_signal(signal.SIGTERM)  # a scheduler preempting one rank
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        _killpg(proc, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-4000:]
    match = re.search(r"preempted: saved step (\d+)", stdout)
    assert match, stdout + stderr[-2000:]
    assert _steps(out)[-1] == int(match.group(1))

    resumed = _run(
        _torchrun(
            "--epochs=20", f"--max-steps={int(match.group(1)) + 3}", f"--out-dir={out}", *FAST
        )
    )
    assert f"resumed from step {match.group(1)}" in resumed.stdout


@pytest.mark.slow
def test_two_nodes_one_process_each_with_c10d_rendezvous(tmp_path: Path) -> None:
    port = _free_port()
    common = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=digits",
        "--max-restarts=0",
    ]
    args = [
        str(TRAINER),
        "--epochs=2",
        "--max-steps=30",
        f"--out-dir={tmp_path / 'run'}",
        "--no-progress",
    ]
    nodes = [
        _start([sys.executable, "-m", "torch.distributed.run", *common, f"--node-rank={n}", *args])
        for n in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=180) for p in nodes]
    finally:
        for p in nodes:
            _killpg(p, signal.SIGKILL)
    for p, (_, stderr) in zip(nodes, outs, strict=True):
        assert p.returncode == 0, stderr[-4000:]
    printed = "".join(o for o, _ in outs)
    assert printed.count("final validation accuracy") == 1  # one main process across nodes
    assert _steps(tmp_path / "run")[-1] == 30


# --------------------------------------------------------------------------- node-local tier

LOCAL = ["--epochs=2", "--save-every=40", "--local-every=5", *FAST]


def _local_steps(folder: Path) -> list[int]:
    return _steps(folder) if folder.exists() else []


@pytest.mark.slow
def test_kill9_of_one_worker_restarts_from_the_local_tier_bitwise(tmp_path: Path) -> None:
    # Its own reference: the trainer syncs BatchNorm running stats at each save, so a run
    # with another save schedule ends with other running stats.
    _run(_torchrun(*LOCAL, f"--out-dir={tmp_path / 'straight'}", f"--local-dir={tmp_path / 's'}"))
    reference = load_file(str(tmp_path / "straight" / "model.safetensors"))

    out, shm = tmp_path / "killed", tmp_path / "shm"
    # torchrun restarts the workers once; its agent shares its store with them, so this
    # also checks init_distributed's per-attempt store (pytorch/pytorch#135712).
    cmd = _torchrun(*LOCAL, f"--out-dir={out}", f"--local-dir={shm}", extra=("--max-restarts=1",))
    proc = _start(cmd)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not [s for s in _local_steps(shm) if s >= 15]:
            time.sleep(0.05)
        seen = max(_local_steps(shm))
        workers = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "train_ddp.py" in " ".join(p.cmdline())
        ]
        assert len(workers) == 2
        workers[-1].send_signal(signal.SIGKILL)  # one worker crashes; the agent restarts both
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        _killpg(proc, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-4000:]
    restored = re.findall(r"rank (\d): restored local step (\d+)", stdout)
    assert sorted(r for r, _ in restored) == ["0", "1"], stdout + stderr[-3000:]
    step = int(restored[0][1])
    assert 15 <= seen <= step < 40  # the local step: no durable checkpoint before step 40
    final = load_file(str(out / "model.safetensors"))
    assert final.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(final[key], tensor), key


@pytest.mark.slow
def test_a_finished_run_deletes_its_node_local_tier(tmp_path: Path) -> None:
    out, shm = tmp_path / "run", tmp_path / "shm"
    args = ("--epochs=1", "--max-steps=10", "--local-every=5", "--save-every=10", *FAST)
    proc = _run(_torchrun(*args, f"--out-dir={out}", f"--local-dir={shm}"))
    assert "final validation accuracy" in proc.stdout
    assert _steps(out) == [10]
    assert not shm.exists(), f"the local tier was left behind: {sorted(shm.rglob('*'))}"


@pytest.mark.slow
def test_two_nodes_a_wiped_node_gets_the_local_step_from_the_other(tmp_path: Path) -> None:
    def both_nodes(*args: str) -> list[str]:
        port = _free_port()
        nodes = [
            _start(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes=2",
                    "--nproc-per-node=1",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}",
                    "--rdzv-id=local-tier",
                    "--max-restarts=0",
                    f"--node-rank={n}",
                    str(TRAINER),
                    *args,
                    f"--out-dir={tmp_path / 'run'}",
                    f"--local-dir={tmp_path / f'shm{n}'}",  # each "node" has its own /dev/shm
                ]
            )
            for n in (0, 1)
        ]
        try:
            outs = [p.communicate(timeout=240) for p in nodes]
        finally:
            for p in nodes:
                _killpg(p, signal.SIGKILL)
        for p, (_, stderr) in zip(nodes, outs, strict=True):
            assert p.returncode == 0, stderr[-4000:]
        return [o for o, _ in outs]

    args = ("--epochs=2", "--max-steps=14", "--local-every=5", "--save-every=4", "--keep-local")
    args = (*args, *FAST)
    both_nodes(*args)
    assert _steps(tmp_path / "run") == [12, 14] and _steps(tmp_path / "shm1") == [5, 10]
    shutil.rmtree(tmp_path / "shm1")  # node 1 was replaced
    # Make the local tier the newest: drop the durable steps after 10.
    for step in (12, 14):
        shutil.rmtree(tmp_path / "run" / f"step_{step:010d}")
    printed = both_nodes(*args)
    assert "rank 0: restored local step 10" in printed[0], printed[0]
    assert "rank 1: restored peer step 10" in printed[1], printed[1]
    assert "sent by rank 0's node" in printed[1]
    assert 10 in _steps(tmp_path / "shm1")  # the replaced node holds the step again
