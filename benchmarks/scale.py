"""``python -m benchmarks.scale``: ddpstate's collectives at 8 to 1,024 ranks, and should_stop().

Part 1, simulated ranks. For each N (default 8, 64, 256, 1,024): one real
``torch.distributed.TCPStore`` server and N threads in this process, each with
its own TCPStore client (its own connection), each calling ddpstate's own
collective code (``ddpstate._collectives``, the functions ``ddpstate.dist``
wraps) with its own ``StoreGroup``. Per round every thread is released at once
and the round lasts until the last thread returns; the median over rounds is
reported for:

* ``barrier`` against torch's ``torch.distributed.elastic.utils.store.barrier``
  (counter + last-member key, the O(1)-per-rank design), side by side, in
  alternating order;
* ``share_outcome`` (every rank succeeded), ``gather to 0`` (each rank's
  13 KB of RNG states and metadata, as CheckpointManager.save sends them),
  ``broadcast`` (a small object from rank 0);
* ``save collectives``: what one synchronous ``CheckpointManager.save`` does
  besides writing bytes: one ``gather_and_decide`` round in which every rank
  sends ``{"step", "names", "rng"}`` (its RNG states as one pickled blob) to
  the writer, the writer unpickles and checks every rank's step and names, and
  its verdict reaches every rank. (The writer unpickles the RNG blobs while it
  writes ``_rng.pt``, in the background thread for async saves.)

Store operations per rank are counted in one extra round per collective with
a counting wrapper around each client (not in the timed rounds): the mean over
ranks and the maximum (the last arriver, which also sets "done" and deletes
the previous call's keys, or the receiving rank).

Part 2, real processes: 2 and 8 gloo processes on 127.0.0.1 time
``CheckpointManager.should_stop()`` against a bare ``dist.all_reduce`` of a
one-element tensor (the floor: should_stop is one such all-reduce), call by
call in alternating order; per call, the median over calls of the slowest rank.

Threads share one interpreter, so Python overhead weighs more than on a real
cluster, on both sides alike. Targets (issue 16): barrier <= 1.5x torch's at
1,024; save collectives <= 250 ms at 1,024; operations per rank constant in N;
should_stop <= 1.5x the bare all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks import harness

TIMEOUT = 300.0


class _Counting:
    """A store client that counts its operations (round trips to the server)."""

    _LOCAL = frozenset({"set_timeout"})  # no message to the server

    def __init__(self, store: Any) -> None:
        self.store = store
        self.ops: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)
        if not callable(method) or name in self._LOCAL:
            return method

        def call(*args: Any) -> Any:
            self.ops[name] += 1
            return method(*args)

        return call


def _clients(n: int) -> tuple[Any, list[Any]]:
    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=TIMEOUT), wait_for_workers=False
    )
    # Many threads connect at once: on some machines a few connects to a fresh
    # listener stall for seconds, and in parallel those stalls overlap.
    with ThreadPoolExecutor(min(n, 256)) as pool:
        clients = list(
            pool.map(
                lambda _: dist.TCPStore(
                    "127.0.0.1", server.port, None, False, timedelta(seconds=TIMEOUT)
                ),
                range(n),
            )
        )
    return server, clients


class _Ranks:
    """N long-lived threads; ``run(fn)`` releases them at once and times the round."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.job: Callable[[int], None] | None = None
        self.go = threading.Barrier(n + 1)
        self.done = threading.Barrier(n + 1)
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._body, args=(r,), daemon=True) for r in range(n)
        ]
        for t in self.threads:
            t.start()

    def _body(self, rank: int) -> None:
        while True:
            self.go.wait()
            job = self.job
            if job is None:
                return
            try:
                job(rank)
            except BaseException as exc:
                self.errors.append(exc)
            self.done.wait()

    def run(self, job: Callable[[int], None]) -> float:
        self.job = job
        self.go.wait()
        start = time.perf_counter()
        self.done.wait()
        elapsed = time.perf_counter() - start
        if self.errors:
            raise self.errors[0]
        return elapsed

    def close(self) -> None:
        self.job = None
        self.go.wait()


def _simulated(n: int, rounds: int) -> dict[str, Any]:
    from torch.distributed.elastic.utils.store import barrier as torch_barrier

    from ddpstate import _collectives as c
    from ddpstate._manager.entries import rng_to_wire
    from ddpstate.rng import capture_rng_state

    server, clients = _clients(n)
    groups = [c.StoreGroup.join(store, r, n) for r, store in enumerate(clients)]
    info = {"step": 1000, "names": ["model", "optimizer", "scheduler"], "rng": capture_rng_state()}
    state_bytes = pickle.dumps(info)
    small = pickle.dumps({"resume_step": 1000, "folder": "/ckpt/step_0000001000"})
    counter = iter(range(1 << 30))

    def ours_barrier(rank: int) -> None:
        c.barrier(groups[rank], "barrier", TIMEOUT)

    def torch_side(prefix: str) -> Callable[[int], None]:
        return lambda rank: torch_barrier(clients[rank], n, prefix, TIMEOUT, rank=rank)

    def share(rank: int) -> None:
        c.share_outcome(groups[rank], None, "outcome", TIMEOUT)

    def gather(rank: int) -> None:
        c.gather(groups[rank], state_bytes, 0, "gather", TIMEOUT)

    def broadcast(rank: int) -> None:
        c.broadcast(groups[rank], small if rank == 0 else None, 0, "broadcast", TIMEOUT)

    # Each rank pickles its own RNG states before the collective (in parallel on a
    # real cluster, serialised by the GIL here), so that is done outside the timing.
    payloads = [
        pickle.dumps({**info, "rng": pickle.dumps(rng_to_wire(capture_rng_state()))})
        for _ in range(n)
    ]

    def decide(raw: list[bytes]) -> Any:
        infos = [pickle.loads(b) for b in raw]
        if len({i["step"] for i in infos}) > 1 or len({tuple(i["names"]) for i in infos}) > 1:
            raise AssertionError("the simulated ranks disagree")
        assert len([i["rng"] for i in infos]) == n
        # Here CheckpointManager.save writes the checkpoint, unpickling the RNG
        # states (_manager.entries.rng_states) as it writes _rng.pt.
        return None

    def save_collectives(rank: int) -> None:
        # CheckpointManager.save (synchronous) minus the writing: one gather_and_decide
        # round; the writer unpickles every rank's step and names and checks them, and
        # its verdict reaches every rank.
        name = "CheckpointManager.save(step=1000)"
        c.gather_and_decide(groups[rank], payloads[rank], 0, name, TIMEOUT, decide)

    ranks = _Ranks(n)
    cases: dict[str, Callable[[int], None]] = {
        "share_outcome": share,
        "gather to 0": gather,
        "broadcast": broadcast,
        "save collectives": save_collectives,
    }
    times: dict[str, list[float]] = {name: [] for name in ["barrier", "torch barrier", *cases]}
    try:
        ranks.run(ours_barrier)  # warm-up
        for i in range(rounds):
            pair = [("barrier", ours_barrier), ("torch barrier", torch_side(f"t/{next(counter)}"))]
            for name, job in pair if i % 2 == 0 else pair[::-1]:
                times[name].append(ranks.run(job))
            for name, job in cases.items():
                times[name].append(ranks.run(job))
        # One counted round per collective, outside the timed ones.
        counting = [_Counting(store) for store in clients]
        for g, wrapped in zip(groups, counting, strict=True):
            g.store = wrapped
        ops: dict[str, tuple[float, int]] = {}
        for name, job in [("barrier", ours_barrier), *cases.items()]:
            for w in counting:
                w.ops.clear()
            ranks.run(job)
            per_rank = [sum(w.ops.values()) for w in counting]
            ops[name] = (statistics.mean(per_rank), max(per_rank))
        torch_counting = [_Counting(store) for store in clients]
        prefix = f"t/{next(counter)}"
        ranks.run(lambda rank: torch_barrier(torch_counting[rank], n, prefix, TIMEOUT, rank=rank))
        per_rank = [sum(w.ops.values()) for w in torch_counting]
        ops["torch barrier"] = (statistics.mean(per_rank), max(per_rank))
    finally:
        ranks.close()
    del server
    return {
        "n": n,
        "ms": {name: statistics.median(v) * 1e3 for name, v in times.items()},
        "ops": ops,
        "payload_bytes": len(state_bytes),
    }


# --------------------------------------------------------------------------- real processes


def _stop_worker(
    rank: int, world: int, port: int, calls: int, blocks: int, folder: str, out: str
) -> None:
    import torch
    import torch.distributed as dist

    from ddpstate import CheckpointManager

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    manager = CheckpointManager(folder)
    flag = torch.zeros(1, dtype=torch.int32)

    def bare() -> None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)

    sides: dict[str, Callable[[], Any]] = {"should_stop": manager.should_stop, "all_reduce": bare}
    times: dict[str, list[float]] = {name: [] for name in sides}
    # Call by call, alternating which side goes first: load from other processes on
    # the machine then hits both sides alike.
    for i in range(calls * blocks + 50):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        for name in order:
            start = time.perf_counter()
            sides[name]()
            if i >= 50:  # warm-up
                times[name].append(time.perf_counter() - start)
    manager.close()
    medians = {name: statistics.median(v) for name, v in times.items()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, medians)
    if rank == 0:
        # A collective is as slow as its slowest rank.
        slowest = {name: max(g[name] for g in gathered) for name in medians}
        Path(out).write_text(json.dumps(slowest))
    dist.destroy_process_group()


def _real(world: int, calls: int, blocks: int) -> dict[str, float]:
    import torch.multiprocessing as tmp

    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "result.json")
        tmp.spawn(
            _stop_worker,
            args=(world, harness.free_port(), calls, blocks, folder, out),
            nprocs=world,
            join=True,
        )
        result: dict[str, float] = json.loads(Path(out).read_text())
    return result


# --------------------------------------------------------------------------- report


def _table(sim: list[dict[str, Any]], real: dict[int, dict[str, float]]) -> str:
    lines = [
        "| ranks | barrier | torch elastic barrier | ratio | share_outcome | gather to 0 "
        "| broadcast | save collectives | store ops per rank (mean / max): barrier, torch "
        "barrier, share_outcome, gather, broadcast, save |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sim:
        ms, ops = row["ms"], row["ops"]
        counted = ", ".join(
            f"{ops[k][0]:.1f} / {ops[k][1]}"
            for k in ("barrier", "torch barrier", "share_outcome", "gather to 0", "broadcast",
                      "save collectives")
        )  # fmt: skip
        lines.append(
            f"| {row['n']} | {ms['barrier']:.1f} ms | {ms['torch barrier']:.1f} ms "
            f"| {ms['barrier'] / ms['torch barrier']:.2f}x | {ms['share_outcome']:.1f} ms "
            f"| {ms['gather to 0']:.1f} ms | {ms['broadcast']:.1f} ms "
            f"| {ms['save collectives']:.1f} ms | {counted} |"
        )
    if real:
        lines += [
            "",
            "| gloo processes | should_stop() | bare all_reduce (1 element) | ratio |",
            "|---|---|---|---|",
        ]
        for world, r in real.items():
            lines.append(
                f"| {world} | {r['should_stop'] * 1e6:.0f} us | {r['all_reduce'] * 1e6:.0f} us "
                f"| {r['should_stop'] / r['all_reduce']:.2f}x |"
            )
    return "\n".join(lines)


def _plot(sim: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [row["n"] for row in sim]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in ("barrier", "torch barrier", "share_outcome", "gather to 0", "broadcast",
                 "save collectives"):  # fmt: skip
        label = "torch elastic barrier" if name == "torch barrier" else name
        style = "--" if name == "torch barrier" else "-"
        ax.plot(ns, [row["ms"][name] for row in sim], style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("ranks (threads, one TCPStore client each)")
    ax.set_ylabel("ms per call (median)")
    ax.set_title("ddpstate collectives against one TCPStore")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scale", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--ranks", default="8,64,256,1024", help="simulated rank counts")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per collective")
    parser.add_argument("--procs", default="2,8", help="gloo process counts ('' for none)")
    parser.add_argument("--calls", type=int, default=500, help="should_stop calls per block")
    parser.add_argument("--blocks", type=int, default=4, help="blocks of calls per side")
    parser.add_argument("--out", type=Path, default=None, help="write scale.md/.json/.png here")
    args = parser.parse_args(argv)
    # 1,024 clients plus their server connections need more than the usual 1,024 files.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    sim = []
    for n in [int(v) for v in args.ranks.split(",") if v.strip()]:
        sim.append(_simulated(n, args.rounds))
        print(f"{n} ranks: {json.dumps(sim[-1]['ms'])}", file=sys.stderr, flush=True)
    real = {
        world: _real(world, args.calls, args.blocks)
        for world in [int(v) for v in args.procs.split(",") if v.strip()]
    }
    table = _table(sim, real)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scale.md").write_text(table + "\n")
        (args.out / "scale.json").write_text(json.dumps({"simulated": sim, "real": real}, indent=1))
        if sim:
            _plot(sim, args.out / "scale.png")
    return {"simulated": sim, "real": real}


if __name__ == "__main__":
    main()
