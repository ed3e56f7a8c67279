"""Preemption: SIGTERM and SIGUSR1 turned into a flag that ``CheckpointManager.should_stop`` shares.

With ``handle_signals=True`` the signals no longer kill the process; the
handler only sets a flag, and the training loop saves at the next
``should_stop()``, at a step boundary. The previous handlers come back at
:meth:`StopSignals.restore`.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Optional

from ddpstate.dist import all_reduce_flag
from ddpstate.errors import InvalidArgumentError


class StopSignals:
    """The SIGTERM/SIGUSR1 handler of one manager and the stop flag it sets."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Install the handler for SIGTERM and SIGUSR1 (where they exist).

        Raises:
            InvalidArgumentError: Not called from the main thread.
        """
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError(
                "CheckpointManager(handle_signals=True) must be created in the main thread: "
                "Python delivers signals only there"
            )
        for name in ("SIGTERM", "SIGUSR1"):
            signum = getattr(signal, name, None)
            if signum is not None:
                self._previous[int(signum)] = signal.signal(signum, self._on_signal)

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (a collective; see ``should_stop``)."""
        # Return the agreed answer, not the flag: a signal landing after the all-reduce
        # must not make this rank alone stop now (it is seen at the next call).
        stop = all_reduce_flag(self.requested)
        if stop:
            self.requested = True
        return stop

    def restore(self) -> None:
        """Put the previous handlers back (a no-op when none were installed)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        # Only a flag: the loop saves at the next should_stop(), at a step boundary.
        self.requested = True
        self.signum = signum
