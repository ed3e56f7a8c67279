"""A DistributedSampler that remembers how far into its epoch it got, to resume mid-epoch."""

from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Iterator, Mapping, Sized
from typing import Any, Optional

from torch.utils.data import DistributedSampler
from torch.utils.data import dataloader as _dataloader

from ddpstate.dist import get_rank, get_world_size
from ddpstate.errors import DDPStateError

__all__ = ["ResumableDistributedSampler"]

_COUNT_MODES = ("yielded", "consumed")
# How far up from the sampler's generator the DataLoader iterator's frame can be:
# the generator, BatchSampler.__iter__ (or a user batch sampler), _next_index.
_LOADER_FRAME_DEPTH = 6
# The loader iterator's batch counters the position is read from (torch has no public ones):
# batches sent to the workers, and batches given to the loop.
_LOADER_COUNTERS = ("_send_idx", "_rcvd_idx")


def _prefetching_loader() -> Optional[Any]:
    """The DataLoader iterator with worker processes asking for this index, if one is.

    torch gives a sampler no way to learn who iterates it, and with workers the
    loader asks for ``prefetch_factor * num_workers`` batches ahead of the loop.
    The caller's frames do tell: the loader's ``_next_index`` is a few frames up.
    Called once per pass, on its first index.
    """
    loader_kind = getattr(_dataloader, "_MultiProcessingDataLoaderIter", None)
    if loader_kind is None:
        return None
    frame = inspect.currentframe()
    try:
        for _ in range(_LOADER_FRAME_DEPTH):
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, loader_kind):
                missing = [a for a in _LOADER_COUNTERS if not hasattr(owner, a)]
                if missing:  # a torch whose loader no longer keeps these: say so, never guess
                    raise DDPStateError(
                        f"ResumableDistributedSampler: this torch's DataLoader iterator has no "
                        f"{', '.join(missing)}, so the batches its workers prefetched cannot be "
                        f"told from those the loop trained on; construct the sampler with "
                        f"count='consumed' and call sampler.advance(len(batch)) after each step"
                    )
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame held in a local keeps every caller's locals alive


class ResumableDistributedSampler(DistributedSampler[int]):
    """A :class:`~torch.utils.data.DistributedSampler` with ``state_dict()``/``load_state_dict()``.

    Its state is the epoch and the *position*: how many samples of this epoch
    this rank has already passed on. After ``load_state_dict`` the next pass
    (``iter(sampler)``) yields exactly the samples of that epoch the
    interrupted run had not reached yet, in the same order and with the same
    batch boundaries when the position is a multiple of the batch size. Later
    passes, and every pass after :meth:`set_epoch` with a new epoch, start at
    the beginning of the epoch like the parent class.

    **What the position counts.** With ``count="yielded"`` (default) it counts
    the samples the training loop has received. ``DataLoader(num_workers=0)``
    asks for a batch of indices only when the loop asks for the batch, so that
    is the indices handed out. A ``DataLoader`` with ``num_workers > 0``
    prefetches ``prefetch_factor * num_workers`` batches ahead; the sampler
    sees that loader iterating it and counts only the batches it has given the
    loop, so a resume re-reads the prefetched ones (exact either way). A loader
    it cannot see into (one that reorders, ``in_order=False``, or another
    prefetching wrapper) needs ``count="consumed"``: call :meth:`advance` with
    the batch's size after each training step, and the position is the number
    of samples the loop reported.

    **Changing the world size.** When a state saved with ``N`` replicas is
    loaded with ``M != N``, the ``position * N`` leading entries of the epoch's
    global permutation count as consumed; the remaining entries are split
    across the ``M`` ranks the same way the parent splits a full epoch
    (padded by repeating entries, or truncated with ``drop_last``). Nothing is
    skipped and nothing repeats apart from that padding.

    Call :meth:`set_epoch` at the start of each epoch as with the parent. Calling
    it with the epoch the sampler already has keeps a restored position, so the
    usual loop resumes correctly::

        for epoch in range(sampler.epoch, num_epochs):
            sampler.set_epoch(epoch)
            for batch in loader:
                ...

    Only one pass may be in progress at a time (one live iterator).

    Args:
        dataset: A map-style dataset (anything with ``len``).
        num_replicas: Number of ranks. Default: the world size
            (:func:`ddpstate.get_world_size`, 1 without a process group).
        rank: This rank. Default: :func:`ddpstate.get_rank` (0 without one).
        shuffle: Shuffle the indices with ``seed + epoch`` (as the parent).
        seed: Shuffle seed; must be the same on every rank.
        drop_last: Drop the tail instead of padding (as the parent).
        count: ``"yielded"`` or ``"consumed"``: what the position counts (above).

    Raises:
        DDPStateError: ``count`` is not one of the two modes.

    Example:
        >>> import ddpstate
        >>> sampler = ddpstate.ResumableDistributedSampler(range(6), num_replicas=2, rank=0)
        >>> it = iter(sampler)
        >>> first = next(it)
        >>> state = sampler.state_dict()
        >>> resumed = ddpstate.ResumableDistributedSampler(range(6), num_replicas=2, rank=0)
        >>> resumed.load_state_dict(state)
        >>> list(resumed) == list(it)
        True
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        count: str = "yielded",
    ) -> None:
        if count not in _COUNT_MODES:
            raise DDPStateError(
                f"ResumableDistributedSampler: count={count!r} must be 'yielded' or 'consumed'"
            )
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=get_world_size() if num_replicas is None else num_replicas,
            rank=get_rank() if rank is None else rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.count = count
        # Leading entries of the epoch's global permutation consumed under an earlier
        # world size (0 unless this epoch was resumed with a different world size).
        self._offset = 0
        self._start_pass(0)

    # ----------------------------------------------------------------- sequence

    def _dataset_len(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _permutation(self) -> list[int]:
        # The parent's own order for one replica is the epoch's global permutation.
        whole: DistributedSampler[int] = DistributedSampler(
            self.dataset, num_replicas=1, rank=0, shuffle=self.shuffle, seed=self.seed
        )
        whole.set_epoch(self.epoch)
        return list(whole)

    def _sequence_len(self) -> int:
        # With no offset, the parent's num_samples (a drop_last epoch drops the tail).
        rest = max(self._dataset_len() - self._offset, 0)
        if self.drop_last:
            return rest // self.num_replicas
        return math.ceil(rest / self.num_replicas)

    def _sequence(self) -> list[int]:
        """This rank's samples for the whole epoch (after any earlier-world offset).

        With no offset this is the parent's own split: the permutation, padded by
        repeating it (or cut with drop_last), every ``num_replicas``-th entry.
        """
        rest = self._permutation()[self._offset :]
        total = self._sequence_len() * self.num_replicas
        if len(rest) < total:
            rest = (rest * math.ceil(total / len(rest)))[:total]
        return rest[:total][self.rank :: self.num_replicas]

    # ----------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[int]:
        sequence = self._sequence()
        start = self._position if self._resume_pending else 0
        self._start_pass(start)
        return self._generate(sequence, start)

    def _start_pass(self, start: int, *, resume: bool = False) -> None:
        # The next (or this) pass begins at `start`; nothing of an earlier pass is kept.
        # Where the pass in progress (or the next one) began and has reached; True
        # after load_state_dict: the next pass starts at _position, not at 0.
        self._position = self._pass_start = start
        self._resume_pending = resume
        # Samples the loop reported through advance() in the current pass.
        self._consumed = 0
        # The DataLoader iterator with workers that drives the current pass, if any:
        # it prefetches, so under count="yielded" the position runs ahead of the loop.
        self._prefetcher: Optional[weakref.ref[Any]] = None
        # Under such a loader: the position after each batch it sent, the batches it
        # had given the loop when last seen, and whether the pass was handed out whole.
        self._batch_ends: list[int] = []
        self._delivered = 0
        self._exhausted = False

    def _generate(self, sequence: list[int], start: int) -> Iterator[int]:
        for index in sequence[start:]:
            if self._position == self._pass_start and self.count == "yielded":
                loader = _prefetching_loader()
                # A weak reference: the loader's iterator holds this generator, and a
                # strong one back would keep its worker processes alive after the loop.
                self._prefetcher = None if loader is None else weakref.ref(loader)
            self._position += 1
            if self._prefetcher is not None:
                self._note_batch()
            yield index
        self._exhausted = True

    def _note_batch(self) -> None:
        # Which batch the loader is filling with this index, and how many it has delivered.
        loader = self._prefetcher() if self._prefetcher is not None else None
        if loader is None:
            return
        batch = int(loader._send_idx)
        self._delivered = int(loader._rcvd_idx)
        # Pad the list up to this batch (a negative count pads nothing), then set its end.
        self._batch_ends += [self._position] * (batch + 1 - len(self._batch_ends))
        self._batch_ends[batch] = self._position

    def __len__(self) -> int:
        """Samples the current pass yields (the rest of the epoch after a resume)."""
        start = self._position if self._resume_pending else self._pass_start
        return max(self._sequence_len() - start, 0)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; a new epoch starts at its beginning, the current one keeps its place.

        Args:
            epoch: The epoch number (seeds the shuffle as ``seed + epoch``).

        Example:
            >>> import ddpstate
            >>> sampler = ddpstate.ResumableDistributedSampler(range(4), num_replicas=1, rank=0)
            >>> sampler.set_epoch(1)
            >>> sampler.state_dict()["epoch"], sampler.state_dict()["position"]
            (1, 0)
        """
        if epoch != self.epoch:
            self._offset = 0
            self._start_pass(0)
        super().set_epoch(epoch)

    def advance(self, num_samples: int) -> None:
        """Record that the training loop consumed ``num_samples`` more samples of this pass.

        Only for ``count="consumed"``: call it after each step with the number
        of samples of the batch this rank trained on (``len(batch)``).

        Args:
            num_samples: Samples consumed since the previous call.

        Raises:
            DDPStateError: The sampler counts yielded samples, ``num_samples``
                is negative, or the total would pass the end of the epoch.

        Example:
            >>> import ddpstate
            >>> sampler = ddpstate.ResumableDistributedSampler(
            ...     range(8), num_replicas=1, rank=0, count="consumed")
            >>> it = iter(sampler); batch = [next(it), next(it)]
            >>> sampler.advance(len(batch))
            >>> sampler.state_dict()["position"]
            2
        """
        if self.count != "consumed":
            raise DDPStateError(
                "ResumableDistributedSampler.advance() needs count='consumed'; with the default "
                "count='yielded' the position already counts the samples handed out"
            )
        if num_samples < 0:
            raise DDPStateError(f"advance({num_samples}): the number of samples must be >= 0")
        consumed = self._consumed + num_samples
        if self._pass_start + consumed > self._sequence_len():
            raise DDPStateError(
                f"advance({num_samples}): {self._pass_start + consumed} samples consumed but "
                f"this rank's epoch has only {self._sequence_len()}; pass each batch's size once"
            )
        self._consumed = consumed

    # ----------------------------------------------------------------- state

    def _reported_position(self) -> int:
        if self._resume_pending:
            return self._position
        if self.count == "yielded":
            return self._position if self._prefetcher is None else self._loop_position()
        return self._pass_start + self._consumed

    def _loop_position(self) -> int:
        """The position the training loop has reached when workers prefetch (count="yielded").

        The DataLoader numbers the batches it sends to its workers (``_send_idx``,
        read as each index is handed out) and counts those it has given the loop
        (``_rcvd_idx``); torch has no public counter for either. So the samples of
        the batches the loop has received are exactly what ``num_workers=0`` would
        have handed out by now.
        """
        loader = None if self._prefetcher is None else self._prefetcher()
        if loader is not None and not getattr(loader, "_in_order", True):
            raise DDPStateError(
                "ResumableDistributedSampler.state_dict(): the DataLoader iterating this sampler "
                "has in_order=False, so which prefetched samples the loop has trained on is not "
                "known; construct the sampler with count='consumed' and call "
                "sampler.advance(len(batch)) after each step, or drop in_order=False"
            )
        if loader is not None:
            delivered = int(loader._rcvd_idx)
        elif self._exhausted:
            delivered = len(self._batch_ends)  # the loop finished the pass
        else:
            delivered = self._delivered  # the pass was abandoned: the last count seen
        if delivered <= 0:
            return self._pass_start
        return self._batch_ends[min(delivered, len(self._batch_ends)) - 1]

    def state_dict(self) -> dict[str, Any]:
        """Return the sampler's place in the data: epoch, position and the settings it depends on.

        Returns:
            A dict with ``"epoch"``, ``"position"`` (samples of this epoch this
            rank has passed on), ``"num_replicas"``, ``"offset"`` (permutation
            entries consumed under an earlier world size this epoch),
            ``"seed"``, ``"shuffle"``, ``"drop_last"`` and ``"dataset_len"``.

        Raises:
            DDPStateError: ``count="yielded"`` under a ``DataLoader`` with
                workers and ``in_order=False``: which prefetched samples the loop
                has trained on is unknown (use ``count="consumed"`` with
                :meth:`advance`).

        Example:
            >>> import ddpstate
            >>> sampler = ddpstate.ResumableDistributedSampler(range(4), num_replicas=2, rank=1)
            >>> sampler.state_dict()["position"]
            0
        """
        return {
            "epoch": int(self.epoch),
            "position": int(self._reported_position()),
            "num_replicas": int(self.num_replicas),
            "offset": int(self._offset),
            "seed": int(self.seed),
            "shuffle": bool(self.shuffle),
            "drop_last": bool(self.drop_last),
            "dataset_len": int(self._dataset_len()),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from a saved state: the next pass yields the rest of the saved epoch.

        Only ``"epoch"`` and ``"position"`` are required; the other keys, when
        present, are checked against this sampler.

        Args:
            state_dict: A dict from :meth:`state_dict`.

        Raises:
            DDPStateError: A key is missing or out of range, or the dataset
                length, seed, shuffle or drop_last differ from the saved ones
                (the rest of the epoch would then not be the same samples).

        Example:
            >>> import ddpstate
            >>> sampler = ddpstate.ResumableDistributedSampler(range(4), num_replicas=1, rank=0)
            >>> sampler.load_state_dict({"epoch": 2, "position": 3})
            >>> len(sampler)
            1
        """
        try:
            epoch = int(state_dict["epoch"])
            position = int(state_dict["position"])
            saved_replicas = int(state_dict.get("num_replicas", self.num_replicas))
            offset = int(state_dict.get("offset", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise DDPStateError(
                f"ResumableDistributedSampler.load_state_dict: expected integer 'epoch' and "
                f"'position' entries, got {dict(state_dict)!r} ({exc})"
            ) from exc
        expected = {
            "dataset_len": self._dataset_len(),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }
        for key, value in expected.items():
            if key in state_dict and state_dict[key] != value:
                raise DDPStateError(
                    f"ResumableDistributedSampler.load_state_dict: the state was saved with "
                    f"{key}={state_dict[key]!r} but this sampler has {key}={value!r}; the rest "
                    f"of the epoch would be different samples. Construct the sampler with "
                    f"{key}={state_dict[key]!r} (or start a fresh epoch without loading)"
                )
        if min(epoch, position, offset) < 0 or saved_replicas < 1 or offset > self._dataset_len():
            raise DDPStateError(
                f"ResumableDistributedSampler.load_state_dict: epoch={epoch}, position={position}, "
                f"num_replicas={saved_replicas}, offset={offset} are out of range for a dataset "
                f"of {self._dataset_len()} samples"
            )
        self.epoch = epoch
        if saved_replicas == self.num_replicas:
            self._offset = offset
            self._position = position
        else:
            # Everything the old world had passed on, as leading permutation entries.
            self._offset = min(offset + position * saved_replicas, self._dataset_len())
            self._position = 0
        if self._position > self._sequence_len():
            raise DDPStateError(
                f"ResumableDistributedSampler.load_state_dict: position={position} is past the "
                f"end of this rank's epoch ({self._sequence_len()} samples)"
            )
        self._start_pass(self._position, resume=True)
