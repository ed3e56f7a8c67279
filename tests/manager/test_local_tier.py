"""CheckpointManager's node-local tier: real files, real 2-rank gloo groups, real full disks."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpstate.errors import InvalidArgumentError
from ddpstate.manager import MANIFEST_NAME, CheckpointManager, NodeLocal, verify_checkpoint
from tests.manager.test_manager import _assert_bitwise
from tests.manager.test_manager_dist import _build, _contents, _draws, _step
from tests.multiproc import run_ranks

# --------------------------------------------------------------------------- one process


def test_save_local_writes_due_steps_and_keeps_the_newest(tmp_path: Path) -> None:
    local = tmp_path / "shm"
    model = nn.Linear(4, 4)
    with CheckpointManager(tmp_path / "run", local=NodeLocal(local, every=3, keep=2)) as m:
        written = [s for s in range(1, 13) if m.save_local(s, {"model": model, "step": s})]
    assert written == [3, 6, 9, 12]
    assert sorted(p.name for p in local.iterdir()) == ["step_0000000009", "step_0000000012"]
    check = verify_checkpoint(local / "step_0000000012")  # same layout and manifest as durable
    assert check.ok, check.problems
    assert not (tmp_path / "run").exists()  # the durable tier is the caller's business
    assert local.exists()  # close() leaves the local tier for a restart


def test_restore_takes_the_newest_tier_and_reports_it(tmp_path: Path) -> None:
    local = tmp_path / "shm"
    model = nn.Linear(4, 4)
    with CheckpointManager(tmp_path / "run", local=NodeLocal(local, every=5)) as m:
        for s in range(1, 11):
            with torch.no_grad():
                model.weight.fill_(float(s))
            m.save_local(s, {"model": model})
            if s == 7:
                m.save(s, {"model": model})
    fresh = nn.Linear(4, 4)
    with CheckpointManager(tmp_path / "run", local=NodeLocal(local, every=5)) as m:
        assert m.restore({"model": fresh}) == 10
        assert m.restored_from is not None
        assert (m.restored_from.tier, m.restored_from.step) == ("local", 10)
        assert torch.equal(fresh.weight, torch.full((4, 4), 10.0))
        m.save(12, {"model": fresh})  # now the durable tier is newer
        assert m.restore({"model": fresh}) == 12
        assert m.restored_from.tier == "durable"
        # An explicit step always comes from the durable tier.
        assert m.restore({"model": fresh}, step=7) == 7
        assert m.restored_from.tier == "durable"
        m.clear_local()
    assert not local.exists()
    assert (tmp_path / "run" / "step_0000000012" / MANIFEST_NAME).exists()


def test_a_newer_durable_step_only_a_retired_copy_holds_beats_an_older_local_step(
    tmp_path: Path,
) -> None:
    """A re-save of durable step 7 killed between its two renames leaves step 7 only as
    .step_7.ddpstate-old-<hex>: the local tier's step 5 was taken as the newest step."""
    local, model = tmp_path / "shm", nn.Linear(4, 4)
    with CheckpointManager(tmp_path / "run", local=NodeLocal(local, every=5)) as m:
        for s in (5, 7):
            with torch.no_grad():
                model.weight.fill_(float(s))
            m.save_local(s, {"model": model})
            m.save(s, {"model": model})
        folder = Path(m.checkpoint_path(7))
        retired = folder.with_name(f".{folder.name}.ddpstate-old-0123456789abcdef")
        folder.rename(retired)
        fresh = nn.Linear(4, 4)
        with pytest.warns(UserWarning, match="reading step 7 from"):
            assert m.restore({"model": fresh}) == 7
        assert m.restored_from is not None and m.restored_from.tier == "durable"
        assert m.restored_from.path == str(retired)
        assert torch.equal(fresh.weight, torch.full((4, 4), 7.0))


def test_save_local_needs_a_local_dir_and_valid_settings(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m, pytest.raises(InvalidArgumentError, match="local_dir"):
        m.save_local(1, {"w": torch.ones(1)})
    with pytest.raises(InvalidArgumentError, match="local_every"):
        CheckpointManager(tmp_path, local=NodeLocal(tmp_path / "shm", every=0))
    with pytest.raises(InvalidArgumentError, match="URL"):
        CheckpointManager(tmp_path, local=NodeLocal("memory://shm"))


def test_a_local_write_error_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    model = nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(tmp_path / "run", local=NodeLocal(blocker / "shm", every=1)) as m:
            for s in range(1, 5):
                m.save_local(s, {"model": model})
            m.save(4, {"model": model})
        skipped = m.local_skipped  # after close(), which waited for the last local write
    local_warnings = [w for w in caught if "node-local tier skipped" in str(w.message)]
    assert len(local_warnings) == 1, [str(w.message) for w in caught]
    assert "step 1" in str(local_warnings[0].message)
    assert [s for s, _ in skipped] == [1, 2, 3, 4]
    assert all("NotADirectoryError" in why for _, why in skipped)
    assert verify_checkpoint(tmp_path / "run" / "step_0000000004").ok


# --------------------------------------------------------------------------- 2-rank gloo groups


def _local_dir(base: str, rank: int, nodes: int) -> str:
    return os.path.join(base, f"node{rank % nodes}")


def _train_with_tiers(
    rank: int, world: int, directory: str, local_base: str, nodes: int, refs: str
) -> dict[str, Any]:
    state, loader = _build(seed=0)
    state["sampler"].set_epoch(1)
    batches = iter(loader)
    local = _local_dir(local_base, rank, nodes)
    with CheckpointManager(directory, local=NodeLocal(local, every=5)) as manager:
        for step in range(1, 6):
            _step(state, *next(batches))
            state["epoch"] = step
            if step == 2:
                manager.save(step, state)
            manager.save_local(step, state)
    draws = _draws()
    torch.save(_contents(state), os.path.join(refs, f"rank{rank}.pt"))
    return {"draws": draws, "rest": [x.tolist() for x, _ in batches]}


def _restore_with_tiers(
    rank: int, world: int, directory: str, local_base: str, nodes: int, refs: str, sender: int
) -> dict[str, Any]:
    state, loader = _build(seed=1)  # different weights: everything must come from a tier
    local = _local_dir(local_base, rank, nodes)
    with CheckpointManager(directory, local=NodeLocal(local, every=5)) as manager:
        step = manager.restore(state)
        source = manager.restored_from
    draws = _draws()
    if step == 5:
        # The sending node's state: under DDP the same as rank 0's, except BatchNorm
        # statistics, which each rank keeps (DDP broadcasts rank 0's at the next forward).
        _assert_bitwise(_contents(state), torch.load(os.path.join(refs, f"rank{sender}.pt")))
    state["sampler"].set_epoch(state["sampler"].epoch)
    rest = [x.tolist() for x, _ in loader]
    assert source is not None
    return {
        "step": step,
        "tier": source.tier,
        "sender": source.sender,
        "path": source.path,
        "draws": draws,
        "rest": rest,
        "epoch": state["epoch"],
    }


def _run_both(
    tmp_path: Path, nodes: int, damage: Any = None, sender: int = 0
) -> tuple[list[Any], list[Any]]:
    args = (str(tmp_path / "run"), str(tmp_path / "shm"), nodes, str(tmp_path))
    # LOCAL_RANK=0 on both ranks makes each its own "node" with its own local folder.
    env = {"LOCAL_RANK": "0"} if nodes == 2 else {}
    before = run_ranks(_train_with_tiers, 2, args=args, env=env)
    if damage is not None:
        damage(tmp_path / "shm")
    after = run_ranks(_restore_with_tiers, 2, args=(*args, sender), env=env)
    return before, after


@pytest.mark.slow
def test_two_ranks_restore_the_local_step_bitwise(tmp_path: Path) -> None:
    before, after = _run_both(tmp_path, nodes=1)
    for rank in range(2):
        assert (after[rank]["step"], after[rank]["tier"]) == (5, "local")
        assert after[rank]["epoch"] == 5
        assert after[rank]["draws"] == before[rank]["draws"]  # each rank's own RNG
        assert after[rank]["rest"] == before[rank]["rest"]  # the rest of the epoch
    assert before[0]["draws"] != before[1]["draws"]


@pytest.mark.slow
def test_a_node_without_the_local_step_receives_it_from_another(tmp_path: Path) -> None:
    def wipe_node1(shm: Path) -> None:
        assert (shm / "node1" / "step_0000000005" / MANIFEST_NAME).exists()
        shutil.rmtree(shm / "node1")  # a replaced node, or a wiped /dev/shm

    before, after = _run_both(tmp_path, nodes=2, damage=wipe_node1)
    assert (after[0]["tier"], after[0]["sender"]) == ("local", None)
    assert (after[1]["tier"], after[1]["sender"]) == ("peer", 0)
    for rank in range(2):
        assert after[rank]["step"] == 5
        assert after[rank]["draws"] == before[rank]["draws"]
        assert after[rank]["rest"] == before[rank]["rest"]
    # The receiving node now holds the step itself, verified like any other.
    assert verify_checkpoint(tmp_path / "shm" / "node1" / "step_0000000005").ok


@pytest.mark.slow
def test_the_newest_step_of_any_node_wins(tmp_path: Path) -> None:
    def node0_lost_step5(shm: Path) -> None:
        (shm / "node0" / "step_0000000005" / MANIFEST_NAME).unlink()  # uncommitted there

    _, after = _run_both(tmp_path, nodes=2, damage=node0_lost_step5, sender=1)
    assert [(a["step"], a["tier"], a["sender"]) for a in after] == [
        (5, "peer", 1),
        (5, "local", None),
    ]


@pytest.mark.slow
def test_no_complete_local_step_falls_back_to_durable(tmp_path: Path) -> None:
    def uncommit_everywhere(shm: Path) -> None:
        for manifest in shm.glob(f"node*/step_*/{MANIFEST_NAME}"):
            manifest.unlink()  # killed before the commit marker

    _, after = _run_both(tmp_path, nodes=2, damage=uncommit_everywhere)
    for rank in range(2):
        assert (after[rank]["step"], after[rank]["tier"]) == (2, "durable")
        assert after[rank]["epoch"] == 2
        assert after[rank]["path"] == str(tmp_path / "run" / "step_0000000002")


@pytest.mark.slow
def test_a_corrupt_local_step_is_skipped_for_the_durable_one(tmp_path: Path) -> None:
    def corrupt(shm: Path) -> None:
        for model in shm.glob("node*/step_*/model.pt"):
            data = bytearray(model.read_bytes())
            data[len(data) // 2] ^= 0xFF
            model.write_bytes(bytes(data))

    _, after = _run_both(tmp_path, nodes=2, damage=corrupt)
    assert [(a["step"], a["tier"]) for a in after] == [(2, "durable"), (2, "durable")]


# --------------------------------------------------------------------------- out of space


def _train_on_a_full_local_tier(
    rank: int, world: int, directory: str, local: str, fsize_limit: int
) -> dict[str, Any]:
    if fsize_limit:
        # Past RLIMIT_FSIZE a write fails with EFBIG (SIGXFSZ ignored, as on a full disk).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, resource.RLIM_INFINITY))
    torch.manual_seed(0)
    model = DDP(nn.Linear(512, 512))  # 1 MiB of weights: larger than the local tier's space
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(directory, local=NodeLocal(local, every=2)) as manager:
            for step in range(1, 7):
                model(torch.randn(4, 512)).sum().backward()
                opt.step()
                opt.zero_grad()
                steps += 1
                manager.save_local(step, {"model": model, "opt": opt})
                if step == 6:
                    manager.wait()
                    if fsize_limit:  # the durable tier has room: lift the limit for it
                        resource.setrlimit(
                            resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
                        )
                    manager.save(step, {"model": model, "opt": opt})
        skipped = manager.local_skipped
    texts = [str(w.message) for w in caught if "node-local tier" in str(w.message)]
    return {"steps": steps, "skipped": skipped, "warnings": texts}


def _check_full_tier_outcome(results: list[Any], directory: Path, local: Path) -> None:
    for rank, result in enumerate(results):
        assert result["steps"] == 6
        if rank == 0:  # the node's writer
            assert [s for s, _ in result["skipped"]] == [2, 4, 6]
            assert len(result["warnings"]) == 1
        else:
            # The writer's skips as it knew them at the last due save (step 6's write
            # failed after it), without a warning of its own.
            assert [s for s, _ in result["skipped"]] == [2, 4]
            assert result["skipped"] == results[0]["skipped"][:2]
            assert result["warnings"] == []
    assert verify_checkpoint(directory / "step_0000000006").ok
    # Nothing half-written is left to fill the tier further.
    assert not list(local.glob("*/*")) if local.exists() else True


@pytest.mark.slow
def test_rlimit_fsize_on_the_local_tier_never_stops_training(tmp_path: Path) -> None:
    results = run_ranks(
        _train_on_a_full_local_tier,
        2,
        args=(str(tmp_path / "run"), str(tmp_path / "shm"), 256 << 10),
    )
    assert all("EFBIG" in why or "File too large" in why for _, why in results[0]["skipped"])
    _check_full_tier_outcome(results, tmp_path / "run", tmp_path / "shm")


@contextlib.contextmanager
def _tiny_tmpfs(path: Path) -> Iterator[Path]:
    path.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.slow
def test_enospc_on_a_tiny_tmpfs_never_stops_training(tmp_path: Path) -> None:
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with _tiny_tmpfs(tmp_path / "tmpfs") as shm:
        results = run_ranks(
            _train_on_a_full_local_tier, 2, args=(str(tmp_path / "run"), str(shm / "job"), 0)
        )
        assert all("No space left" in why for _, why in results[0]["skipped"])
        _check_full_tier_outcome(results, tmp_path / "run", shm / "job")


def _four_ranks_two_nodes(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank % 2)  # ranks 0-1 on node 0, ranks 2-3 on node 1
    local = os.path.join(root, "shm", f"node{rank // 2}")
    model = DDP(nn.Linear(64, 64))
    with CheckpointManager(os.path.join(root, "run"), local=NodeLocal(local, every=3)) as m:
        for step in range(1, 7):
            with torch.no_grad():
                model.module.weight.fill_(float(step))
            m.save_local(step, {"model": model})
        draws = _draws()
    # close() waits for this rank's own local write only: node 1's writer (rank 2) may
    # still be finishing its step 6, so the "replacement" waits for every node's close.
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(root, "shm", "node1"))  # node 1 is replaced
    # Every rank waits until the wipe is done before restoring.
    torch.distributed.barrier()
    fresh = DDP(nn.Linear(64, 64))
    with CheckpointManager(os.path.join(root, "run"), local=NodeLocal(local, every=3)) as m:
        step = m.restore({"model": fresh})
        source = m.restored_from
    assert source is not None
    return {
        "step": step,
        "tier": source.tier,
        "sender": source.sender,
        "weight": fresh.module.weight[0, 0].item(),
        "same_draws": _draws() == draws,
    }


@pytest.mark.slow
def test_four_ranks_on_two_nodes_the_replaced_node_receives_once(tmp_path: Path) -> None:
    results = run_ranks(_four_ranks_two_nodes, 4, args=(str(tmp_path),))
    assert [(r["tier"], r["sender"]) for r in results] == [
        ("local", None),
        ("local", None),
        ("peer", 0),
        ("peer", 0),
    ]
    assert all(r["step"] == 6 and r["weight"] == 6.0 and r["same_draws"] for r in results)
    assert verify_checkpoint(tmp_path / "shm" / "node1" / "step_0000000006").ok


# --------------------------------------------------------------------------- store traffic


def _count_store_operations(rank: int, world: int, root: str) -> dict[str, Any]:
    from ddpstate import dist as ddp_dist
    from tests.collectives.test_collectives_threads import Counting

    counting = Counting(ddp_dist._default_store())
    # The same client object every time, so ddpstate keeps one group view over it.
    ddp_dist._default_store = lambda: counting
    model = DDP(nn.Linear(64, 64))
    per_step: dict[int, dict[str, int]] = {}
    started: dict[int, bool] = {}
    with CheckpointManager(
        os.path.join(root, "run"), local=NodeLocal(os.path.join(root, "shm"), every=2)
    ) as m:
        for step in range(1, 7):
            counting.ops.clear()
            started[step] = m.save_local(step, {"model": model})
            per_step[step] = dict(counting.ops)
            torch.distributed.barrier()  # the backend's own, outside the count
    return {"ops": per_step, "started": started}


@pytest.mark.slow
def test_a_due_save_local_costs_the_non_writer_three_store_operations(tmp_path: Path) -> None:
    results = run_ranks(_count_store_operations, 2, args=(str(tmp_path),))
    non_writer = results[1]["ops"]
    assert [non_writer[s] for s in (1, 3, 5)] == [{}, {}, {}]  # not due: no collective
    for step in (2, 4, 6):
        ops = dict(non_writer[step])
        # Due: send its RNG states and read whether the node's write started (an all-gather
        # would read every rank's RNG states); as the last arriver it may also mark the
        # arrival (set) and delete the last call's keys.
        tidying = {k: ops.pop(k) for k in ("set", "delete_key") if k in ops}
        # (the call's identity travels in the appended record; the last arriver reads the log)
        assert ops == {"append": 1, "add": 1, "get": 2 if tidying else 1}, ops
        assert tidying in ({}, {"set": 1, "delete_key": 4}), non_writer[step]
    # The outcome is shared: the writer started the node's write, and every rank knows it.
    for result in results:
        assert result["started"] == {1: False, 2: True, 3: False, 4: True, 5: False, 6: True}
    assert verify_checkpoint(tmp_path / "shm" / "step_0000000006").ok


# --------------------------------------------------------------------------- restart cost

_RESTORE_ONLY = """
import sys, torch
from ddpstate.manager import CheckpointManager, NodeLocal
model = torch.nn.Linear(4, 4)
with CheckpointManager(sys.argv[1], local=NodeLocal(sys.argv[2])) as m:
    assert m.restore({"model": model}) == 1 and m.restored_from.tier == "local"
assert torch.equal(model.weight, torch.ones(4, 4))
print("torch._dynamo" in sys.modules)
"""


@pytest.mark.slow
def test_restore_does_not_import_torch_dynamo(tmp_path: Path) -> None:
    # Importing torch._dynamo to recognise compiled wrappers took seconds of every restart;
    # a process that never compiled holds no compiled module to recognise.
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(1.0)
    with CheckpointManager(tmp_path / "run", local=NodeLocal(tmp_path / "shm")) as m:
        m.save_local(1, {"model": model})
    done = subprocess.run(
        [sys.executable, "-c", _RESTORE_ONLY, str(tmp_path / "run"), str(tmp_path / "shm")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"


def _restore_with_a_failing_receive(rank: int, world: int, directory: str, local_base: str) -> Any:
    local = _local_dir(local_base, rank, 2)
    if rank == 1:
        # Node 1 lacks the step and cannot write what it receives: EFBIG past 4 KiB.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 10, resource.RLIM_INFINITY))
    state, _ = _build(seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(directory, local=NodeLocal(local, every=5)) as manager:
            step = manager.restore(state)
            source = manager.restored_from
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert source is not None
    return {
        "step": step,
        "tier": source.tier,
        "warnings": [str(w.message) for w in caught if "sending local step" in str(w.message)],
    }


@pytest.mark.slow
def test_a_failed_receive_falls_back_to_durable_on_every_rank(tmp_path: Path) -> None:
    args = (str(tmp_path / "run"), str(tmp_path / "shm"), 2, str(tmp_path))
    run_ranks(_train_with_tiers, 2, args=args, env={"LOCAL_RANK": "0"})
    shutil.rmtree(tmp_path / "shm" / "node1")  # a replaced node
    after = run_ranks(
        _restore_with_a_failing_receive,
        2,
        args=(str(tmp_path / "run"), str(tmp_path / "shm")),
        env={"LOCAL_RANK": "0"},
    )
    assert [(a["step"], a["tier"]) for a in after] == [(2, "durable"), (2, "durable")]
    (warning,) = after[0]["warnings"]  # rank 0 names the rank whose receive failed
    assert warning.startswith("CheckpointManager.restore: sending local step 5 to the nodes")
    assert "rank 1: " in warning and "restoring from the durable tier instead" in warning
    assert after[1]["warnings"] == []
    assert not (tmp_path / "shm" / "node1" / "step_0000000005").exists()


def _agree_counting_reads(rank: int, world: int, root: str) -> dict[str, Any]:
    from ddpstate import dist as ddp_dist
    from ddpstate._manager.local_check import newest_on_nodes
    from tests.collectives.test_collectives_threads import Counting

    class Reads(Counting):
        """Counts operations, and the bytes ``get`` returns."""

        read = 0

        def __getattr__(self, name: str) -> Any:
            call = super().__getattr__(name)
            if name != "get":
                return call

            def get(*args: Any) -> Any:
                value = call(*args)
                self.read += len(value)
                return value

            return get

    counting = Reads(ddp_dist._default_store())
    ddp_dist._default_store = lambda: counting
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["LOCAL_RANK"] = str(rank % 2)
    local = os.path.join(root, f"node{rank // 2}")
    with CheckpointManager(os.path.join(root, "run"), local=NodeLocal(local, every=1)) as m:
        m.save_local(3, {"model": nn.Linear(64, 64), "extra": torch.zeros(1000)})
    torch.distributed.barrier()
    counting.ops.clear()
    counting.read = 0
    held, durable = newest_on_nodes(local, [3], 1 if rank == 0 else None, None)
    return {"held": held, "durable": durable, "ops": dict(counting.ops), "read": counting.read}


@pytest.mark.slow
def test_the_local_agreement_reads_one_answer_on_every_rank_but_rank_0(tmp_path: Path) -> None:
    results = run_ranks(_agree_counting_reads, 4, args=(str(tmp_path),))
    for result in results:
        assert (result["held"], result["durable"]) == ({0: 3, 2: 3}, 1)
    for rank, result in enumerate(results[1:], start=1):
        ops = dict(result["ops"])
        tidying = {k: ops.pop(k) for k in ("set", "delete_key") if k in ops}
        expected = {"append": 1, "add": 1, "get": 2 if tidying else 1}
        assert ops == expected, (rank, result["ops"])
        assert tidying in ({}, {"set": 1}, {"set": 1, "delete_key": 4}), (rank, result["ops"])
    # Rank 0 reads every rank's findings; so does the last rank to arrive, which checks that
    # every rank is in the same call from the records. Every other rank reads only rank 0's
    # answer, a fraction of that.
    reads = [r["read"] for r in results]
    others = sorted(reads[1:])
    assert all(read * 3 < reads[0] for read in others[:-1]), reads
    assert others[-1] <= reads[0] * 1.1, reads
