"""The node-local checkpoint tier: a fast copy of the training state on every node (``/dev/shm``).

Under DDP every rank holds the whole replicated state, so one copy per node in
node-local memory is enough to survive a worker crash and torchrun's restart
of the workers (``/dev/shm`` outlives the processes, not the node). The local
main process (local rank 0) of each node writes it, in a background thread,
in the same layout as a durable step folder (entries, every rank's RNG states,
``manifest.json`` written last as the commit marker)::

    <local_dir>/step_0000001230/{model.pt, optimizer.pt, _rng.pt, manifest.json}

Nothing here may hurt training: every failure of a local save (out of space, a
folder that cannot be made, any write error) is a warning, once, and the step
is skipped on that node. On restore the nodes agree on the newest step any of
them holds; a node that lacks it receives the files from a node that has it
over the process group (so a replaced node, or a wiped ``/dev/shm``, costs a
transfer, not a fall back to the durable tier).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ddpstate import _checksum, _crc, _manifest, storage
from ddpstate._manager import local_check
from ddpstate._manager.config import ManagerConfig
from ddpstate._manager.entries import Entry
from ddpstate._manager.snapshot import Snapshot
from ddpstate._manager.writer import InFlight, write_entries
from ddpstate._warn import warn
from ddpstate.dist import (
    broadcast_object,
    compare_across_ranks,
    gather_to_receivers,
    get_local_rank,
    get_rank,
    is_distributed,
    is_local_main_process,
)
from ddpstate.errors import InvalidArgumentError
from ddpstate.rng import capture_rng_state

__all__ = ["LocalTier", "RestoreSource"]

#: Files travel between nodes in pieces of this many bytes (bounds the memory a transfer takes).
TRANSFER_CHUNK = 64 << 20


@dataclass(frozen=True)
class RestoreSource:
    """Where :meth:`CheckpointManager.restore` took the state from, on this rank.

    Attributes:
        step: The restored step, or None when nothing was restored (a fresh run).
        tier: ``"local"`` (this node's own local tier), ``"peer"`` (this node
            lacked the step and received it from another node's local tier),
            ``"durable"`` (the manager's directory) or ``"none"``.
        path: The step folder loaded from (None for ``"none"``).
        sender: For ``"peer"``: the global rank whose node sent the step.

    Example:
        >>> import tempfile, torch, ddpstate
        >>> manager = ddpstate.CheckpointManager(tempfile.mkdtemp(), local_dir=tempfile.mkdtemp())
        >>> manager.save_local(1, {"w": torch.ones(2)})
        True
        >>> manager.restore({"w": torch.zeros(2)})
        1
        >>> isinstance(manager.restored_from, ddpstate.RestoreSource)
        True
        >>> (manager.restored_from.tier, manager.restored_from.step)
        ('local', 1)
        >>> manager.close()
    """

    step: Optional[int]
    tier: str
    path: Optional[str] = None
    sender: Optional[int] = None

    def __str__(self) -> str:
        if self.step is None:
            return "nothing (no checkpoint in any tier)"
        via = f" sent by rank {self.sender}'s node" if self.sender is not None else ""
        return f"{self.tier} step {self.step} ({self.path}{via})"


def _node_main(rank: int) -> int:
    # torchrun and srun number the ranks of a node contiguously from its local rank 0.
    return rank - get_local_rank()


class LocalTier:
    """The node-local tier of one :class:`~ddpstate.CheckpointManager` (internal)."""

    def __init__(self, config: ManagerConfig) -> None:
        assert config.local_dir is not None  # the manager makes a tier only for a local_dir
        self.directory, self.timeout = config.local_dir, config.timeout
        self.every, self.keep = config.local_every, config.local_keep
        self._folders = _manifest.StepFolders(self.directory)
        self.skipped: list[tuple[int, str]] = []
        self._reported = 0  # skips already told to the node's other ranks
        self._warned = False
        self._snapshot = Snapshot()  # its own buffers: a durable async write may read the manager's
        self._flight = InFlight()  # its own thread: at most one local write in flight
        self._thread_step = -1
        if is_distributed():
            # One rank compares; the values travel to every rank only when they differ.
            settings = compare_across_ranks(
                (self.every, self.keep),
                name="CheckpointManager local tier settings",
                timeout=self.timeout,
            )
            if settings is not None:
                differing = [r for r, c in enumerate(settings) if c != settings[0]]
                raise InvalidArgumentError(
                    f"CheckpointManager: rank(s) {differing} passed local_every/local_keep "
                    f"{settings[differing[0]]} but rank 0 passed {settings[0]}; pass the same on "
                    f"every rank"
                )

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: Mapping[str, Any]) -> bool:
        """Snapshot ``state`` and write it in the background when ``step`` is due."""
        if step % self.every:
            return False
        self.wait()
        writer = is_local_main_process()
        entries: Optional[dict[str, Entry]] = None
        events: list[Any] = []
        if writer:
            try:
                entries, events = self._snapshot.collect(state, snapshot=True)
            except Exception as exc:  # the local tier never stops training
                self._skip(step, exc)

        def start(rng_states: list[Any]) -> tuple[bool, list[tuple[int, str]]]:
            # On the writer: start the write; the node's ranks learn whether it started
            # and the skips the writer recorded since its last report.
            started = False
            if entries is not None:
                try:
                    self._thread_step = step
                    self._flight.start(
                        f"ddpstate-local-tier-step-{step}",
                        events,
                        lambda: self._write(step, entries, rng_states),
                    )
                    started = True
                except Exception as exc:  # no thread to be had: still only a skipped step
                    self._skip(step, exc)
            news = self.skipped[self._reported :]
            self._reported = len(self.skipped)
            return started, news

        # Every rank's RNG states go to every node's writer, so any node can restore any
        # rank; one round, and a rank that is not a writer never reads the others' states.
        started, news = gather_to_receivers(
            capture_rng_state(),
            start,
            dst=_node_main(get_rank()),
            name="CheckpointManager.save_local",
            timeout=self.timeout,
        )
        if not writer:
            self.skipped.extend(news)
        return bool(started)

    def _write(self, step: int, entries: dict[str, Entry], rng_states: list[Any]) -> None:
        os.makedirs(self.directory, exist_ok=True)
        self._folders.clean_stale()
        # No fsync: the local tier is for surviving a crashed process, not a crashed node.
        with storage.staged_folder(self._folders.checkpoint_path(step), fsync=False) as staged:
            files, listed = write_entries(staged.path, entries, rng_states, _write_file)
            staged.commit(_manifest.manifest_for(step, {}, len(rng_states), listed, files))
        self._folders.rotate(step, self.keep)

    def _skip(self, step: int, exc: BaseException) -> None:
        self.skipped.append((step, _checksum.error_text(exc)))
        if self._warned:
            return
        self._warned = True
        warn(
            f"CheckpointManager: the node-local tier skipped step {step} on rank {get_rank()} "
            f"({_checksum.error_text(exc)}); training goes on and the durable checkpoints are "
            f"untouched. "
            f"{self.directory} needs free space for local_keep + 1 copies of the state; "
            f"later local failures are not warned about again (see manager.local_skipped)"
        )

    def wait(self) -> None:
        """Wait for the local write in flight; a failure is a warning, never an error."""
        error = self._flight.join()
        if error is not None:
            self._skip(self._thread_step, error)

    def clear(self) -> None:
        """Wait for the write in flight, then delete the local folder (local main process)."""
        self.wait()
        if is_local_main_process():
            shutil.rmtree(self.directory, ignore_errors=True)

    def close(self) -> None:
        """Finish the local write in flight and free the copy buffers; the files stay."""
        try:
            self.wait()
        finally:
            self._snapshot.buffers.clear()

    # ------------------------------------------------------------------ restoring

    def choose(
        self, latest_step: Callable[[], Optional[int]]
    ) -> Optional[tuple[RestoreSource, dict[str, Any]]]:
        """A collective: the local step to restore on this rank, or None for the durable tier.

        Each node's ranks verify shares of its newest local step
        (``local_check``); the ranks gather the findings and agree on the
        newest step any node holds,
        unless the durable tier has a newer committed step (``latest_step``,
        called on rank 0). Nodes that lack the step receive its files from the
        lowest rank that has it.
        """
        self.wait()
        rank = get_rank()
        durable: Optional[float] = None
        if rank == 0:
            try:
                durable = latest_step()
            except Exception:
                # The durable path below reads the folder again and raises the real error.
                durable = math.inf
        # Every rank of a node checks a share of the node's newest local step (one rank
        # alone checks all of it, as verify_checkpoint does).
        committed: Optional[list[int]] = None
        try:
            committed = self._folders.committed_steps()
        except Exception as exc:  # an unreadable local tier is an empty one
            if is_local_main_process():
                warn(
                    f"CheckpointManager.restore: the node-local tier {self.directory} cannot be "
                    f"read on rank {rank} ({_checksum.error_text(exc)}); this node counts as "
                    f"holding no local step"
                )
        held, durable = local_check.newest_on_nodes(
            self.directory, committed, durable, self.timeout
        )
        steps = [s for s in held.values() if s is not None]
        if not steps or (durable is not None and durable > max(steps)):
            return None
        best = max(steps)
        holders = sorted(r for r, s in held.items() if s == best)
        lacking = sorted(r for r, s in held.items() if s != best)
        folder = os.path.join(self.directory, _manifest.step_name(best))
        node = _node_main(rank)
        if lacking:
            error = self._transfer(best, holders[0], lacking)
            # Rank 0 reads every rank's outcome; the others read only the failures.
            failed = gather_to_receivers(
                error,
                lambda errors: [(r, e) for r, e in enumerate(errors) if e],
                dst=0,
                name=f"CheckpointManager.restore (sending local step {best})",
                timeout=self.timeout,
            )
            if failed:
                if rank == 0:
                    warn(
                        f"CheckpointManager.restore: sending local step {best} to the nodes "
                        f"that lack it failed ("
                        + "; ".join(f"rank {r}: {e}" for r, e in failed)
                        + "); restoring from the durable tier instead"
                    )
                return None
        manifest, problem = _manifest.read_manifest(folder, None)
        if manifest is None:
            # Only possible if the folder changed under us after the agreement.
            raise InvalidArgumentError(f"CheckpointManager.restore: {folder}: {problem}")
        if node in lacking:
            return RestoreSource(best, "peer", folder, holders[0]), manifest
        return RestoreSource(best, "local", folder), manifest

    def _transfer(self, step: int, src: int, receivers: list[int]) -> str:
        """Send step ``step``'s files from ``src``'s node to the ``receivers`` (node mains).

        A collective over every rank; returns this rank's error text ("" when fine).
        Every member goes through every chunk even after its own failure, so a
        full disk on one node never leaves the others waiting.
        """
        rank = get_rank()
        folder = os.path.join(self.directory, _manifest.step_name(step))
        raw_manifest: Any = None
        if rank == src:
            try:
                with open(os.path.join(folder, _manifest.MANIFEST_NAME), "rb") as f:
                    raw_manifest = f.read()
            except OSError as exc:
                raw_manifest = _checksum.error_text(exc)
        raw_manifest = broadcast_object(raw_manifest, src_rank=src, timeout=self.timeout)
        if not isinstance(raw_manifest, bytes):  # the sender lost its copy: every rank gives up
            return f"rank {src} could not read its local step {step}: {raw_manifest}"
        files: dict[str, Any] = json.loads(raw_manifest.decode())["files"]
        members = sorted({src, *receivers})
        # Every rank calls new_group (torch requires it); only the members exchange bytes.
        group = dist.new_group(members) if is_distributed() else None
        try:
            if rank not in members:
                return ""
            sink = _Sink(folder if rank in receivers else None)
            for filename in sorted(files):
                _send_file(
                    os.path.join(folder, filename) if rank == src else None,
                    sink,
                    filename,
                    int(files[filename]["size"]),
                    str(files[filename]["crc32"]),
                    src,
                    group,
                )
            if sink.staged is not None:
                sink.commit(raw_manifest)
                if not sink.error:
                    self._folders.rotate(step, self.keep)
            return sink.error
        finally:
            if group is not None and rank in members:
                dist.destroy_process_group(group)


class _Sink:
    """A receiver's staged folder; the first error is kept and later writes are dropped."""

    def __init__(self, target: Optional[str]) -> None:
        self.staged: Optional[storage.StagedFolder] = None
        self.error = ""
        self._file: Optional[Any] = None
        self._crc = 0
        if target is not None:
            self._guard(lambda: setattr(self, "staged", storage.stage_folder(target, fsync=False)))

    def _guard(self, action: Any) -> None:
        if self.error:
            return
        try:
            action()
        except Exception as exc:
            # A failed receive costs the fast path, never the job: restore falls back.
            self.error = _checksum.error_text(exc)
            self.close()
            if self.staged is not None:
                self.staged.discard(exc)

    def open(self, filename: str) -> None:
        if self.staged is not None:
            self._crc = 0
            path = os.path.join(self.staged.path, filename)
            self._guard(lambda: setattr(self, "_file", open(path, "wb")))  # noqa: SIM115

    def write(self, data: memoryview) -> None:
        if self._file is not None:
            self._crc = _crc.crc32_parallel(data, self._crc)
            self._guard(lambda: self._file.write(data))

    def finish(self, filename: str, crc32: str) -> None:
        def check() -> None:
            self.close()
            if _checksum.checksum_hex(self._crc) != crc32:
                raise OSError(f"{filename}: the received bytes fail their CRC-32 ({crc32})")

        if self.staged is not None:
            self._guard(check)

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()

    def commit(self, raw_manifest: bytes) -> None:
        staged = self.staged
        if staged is not None:
            self._guard(lambda: staged.commit(raw_manifest))


def _write_file(path: str, obj: Any, as_safetensors: bool, what: str) -> dict[str, Any]:
    # No fsync: the local tier is for surviving a crashed process, not a crashed node.
    return _checksum.write_listed_file(path, lambda f: torch.save(obj, f), fsync=False)  # type: ignore[arg-type]


def _send_file(
    source: Optional[str],
    sink: _Sink,
    filename: str,
    size: int,
    crc32: str,
    src: int,
    group: Any,
) -> None:
    """Broadcast one file from ``src`` in chunks; a receiver's ``sink`` writes and checks it."""
    nccl = group is not None and dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    buffer = torch.zeros(min(size, TRANSFER_CHUNK) or 1, dtype=torch.uint8)
    sink.open(filename)
    inp = open(source, "rb") if source is not None else None  # noqa: SIM115
    try:
        done = 0
        while done < size:
            n = min(TRANSFER_CHUNK, size - done)
            chunk = buffer[:n]
            if inp is not None:
                # A short read sends zeros: the receivers' CRC check then fails, nobody hangs.
                inp.readinto(chunk.numpy().data)
            if group is not None:
                moved = chunk.to(device)
                dist.broadcast(moved, src=src, group=group)
                if nccl:
                    chunk.copy_(moved.cpu())
            sink.write(chunk.numpy().data)
            done += n
        sink.finish(filename, crc32)
    finally:
        if inp is not None:
            inp.close()
