"""Restore's checksum pass split across ranks.

:meth:`CheckpointManager.restore` verifies a step folder before loading it.
Reading every byte of every file for its CRC-32 is most of restore's cost, so
in a multi-rank job rank 0 reads the manifest and lists the folder (cheap),
proposes the step to the others, and every rank checksums its share of the
listed files; the shares' problems meet on rank 0 in one gather round, where
``restore.choose`` decides exactly as it does alone (same
candidate order, same fallback, same warning text). The other ranks follow
:func:`follow` until rank 0 ends the loop with :func:`finish`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from ddpstate import _manifest, storage
from ddpstate._manager.entries import Timeout
from ddpstate.dist import broadcast_object, gather_and_decide, get_rank, get_world_size

_NAME = "CheckpointManager.restore (verify)"


def assign(sizes: Mapping[str, int], world: int) -> list[list[str]]:
    """Split files across ``world`` ranks, balanced by bytes; the same on every rank.

    Largest file first, each to the rank with the fewest bytes so far (the
    lowest rank on a tie); files of equal size go in name order.
    """
    shares: list[list[str]] = [[] for _ in range(world)]
    load = [(0, r) for r in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        total, rank = heapq.heappop(load)
        shares[rank].append(name)
        heapq.heappush(load, (total + sizes[name], rank))
    return shares


def _checked(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The manifest's listed files that ``check_folder`` reads (the rest are manifest problems)."""
    files: dict[str, Any] = manifest["files"]
    return {n: e for n, e in files.items() if _manifest.is_listed(n) and isinstance(e, dict)}


def check_share(
    folder: str, manifest: dict[str, Any], opts: Optional[dict[str, Any]], index: int, count: int
) -> list[tuple[str, str]]:
    """Check share ``index`` of ``count`` of ``manifest``'s files; return (file, problem) pairs.

    The shares are :func:`assign`'s over the files ``check_folder`` reads; an
    ``index`` outside ``range(count)`` checks nothing.

    Args:
        folder: The step folder.
        manifest: Its manifest, as read.
        opts: fsspec storage options, or None.
        index: This checker's share.
        count: How many checkers split the files.

    Returns:
        (file, problem) pairs for the files of this share, in manifest order.
    """
    files = _checked(manifest)
    sizes = {n: e["size"] if isinstance(e.get("size"), int) else 0 for n, e in files.items()}
    mine = set(assign(sizes, count)[index]) if 0 <= index < count else set()
    check = _manifest.FolderCheck(manifest, [], [])
    found: list[tuple[str, str]] = []
    for filename, expected in files.items():
        if filename not in mine:
            continue
        before = len(check.problems)
        try:
            _manifest.check_file(storage.join(folder, filename), filename, expected, check, opts)
        except Exception as exc:  # still join the round: the others would wait for this rank
            check.problems.append(f"{filename} cannot be checked ({type(exc).__name__}: {exc})")
        found.extend((filename, p) for p in check.problems[before:])
    return found


def in_file_order(order: list[str], shares: Iterable[list[tuple[str, str]]]) -> list[str]:
    """The shares' problems in manifest order (``order``), as one rank checking them all reports.

    Example:
        >>> from ddpstate._manager.verify_split import in_file_order
        >>> in_file_order(["a.pt", "b.pt"], [[("b.pt", "b bad")], [("a.pt", "a bad")]])
        ['a bad', 'b bad']
    """
    rank_of = {n: i for i, n in enumerate(order)}
    pairs = (pair for share in shares for pair in share)
    found = sorted(pairs, key=lambda f: rank_of.get(f[0], len(rank_of)))
    return [p for _, p in found]


def _check_share(
    folder: str, manifest: dict[str, Any], opts: Optional[dict[str, Any]]
) -> list[tuple[str, str]]:
    return check_share(folder, manifest, opts, get_rank(), get_world_size())


def verify(
    folder: str, step: int, opts: Optional[dict[str, Any]], timeout: Timeout
) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """Rank 0: check ``folder`` with every rank's help; return (manifest, problems) as _verify."""
    manifest, problem = _manifest.read_manifest(folder, opts)
    if manifest is None:
        return None, str(problem)
    check = _manifest.FolderCheck(manifest, _manifest.manifest_problems(manifest, step), [])
    listing = _manifest.FolderCheck(manifest, [], [])
    _manifest.check_listing(folder, manifest["files"], listing, opts)
    broadcast_object((folder, manifest), src=0, timeout=timeout)
    shares: list[list[tuple[str, str]]] = []

    def collect(payloads: list[Any]) -> None:
        shares.extend(payloads)

    gather_and_decide(_check_share(folder, manifest, opts), collect, name=_NAME, timeout=timeout)
    # Back in manifest order, so the text is what one rank checking the whole folder reports.
    found = in_file_order(list(manifest["files"]), shares)
    problems = [*check.problems, *found, *listing.problems]
    return (None, "; ".join(problems)) if problems else (manifest, None)


def follow(opts: Optional[dict[str, Any]], timeout: Timeout) -> None:
    """Ranks other than 0: check a share of each step rank 0 proposes, until it is done."""
    while True:
        proposal = broadcast_object(None, src=0, timeout=timeout)
        if proposal is None:
            return
        folder, manifest = proposal
        problems = _check_share(folder, manifest, opts)
        gather_and_decide(problems, lambda payloads: None, name=_NAME, timeout=timeout)


def finish(timeout: Timeout) -> None:
    """Rank 0: tell the followers no more steps are proposed (also after a failure)."""
    broadcast_object(None, src=0, timeout=timeout)
