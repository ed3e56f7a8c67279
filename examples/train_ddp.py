"""Reference DDP trainer: a small BatchNorm CNN on scikit-learn's 8x8 digits, with ddpstate.

Every checkpoint, resume, BatchNorm and rank decision goes through ddpstate, so this
file shows the whole library in one sitting. The data ships inside scikit-learn
(1,797 images), so nothing is downloaded at run time.

Run it (from the repository root, after ``pip install -e ".[examples]"``):

    # one process (CPU, or cuda:0)
    python examples/train_ddp.py

    # one machine, 2 processes (gloo on CPU, nccl on GPUs)
    torchrun --standalone --nproc-per-node=2 examples/train_ddp.py

    # two machines with 4 GPUs each: run on both, with --node-rank=0 / 1
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=4 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 examples/train_ddp.py

    # SLURM: one task per GPU
    srun --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 python examples/train_ddp.py

Checkpoints go to ``--out-dir`` (default ``runs/digits``) every ``--save-every``
optimizer steps and at the end; a rerun resumes from the newest valid one
(``--resume auto``). SIGTERM (or SLURM's SIGUSR1) saves once more and exits 0.
At the end the plain model weights are exported as ``model.safetensors``
(SyncBatchNorm reverted, wrapper prefixes removed), loadable with torch and
safetensors alone.

``--local-every K`` also saves every K steps to a node-local tier (``--local-dir``,
default ``/dev/shm/ddpstate-<run id>-<out dir name>``), in the background; a worker
that crashes is back within seconds and loses fewer than K steps. The tier is RAM, so a
run that ends (finished or preempted, its last durable checkpoint committed) deletes it;
``--keep-local`` keeps it:

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 examples/train_ddp.py \
        --local-every=5 --save-every=50

Every rank prints which tier and step it restored from. Restarts by torchrun work as
typed: ``ddpstate.init_distributed`` gives each restart attempt its own store keys
(pytorch/pytorch#135712; code calling ``init_process_group`` itself needs
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun instead).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpstate
from ddpstate.manager import NodeLocal


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--epochs", type=int, default=8, help="passes over the training split (default: 8)")
    add("--batch-size", "--batch_size", type=int, default=32, help="per rank, per micro-batch")
    add("--grad-accum", "--grad_accum", type=int, default=1, help="micro-batches per step")
    add("--lr", type=float, default=0.05, help="peak learning rate (SGD + cosine schedule)")
    add("--seed", type=int, default=0, help="data split, init and shuffling seed")
    add(
        "--batchnorm",
        choices=["auto", "sync", "unsynced", "keep"],
        default="auto",
        help="BatchNorm policy passed to ddpstate.wrap_ddp (default: auto)",
    )
    add("--compile", action="store_true", help="torch.compile the DDP model")
    add("--amp", action="store_true", help="float16 autocast + GradScaler (CUDA only)")
    add(
        "--deterministic",
        action="store_true",
        help="deterministic kernels: a killed-and-resumed run ends bitwise equal",
    )
    add("--out-dir", "--out_dir", default="runs/digits", help="checkpoints and the export")
    add("--save-every", "--save_every", type=int, default=50, help="checkpoint every N steps")
    add("--keep-last", "--keep_last", type=int, default=2, help="checkpoints kept by rotation")
    add(
        "--async-save",
        "--async_save",
        action="store_true",
        help="write checkpoints in a background thread",
    )
    add(
        "--local-every",
        "--local_every",
        type=int,
        default=0,
        help="also save to the node-local tier (--local-dir) every K steps (default: 0, off)",
    )
    add(
        "--local-dir",
        "--local_dir",
        default=None,
        help="node-local folder for --local-every (default: /dev/shm/ddpstate-<run id>)",
    )
    add(
        "--keep-local",
        "--keep_local",
        action="store_true",
        help="keep the node-local tier when the run ends (default: deleted once the last "
        "durable checkpoint is committed; a crash always leaves it for the restart)",
    )
    add(
        "--resume",
        default="auto",
        help="'auto' (newest valid checkpoint, if any), 'none', or a step number",
    )
    add(
        "--max-steps",
        "--max_steps",
        type=int,
        default=None,
        help="stop after this many optimizer steps (for smoke tests)",
    )
    add("--no-progress", action="store_true", help="no tqdm bar")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data and model


def load_digits_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The 8x8 digits as (N, 1, 8, 8) float tensors in [0, 1], split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_val = len(labels) // 5
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[val], labels[val])


class DigitsCNN(nn.Module):
    """Two conv blocks with BatchNorm, then a small MLP head: ~140k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 128, bias=False),
            nn.BatchNorm1d(128),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(128, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorDataset, device: torch.device) -> tuple[float, float]:
    """Loss and accuracy over the whole split; every rank returns the same numbers.

    Each rank scores a disjoint stride of the split (no padding, so no sample is
    counted twice), then the sums are all-reduced.
    """
    was_training = model.training
    model.eval()
    rank, world = ddpstate.get_rank(), ddpstate.get_world_size()
    images, labels = data.tensors[0][rank::world], data.tensors[1][rank::world]
    logits = model(images.to(device))
    labels = labels.to(device)
    sums = torch.tensor(
        [
            F.cross_entropy(logits, labels, reduction="sum").item(),
            (logits.argmax(1) == labels).sum().item(),
            len(labels),
        ],
        dtype=torch.float64,
        device=device,
    )
    if ddpstate.is_distributed():
        dist.all_reduce(sums)
    model.train(was_training)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


# ----------------------------------------------------------------------------- training


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = ddpstate.init_distributed()  # gloo on CPU, nccl + cuda:LOCAL_RANK on GPUs
    device, main_process = ctx.device, ctx.is_main_process
    log = ddpstate.rank_zero_only(print)

    torch.manual_seed(args.seed)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    amp = args.amp and device.type == "cuda"
    if args.amp and not amp:
        log("--amp needs CUDA; training in float32")

    # Import scikit-learn (seconds) on every rank at once; only reading the data goes
    # first. Inside main_process_first the ranks imported it one after the other, which
    # a torchrun restart paid again before its restore.
    import sklearn.datasets  # noqa: F401

    with ddpstate.main_process_first():  # sklearn may unpack its data files once
        train_set, val_set = load_digits_split(args.seed)

    # Resumable sampler: after a restore it yields exactly the rest of the interrupted epoch.
    sampler = ddpstate.ResumableDistributedSampler(train_set, shuffle=True, seed=args.seed)
    # The loader gets its own generator: each new iterator draws a seed from it, and
    # drawing from the global RNG instead would shift dropout after a mid-epoch resume.
    loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=sampler,
        generator=torch.Generator().manual_seed(args.seed),
    )
    steps_per_epoch = math.ceil(len(loader) / args.grad_accum)
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)

    # wrap_ddp moves the model to this rank's device and applies the BatchNorm policy:
    # SyncBatchNorm on multi-GPU, else broadcast_buffers=False plus sync_batchnorm_stats.
    model = ddpstate.wrap_ddp(DigitsCNN(), batchnorm=args.batchnorm, device=device)
    plain_model = ddpstate.unwrap_model(model)  # for evaluation: no DDP hooks, no collectives
    unsynced_bn = not any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    train_model: nn.Module = torch.compile(model) if args.compile else model

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=max(total_steps, 1)
    )
    scaler = torch.amp.GradScaler(device.type, enabled=amp)

    local = None
    if args.local_every > 0:
        # One folder per job: restore takes the newest step of either tier.
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        local_dir = args.local_dir or f"/dev/shm/ddpstate-{run_id}-{Path(args.out_dir).name}"
        local = NodeLocal(local_dir, every=args.local_every)
    manager = ddpstate.CheckpointManager(
        args.out_dir,
        keep_last=args.keep_last,
        async_save=args.async_save,
        handle_signals=True,  # SIGTERM / SIGUSR1: save at an agreed step, then exit 0
        local=local,
    )
    state = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "scaler": scaler,
        "sampler": sampler,
    }
    step = 0
    if args.resume == "none":
        manager.clear_local()  # a fresh run must not resume from an older run's local copy
    else:
        wanted = None if args.resume == "auto" else int(args.resume)
        restored = manager.restore(state, step=wanted, map_location=device)
        if restored is not None:
            step = restored
            log(f"resumed from step {step} (epoch {sampler.epoch})")
        # Every rank says where its state came from: this node's local tier, another
        # node's (sent over the process group), or the durable folder.
        print(f"rank {ctx.rank}: restored {manager.restored_from}", flush=True)

    last_saved = step

    def checkpoint() -> float:
        nonlocal last_saved
        start = time.perf_counter()
        if unsynced_bn:
            ddpstate.sync_batchnorm_stats(model)  # save the ranks' average, not rank 0's
        manager.save(step, state)
        last_saved = step
        return time.perf_counter() - start

    progress = None
    if main_process and not args.no_progress and sys.stderr.isatty():
        from tqdm import tqdm

        progress = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True)

    stopped = False
    model.train()
    for epoch in range(sampler.epoch, args.epochs):
        if step >= total_steps or stopped:
            break
        sampler.set_epoch(epoch)  # once per epoch; keeps the position after a mid-epoch resume
        epoch_start, ckpt_time, seen, loss_sum, micro = time.perf_counter(), 0.0, 0, 0.0, 0
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            micro += 1
            last_micro = micro % args.grad_accum == 0
            # Gradients are all-reduced only on the last micro-batch of each step.
            sync = (
                contextlib.nullcontext()
                if last_micro or not ctx.is_distributed
                else model.no_sync()
            )
            with sync, torch.autocast(device.type, dtype=torch.float16, enabled=amp):
                loss = F.cross_entropy(train_model(images), labels)
                scaler.scale(loss / args.grad_accum).backward()
            seen += len(labels)
            loss_sum += loss.item() * len(labels)
            if not last_micro:
                continue
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if progress is not None:
                progress.update(1)
            if manager.should_stop():  # a collective: every rank stops at the same step
                ckpt_time += checkpoint()
                log(f"preempted: saved step {step}, exiting")
                stopped = True
                break
            if step % args.save_every == 0:
                ckpt_time += checkpoint()
            if args.local_every > 0 and step % args.local_every == 0:
                start = time.perf_counter()
                if unsynced_bn:
                    ddpstate.sync_batchnorm_stats(model)  # every node keeps the same state
                manager.save_local(step, state)  # a snapshot; the write runs in the background
                ckpt_time += time.perf_counter() - start
            if step >= total_steps:
                break
        if stopped:
            break
        if unsynced_bn:
            ddpstate.sync_batchnorm_stats(model)
        val_loss, val_acc = evaluate(plain_model, val_set, device)
        elapsed = time.perf_counter() - epoch_start
        log(
            f"epoch {epoch + 1}/{args.epochs} step {step}: train loss {loss_sum / max(seen, 1):.4f}"
            f"  val loss {val_loss:.4f}  val acc {100 * val_acc:.2f}%"
            f"  {seen * ctx.world_size / elapsed:.0f} samples/s  checkpointing {ckpt_time:.2f}s"
        )

    if progress is not None:
        progress.close()
    if not stopped:
        if last_saved != step:
            checkpoint()
        if unsynced_bn:
            ddpstate.sync_batchnorm_stats(model)
        _, val_acc = evaluate(plain_model, val_set, device)
        export = Path(args.out_dir, "model.safetensors")
        # A plain single-device model: SyncBatchNorm back to BatchNorm, no wrapper prefixes.
        plain = ddpstate.revert_sync_batchnorm(copy.deepcopy(plain_model))
        ddpstate.save(ddpstate.normalize_keys(plain.state_dict()), export)
        log(f"exported {export}")
        log(f"final validation accuracy: {100 * val_acc:.2f}%")
    manager.wait()  # the last durable checkpoint is committed (or its error raised here)
    if local is not None and not args.keep_local:
        # The node-local tier lives in RAM (/dev/shm) and a later launch gets a new run id,
        # so a finished run removes it; a crash never gets here and leaves it for the restart.
        manager.clear_local()
    manager.close()
    if ctx.is_distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
