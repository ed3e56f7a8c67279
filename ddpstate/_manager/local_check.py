"""The node-local tier's restore check, split across the ranks of each node.

Restoring from the local tier verifies each node's newest local step first,
and reading every byte for its CRC-32 is most of that cost. So every rank of a
node checks a share of the bytes of the node's candidate folder
(``_checksum.assign`` over the node's ranks: byte ranges, so a single large
file is read by all of them; as the durable restore splits its check over the
job), and the shares' findings go to rank 0 in the round the ranks need anyway to
agree on a step. Rank 0 decides each node's verdict from them exactly as one
process checking the folder would (same problems, in the same order, same
warning text) and answers every rank at once: the steps the nodes hold, or
which nodes check again. No other rank reads another's findings, so a rank
costs three store operations a round and reads an answer the size of the node
count, however many ranks the job has.

Rounds: one when every node's newest step is sound and ``LOCAL_WORLD_SIZE``
(set by torchrun) names the node's size. A node whose candidate fails moves to
its next older step in a further round (its ranks warn with the problems rank
0 found), and a node whose ranks did not cover the candidate between them (no
``LOCAL_WORLD_SIZE``, or a rank that listed another newest step) checks it
again in the next round, split by the node membership the first round showed.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ddpstate import _checksum, _manifest
from ddpstate._manager import verify_split
from ddpstate._warn import warn
from ddpstate.dist import Timeout, gather_to_receivers, get_local_rank, get_rank

__all__ = ["local_world_size", "check_share_of_step", "newest_on_nodes"]


def local_world_size() -> int:
    """The number of ranks on this node as the launcher says (``LOCAL_WORLD_SIZE``), else 1.

    A wrong value costs a round, never a wrong verdict: the gathered findings
    show which shares were checked, and a node whose shares leave a file
    unchecked checks again.

    Returns:
        ``LOCAL_WORLD_SIZE`` when it is a positive int, else 1.

    Example:
        >>> from ddpstate._manager.local_check import local_world_size
        >>> local_world_size()  # no launcher here
        1
    """
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def check_share_of_step(
    directory: str, step: Optional[int], share: tuple[int, int]
) -> dict[str, Any]:
    """This rank's findings on share ``share`` (index, count) of local step ``step``.

    Share 0 also reports what one rank reads once: the manifest's own problems
    (``head``), the folder listing's (``tail``) and the files it lists
    (``expected``, in manifest order).

    Args:
        directory: The node's local tier folder.
        step: The step to check (None: nothing to check).
        share: (index, count): this rank's share among ``count`` checkers.

    Returns:
        The findings, small and picklable, for the gather round; never raises
        (a failure is a finding, so the other ranks are not left waiting).

    Example:
        >>> import tempfile
        >>> from ddpstate._manager.local_check import check_share_of_step
        >>> found = check_share_of_step(tempfile.mkdtemp(), 3, (0, 1))
        >>> (found["step"], len(found["head"]))  # no manifest: one problem
        (3, 1)
    """
    if step is None:
        return {"step": None}
    index, _ = share
    folder = os.path.join(directory, _manifest.step_name(step))
    found: dict[str, Any] = {
        "step": step,
        "share": share,
        "head": [],
        "files": [],
        "tail": [],
        "expected": {},
    }
    try:
        manifest, problem = _manifest.read_manifest(folder, None)
        if manifest is None:
            found["head"] = [str(problem)] if index == 0 else []
            return found
        found["files"] = verify_split.check_share(folder, manifest, None, *share)
        if index == 0:
            found["head"] = _manifest.manifest_problems(manifest, step)
            found["tail"], _ = _manifest.check_listing(folder, manifest["files"], None)
            found["expected"] = _manifest.checked_files(manifest)
    except Exception as exc:  # still join the round: the others would wait for this rank
        text = f"it cannot be checked ({_checksum.error_text(exc)})"
        found["files"] = [*found["files"], ("", _checksum.PieceRead(0, 0, 0, text))]
    return found


def _verdict(reports: list[dict[str, Any]], step: int) -> Optional[list[str]]:
    """The node's problems with ``step`` from its ranks' reports; None when not all checked."""
    zero = [g for g in reports if g["step"] == step and g["share"][0] == 0]
    if not zero:
        return None
    count = zero[0]["share"][1]
    by_share = {g["share"][0]: g for g in reports if g["step"] == step and g["share"][1] == count}
    if any(i not in by_share for i in range(count)):
        return None
    first = by_share[0]
    files = _checksum.file_problems(first["expected"], (g["files"] for g in by_share.values()))
    return [*first["head"], *files, *first["tail"]]


def newest_on_nodes(
    directory: str,
    committed: Optional[list[int]],
    durable: Optional[float],
    timeout: Timeout,
) -> tuple[dict[int, Optional[int]], Optional[float]]:
    """A collective: each node's newest sound local step, checked by all its ranks.

    Args:
        directory: This node's local tier folder.
        committed: This rank's committed local steps, oldest first (None: unreadable).
        durable: Rank 0's newest durable step (ignored on the other ranks).
        timeout: As for the collectives.

    Returns:
        ({node's local main rank: its newest sound step or None}, rank 0's ``durable``).

    Raises:
        BarrierTimeoutError: Some ranks did not arrive in time (named).

    Example:
        >>> import tempfile
        >>> from ddpstate._manager.local_check import newest_on_nodes
        >>> newest_on_nodes(tempfile.mkdtemp(), [], 7, None)
        ({0: None}, 7)
    """
    rank = get_rank()
    local = get_local_rank()
    node = rank - local  # launchers number a node's ranks contiguously from its local rank 0
    report = {
        "main": local == 0,
        "node": node,
        "committed": committed if local == 0 else None,
        "durable": durable,
        **check_share_of_step(
            directory, committed[-1] if committed else None, (local, local_world_size())
        ),
    }
    agreement = _Agreement()  # used on rank 0 only, the one receiver
    answer = gather_to_receivers(report, agreement.first, dst=0, name=_NAME, timeout=timeout)
    while True:
        for step, problems in answer["failed"].get(node, []):
            folder = os.path.join(directory, _manifest.step_name(step))
            warn(f"CheckpointManager.restore: skipping the local {folder}: {'; '.join(problems)}")
        if not answer["again"]:
            return answer["held"], answer["durable"]
        mine: dict[str, Any] = {"step": None}
        if node in answer["again"]:
            step, ranks = answer["again"][node]
            if rank in ranks:
                mine = check_share_of_step(directory, step, (ranks.index(rank), len(ranks)))
        answer = gather_to_receivers(mine, agreement.next, dst=0, name=_NAME, timeout=timeout)


_NAME = "CheckpointManager.restore (local tier)"


class _Agreement:
    """Rank 0's side of :func:`newest_on_nodes`: every node's verdict, round after round.

    Each round rank 0 reads every rank's findings and answers every rank at
    once with what is small: the steps each node holds (when all are known),
    the nodes that check again (with the step and their ranks), and each
    failed node's problems for its ranks to warn with. No rank reads another
    rank's findings but rank 0 (three store operations each).
    """

    def __init__(self) -> None:
        self.durable: Optional[float] = None
        self.members: dict[int, list[int]] = {}
        self.left: dict[int, list[int]] = {}
        self.held: dict[int, Optional[int]] = {}

    def first(self, reports: list[dict[str, Any]]) -> dict[str, Any]:
        self.durable = reports[0]["durable"]
        self.members = {
            m: [q for q, g in enumerate(reports) if g["node"] == m]
            for m, g in enumerate(reports)
            if g["main"]
        }
        self.left = {m: list(reports[m]["committed"] or []) for m in self.members}
        return self.next(reports)

    def next(self, reports: list[dict[str, Any]]) -> dict[str, Any]:
        again: dict[int, tuple[int, list[int]]] = {}
        failed: dict[int, list[tuple[int, list[str]]]] = {}
        for m, ranks in self.members.items():
            if m in self.held:
                continue
            if not self.left[m]:
                self.held[m] = None
                continue
            step = self.left[m][-1]
            problems = _verdict([reports[q] for q in ranks], step)
            if problems is None:  # a share went unchecked: check it again, split by membership
                again[m] = (step, ranks)
                continue
            if not problems:
                self.held[m] = step
                continue
            failed[m] = [(step, problems)]
            self.left[m].pop()
            if self.left[m]:
                again[m] = (self.left[m][-1], ranks)
            else:
                self.held[m] = None
        return {
            "again": again,
            "failed": failed,
            "held": None if again else dict(self.held),
            "durable": self.durable,
        }
