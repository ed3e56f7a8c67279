"""The node-local tier on 2 gloo ranks: loop stall per local save, and restart-to-first-step time.

Run: ``python -m benchmarks.local_tier --size-mib 1024`` (2 ranks, one 1 GiB
state each, as the issue asks; ``--size-mib`` shrinks it on a busy machine).

1. **Stall.** Each rank holds the state (float32 tensors of 64 MiB). The loop
   changes every tensor, then calls ``save_local`` (``local_every=1``) and
   times the call on every rank; between calls the "training" waits for the
   background write, untimed, so the figure is the snapshot plus the RNG
   gather. Baseline: the same ranks' synchronous durable ``save`` (to
   ``--work``, with fsync). Target: median stall <= 0.1 of a sync save.
2. **Restart.** Both tiers hold the same step. A fresh pair of processes
   (as torchrun's restart makes: spawn, import torch, join the group, build
   the state) restores it and does one step; the time is from the spawn to
   the first step done, on the slower rank. From the local tier
   (``/dev/shm``) against the durable tier on the local disk, read cold (each
   file fsynced and evicted from the page cache with ``POSIX_FADV_DONTNEED``,
   as after the node dropped it) and warm. Target: local <= 0.5 x durable.
   The ``restore()`` call alone is timed too: the local tier verifies its
   CRC-32s like the durable one, then maps the files (``/dev/shm``) instead
   of reading them into new memory.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

_TENSOR_MIB = 64
_MIB = 1 << 20
_CTX = mp.get_context("spawn")


def _state(size_mib: int, fill: float) -> Any:
    """A model of float32 parameters (64 MiB each): restore loads into them in place."""
    import torch

    per = min(_TENSOR_MIB, max(1, size_mib // 4))
    return torch.nn.ParameterDict(
        {
            f"w{i:03d}": torch.nn.Parameter(torch.full((per * _MIB // 4,), fill))
            for i in range(max(1, size_mib // per))
        }
    )


def _join(rank: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)


def _stall_child(rank: int, port: int, opts: dict[str, Any], out: Any) -> None:
    import torch

    from ddpstate.dist import barrier
    from ddpstate.manager import CheckpointManager

    _join(rank, port)
    weights = _state(opts["size_mib"], 1.0)
    state = {"weights": weights}
    local, sync = [], []
    with CheckpointManager(
        opts["durable"], keep_last=1, local_dir=opts["shm"], local_every=1, local_keep=2
    ) as manager:
        for step in range(1, opts["saves"] + 1):
            with torch.no_grad():
                for t in weights.values():
                    t.add_(1.0)
            start = time.perf_counter()
            manager.save_local(step, state)
            local.append(time.perf_counter() - start)
            manager.wait()  # the "training" goes on meanwhile; not timed
            barrier()  # ranks enter the next step together, as DDP's all-reduce makes them
        for step in range(opts["saves"] + 1, opts["saves"] + 1 + opts["sync_saves"]):
            with torch.no_grad():
                for t in weights.values():
                    t.add_(1.0)
            start = time.perf_counter()
            manager.save(step, state)
            sync.append(time.perf_counter() - start)
        skipped = manager.local_skipped
    out.put((rank, {"local": local, "sync": sync, "skipped": skipped}))


def _restart_child(rank: int, port: int, opts: dict[str, Any], out: Any) -> None:
    import torch

    from ddpstate.manager import CheckpointManager

    _join(rank, port)
    weights = _state(opts["size_mib"], 0.0)
    state = {"weights": weights}
    local_dir = opts["shm"] if opts["tier"] == "local" else None
    with CheckpointManager(opts["durable"], keep_last=1, local_dir=local_dir) as manager:
        start = time.perf_counter()
        step = manager.restore(state)
        restore_s = time.perf_counter() - start
        assert weights["w000"][0].item() == opts["value"], "restored the wrong values"
        with torch.no_grad():  # the first training step
            for t in weights.values():
                t.add_(1.0)
        source = manager.restored_from
    tier = source and source.tier
    out.put((rank, {"done": time.time(), "restore": restore_s, "step": step, "tier": tier}))


def _spawn(target: Any, opts: dict[str, Any]) -> tuple[float, list[dict[str, Any]]]:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    out = _CTX.Queue()
    start = time.time()
    procs = [_CTX.Process(target=target, args=(r, store.port, opts, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank exited with {p.exitcode}")
    return start, [results[0], results[1]]


def _evict(folder: Path) -> None:
    for file in folder.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="state per rank (MiB)")
    parser.add_argument("--saves", type=int, default=4, help="local saves timed")
    parser.add_argument("--sync-saves", type=int, default=2, help="durable sync saves timed")
    parser.add_argument("--restarts", type=int, default=3, help="restarts timed per variant")
    parser.add_argument("--work", default=None, help="folder on the local disk (default: cwd)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ddpstate-local-bench-", dir=args.work or os.getcwd()))
    shm = Path(tempfile.mkdtemp(prefix="ddpstate-local-bench-", dir="/dev/shm"))
    opts: dict[str, Any] = {
        "size_mib": args.size_mib,
        "saves": args.saves,
        "sync_saves": args.sync_saves,
        "durable": str(work / "run"),
        "shm": str(shm / "tier"),
    }
    try:
        _, stall = _spawn(_stall_child, opts)
        local = statistics.median(max(r["local"][i] for r in stall) for i in range(args.saves))
        steady = statistics.median(max(r["local"][i] for r in stall) for i in range(1, args.saves))
        sync = statistics.median(max(r["sync"][i] for r in stall) for i in range(args.sync_saves))
        # Both tiers now hold the last step: make the local tier's newest the same step.
        last = args.saves + args.sync_saves
        _spawn(_resave_child, {**opts, "step": last})
        restarts: dict[str, list[float]] = {"local": [], "durable, cold": [], "durable, warm": []}
        restores: dict[str, list[float]] = {k: [] for k in restarts}
        for _ in range(args.restarts):
            for variant in restarts:
                tier = variant.split(",")[0]
                if variant == "durable, cold":
                    _evict(work / "run")
                start, res = _spawn(_restart_child, {**opts, "tier": tier, "value": 1.0 + last})
                assert all(r["step"] == last and r["tier"] == tier for r in res), res
                restarts[variant].append(max(r["done"] for r in res) - start)
                restores[variant].append(max(r["restore"] for r in res))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    times = {k: statistics.median(v) for k, v in restarts.items()}
    calls = {k: statistics.median(v) for k, v in restores.items()}
    print(f"2 gloo ranks, {args.size_mib} MiB state per rank, durable tier on {work.parent}")
    print("| measure | local tier | baseline | ratio | target |")
    print("|---|---|---|---|---|")
    print(
        f"| loop stall per save (median of {args.saves}) | {local:.3f} s | sync durable save "
        f"{sync:.3f} s | {local / sync:.3f} | <= 0.1 |"
    )
    print(
        f"| loop stall, steady (buffers reused) | {steady:.3f} s | {sync:.3f} s | "
        f"{steady / sync:.3f} | <= 0.1 |"
    )
    for base in ("durable, cold", "durable, warm"):
        print(
            f"| restart to first step (median of {args.restarts}) | {times['local']:.2f} s | "
            f"{base} {times[base]:.2f} s | {times['local'] / times[base]:.2f} | <= 0.5 |"
        )
    for base in ("durable, cold", "durable, warm"):
        print(
            f"| the restore() call alone | {calls['local']:.2f} s | {base} {calls[base]:.2f} s | "
            f"{calls['local'] / calls[base]:.2f} | |"
        )
    return {"stall": local, "steady": steady, "sync": sync, "restart": times, "restore": calls}


def _resave_child(rank: int, port: int, opts: dict[str, Any], out: Any) -> None:
    from ddpstate.manager import CheckpointManager

    _join(rank, port)
    state = {"weights": _state(opts["size_mib"], 0.0)}
    with CheckpointManager(
        opts["durable"], keep_last=1, local_dir=opts["shm"], local_every=1
    ) as manager:
        manager.restore(state, step=opts["step"])  # the durable step, into the local tier too
        manager.save_local(opts["step"], state)
    out.put((rank, {}))


if __name__ == "__main__":
    main()
