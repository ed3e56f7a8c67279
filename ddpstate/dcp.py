"""Durable, verified storage for ``torch.distributed.checkpoint`` (DCP), on disk and object stores.

Plug these into plain DCP (or anything built on it, such as torchtitan)::

    import torch.distributed.checkpoint as dcp
    from ddpstate.dcp import DurableWriter, VerifiedReader

    dcp.save(state, storage_writer=DurableWriter("s3://bucket/run/step_100"))
    dcp.load(state, storage_reader=VerifiedReader("s3://bucket/run/step_100"))

:class:`DurableWriter` CRC-32s every item as it is written and commits the
folder with ddpstate's manifest, written last (on local disks after an fsync
and a swap into place; on object stores by one PUT, a save over a committed
checkpoint going to a fresh version prefix first); of two saves to one path at
once, the later commit fails, naming it. :class:`VerifiedReader` refuses an
uncommitted folder and checks every byte range it reads against the manifest. Importing this module
imports ``torch.distributed.checkpoint``. See docs/dcp.md.
"""

from __future__ import annotations

from ddpstate._io.durable_dcp import DurableWriter, VerifiedReader

__all__ = ["DurableWriter", "VerifiedReader"]
