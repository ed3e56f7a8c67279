"""DCP saves on gloo ranks: ddpstate's storage and manager against torch's, side by side.

Run: ``python -m benchmarks.dcp`` (1 GiB, 1 and 2 ranks, /dev/shm and disk: the
figures in docs/benchmarks.md); ``--size-mib 64`` for a quick check; ``--ddp`` adds
the DDP rows, ``--s3`` the object-store pair. Also a family of ``python -m
benchmarks`` (``--only dcp``, at ``--dist-size``, 1 and 2 ranks, /dev/shm and disk).

Per world size (N real processes, gloo on 127.0.0.1) and place (``/dev/shm``,
where the disk's noise is absent, and ``--work`` on disk), every rank holds the
same model of float32 parameters (``--size-mib`` in all, 64 MiB tensors; FSDP2
``fully_shard`` over the ranks when there are two or more). Alternating the order
per repeat, each timed call is taken on every rank and its time is the slowest
rank's (a collective waits for it), median over repeats. The table names the
CRC-32 implementation the run used (``ddpstate._crc.crc32``).

* storage: ``dcp.save`` with ``ddpstate.dcp.DurableWriter`` vs torch's
  ``FileSystemWriter(sync_files=True)``, and ``dcp.load`` with ``VerifiedReader`` vs
  ``FileSystemReader`` (target <= 1.05x on 1 rank, <= 1.10x on more; ``--storage-only``
  runs only these); the same save with ``_extensions=[ZStandard()]`` on both sides
  (target <= 1.05x);
* FSDP2 (two or more ranks): ``CheckpointManager.save`` vs ``dcp.save`` of the
  sharded state dict, and ``CheckpointManager.restore`` (every file's CRC-32, split
  across the ranks, then ``dcp.load`` into the live state) vs ``dcp.load`` +
  ``set_model_state_dict``
  (target <= 1.10x). And the time ``save`` blocks training with ``async_save=True``
  (the CPU snapshot; the write is waited for untimed) vs the synchronous ``save``;
* with ``--ddp``: ``CheckpointManager(writers="rank0").save`` (rank 0 writes it all),
  ``CheckpointManager(writers="all").save`` (DCP's planner splits the replicated
  tensors across the ranks) and the baseline ``dcp.save(get_model_state_dict(model))``;
* with ``--s3``, the storage pair on moto's S3 server on 127.0.0.1 (started here):
  ``DurableWriter`` / ``VerifiedReader`` at an ``s3://`` URL vs torch's ``FsspecWriter`` /
  ``FsspecReader`` (target <= 1.15x). The server is Python in this process, so both
  sides share its cost.

``keep_last=1``: each manager save also deletes the previous step, as in training.
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
from typing import Any, Callable, Optional

from benchmarks import harness
from benchmarks.harness import Results, Settings, Timing

_TENSOR_MIB = 64
_MIB = 1 << 20
_CTX = mp.get_context("spawn")


def _model(size_mib: int) -> Any:
    import torch

    per = min(_TENSOR_MIB, max(1, size_mib // 4))
    torch.manual_seed(0)
    return torch.nn.ParameterDict(
        {
            f"w{i:03d}": torch.nn.Parameter(torch.randn(per * _MIB // 4))
            for i in range(max(1, size_mib // per))
        }
    )


def _sharded_state(size_mib: int, world: int) -> dict[str, Any]:
    """The model's state dict: FSDP2 ``DTensor`` shards on two or more ranks, tensors on one."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(size_mib)
    if world > 1:
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return dict(get_model_state_dict(model))


def _timed(fn: Callable[[], Any]) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    took = time.perf_counter() - start
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, took)
    return max(gathered)


def _child(rank: int, world: int, port: int, opts: dict[str, Any], out: Any) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    from ddpstate.manager import CheckpointManager

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    base = Path(opts["folder"])
    times: dict[str, list[float]] = {}

    def run(sides: dict[str, Callable[[], Any]], repeats: int) -> None:
        for i in range(repeats):
            for name in list(sides) if i % 2 == 0 else list(sides)[::-1]:
                times.setdefault(name, []).append(_timed(sides[name]))

    if opts["kind"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(_model(opts["size_mib"]))
        rank0 = CheckpointManager(base / "rank0", keep_last=1)
        every = CheckpointManager(base / "all", keep_last=1, writers="all")
        step = iter(range(1, 10_000))
        run(
            {
                "manager_rank0": lambda: rank0.save(next(step), {"model": model}),
                "manager_all": lambda: every.save(next(step), {"model": model}),
                "dcp_save": lambda: dcp.save(
                    get_model_state_dict(model), checkpoint_id=str(base / "dcp")
                ),
            },
            opts["repeats"],
        )
    elif opts["kind"] == "storage":
        from torch.distributed.checkpoint._extension import ZStandard

        from ddpstate.dcp import DurableWriter, VerifiedReader

        sd = _sharded_state(opts["size_mib"], world)
        durable, plain = str(base / "durable"), str(base / "plain")
        zstd_durable, zstd_plain = str(base / "durable_zstd"), str(base / "plain_zstd")
        run(
            {
                "durable_save": lambda: dcp.save(sd, storage_writer=DurableWriter(durable)),
                "fs_save": lambda: dcp.save(
                    sd, storage_writer=dcp.FileSystemWriter(plain, sync_files=True)
                ),
            },
            opts["repeats"],
        )
        run(
            {
                "verified_load": lambda: dcp.load(sd, storage_reader=VerifiedReader(durable)),
                "fs_load": lambda: dcp.load(sd, storage_reader=dcp.FileSystemReader(plain)),
            },
            opts["repeats"],
        )
        run(
            {
                "durable_zstd_save": lambda: dcp.save(
                    sd, storage_writer=DurableWriter(zstd_durable, _extensions=[ZStandard()])
                ),
                "fs_zstd_save": lambda: dcp.save(
                    sd,
                    storage_writer=dcp.FileSystemWriter(
                        zstd_plain, sync_files=True, _extensions=[ZStandard()]
                    ),
                ),
            },
            opts["repeats"],
        )
    elif opts["kind"] == "s3":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from ddpstate._io.durable_dcp import fsspec_reader
        from ddpstate.dcp import DurableWriter, VerifiedReader

        try:  # the public module (newer torch deprecates the private one)
            from torch.distributed.checkpoint.fsspec_filesystem import (  # type: ignore[import-not-found,unused-ignore]
                FsspecWriter,
            )
        except ImportError:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        model = _model(opts["size_mib"])
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        sd = get_model_state_dict(model)
        so = opts["storage_options"]
        durable, plain = f"{opts['url']}/durable", f"{opts['url']}/plain"
        run(
            {
                "durable_save": lambda: dcp.save(
                    sd, storage_writer=DurableWriter(durable, storage_options=so)
                ),
                "fs_save": lambda: dcp.save(sd, storage_writer=FsspecWriter(plain, **so)),
            },
            opts["repeats"],
        )
        run(
            {
                "verified_load": lambda: dcp.load(
                    sd, storage_reader=VerifiedReader(durable, storage_options=so)
                ),
                "fs_load": lambda: dcp.load(sd, storage_reader=fsspec_reader(plain, so)),
            },
            opts["repeats"],
        )
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = _model(opts["size_mib"])
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        manager = CheckpointManager(base / "fsdp", keep_last=1)
        step = iter(range(1, 10_000))
        run(
            {
                "manager_save": lambda: manager.save(next(step), {"model": model}),
                "dcp_save": lambda: dcp.save(
                    get_model_state_dict(model), checkpoint_id=str(base / "dcp")
                ),
            },
            opts["repeats"],
        )

        def dcp_load() -> None:
            sd = get_model_state_dict(model)
            dcp.load(sd, checkpoint_id=str(base / "dcp"))
            set_model_state_dict(model, sd)

        run(
            {"manager_restore": lambda: manager.restore({"model": model}), "dcp_load": dcp_load},
            opts["repeats"],
        )
        # What training waits for with async_save: save() returns after the CPU snapshot;
        # the write (waited for outside the timed call) runs on the manager's own group.
        background = CheckpointManager(base / "async", keep_last=1, async_save=True)

        def async_save() -> None:
            background.save(next(step), {"model": model})

        for _ in range(opts["repeats"]):
            times.setdefault("manager_async_save", []).append(_timed(async_save))
            background.wait()
        background.close()
    if rank == 0:
        out.put(times)
        out.close()
        out.join_thread()  # the times are in the pipe before this process ends
    dist.barrier()
    dist.destroy_process_group()
    # Skip the interpreter's teardown: a C++ thread torch or gloo leaves joinable then
    # aborts the process now and again ("terminate called without an active exception",
    # seen once in CI) after every figure was sent.
    os._exit(0)


def measure(
    kind: str, world: int, size_mib: int, repeats: int, folder: Path, **extra: Any
) -> dict[str, float]:
    """Run one case on ``world`` spawned ranks; the median (slowest-rank) seconds per side.

    ``extra``: more options for the ranks (``url`` and ``storage_options`` for ``"s3"``).
    """
    import torch.distributed as dist

    folder.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore(
        "127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=600),
    )  # fmt: skip
    out = _CTX.Queue()
    opts = {"kind": kind, "size_mib": size_mib, "repeats": repeats, "folder": str(folder), **extra}
    procs = [
        _CTX.Process(target=_child, args=(r, world, store.port, opts, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    times = out.get(timeout=3600)
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank exited with {p.exitcode}")
    shutil.rmtree(folder, ignore_errors=True)
    return {name: statistics.median(runs) for name, runs in times.items()}


def measure_s3(world: int, size_mib: int, repeats: int, folder: Path) -> dict[str, float]:
    """The ``"s3"`` case against moto's S3 server, started here on a free port of 127.0.0.1."""
    import s3fs
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        so = {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": f"http://{host}:{port}",
            "client_kwargs": {"region_name": "eu-west-1"},
        }
        s3fs.S3FileSystem(skip_instance_cache=True, **so).mkdir("bench")
        return measure(
            "s3", world, size_mib, repeats, folder, url="s3://bench/dcp", storage_options=so
        )
    finally:
        server.stop()


def _places(work: Path) -> dict[str, Path]:
    places = {"disk": work}
    if os.path.isdir("/dev/shm"):
        places["/dev/shm"] = Path(tempfile.mkdtemp(prefix="ddpstate-dcp-", dir="/dev/shm"))
    return places


def crc_implementation() -> str:
    """The CRC-32 function ddpstate checksums with here (zlib, zlib-ng, isal...)."""
    from ddpstate import _crc

    return f"{_crc.crc32.__module__}.{getattr(_crc.crc32, '__name__', 'crc32')}"


Row = tuple[str, str, float, str, float, Optional[float]]  # case, ours, s, baseline, s, target


def measure_place(
    world: int, size_mib: int, repeats: int, root: Path, *, storage_only: bool, ddp: bool
) -> list[Row]:
    """Every case at one world size in one place: the rows of the table."""
    near = 1.05 if world == 1 else 1.10  # one rank has a spare core for the CRC; two share
    ours = measure("storage", world, size_mib, repeats, root / "storage")
    rows: list[Row] = [
        ("dcp.save", "DurableWriter", ours["durable_save"],
         "FileSystemWriter(sync_files=True)", ours["fs_save"], near),
        ("dcp.load", "VerifiedReader", ours["verified_load"], "FileSystemReader",
         ours["fs_load"], near),
        ("dcp.save, ZStandard", "DurableWriter", ours["durable_zstd_save"],
         "FileSystemWriter(sync_files=True)", ours["fs_zstd_save"], 1.05),
    ]  # fmt: skip
    if world > 1 and not storage_only:
        fsdp = measure("fsdp", world, size_mib, repeats, root / "fsdp")
        rows += [
            ("FSDP2 save", "CheckpointManager.save", fsdp["manager_save"], "dcp.save",
             fsdp["dcp_save"], 1.10),
            ("FSDP2 restore", "CheckpointManager.restore", fsdp["manager_restore"],
             "dcp.load", fsdp["dcp_load"], 1.10),
            ("FSDP2 save() blocks", "async_save=True", fsdp["manager_async_save"],
             "async_save=False", fsdp["manager_save"], None),
        ]  # fmt: skip
    if world > 1 and ddp:
        dd = measure("ddp", world, size_mib, repeats, root / "ddp")
        rows += [
            ("DDP save", "writers='all'", dd["manager_all"], "writers='rank0'",
             dd["manager_rank0"], None),
            ("DDP save", "writers='all'", dd["manager_all"], "dcp.save", dd["dcp_save"], None),
        ]  # fmt: skip
    return rows


def _line(world: int, place: str, row: Row) -> str:
    case, mine, ours_s, base, base_s, target = row
    ratio = ours_s / base_s
    verdict = (
        "" if target is None else f"<= {target:.2f}x: {'met' if ratio <= target else 'NOT met'}"
    )
    return (
        f"| {world} | {place} | {case} | {mine} | {ours_s:.2f} | {base} | {base_s:.2f} | "
        f"{ratio:.2f}x | {verdict} |"
    )


def run(results: Results, settings: Settings) -> None:
    """The ``python -m benchmarks`` family: 1 and 2 ranks at ``--dist-size``, /dev/shm and disk."""
    size = settings.dist_size_mib
    results.notes.append(f"dcp: CRC-32 by {crc_implementation()}")
    for world in (1, 2):
        for place, root in _places(settings.work / "dcp").items():
            try:
                rows = measure_place(
                    world, size, settings.repeats, root, storage_only=False, ddp=world > 1
                )
            finally:
                if place == "/dev/shm":
                    shutil.rmtree(root, ignore_errors=True)
            for case, ours_name, ours_s, base_name, base_s, target in rows:
                label = f"{world}-rank {case} ({place})"
                ours = results.add(
                    Timing(label, "size_mib", size, ours_name, ours_s, None, [], True)
                )
                base = results.add(Timing(label, "size_mib", size, base_name, base_s, None, []))
                results.compare(ours, base, target, label=label)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.dcp", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--worlds", default="1,2", help="world sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None, help="disk folder (default: a temp one)")
    parser.add_argument(
        "--storage-only", action="store_true",
        help="only DurableWriter/VerifiedReader vs FileSystemWriter/FileSystemReader",
    )  # fmt: skip
    parser.add_argument("--ddp", action="store_true", help="also the DDP manager rows")
    parser.add_argument(
        "--s3", action="store_true",
        help="also DurableWriter/VerifiedReader vs FsspecWriter/FsspecReader on moto's S3 server",
    )  # fmt: skip
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ddpstate-dcp-", dir=args.work))
    print(
        f"{args.size_mib} MiB of float32 parameters, median of {args.repeats}, slowest rank; "
        f"CRC-32 by {crc_implementation()}"
    )
    print("| ranks | place | case | ddpstate | s | baseline | s | ratio | target |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for world in [int(w) for w in args.worlds.split(",")]:
            for place, root in _places(work).items():
                try:
                    rows = measure_place(
                        world, args.size_mib, args.repeats, root,
                        storage_only=args.storage_only, ddp=args.ddp,
                    )  # fmt: skip
                finally:
                    if place == "/dev/shm":
                        shutil.rmtree(root, ignore_errors=True)
                for row in rows:
                    print(_line(world, place, row), flush=True)
            if args.s3:
                s3 = measure_s3(world, args.size_mib, args.repeats, work / "s3")
                for row in [
                    ("dcp.save", "DurableWriter", s3["durable_save"], "FsspecWriter",
                     s3["fs_save"], 1.15),
                    ("dcp.load", "VerifiedReader", s3["verified_load"], "FsspecReader",
                     s3["fs_load"], 1.15),
                ]:  # fmt: skip
                    print(_line(world, "s3 (moto)", row), flush=True)
    finally:
        harness.remove(work)


if __name__ == "__main__":
    main()
