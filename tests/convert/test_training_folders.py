"""inspect/verify/convert on the folders users have, by real Accelerate, transformers, ddpstate.

A Hugging Face Trainer ``checkpoint-N`` (single file and sharded), an Accelerate
``save_state`` folder (with and without ddpstate's manifest) and a CheckpointManager
step folder, each taken as one unit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ddpstate import formats
from ddpstate.convert import StateEdit, convert_file, inspect_file, verify_file
from ddpstate.errors import AmbiguousStateDictError, CheckpointFormatError, InvalidArgumentError
from ddpstate.manager import CheckpointManager
from tests.multiproc import run_ranks

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


def _hf_trainer(rank: int, world: int, out: str, shard: bool) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = GPT2LMHeadModel(config)
    data = [{"input_ids": torch.randint(0, 50, (8,)), "labels": torch.randint(0, 50, (8,))}] * 4
    args = TrainingArguments(
        output_dir=out, max_steps=1, save_steps=1, per_device_train_batch_size=4,
        use_cpu=True, report_to=[], disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data)
    if shard:  # the Trainer's own save, with small shards: model.safetensors.index.json
        trainer.save_model = lambda output_dir=None, _internal_call=False: model.save_pretrained(  # type: ignore[method-assign]
            output_dir, max_shard_size="10KB"
        )
    trainer.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    del state["lm_head.weight"]  # tied to transformer.wte.weight: saved once
    return state


def _accelerate(rank: int, world: int, out: str, through_ddpstate: bool) -> dict[str, Any]:
    from accelerate import Accelerator

    from ddpstate.integrations.accelerate import save_state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(model, opt)
    if through_ddpstate:
        save_state(acc, out)
    else:
        acc.save_state(out)
    return {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}


def _framework_folders(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    """The four framework folders, made in one process (transformers imports once)."""
    made = {}
    for name, shard in (("hf", False), ("hf_sharded", True)):
        made[name] = _hf_trainer(rank, world, os.path.join(root, name), shard)
    for name, ours in (("accelerate", False), ("accelerate_ddpstate", True)):
        made[name] = _accelerate(rank, world, os.path.join(root, name), ours)
    return made


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("folders")
    [states] = run_ranks(_framework_folders, 1, args=(str(root),), timeout=240)
    made: dict[str, tuple[Path, dict[str, Any]]] = {
        name: (root / name / ("checkpoint-1" if name.startswith("hf") else ""), state)
        for name, state in states.items()
    }
    model = torch.nn.Linear(3, 2)
    with CheckpointManager(root / "manager") as manager:
        manager.save(
            7, {"model": model, "ema": torch.nn.Linear(3, 2), "epoch": 1}, metrics={"loss": 0.25}
        )
    made["manager"] = (Path(manager.checkpoint_path(7)), model.state_dict())
    return made


KINDS = {
    "hf": formats.HF_TRAINER,
    "hf_sharded": formats.HF_TRAINER,
    "accelerate": formats.ACCELERATE,
    "accelerate_ddpstate": formats.ACCELERATE,
    "manager": formats.MANAGER,
}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_detect_inspect_verify_convert_take_the_folder_as_a_unit(
    folders: dict[str, tuple[Path, dict[str, Any]]], name: str, tmp_path: Path
) -> None:
    folder, state = folders[name]
    assert formats.detect_format(folder) == KINDS[name]
    info = inspect_file(folder)
    assert sorted(t.name for t in info.tensors) == sorted(state)
    assert info.notes[0].startswith(f"{folder}: {formats.DESCRIPTIONS[KINDS[name]]}; shown")
    found = verify_file(folder)
    assert found.ok, found.problems
    assert found.format == KINDS[name]
    out = tmp_path / "model.safetensors"
    convert_file(folder, out)
    loaded = load_file(out)
    assert sorted(loaded) == sorted(state)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k


def test_inspect_lists_the_roles_and_the_manifest(
    folders: dict[str, tuple[Path, dict[str, Any]]],
) -> None:
    notes = "\n".join(inspect_file(folders["hf"][0]).notes)
    for line in (
        "file optimizer.pt: optimizer state",
        "file rng_state.pth: RNG states",
        "file trainer_state.json: Trainer state",
        "file training_args.bin: TrainingArguments",
        "ddpstate manifest: none",
    ):
        assert line in notes, notes
    notes = "\n".join(inspect_file(folders["accelerate_ddpstate"][0]).notes)
    assert "file random_states_0.pkl: RNG states" in notes and "file optimizer.bin" in notes
    assert "ddpstate manifest: present" in notes
    notes = "\n".join(inspect_file(folders["manager"][0]).notes)
    assert "step 7; metrics loss=0.25" in notes
    assert "file ema.pt: entry 'ema' (module)" in notes


def test_manager_convert_asks_for_key_when_no_entry_is_the_model(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, {"student": torch.nn.Linear(3, 2), "teacher": torch.nn.Linear(2, 2)})
    folder = Path(manager.checkpoint_path(1))
    with pytest.raises(AmbiguousStateDictError, match=r"2 model entries \(student, teacher\)"):
        convert_file(folder, tmp_path / "x.pt")
    with pytest.raises(InvalidArgumentError, match="in_place"):
        convert_file(folder, in_place=True)
    info = inspect_file(folder)  # inspect still describes the folder
    assert not info.tensors and "entry 'teacher' (module)" in "\n".join(info.notes)
    done = convert_file(folder, edit=StateEdit(key="teacher"))  # the default name: beside it
    assert done.dst == str(folder) + ".converted.pt"
    assert torch.load(done.dst)["weight"].shape == (2, 2)
    cli = subprocess.run(
        [sys.executable, "-m", "ddpstate", "convert", str(folder), str(tmp_path / "y.pt")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 2 and "--key" in cli.stderr, cli.stderr


@pytest.mark.parametrize("name", ["hf", "accelerate", "accelerate_ddpstate"])
def test_a_damaged_file_fails_verify_naming_it(
    folders: dict[str, tuple[Path, dict[str, Any]]], name: str, tmp_path: Path
) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(folders[name][0], folder)
    optimizer = next(p for p in folder.iterdir() if p.name.startswith("optimizer"))
    with open(optimizer, "r+b") as f:
        f.seek(os.path.getsize(optimizer) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    found = verify_file(folder)
    assert not found.ok
    assert any(p.startswith(optimizer.name) for p in found.problems), found.problems


def test_sharded_trainer_folder_is_checked_through_its_index(
    folders: dict[str, tuple[Path, dict[str, Any]]], tmp_path: Path
) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(folders["hf_sharded"][0], folder)
    assert any(p.name.endswith(".index.json") for p in folder.iterdir())
    shard = sorted(folder.glob("model-*-of-*.safetensors"))[-1]
    shard.unlink()
    found = verify_file(folder)
    assert any(f"shard {shard.name} is missing" in p for p in found.problems), found.problems


def test_an_unknown_folder_and_load_of_a_training_folder_say_what_to_do(
    folders: dict[str, tuple[Path, dict[str, Any]]], tmp_path: Path
) -> None:
    import ddpstate

    with pytest.raises(CheckpointFormatError, match="Accelerate save_state or Hugging Face"):
        inspect_file(tmp_path)
    with pytest.raises(CheckpointFormatError, match="ddpstate inspect"):
        ddpstate.load(folders["hf"][0])


def test_cli_verify_and_inspect_on_framework_folders(
    folders: dict[str, tuple[Path, dict[str, Any]]],
) -> None:
    paths = [str(folders[n][0]) for n in ("hf", "hf_sharded", "accelerate_ddpstate")]
    code = (
        "import sys\n"
        "from ddpstate.cli import main\n"
        f"rcs = [main(['verify', p, '-q']) + main(['inspect', p]) for p in {paths!r}]\n"
        "print(rcs)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[0, 0, 0]", done.stdout


def _dcp_step(rank: int, world: int, root: str) -> dict[str, Any]:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    with CheckpointManager(root, writers="all") as manager:
        manager.save(1, {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)})
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def test_manager_step_with_sharded_entries_reads_its_dcp_folder(tmp_path: Path) -> None:
    [state, _] = run_ranks(_dcp_step, 2, args=(str(tmp_path / "run"),))
    folder = tmp_path / "run" / "step_0000000001"
    info = inspect_file(folder)
    assert info.state_dict_path == "model" and sorted(t.name for t in info.tensors) == sorted(state)
    out = convert_file(folder, tmp_path / "model.safetensors")
    loaded = load_file(out.dst)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert verify_file(folder).ok


def test_verify_never_unpickles_a_folder_file_beyond_weights_only(
    folders: dict[str, tuple[Path, dict[str, Any]]], tmp_path: Path
) -> None:
    """training_args.bin pickles Python objects; verify checks its zip records and never
    unpickles it (weights_only=False is torch's full unpickler, which would run them)."""
    from tests.payloads import RunsCommand

    folder = tmp_path / "checkpoint-1"
    shutil.copytree(folders["hf"][0], folder)
    marker = tmp_path / "marker"
    torch.save({"args": RunsCommand(marker)}, folder / "training_args.bin")
    found = verify_file(folder)
    assert found.ok, found.problems
    assert any("training_args.bin" in n and "never unpickled" in n for n in found.notes)
    assert not marker.exists()
    raw = bytearray((folder / "training_args.bin").read_bytes())
    at = raw.index(b"data.pkl") + 60  # inside data.pkl's bytes: its CRC-32 no longer matches
    raw[at] ^= 0xFF
    (folder / "training_args.bin").write_bytes(bytes(raw))
    assert not verify_file(folder).ok
    assert not marker.exists()
