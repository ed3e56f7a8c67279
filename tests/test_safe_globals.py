"""The streaming scanner's allowlist is torch's own weights-only allowlist, name for name.

``ddpstate inspect``/``convert``/``verify`` never import torch, so the scanner
keeps a copy of the globals ``torch.load(weights_only=True)`` accepts by
default (:data:`ddpstate._streaming.pickle_scan.SAFE_GLOBALS`). A copy drifts
when torch changes its list; this test reads torch's list and names every
difference, so the two only ever differ on purpose.
"""

from __future__ import annotations

import torch
import torch._weights_only_unpickler as weights_only

from ddpstate._streaming.pickle_scan import SAFE_GLOBALS


def test_safe_globals_match_torchs_weights_only_allowlist() -> None:
    # _get_allowed_globals() is what torch's weights-only Unpickler consults for
    # every GLOBAL opcode (full "module.name" -> object); user-added safe globals
    # (torch.serialization.add_safe_globals) live elsewhere and stay out of it.
    torchs = set(weights_only._get_allowed_globals())
    only_torch = sorted(torchs - SAFE_GLOBALS)
    only_ddpstate = sorted(SAFE_GLOBALS - torchs)
    assert not only_torch and not only_ddpstate, (
        f"pickle_scan.SAFE_GLOBALS differs from torch {torch.__version__}'s weights-only "
        f"allowlist: torch accepts but ddpstate refuses {only_torch}; ddpstate accepts but "
        f"torch refuses {only_ddpstate}"
    )
