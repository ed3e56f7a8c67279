"""A rendezvous store of its own for each torchrun restart attempt (pytorch/pytorch#135712).

When torchrun's agent shares its rendezvous TCPStore with the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``, the default since torch 2.4), every key
a worker writes outlives it: after ``--max-restarts`` brings the workers back,
the new process group and ddpstate's own collectives start numbering their keys
again and can read what the dead workers wrote (stale peer addresses, stale
collective payloads). A prefix naming the restart attempt keeps each attempt's
keys apart. Setting ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun is
torch's documented workaround; this makes it unnecessary for
:func:`ddpstate.init_distributed`.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]


def attempt_store(timeout: timedelta) -> Optional[Any]:
    """Return a store for this restart attempt under torchrun's shared agent store, else None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # A client of the agent's store, as torch's env:// would make; only the keys differ.
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return PrefixStore(f"ddpstate/attempt_{attempt}", store)
