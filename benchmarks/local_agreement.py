"""The local tier's restore round at 8 to 1,024 ranks: all-gather against one gather to rank 0.

``restore()`` with a node-local tier starts with one round in which every rank
reports its share of its node's check and the ranks agree on a step
(``_manager/local_check.newest_on_nodes``). It was an all-gather: every rank
read every rank's findings and decided alone (N payloads read per rank, N^2 in
all). Now the findings go to rank 0 alone, which decides and answers every
rank with what is small (``dist.gather_to_receivers``). Simulated as
``benchmarks.scale`` does: one real TCPStore server, N threads each with its own
client, released at once; the payloads are real findings (``check_share_of_step``
on a real local step, 8 ranks a node) and rank 0 runs the real decision
(``_Agreement``); the all-gather side runs the same decision on every rank, as
before. Median round time over ``--rounds``; the all-gather is skipped above
``--baseline-max`` ranks (at 1,024 one round takes minutes here).

    python -m benchmarks.local_agreement --rounds 3
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import statistics
import tempfile

from benchmarks.scale import TIMEOUT, _clients, _Ranks

_PER_NODE = 8


def _reports(n: int) -> list[bytes]:
    """Every rank's findings on a sound local step, as ``newest_on_nodes`` sends them."""
    import torch

    from ddpstate._manager.local_check import check_share_of_step
    from ddpstate.manager import CheckpointManager, NodeLocal

    root = tempfile.mkdtemp(prefix="ddpstate-agreement-")
    try:
        state = {"model": torch.nn.Linear(256, 256), "extra": torch.zeros(4096)}
        local = os.path.join(root, "local")
        with CheckpointManager(os.path.join(root, "run"), local=NodeLocal(local, every=1)) as m:
            m.save_local(7, state)
        shares = [check_share_of_step(local, 7, (i, _PER_NODE)) for i in range(_PER_NODE)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = []
    for rank in range(n):
        local = rank % _PER_NODE
        report = {
            "main": local == 0,
            "node": rank - local,
            "committed": [6, 7] if local == 0 else None,
            "durable": 5 if rank == 0 else None,
            **shares[local],
        }
        out.append(pickle.dumps(report))
    return out


def _round_times(n: int, rounds: int, baseline: bool) -> dict[str, float]:
    from ddpstate import _collectives as c
    from ddpstate._manager.local_check import _Agreement

    server, clients = _clients(n)
    groups = [c.StoreGroup.join(store, r, n) for r, store in enumerate(clients)]
    payloads = _reports(n)
    expected = {m: 7 for m in range(0, n, _PER_NODE)}

    def gather_to_rank_0(rank: int) -> None:
        def decide(raw: list[bytes]) -> bytes:
            return pickle.dumps(_Agreement().first([pickle.loads(b) for b in raw]))

        answer = pickle.loads(
            c.gather_to_receivers(groups[rank], payloads[rank], 0, "agree", TIMEOUT, decide)
        )
        assert answer["held"] == expected

    def all_gather(rank: int) -> None:
        raw = c.gather(groups[rank], payloads[rank], None, "agree", TIMEOUT)
        assert raw is not None
        assert _Agreement().first([pickle.loads(b) for b in raw])["held"] == expected

    ranks = _Ranks(n)
    try:
        times: dict[str, list[float]] = {"gather to rank 0 + answer (now)": []}
        if baseline:
            times["all-gather (before)"] = []
        for _ in range(rounds):
            times["gather to rank 0 + answer (now)"].append(ranks.run(gather_to_rank_0))
            if baseline:
                times["all-gather (before)"].append(ranks.run(all_gather))
    finally:
        ranks.close()
        del server, clients
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="8,64,256,1024", help="comma-separated world sizes")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per variant")
    parser.add_argument("--baseline-max", type=int, default=256, help="largest all-gather run")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.ranks.split(",")]
    result = {}
    print(
        f"the local tier's restore round, {_PER_NODE} ranks a node, simulated ranks on one "
        f"TCPStore, median of {args.rounds}"
    )
    print("| ranks | gather to rank 0 + answer (now) | all-gather (before) | ratio |")
    print("| --- | --- | --- | --- |")
    for n in sizes:
        times = _round_times(n, args.rounds, n <= args.baseline_max)
        now = times["gather to rank 0 + answer (now)"]
        before = times.get("all-gather (before)")
        shown = f"{before * 1000:.1f} ms" if before else "(skipped)"
        ratio = f"{now / before:.3f}" if before else ""
        print(f"| {n:,} | {now * 1000:.1f} ms | {shown} | {ratio} |")
        result[n] = times
    return result


if __name__ == "__main__":
    main()
