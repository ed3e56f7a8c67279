"""The node-local tier on 2 gloo ranks: save stall, torchrun restart by phase, peer send.

Run: ``python -m benchmarks.local_tier`` (2 ranks, one 1 GiB state each, as the
issue asks; ``--size 64M`` for a quick run, ``--only stall,restart,peer`` for a
part, ``--work DIR`` for the durable tier's disk).

1. **Stall.** Each rank holds the state (float32 tensors of 64 MiB). The loop
   changes every tensor, then calls ``save_local`` (``local_every=1``) and
   times the call on every rank; between calls the "training" waits for the
   background write, untimed, so the figure is the snapshot plus the RNG
   gather. Baseline: the same ranks' synchronous durable ``save`` (to
   ``--work``, with fsync). Target: median stall <= 0.1 of a sync save.
2. **Restart.** Both tiers hold the same step. A real ``torchrun
   --max-restarts=1`` job: in attempt 0, rank 1 SIGKILLs itself while rank 0
   trains on (``handle_signals=True``, as the trainer); torchrun restarts
   both, and attempt 1 restores and does one step. The phases are
   timestamped (agent's first log line after the kill, each worker's process
   start from ``/proc``, script start, imports done, ``init_distributed``
   done, state built, ``restore`` done, first step) and reported on the
   slower rank, from the local tier (``/dev/shm``) against the durable tier
   on the local disk, read cold (each file fsynced and evicted from the page
   cache with ``POSIX_FADV_DONTNEED``, as after the node dropped it) and
   warm. Target: kill (or spawn) to first step, local <= 0.5 x durable; the
   ``restore()`` call alone is reported too, and the lower bound: the local
   restart's time with its ``restore()`` taken out (what an instant restore
   would give; the agent, Python, ``import torch`` and building the model are
   the same in both tiers).
3. **Peer send.** Two "nodes" (``LOCAL_RANK=0`` on both ranks, one local
   folder each, as the tests), node 1's folder empty (a replaced node): the
   ``restore()`` call on node 1, which receives the step from node 0 over the
   process group, against restoring that step from the durable tier on disk
   (cold, warm) and on ``/dev/shm``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
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


def _join(rank: int, port: int, local_rank: int | None = None) -> None:
    import torch.distributed as dist

    local = rank if local_rank is None else local_rank
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE="2")
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)


def _stall_child(rank: int, port: int, opts: dict[str, Any], out: Any) -> None:
    import torch

    from ddpstate.dist import barrier
    from ddpstate.manager import CheckpointManager, NodeLocal

    _join(rank, port)
    weights = _state(opts["size_mib"], 1.0)
    state = {"weights": weights}
    local, sync = [], []
    with CheckpointManager(
        opts["durable"], keep_last=1, local=NodeLocal(opts["shm"], every=1, keep=2)
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


# The peer row: 2 "nodes" (LOCAL_RANK=0 on both ranks, one local folder each), as the tests.
_PEER_VARIANTS = ("peer", "local", "durable, disk cold", "durable, disk warm", "durable, /dev/shm")


def _node_dir(opts: dict[str, Any], rank: int) -> str:
    return os.path.join(opts["shm"], f"node{rank}")


def _setup_child(rank: int, port: int, opts: dict[str, Any], out: Any) -> None:
    """Both tiers hold step ``opts["step"]`` (values ``opts["value"]``): durable on disk and
    on /dev/shm, local in ``opts["shm"]`` (one node) or per rank (2 "nodes")."""
    from ddpstate.manager import CheckpointManager, NodeLocal

    nodes = opts.get("nodes", 1)
    _join(rank, port, local_rank=0 if nodes == 2 else None)
    state = {"weights": _state(opts["size_mib"], opts["value"])}
    for durable in (opts["durable"], opts["durable_shm"]):
        with CheckpointManager(durable, keep_last=1) as manager:
            manager.save(opts["step"], state)
    local = _node_dir(opts, rank) if nodes == 2 else opts["shm"]
    with CheckpointManager(
        opts["durable"], keep_last=1, local=NodeLocal(local, every=1, keep=1)
    ) as manager:
        manager.save_local(opts["step"], state)
    out.put((rank, {}))


def _peer_child(rank: int, port: int, opts: dict[str, Any], out: Any) -> None:
    import torch

    from ddpstate.dist import barrier
    from ddpstate.manager import CheckpointManager, NodeLocal

    _join(rank, port, local_rank=0)
    weights = _state(opts["size_mib"], 0.0)
    state = {"weights": weights}
    times: dict[str, list[float]] = {v: [] for v in _PEER_VARIANTS}
    for _ in range(opts["repeats"]):
        for variant in _PEER_VARIANTS:
            if variant == "peer" and rank == 1:
                shutil.rmtree(_node_dir(opts, 1))  # node 1 was replaced: its /dev/shm is empty
            if variant == "durable, disk cold" and rank == 0:
                _evict(Path(opts["durable"]))
            with torch.no_grad():
                for t in weights.values():
                    t.zero_()
            barrier()
            local_dir = _node_dir(opts, rank) if variant in ("peer", "local") else None
            durable = opts["durable_shm"] if variant.endswith("/dev/shm") else opts["durable"]
            start = time.perf_counter()
            with CheckpointManager(
                durable, keep_last=1, local=NodeLocal(local_dir) if local_dir else None
            ) as manager:
                step = manager.restore(state)
                source = manager.restored_from
            times[variant].append(time.perf_counter() - start)
            want = "durable" if variant.startswith("durable") else "local"
            want = "peer" if variant == "peer" and rank == 1 else want
            assert step == opts["step"] and source is not None and source.tier == want, source
            assert weights["w000"][0].item() == opts["value"], "restored the wrong values"
    out.put((rank, times))


def _peer_rows(opts: dict[str, Any], repeats: int) -> dict[str, dict[str, float]]:
    """Median restore() time per variant: on the receiving node (rank 1) and the slower rank."""
    peer_opts = {**opts, "nodes": 2, "repeats": repeats}
    _spawn(_setup_child, peer_opts)
    _, res = _spawn(_peer_child, peer_opts)
    return {
        v: {
            "receiver": statistics.median(res[1][v]),
            "slower": statistics.median(
                max(a, b) for a, b in zip(res[0][v], res[1][v], strict=True)
            ),
        }
        for v in _PEER_VARIANTS
    }


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


# --------------------------------------------------------------------------- torchrun restart

#: The restart's phases, in order, as (key, what ends at that moment).
_PHASES = (
    ("detected", "agent detects the failure, SIGTERMs the survivors"),
    ("stopped", "survivors exited (agent logs the failure)"),
    ("restarting", "agent's rendezvous done, starts the new workers"),
    ("spawned", "restarted workers spawned (process start, /proc)"),
    ("python", "Python up, the script starts"),
    ("torch", "torch imported"),
    ("imported", "ddpstate imported"),
    ("joined", "init_distributed: group joined"),
    ("built", "state built (the model's tensors allocated)"),
    ("restored", "manager.restore done"),
    ("first_step", "first step done"),
)


def _process_start() -> float:
    """This process's start, in ``time.time()`` seconds (10 ms resolution, from /proc)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def _worker(opts: dict[str, Any]) -> None:
    """One torchrun worker: attempt 0 dies (rank 1, SIGKILL); attempt 1 restores and steps."""
    marks = {"spawned": _process_start(), "python": time.time()}
    import torch
    import torch.distributed as dist

    marks["torch"] = time.time()
    import ddpstate
    from ddpstate.manager import CheckpointManager, NodeLocal

    marks["imported"] = time.time()
    ctx = ddpstate.init_distributed()
    marks["joined"] = time.time()
    weights = _state(opts["size_mib"], 0.0)
    state = {"weights": weights}
    marks["built"] = time.time()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    local_dir = opts["shm"] if opts["tier"] == "local" else None
    one = torch.ones(1)
    with CheckpointManager(
        opts["durable"],
        keep_last=1,
        local=NodeLocal(local_dir) if local_dir else None,
        handle_signals=True,
    ) as manager:
        if attempt == 0:
            if opts["evict"] and ctx.rank == 0:
                _evict(Path(opts["durable"]))
            dist.barrier()
            if ctx.rank == 1:
                with open(os.path.join(opts["out"], "killed"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), 9)  # the crash
            while not manager.should_stop():  # rank 0 trains on, as the trainer's loop
                dist.all_reduce(one)
            return
        step = manager.restore(state)
        marks["restored"] = time.time()
        source = manager.restored_from
        with torch.no_grad():  # the first training step: update, then DDP's all-reduce
            for t in weights.values():
                t.add_(1.0)
        dist.all_reduce(one)
        marks["first_step"] = time.time()
    assert weights["w000"][0].item() == opts["value"] + 1.0, "restored the wrong values"
    result = {"marks": marks, "step": step, "tier": source and source.tier}
    with open(os.path.join(opts["out"], f"rank{ctx.rank}.json"), "w") as f:
        json.dump(result, f)


_AGENT_LINE = re.compile(r"^[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+) \d+ \S+\] (.*)$")
# The agent's log lines that end its phases (torch's elastic agent, LOGLEVEL=INFO).
_AGENT_EVENTS = {
    "detected": "",  # its first line after the kill
    "stopped": "failed (exitcode",
    "restarting": "Starting worker group",
}


def _agent_times(log: str, after: float) -> dict[str, float]:
    """When the agent logged each of ``_AGENT_EVENTS`` after ``after`` (glog lines, local time)."""
    base = time.localtime(after)
    midnight = time.mktime((base.tm_year, base.tm_mon, base.tm_mday, 0, 0, 0, 0, 0, -1))
    found: dict[str, float] = {}
    for line in log.splitlines():
        match = _AGENT_LINE.match(line)
        if not match:
            continue
        h, m, sec, message = match.groups()
        at = midnight + int(h) * 3600 + int(m) * 60 + float(sec)
        if at < after:
            continue
        for event, text in _AGENT_EVENTS.items():
            if event not in found and text in message:
                found[event] = at
    return found


def _torchrun_restart(opts: dict[str, Any], monitor: float) -> dict[str, float]:
    """One torchrun --max-restarts=1 run; each phase's end, in seconds after the kill."""
    out = tempfile.mkdtemp(prefix="ddpstate-restart-")
    try:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=2", "--max-restarts=1", f"--monitor-interval={monitor}",
            "-m", "benchmarks.local_tier", "--worker", json.dumps({**opts, "out": out}),
        ]  # fmt: skip
        env = {**os.environ, "LOGLEVEL": "INFO", "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stderr[-4000:]}")
        with open(os.path.join(out, "killed")) as f:
            killed = float(f.read())
        ranks = []
        for rank in range(2):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert all(r["tier"] == opts["tier"] and r["step"] == opts["step"] for r in ranks), ranks
    agent = _agent_times(done.stderr, killed)
    phases = {event: agent.get(event, math.nan) - killed for event in _AGENT_EVENTS}
    for key, _ in _PHASES[len(_AGENT_EVENTS) :]:
        # The slower rank: the job moves at its pace.
        phases[key] = max(r["marks"][key] for r in ranks) - killed
    return phases


def _restart_rows(opts: dict[str, Any], repeats: int, monitor: float) -> dict[str, Any]:
    """Median phase ends per variant: local tier, durable tier on disk (cold, warm)."""
    variants = {
        "local": {"tier": "local", "evict": False},
        "durable, cold": {"tier": "durable", "evict": True},
        "durable, warm": {"tier": "durable", "evict": False},
    }
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(repeats):
        for variant, extra in variants.items():
            runs[variant].append(_torchrun_restart({**opts, **extra}, monitor))
    return {
        v: {k: statistics.median(r[k] for r in rs) for k, _ in _PHASES} for v, rs in runs.items()
    }


def _evict(folder: Path) -> None:
    for file in folder.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _table(rows: Sequence[tuple[str, ...]]) -> None:
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _print_stall(stall: list[dict[str, Any]], saves: int, sync_saves: int) -> dict[str, float]:
    local = statistics.median(max(r["local"][i] for r in stall) for i in range(saves))
    steady = statistics.median(max(r["local"][i] for r in stall) for i in range(1, saves))
    sync = statistics.median(max(r["sync"][i] for r in stall) for i in range(sync_saves))
    _table(
        [
            ("measure", "local tier", "baseline", "ratio", "target"),
            ("---",) * 5,
            (f"loop stall per save_local (median of {saves})", f"{local:.3f} s",
             f"sync durable save {sync:.3f} s", f"{local / sync:.3f}", "<= 0.1"),
            ("loop stall, steady (buffers reused)", f"{steady:.3f} s", f"{sync:.3f} s",
             f"{steady / sync:.3f}", "<= 0.1"),
        ]
    )  # fmt: skip
    return {"stall": local, "steady": steady, "sync": sync}


def _print_restart(rows: dict[str, dict[str, float]], repeats: int, monitor: float) -> None:
    variants = list(rows)
    print(
        f"\ntorchrun --max-restarts=1 --monitor-interval={monitor}: rank 1 is SIGKILLed; each "
        f"phase's duration (its end, in s after the kill), median of {repeats}, slower rank"
    )
    lines = [("phase", *variants), ("---",) * (1 + len(variants))]
    before = dict.fromkeys(variants, 0.0)
    for key, what in _PHASES:
        cells = []
        for v in variants:
            cells.append(f"{rows[v][key] - before[v]:.2f} ({rows[v][key]:.2f})")
            before[v] = rows[v][key]
        lines.append((what, *cells))
    _table(lines)
    local = rows["local"]
    print()
    lines = [("measure", "local tier", "baseline", "ratio", "target"), ("---",) * 5]
    for base in variants[1:]:
        durable = rows[base]
        for measure, start, end, target in (
            ("restart: kill to first step", None, "first_step", "<= 0.5"),
            ("restart: spawn to first step", "spawned", "first_step", "<= 0.5"),
            ("the restore() call alone", "built", "restored", ""),
        ):
            ours = local[end] - (local[start] if start else 0.0)
            theirs = durable[end] - (durable[start] if start else 0.0)
            lines.append(
                (measure, f"{ours:.2f} s", f"{base} {theirs:.2f} s", f"{ours / theirs:.2f}", target)
            )
        # What the local tier could reach at best: its restart with restore() taking no time.
        floor = local["first_step"] - (local["restored"] - local["built"])
        lines.append(
            (
                "lower bound: kill to first step with a 0 s restore()",
                f"{floor:.2f} s",
                f"{base} {durable['first_step']:.2f} s",
                f"{floor / durable['first_step']:.2f}",
                "",
            )
        )
    _table(lines)


def _print_peer(rows: dict[str, dict[str, float]], repeats: int) -> None:
    print(
        f'\n2 "nodes" (one local folder each): the restore() call, median of {repeats}, on '
        f"node 1's rank (on the slower rank)"
    )
    lines = [("measure", "ours", "baseline", "ratio"), ("---",) * 4]
    for ours, measure in (
        ("peer", "node 1 lacks the step: receive it from node 0"),
        ("local", "both nodes hold it: the local tier"),
    ):
        for base in _PEER_VARIANTS[2:]:
            mine, durable = rows[ours], rows[base]
            lines.append(
                (
                    measure,
                    f"{mine['receiver']:.2f} s ({mine['slower']:.2f} s)",
                    f"{base} {durable['receiver']:.2f} s ({durable['slower']:.2f} s)",
                    f"{mine['receiver'] / durable['receiver']:.2f}",
                )
            )
    _table(lines)


def _size_mib(text: str) -> int:
    """``1024``, ``64M``, ``1G`` -> MiB."""
    scale = {"M": 1, "G": 1024}.get(text[-1:].upper(), 0)
    return int(text[:-1]) * scale if scale else int(text)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size",
        "--size-mib",
        dest="size",
        type=_size_mib,
        default=1024,
        help="state per rank: MiB, or 64M / 1G (default 1G)",
    )
    parser.add_argument(
        "--only",
        default="stall,restart,peer",
        help="comma-separated parts to run: stall, restart, peer",
    )
    parser.add_argument("--saves", type=int, default=4, help="local saves timed")
    parser.add_argument("--sync-saves", type=int, default=2, help="durable sync saves timed")
    parser.add_argument("--restarts", type=int, default=2, help="torchrun restarts per variant")
    parser.add_argument("--peer-repeats", type=int, default=3, help="peer restores per variant")
    parser.add_argument(
        "--monitor-interval",
        type=float,
        default=0.1,
        help="torchrun's --monitor-interval (its default: 0.1 s)",
    )
    parser.add_argument("--work", default=None, help="folder on the local disk (default: cwd)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # torchrun's workers
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(json.loads(args.worker))
        return {}
    parts = set(args.only.split(","))
    work = Path(tempfile.mkdtemp(prefix="ddpstate-local-bench-", dir=args.work or os.getcwd()))
    shm = Path(tempfile.mkdtemp(prefix="ddpstate-local-bench-", dir="/dev/shm"))
    opts: dict[str, Any] = {
        "size_mib": args.size,
        "saves": args.saves,
        "sync_saves": args.sync_saves,
        "durable": str(work / "run"),
        "durable_shm": str(shm / "run"),
        "shm": str(shm / "tier"),
        "step": 7,
        "value": 7.0,
    }
    result: dict[str, Any] = {}
    print(f"2 gloo ranks, {args.size} MiB state per rank, durable tier on {work.parent}")
    try:
        if "stall" in parts:
            _, stall = _spawn(_stall_child, {**opts, "durable": str(work / "stall")})
            result.update(_print_stall(stall, args.saves, args.sync_saves))
        if "restart" in parts:
            _spawn(_setup_child, opts)
            rows = _restart_rows(opts, args.restarts, args.monitor_interval)
            _print_restart(rows, args.restarts, args.monitor_interval)
            result["restart"] = rows
        if "peer" in parts:
            shutil.rmtree(work / "run", ignore_errors=True)
            rows = _peer_rows(opts, args.peer_repeats)
            _print_peer(rows, args.peer_repeats)
            result["peer"] = rows
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
