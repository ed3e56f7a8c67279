"""Restore's checksum pass split across ranks.

:meth:`CheckpointManager.restore` verifies a step folder before loading it.
Reading every byte of every file for its CRC-32 is most of restore's cost, so
in a multi-rank job rank 0 reads the manifest and lists the folder (cheap),
proposes the step to the others, and every rank checksums its share of the
listed files' bytes (``_checksum.assign``: consecutive byte ranges, so one large file
is read by several ranks at once and its CRC-32 put together from the pieces'
with ``_crc``); the shares' findings meet on rank 0 in one gather round, where
``restore.choose`` decides exactly as it does alone (same
candidate order, same fallback, same warning text). The other ranks follow
:func:`follow` until rank 0 ends the loop with :func:`finish`. A rank that
cannot see the manifest rank 0 read makes :func:`verify` raise that the folder
is not shared storage between the ranks, never that the checkpoint is damaged.
"""

from __future__ import annotations

from typing import Any, Optional

from ddpstate import _checksum, _manifest, _visibility, storage
from ddpstate._manifest import MANIFEST_NAME
from ddpstate.dist import Timeout, broadcast_object, gather_and_decide, get_rank, get_world_size

_NAME = "CheckpointManager.restore (verify)"


def check_share(
    folder: str, manifest: dict[str, Any], opts: Optional[dict[str, Any]], index: int, count: int
) -> list[_checksum.Finding]:
    """Checksum share ``index`` of ``count`` of ``manifest``'s listed files (see ``_checksum``).

    DCP shards included: restore loads them straight into the live state, so
    their bytes are checked here, before anything is loaded.
    """
    files = _manifest.checked_files(manifest)
    return _checksum.check_share(folder, files, opts, index, count)


def _check_share(
    folder: str, manifest: dict[str, Any], opts: Optional[dict[str, Any]]
) -> tuple[Optional[int], list[_checksum.Finding]]:
    """What this rank sees of ``folder``'s manifest, and its share's findings.

    A rank that cannot see the manifest rank 0 read checks nothing: its
    findings would call the intact files missing.
    """
    seen = _visibility.stat(storage.join(folder, MANIFEST_NAME))
    if seen is None:
        return None, []
    return seen, check_share(folder, manifest, opts, get_rank(), get_world_size())


def verify(
    folder: str, step: int, opts: Optional[dict[str, Any]], timeout: Timeout
) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """Rank 0: check ``folder`` with every rank's help; return (manifest, problems) as _verify."""
    folder = storage.committed_folder(folder, storage_options=opts)  # a URL's version folder
    manifest, problem = _manifest.read_manifest(folder, opts)
    if manifest is None:
        return None, str(problem)
    head = _manifest.manifest_problems(manifest, step)
    listing, _ = _manifest.check_listing(folder, manifest["files"], opts)
    broadcast_object((folder, manifest), src_rank=0, timeout=timeout)
    shares: list[list[_checksum.Finding]] = []
    seen: list[Optional[int]] = []

    def collect(payloads: list[Any]) -> None:
        seen.extend(view for view, _ in payloads)
        shares.extend(share for _, share in payloads)

    gather_and_decide(_check_share(folder, manifest, opts), collect, name=_NAME, timeout=timeout)
    # Some ranks cannot see the folder rank 0 reads: not damage (see restore.choose).
    not_shared = _visibility.not_shared(
        storage.join(folder, MANIFEST_NAME),
        0,
        seen,
        "sees",
        "nothing is damaged; put the checkpoint folder on storage every rank sees (a shared "
        "filesystem or an fsspec URL)",
    )
    if not_shared is not None:
        raise not_shared
    # Back in manifest order, so the text is what one rank checking the whole folder reports.
    found = _checksum.file_problems(_manifest.checked_files(manifest), shares)
    inner = _manifest.dcp_manifest_problems(folder, manifest, opts)
    problems = [*head, *found, *inner, *listing]
    return (None, "; ".join(problems)) if problems else (manifest, None)


def follow(opts: Optional[dict[str, Any]], timeout: Timeout) -> None:
    """Ranks other than 0: check a share of each step rank 0 proposes, until it is done."""
    while True:
        proposal = broadcast_object(None, src_rank=0, timeout=timeout)
        if proposal is None:
            return
        folder, manifest = proposal
        problems = _check_share(folder, manifest, opts)
        gather_and_decide(problems, lambda payloads: None, name=_NAME, timeout=timeout)


def finish(timeout: Timeout) -> None:
    """Rank 0: tell the followers no more steps are proposed (also after a failure)."""
    broadcast_object(None, src_rank=0, timeout=timeout)
