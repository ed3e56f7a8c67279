"""Each framework integration's save against the framework's own save of the same state.

Side by side in one run, interleaved (``harness.interleave``: round-robin, the disk
synced before each run, so one's write-back is not billed to the other):

* Lightning: ``TorchCheckpointIO.save_checkpoint`` (torch.save to a temporary file,
  then a move; no fsync) against ``DDPStateCheckpointIO.save_checkpoint`` (ddpstate's
  atomic write: the file and its folder fsynced), on the same checkpoint dict: a
  model's state dict of ``--size`` bytes and Adam's two moments (3x in all).
* Hugging Face: the Trainer's checkpoint save (``Trainer._save_checkpoint``: model,
  optimizer, scheduler, RNG, trainer state) without and with ``DDPStateCallback.on_save``
  after it (every file read for its CRC-32 and fsynced, the manifest written last), for
  a GPT-2 of about ``--size`` bytes of weights, after one training step.

Target: ratio <= 1.10, the fsync included. A third row, the framework's save followed by
``os.sync()``, is the durable floor: what making the same bytes durable costs on this disk
at least. Local disk, one process on the CPU::

    python -m benchmarks.integrations --size 64M --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

from benchmarks import harness
from benchmarks.local_tier import _size_mib

TARGET = 1.10


def _with_sync(baseline: tuple[str, Callable[[], None]]) -> dict[str, Callable[[], None]]:
    """The framework's save, and the same followed by ``os.sync()``: the durable floor."""
    name, save = baseline

    def synced() -> None:
        save()
        os.sync()

    return {name: save, f"{name} + os.sync()": synced}


def _lightning(size_mib: int, work: str, repeats: int) -> dict[str, list[float]]:
    import torch
    from lightning.fabric.plugins import TorchCheckpointIO

    from ddpstate.integrations.lightning import DDPStateCheckpointIO

    tensors = max(1, size_mib // 16)
    model = {
        f"layer{i}.weight": torch.randn(size_mib * harness.MIB // 4 // tensors)
        for i in range(tensors)
    }
    state = {
        i: {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn_like(w),
            "exp_avg_sq": torch.rand_like(w),
        }
        for i, w in enumerate(model.values())
    }
    checkpoint = {
        "state_dict": model,
        "optimizer_states": [
            {"state": state, "param_groups": [{"lr": 0.001, "params": list(state)}]}
        ],
        "global_step": 100,
        "epoch": 1,
        "pytorch-lightning_version": "2.6.0",
    }
    path = os.path.join(work, "epoch=1-step=100.ckpt")
    plugins = {
        "Lightning TorchCheckpointIO": TorchCheckpointIO(),
        "DDPStateCheckpointIO": DDPStateCheckpointIO(),
    }

    def saver(plugin: Any) -> Callable[[], None]:
        return lambda: plugin.save_checkpoint(checkpoint, path)

    def remove() -> None:
        if os.path.exists(path):
            os.unlink(path)

    fns = {name: saver(p) for name, p in plugins.items()}
    fns = {**_with_sync(next(iter(fns.items()))), **fns}
    timed = harness.interleave(fns, repeats, prepare={name: remove for name in fns}, rss=False)
    return {name: times for name, (times, _) in timed.items()}


def _transformers(size_mib: int, work: str, repeats: int) -> dict[str, list[float]]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from ddpstate.integrations.transformers import DDPStateCallback

    torch.manual_seed(0)
    # 12 * n_embd^2 parameters per layer, 4 bytes each: 4 layers of size_mib / 4.
    embd = max(64, int((size_mib * harness.MIB / 4 / 4 / 12) ** 0.5) // 64 * 64)
    config = GPT2Config(n_layer=4, n_embd=embd, n_head=4, vocab_size=256, n_positions=32)
    args = TrainingArguments(
        work, max_steps=1, save_strategy="no", per_device_train_batch_size=2, use_cpu=True,
        report_to="none", logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    ids = torch.randint(0, 256, (4, 32))
    trainer = Trainer(
        GPT2LMHeadModel(config), args, train_dataset=[{"input_ids": i, "labels": i} for i in ids]
    )
    trainer.train()  # one step: Adam's moments exist, as in a real checkpoint
    callback = DDPStateCallback()
    folder = os.path.join(work, f"checkpoint-{trainer.state.global_step}")

    def plain() -> None:
        trainer._save_checkpoint(trainer.model, None)

    def sealed() -> None:
        plain()
        callback.on_save(trainer.args, trainer.state, trainer.control)

    def remove() -> None:
        shutil.rmtree(folder, ignore_errors=True)

    fns = {**_with_sync(("Trainer save", plain)), "Trainer save + DDPStateCallback": sealed}
    timed = harness.interleave(fns, repeats, prepare={name: remove for name in fns}, rss=False)
    megabytes = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)) / 1e6
    print(f"(Hugging Face checkpoint folder: {megabytes:.0f} MB)")
    return {name: times for name, (times, _) in timed.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="64M", help="model weights, e.g. 64M or 1G")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", default=None, help="folder on the disk to measure")
    options = parser.parse_args(argv)
    size = _size_mib(options.size)
    rows: dict[str, Any] = {}
    for family, run in (("Lightning", _lightning), ("Hugging Face Trainer", _transformers)):
        work = tempfile.mkdtemp(prefix="ddpstate-integrations-", dir=options.work)
        try:
            times = run(size, work, options.repeats)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        base, floor, ours = times
        median = {name: statistics.median(t) for name, t in times.items()}
        ratio = median[ours] / median[base]
        rows[family] = {"ratio": ratio, "ratio_to_synced": median[ours] / median[floor]}
        rows[family]["times"] = times
        verdict = "met" if ratio <= TARGET else "NOT met"
        print(
            f"{family} (median of {options.repeats}): {base} {median[base]:.3f} s, {floor} "
            f"{median[floor]:.3f} s, {ours} {median[ours]:.3f} s: {ratio:.2f}x the framework's "
            f"save (target <= {TARGET:.2f}x: {verdict}), {median[ours] / median[floor]:.2f}x "
            f"the framework's save made durable by os.sync()"
        )
    return rows


if __name__ == "__main__":
    main()
