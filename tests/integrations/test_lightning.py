"""DDPStateCheckpointIO and last_verified_checkpoint with the real Lightning (2 CPU ranks, gloo)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import pytest
import torch

from ddpstate.convert import verify_file
from ddpstate.errors import CheckpointCorruptError, InvalidArgumentError, UnsafeCheckpointError
from tests.multiproc import run_ranks

pytestmark = pytest.mark.slow  # importing Lightning alone takes seconds
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lt() -> ModuleType:
    pytest.importorskip("lightning")
    return importlib.import_module("ddpstate.integrations.lightning")


def _same(a: Any, b: Any) -> bool:
    """Equal bitwise: tensors by value and dtype, containers item by item."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_ddp_run_saves_through_the_plugin_and_resumes_bitwise(
    lt: ModuleType, tmp_path: Path
) -> None:
    # 2 ranks under torchrun: Lightning saves on rank 0 alone, so a collective save would
    # wait for rank 1 until DDPSTATE_TIMEOUT; the run finishing shows none is made.
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        str(ROOT / "tests" / "integrations" / "lightning_run.py"),
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDPSTATE_TIMEOUT": "60"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    folder = tmp_path / "checkpoints"
    # The newest checkpoint was truncated: skipped and named, the one before used.
    assert result["resumed_from"] == str(folder / "epoch=1-step=8.ckpt")
    assert len(result["warnings"]) == 1
    assert "epoch=2-step=12.ckpt" in result["warnings"][0]
    # The resumed Trainer starts at the checkpoint's step and ends where the first run did.
    assert result["start_step"] == 8
    first, second = result["first"], result["second"]
    assert first["global_step"] == second["global_step"] == 12
    assert first["checkpoint_io"] == second["checkpoint_io"] == "DDPStateCheckpointIO"
    assert _same(first["model"], second["model"])
    assert _same(first["optimizer"], second["optimizer"])
    # Every checkpoint written is whole and opens with plain torch, weights-only.
    for name in ("epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12-v1.ckpt"):
        assert verify_file(folder / name).ok
        assert torch.load(folder / name, weights_only=True)["hyper_parameters"] == {"lr": 0.01}


def _checkpoint(step: int) -> dict[str, Any]:
    return {
        "state_dict": {"layer.weight": torch.full((4, 4), float(step))},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(float(step))}}}],
        "global_step": step,
        "epoch": 0,
        "hyper_parameters": {"lr": 0.1, "name": "tiny"},
        "pytorch-lightning_version": "2.6.0",
    }


def test_save_load_round_trip_local_and_fsspec(lt: ModuleType, tmp_path: Path) -> None:
    io = lt.DDPStateCheckpointIO()
    path = tmp_path / "sub" / "epoch=0-step=1.ckpt"
    io.save_checkpoint(_checkpoint(1), path)
    assert _same(io.load_checkpoint(path), _checkpoint(1))
    assert io.load_checkpoint(path, map_location=torch.device("cpu"))["global_step"] == 1
    url = "memory://ddpstate-lightning/run/last.ckpt"
    io.save_checkpoint(_checkpoint(2), url, storage_options={})
    assert _same(io.load_checkpoint(url), _checkpoint(2))
    assert lt.last_verified_checkpoint("memory://ddpstate-lightning/run") == url
    io.remove_checkpoint(url)
    io.remove_checkpoint(url)  # already gone: no error
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(_checkpoint(3), path, storage_options="s3")


def test_unsafe_objects_are_refused_at_save_and_damage_at_load(
    lt: ModuleType, tmp_path: Path
) -> None:
    io = lt.DDPStateCheckpointIO()
    path = tmp_path / "a.ckpt"
    io.save_checkpoint(_checkpoint(1), path)
    before = path.read_bytes()
    bad = {**_checkpoint(2), "hyper_parameters": {"loss": torch.nn.MSELoss()}}
    with pytest.raises(UnsafeCheckpointError, match="hyper_parameters"):
        io.save_checkpoint(bad, path)
    assert path.read_bytes() == before  # the previous checkpoint is untouched
    trusting = lt.DDPStateCheckpointIO(weights_only=False)
    trusting.save_checkpoint(bad, path)
    with pytest.raises(UnsafeCheckpointError):
        io.load_checkpoint(path)
    assert isinstance(trusting.load_checkpoint(path)["hyper_parameters"]["loss"], torch.nn.MSELoss)
    path.write_bytes(before[: len(before) // 2])
    with pytest.raises(CheckpointCorruptError, match=r"a\.ckpt"):
        io.load_checkpoint(path)


def _killed_at_fsync(io: Any, path: Path) -> None:
    """Save through the plugin, SIGKILLed when the temp file's bytes are written (its fsync)."""
    os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[assignment]
    io.save_checkpoint(_checkpoint(8), path)


def test_a_save_killed_midway_is_cleaned_by_the_next_save_never_by_a_reader(
    lt: ModuleType, tmp_path: Path
) -> None:
    from tests.faults import _harness as h

    io = lt.DDPStateCheckpointIO()
    io.save_checkpoint(_checkpoint(4), tmp_path / "epoch=0-step=4.ckpt")
    pid = h._fork(lambda: _killed_at_fsync(io, tmp_path / "epoch=1-step=8.ckpt"))
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    left = sorted(os.listdir(tmp_path))
    assert left[0].startswith(".epoch=1-step=8.ckpt.ddpstate-tmp-"), left
    assert left[1:] == ["epoch=0-step=4.ckpt"]
    assert lt.last_verified_checkpoint(tmp_path) == str(tmp_path / "epoch=0-step=4.ckpt")
    assert io.load_checkpoint(tmp_path / "epoch=0-step=4.ckpt")["global_step"] == 4
    assert sorted(os.listdir(tmp_path)) == left  # readers delete nothing
    io.save_checkpoint(_checkpoint(12), tmp_path / "epoch=2-step=12.ckpt")  # another name
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=4.ckpt", "epoch=2-step=12.ckpt"]


def test_last_verified_checkpoint_takes_the_newest_whole_file(
    lt: ModuleType, tmp_path: Path
) -> None:
    assert lt.last_verified_checkpoint(tmp_path / "absent") is None
    assert lt.last_verified_checkpoint(tmp_path) is None
    io = lt.DDPStateCheckpointIO()
    names = ["epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt", "last.ckpt"]
    for mtime, name in enumerate(names, start=1000):
        io.save_checkpoint(_checkpoint(mtime), tmp_path / name)
        os.utime(tmp_path / name, (mtime, mtime))
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert lt.last_verified_checkpoint(tmp_path) == str(tmp_path / "last.ckpt")
    os.truncate(tmp_path / "last.ckpt", 200)
    with pytest.warns(UserWarning, match=r"last\.ckpt"):
        assert lt.last_verified_checkpoint(tmp_path) == str(tmp_path / "epoch=1-step=20.ckpt")
    os.utime(tmp_path / "epoch=0-step=10.ckpt", (1001, 1001))  # same time: the step decides
    with pytest.warns(UserWarning, match=r"last\.ckpt"):
        assert lt.last_verified_checkpoint(tmp_path) == str(tmp_path / "epoch=1-step=20.ckpt")


def test_last_verified_checkpoint_never_unpickles_the_candidates(
    lt: ModuleType, tmp_path: Path
) -> None:
    """A .ckpt holds objects beyond weights-only; choosing one checks its records'
    CRC-32s and never unpickles it (torch's full unpickler would run the file's code)."""
    from tests.payloads import RunsCommand

    marker = tmp_path / "marker"
    folder = tmp_path / "ckpts"
    folder.mkdir()
    torch.save({"state_dict": {"w": torch.ones(2)}, "hook": RunsCommand(marker)}, folder / "a.ckpt")
    assert lt.last_verified_checkpoint(folder) == str(folder / "a.ckpt")
    assert not marker.exists()


@dataclasses.dataclass
class RunInfo:
    """A data-only type of the user's, kept in the model's state (``get_extra_state``)."""

    name: str = "tiny"


def _fit_with_run_info(
    root: Path, *, checkpoint: bool = True, **trainer_kw: Any
) -> tuple[int, Any]:
    """Fit a model whose state dict holds a RunInfo (8 steps a epoch, 2 epochs): (steps, model).

    ``checkpoint``: with a ModelCheckpoint into ``root/ckpt``."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    class WithInfo(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.info = RunInfo()

        def get_extra_state(self) -> RunInfo:
            return self.info

        def set_extra_state(self, state: RunInfo) -> None:
            self.info = state

        def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Steps(Callback):
        count = 0

        def on_train_batch_end(self, *args: Any) -> None:
            self.count += 1

    steps, callbacks = Steps(), trainer_kw.pop("callbacks", [])
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, callbacks=[*callbacks, steps],
        **trainer_kw,
    )  # fmt: skip
    model = WithInfo()
    data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4)
    try:
        trainer.fit(model, data)
    except UnsafeCheckpointError as exc:
        return steps.count, exc
    return steps.count, model


def test_an_unsafe_type_stops_fit_before_the_first_step_naming_the_plugin_parameter(
    lt: ModuleType, tmp_path: Path
) -> None:
    """Issue 43: an unsafe type stopped fit only at the first checkpoint, an epoch later,
    telling to pass safe_globals to CheckpointManager or ddpstate.save/load."""
    steps, error = _fit_with_run_info(tmp_path / "a", callbacks=[lt.DDPStateCheckpointIO()])
    assert steps == 0, steps
    assert isinstance(error, UnsafeCheckpointError), error
    assert "['state_dict']['_extra_state'] is a RunInfo" in str(error)
    assert "DDPStateCheckpointIO(safe_globals=[RunInfo])" in str(error)
    assert "CheckpointManager" not in str(error) and "ddpstate.save" not in str(error)
    assert not (tmp_path / "a" / "ckpt").exists()
    # As a plugin alone it has no hook before training: the first save refuses, in its terms.
    steps, error = _fit_with_run_info(tmp_path / "b", plugins=[lt.DDPStateCheckpointIO()])
    assert steps == 8 and "DDPStateCheckpointIO(safe_globals=[RunInfo])" in str(error), error
    # Allowed by name: the fit runs, every checkpoint is saved and loads back weights-only.
    io = lt.DDPStateCheckpointIO(safe_globals=[RunInfo])
    steps, model = _fit_with_run_info(tmp_path / "c", callbacks=[io])
    assert steps == 16 and model.info == RunInfo()
    loaded = io.load_checkpoint(tmp_path / "c" / "ckpt" / "epoch=1-step=16.ckpt")
    assert loaded["state_dict"]["_extra_state"] == RunInfo()
    with pytest.raises(
        UnsafeCheckpointError, match=r"DDPStateCheckpointIO\(safe_globals=\[\.\.\.\]\)"
    ):
        lt.DDPStateCheckpointIO().load_checkpoint(tmp_path / "c" / "ckpt" / "epoch=1-step=16.ckpt")
    # Another checkpoint plugin already in place: refused, never silently left in charge.
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    with pytest.raises(InvalidArgumentError, match="AsyncCheckpointIO"):
        _fit_with_run_info(
            tmp_path / "d", callbacks=[lt.DDPStateCheckpointIO()], plugins=[AsyncCheckpointIO()]
        )


def test_a_fit_that_saves_no_checkpoint_runs_with_an_unsafe_type_and_is_warned(
    lt: ModuleType, tmp_path: Path
) -> None:
    """The early check refused fast_dev_run=True and enable_checkpointing=False fits, which
    never save: they run, warned with the type's path and the parameter to pass."""
    for name, kw in {
        "fast_dev_run": {"fast_dev_run": True},
        "no checkpoint callback": {"enable_checkpointing": False, "checkpoint": False},
    }.items():
        root = tmp_path / name.replace(" ", "_")
        with pytest.warns(UserWarning, match=rf"is a RunInfo.*\({name}\)") as caught:
            steps, model = _fit_with_run_info(root, callbacks=[lt.DDPStateCheckpointIO()], **kw)
        assert steps == (1 if name == "fast_dev_run" else 16), (name, model)
        assert model.info == RunInfo() and not (root / "ckpt").exists()
        ours = [str(w.message) for w in caught if "RunInfo" in str(w.message)]
        assert "DDPStateCheckpointIO(safe_globals=[RunInfo])" in ours[0], ours


def _fit_shuffled(root: Path, io: str, ckpt_path: Optional[str] = None) -> str:
    """One process, a shuffled DataLoader, dropout: 8 steps an epoch, 2 epochs; checkpoints
    every 4 steps in root/mid and at each epoch's end in root/end. The final weights' digest."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)
            )

        def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
            return (self.net(batch[0]) - batch[1]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    L.seed_everything(0, verbose=False)  # the same script: the first run and the resumed one
    gen = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 1, generator=gen))
    callbacks: list[Any] = [
        ModelCheckpoint(dirpath=root / "mid", every_n_train_steps=4, save_top_k=-1),
        ModelCheckpoint(dirpath=root / "end", every_n_epochs=1, save_on_train_epoch_end=True,
                        save_top_k=-1),
    ]  # fmt: skip
    if io == "ddpstate":
        from ddpstate.integrations.lightning import DDPStateCheckpointIO

        callbacks.append(DDPStateCheckpointIO())
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's warning about a mid-epoch resume
        trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    digest = hashlib.sha256()
    for _, value in sorted(model.state_dict().items()):
        digest.update(value.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


_SHUFFLED_CHECKPOINTS = {"mid": "epoch=0-step=4.ckpt", "end": "epoch=0-step=8.ckpt"}


def _shuffled_through(rank: int, world: int, root: str) -> dict[str, Any]:
    ends = {io: _fit_shuffled(Path(root) / io, io) for io in ("plain", "ddpstate")}
    saved = torch.load(Path(root) / "plain" / "end" / "epoch=0-step=8.ckpt", weights_only=True)
    return {"ends": ends, "keys": sorted(saved)}


def _shuffled_resumed(rank: int, world: int, root: str) -> dict[tuple[str, str], str]:
    return {
        (io, kind): _fit_shuffled(
            Path(root) / f"{io}-resumed-{kind}", io, str(Path(root) / io / kind / name)
        )
        for io in ("plain", "ddpstate")
        for kind, name in _SHUFFLED_CHECKPOINTS.items()
    }


def test_a_resume_with_a_shuffled_loader_and_dropout_is_as_exact_as_lightnings_own(
    lt: ModuleType, tmp_path: Path
) -> None:
    """Issue 43: what the docs may claim. Lightning saves no RNG state, so on one process with
    a shuffled DataLoader and dropout neither its own CheckpointIO nor ddpstate's resumes
    bitwise, from a mid-epoch or an end-of-epoch checkpoint; both end with the same weights."""
    [through] = run_ranks(_shuffled_through, 1, args=(str(tmp_path),), init_pg=False, timeout=300)
    [resumed] = run_ranks(_shuffled_resumed, 1, args=(str(tmp_path),), init_pg=False, timeout=300)
    assert through["ends"]["plain"] == through["ends"]["ddpstate"]
    assert not [k for k in through["keys"] if "rng" in k.lower() or "random" in k.lower()]
    for kind in _SHUFFLED_CHECKPOINTS:
        assert resumed["plain", kind] == resumed["ddpstate", kind], kind
        assert resumed["ddpstate", kind] != through["ends"]["ddpstate"], kind
    guide = (ROOT / "docs" / "integrations.md").read_text()
    lightning_part = guide[guide.index("## Lightning") : guide.index("## Hugging Face Trainer")]
    assert "Lightning saves no RNG state" in lightning_part


def test_a_missing_lightning_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "ddpstate.integrations.lightning", raising=False)
    monkeypatch.setitem(sys.modules, "lightning.fabric.plugins.io.checkpoint_io", None)
    # from a checkout, then from PyPI
    both = r'pip install -e "\.\[lightning\]".*pip install "ddpstate\[lightning\]"'
    with pytest.raises(ImportError, match=both):
        importlib.import_module("ddpstate.integrations.lightning")
