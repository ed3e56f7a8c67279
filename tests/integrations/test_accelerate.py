"""ddpstate.integrations.accelerate with the real Accelerate, on 1 and 2 gloo CPU ranks."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiproc import run_ranks

pytest.importorskip("accelerate")

pytestmark = pytest.mark.slow


def _setup(root: str, total_limit: Any = None, custom: Any = None) -> tuple[Any, ...]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import ProjectConfiguration

    AcceleratorState._reset_state(True)  # a fresh Accelerator, as a new run has
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    config = ProjectConfiguration(
        project_dir=root, automatic_checkpoint_naming=True, total_limit=total_limit
    )
    acc = Accelerator(cpu=True, project_config=config)
    model, opt, sched = acc.prepare(model, opt, sched)
    if custom is not None:
        acc.register_for_checkpointing(custom)
    return acc, model, opt, sched


def _train(acc: Any, model: Any, opt: Any, sched: Any, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(5, 4)  # from the restored RNG: the same batches after a resume
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        acc.step += 1


def _state(model: Any, opt: Any, acc: Any) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": str(opt.state_dict()),
        "step": acc.step,
        "iteration": acc.project_configuration.iteration,
    }


def _resume(rank: int, world: int, root: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    from ddpstate.integrations.accelerate import load_state, save_state

    acc, model, opt, sched = _setup(root)
    assert acc.num_processes == world
    _train(acc, model, opt, sched, 3)
    saved = save_state(acc)
    _train(acc, model, opt, sched, 2)
    expected = _state(model, opt, acc)
    acc, model, opt, sched = _setup(root)
    loaded = load_state(acc)
    assert loaded == saved
    _train(acc, model, opt, sched, 2)
    return expected, _state(model, opt, acc), saved


@pytest.mark.parametrize("world", [1, 2])
def test_save_and_resume_bitwise(tmp_path: Path, world: int) -> None:
    results = run_ranks(_resume, world, args=(str(tmp_path),), timeout=180)
    for expected, got, saved in results:
        assert got["opt"] == expected["opt"]
        assert got["step"] == expected["step"] == 5
        assert got["iteration"] == 1  # the next save is checkpoint_1, not a collision
        for k, v in expected["model"].items():
            assert torch.equal(got["model"][k], v), k
        assert os.path.basename(saved) == "checkpoint_0"
    folder = tmp_path / "checkpoints" / "checkpoint_0"
    names = sorted(os.listdir(folder))
    assert "manifest.json" in names and "model.safetensors" in names and "optimizer.bin" in names
    assert [n for n in names if n.startswith("random_states_")] == [
        f"random_states_{i}.pkl" for i in range(world)
    ]
    assert not [n for n in os.listdir(folder.parent) if n.startswith(".")]  # no staging left
    out = subprocess.run(
        [shutil.which("ddpstate") or "ddpstate", "verify", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _three(rank: int, world: int, root: str) -> None:
    from ddpstate.integrations.accelerate import save_state

    acc, model, opt, sched = _setup(root)
    for _ in range(3):
        _train(acc, model, opt, sched, 1)
        save_state(acc)


def _load_newest(rank: int, world: int, root: str) -> tuple[str, list[str], int]:
    from ddpstate.integrations.accelerate import load_state

    acc, *_ = _setup(root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = load_state(acc)
    return chosen, [str(w.message) for w in caught], acc.step


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("three")
    run_ranks(_three, 1, args=(str(root),))
    return root


@pytest.mark.parametrize("damage", ["truncated", "removed", "no manifest"])
def test_incomplete_checkpoint_is_skipped(three: Path, tmp_path: Path, damage: str) -> None:
    root = tmp_path / "run"
    shutil.copytree(three, root)
    newest = root / "checkpoints" / "checkpoint_2"
    if damage == "truncated":
        with open(newest / "optimizer.bin", "r+b") as f:
            f.truncate(100)
    elif damage == "removed":
        os.remove(newest / "model.safetensors")
    else:
        os.remove(newest / "manifest.json")
    [(chosen, messages, step)] = run_ranks(_load_newest, 1, args=(str(root),))
    assert chosen.endswith("checkpoint_1")
    assert step == 2
    assert any("checkpoint_2" in m for m in messages), messages


class _Failing:
    """A custom object whose state cannot be pickled on its second save."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.saves = 0
        self.seen: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        self.seen.append(_complete(self.root))  # counted midway through the save
        self.saves += 1
        return {"n": self.saves} if self.saves < 3 else {"f": lambda: 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saves = state["n"]


def _complete(root: str) -> int:
    from ddpstate._manifest import verify_checkpoint

    parent = os.path.join(root, "checkpoints")
    names = [n for n in os.listdir(parent) if n.startswith("checkpoint_")]
    return sum(verify_checkpoint(os.path.join(parent, n)).ok for n in names)


def _fail_midway(rank: int, world: int, root: str) -> tuple[list[int], list[str], str, int]:
    from ddpstate.integrations.accelerate import save_state

    custom = _Failing(root)
    acc, *_ = _setup(root, total_limit=2, custom=custom)
    save_state(acc)
    save_state(acc)
    try:
        save_state(acc)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    else:
        raise AssertionError("the third save should fail")
    return (
        custom.seen,
        sorted(os.listdir(os.path.join(root, "checkpoints"))),
        error,
        (acc.project_configuration.iteration),
    )


def test_rotation_after_commit_only(tmp_path: Path) -> None:
    [(seen, listed, error, iteration)] = run_ranks(_fail_midway, 1, args=(str(tmp_path),))
    assert seen == [0, 1, 2]  # two complete checkpoints while the third was being written
    assert listed == ["checkpoint_0", "checkpoint_1"]  # nothing removed, nothing half-written
    assert "lambda" in error or "pickle" in error.lower(), error
    assert iteration == 2  # the failed save's number is free again
    assert _complete(str(tmp_path)) == 2


def test_example_under_torchrun_on_two_ranks_resumes(tmp_path: Path) -> None:
    example = Path(__file__).parents[2] / "examples" / "accelerate_ddpstate.py"
    project = tmp_path / "run"

    def launch(steps: int) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", str(example),
             "--project", str(project), "--steps", str(steps)],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    launch(40)
    out = launch(60)
    assert f"resumed from {project / 'checkpoints' / 'checkpoint_1'} at step 40" in out, out
    # total_limit=2 kept the two newest; each holds both ranks' RNG states
    assert sorted(os.listdir(project / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    names = os.listdir(project / "checkpoints" / "checkpoint_2")
    assert {"random_states_0.pkl", "random_states_1.pkl", "manifest.json"} <= set(names)


def _rank1_fails(rank: int, world: int, root: str) -> str:
    from ddpstate.integrations.accelerate import save_state

    acc, *_ = _setup(root)
    save_state(acc)

    def hook(models: Any, weights: Any, output_dir: str) -> None:
        if rank == 1:
            raise OSError(28, "No space left on device")

    acc.register_save_state_pre_hook(hook)
    try:
        save_state(acc)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("the save should fail on every rank")


def test_one_rank_failing_fails_every_rank_and_commits_nothing(tmp_path: Path) -> None:
    for error in run_ranks(_rank1_fails, 2, args=(str(tmp_path),), timeout=180):
        assert "rank 1" in error and "No space left" in error, error
    # no checkpoint_1, no staging folder left
    assert os.listdir(tmp_path / "checkpoints") == ["checkpoint_0"]


class _KilledOnSecondSave:
    """A custom object whose second ``state_dict`` (mid ``save_state``) SIGKILLs the process."""

    def __init__(self, kill: bool = True) -> None:
        self.saves = 0
        self.kill = kill

    def state_dict(self) -> dict[str, Any]:
        self.saves += 1
        if self.saves == 2 and self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"n": self.saves}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saves = state["n"]


def _killed_mid_save(rank: int, world: int, root: str) -> None:
    from ddpstate.integrations.accelerate import save_state

    acc, model, opt, sched = _setup(root, custom=_KilledOnSecondSave())
    acc.project_configuration.automatic_checkpoint_naming = False
    save_state(acc, os.path.join(root, "ckpt", "epoch_2"))
    _train(acc, model, opt, sched, 2)
    save_state(acc, os.path.join(root, "ckpt", "epoch_4"))  # killed while Accelerate writes


def _read_then_save(rank: int, world: int, root: str) -> tuple[list[str], list[str], list[str]]:
    from ddpstate._manifest import verify_checkpoint
    from ddpstate.integrations.accelerate import load_state, save_state

    parent = os.path.join(root, "ckpt")
    acc, model, opt, sched = _setup(root, custom=_KilledOnSecondSave(kill=False))
    acc.project_configuration.automatic_checkpoint_naming = False
    load_state(acc, os.path.join(parent, "epoch_2"))
    assert verify_checkpoint(os.path.join(parent, "epoch_2")).ok
    after_reads = sorted(os.listdir(parent))
    _train(acc, model, opt, sched, 1)
    save_state(acc, os.path.join(parent, "epoch_3"))  # another target than the killed save's
    after_save = sorted(os.listdir(parent))
    return after_reads, after_save, sorted(os.listdir(os.path.join(parent, "epoch_3")))


def test_a_killed_save_state_is_cleaned_by_the_next_save_never_by_a_reader(
    tmp_path: Path,
) -> None:
    """Issue 43: a SIGKILL mid ``save_state`` left ``.epoch_4.ddpstate-tmp-*`` (Accelerate's files
    half written) forever; loads and saves of other targets never removed it."""
    assert run_ranks(_killed_mid_save, 1, args=(str(tmp_path),), expect_failure=True) == [None]
    left = sorted(os.listdir(tmp_path / "ckpt"))
    assert left[0].startswith(".epoch_4.ddpstate-tmp-") and left[1:] == ["epoch_2"], left
    assert "model.safetensors" in os.listdir(tmp_path / "ckpt" / left[0])  # killed midway
    [(after_reads, after_save, saved)] = run_ranks(_read_then_save, 1, args=(str(tmp_path),))
    assert after_reads == left  # load_state and verify delete nothing
    assert after_save == ["epoch_2", "epoch_3"]
    assert "manifest.json" in saved and "custom_checkpoint_0.pkl" in saved


# What a resume reproduces with a shuffled DataLoader and dropout: 32 samples in batches of 4
# (8 steps an epoch), 2 epochs; a checkpoint at the end of epoch 0 (step 8) or in its middle
# (step 4, resumed with skip_first_batches). Each case: (use_seedable_sampler, step, dropout).
_EPOCH_STEPS, _EPOCHS = 8, 2
_CASES = [(False, 8, 0.5), (True, 8, 0.5), (False, 4, 0.5), (True, 4, 0.5), (False, 4, 0.0),
          (True, 4, 0.0)]  # fmt: skip


def _shuffled_run(seedable: bool, dropout: float) -> tuple[Any, ...]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration, set_seed

    AcceleratorState._reset_state(True)
    set_seed(0)  # the same script: the first run and the resumed one start alike
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Dropout(dropout), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    config = DataLoaderConfiguration(use_seedable_sampler=seedable)
    acc = Accelerator(cpu=True, dataloader_config=config)
    return (acc, *acc.prepare(net, opt, loader))


def _steps(acc: Any, net: Any, opt: Any, loader: Any, start: int, stop: int) -> str:
    """Train from step ``start`` to ``stop`` (a mid-epoch start skips the epoch's first batches)."""
    step = start
    while step < stop:
        epoch, done = divmod(step, _EPOCH_STEPS)
        loader.set_epoch(epoch)  # the seedable sampler's order is seed + epoch
        for x, y in acc.skip_first_batches(loader, done) if done else loader:
            acc.backward((net(x) - y).pow(2).mean())
            opt.step()
            opt.zero_grad()
            step += 1
            if step == stop:
                break
    digest = hashlib.sha256()
    for _, value in sorted(net.state_dict().items()):
        digest.update(value.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _run_through_and_save(rank: int, world: int, root: str) -> dict[tuple[bool, float], str]:
    from ddpstate.integrations.accelerate import save_state

    ends = {}
    for seedable, dropout in {(s, d) for s, _, d in _CASES}:
        acc, net, opt, loader = _shuffled_run(seedable, dropout)
        ends[seedable, dropout] = _steps(acc, net, opt, loader, 0, _EPOCH_STEPS * _EPOCHS)
    for seedable, at, dropout in _CASES:
        for how in ("accelerate", "ddpstate"):
            acc, net, opt, loader = _shuffled_run(seedable, dropout)
            _steps(acc, net, opt, loader, 0, at)
            folder = os.path.join(root, f"{how}-{seedable}-{at}-{dropout}")
            acc.save_state(folder) if how == "accelerate" else save_state(acc, folder)
    return ends


def _resume_each(rank: int, world: int, root: str) -> dict[tuple[Any, ...], str]:
    from ddpstate.integrations.accelerate import load_state

    ends = {}
    for seedable, at, dropout in _CASES:
        for how in ("accelerate", "ddpstate"):
            acc, net, opt, loader = _shuffled_run(seedable, dropout)
            folder = os.path.join(root, f"{how}-{seedable}-{at}-{dropout}")
            acc.load_state(folder) if how == "accelerate" else load_state(acc, folder)
            ends[how, seedable, at, dropout] = _steps(
                acc, net, opt, loader, at, _EPOCH_STEPS * _EPOCHS
            )
    return ends


def test_a_resume_with_a_shuffled_loader_is_exactly_as_exact_as_accelerates_own(
    tmp_path: Path,
) -> None:
    """Issue 43: docs/integrations.md said the integration "resumes bitwise"; this is what a
    shuffled DataLoader with dropout shows, the run through against a new process resumed
    from the checkpoint, with Accelerate's own save_state/load_state and with ddpstate's."""
    [through] = run_ranks(_run_through_and_save, 1, args=(str(tmp_path),), timeout=240)
    [resumed] = run_ranks(_resume_each, 1, args=(str(tmp_path),), timeout=240)
    exact = {}
    for seedable, at, dropout in _CASES:
        ours, theirs = (
            resumed["ddpstate", seedable, at, dropout],
            resumed["accelerate", seedable, at, dropout],
        )
        assert ours == theirs, (seedable, at, dropout)  # ddpstate changes nothing in the resume
        exact[seedable, at, dropout] = ours == through[seedable, dropout]
    assert exact == {
        (False, 8, 0.5): True,  # end of epoch: the RNG states restored, the next order alike
        (True, 8, 0.5): True,
        (False, 4, 0.5): False,  # mid-epoch: the resumed epoch's order is drawn again
        (True, 4, 0.5): False,  # same order, but the new iterator's seed draw shifts dropout's
        (False, 4, 0.0): False,
        (True, 4, 0.0): True,  # seedable sampler + skip_first_batches, nothing else random
    }
    guide = (Path(__file__).parents[2] / "docs" / "integrations.md").read_text()
    accelerate_part = guide[guide.index("## Accelerate") : guide.index("## What it costs")]
    assert "| mid-epoch, `skip_first_batches` | no | `True` | bitwise |" in accelerate_part
    assert "the integration resumes bitwise" not in accelerate_part  # said with no DataLoader
