"""A small progress bar on stderr, shown only on a terminal and only for slow work."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

# Work shorter than this never shows a bar, so quick commands print nothing extra.
_DELAY_S = 1.0
_REFRESH_S = 0.1
_WIDTH = 30


class Progress:
    """Counts bytes done out of a total and draws a one-line bar once work is slow.

    Args:
        total: Bytes (or any unit) of work expected.
        label: Shown before the bar.
        enabled: False draws nothing (``--quiet``, or stderr not a terminal when None).
        stream: Where to draw; stderr by default.

    Example:
        >>> bar = Progress(100, "copy", enabled=False)
        >>> bar.update(50); bar.close()
        >>> bar.done
        50
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        enabled: Optional[bool] = None,
        stream: Optional[TextIO] = None,
    ) -> None:
        self.total = max(total, 0)
        self.label = label
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self._stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self._enabled = enabled
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False

    def update(self, amount: int) -> None:
        """Record ``amount`` more units done and redraw when due."""
        self.done += amount
        if not self._enabled:
            return
        now = time.monotonic()
        if now - self._start < _DELAY_S or now - self._last_draw < _REFRESH_S:
            return
        self._draw(now)

    def _draw(self, now: float) -> None:
        self._last_draw = now
        self._drawn = True
        fraction = min(self.done / self.total, 1.0) if self.total else 1.0
        filled = int(fraction * _WIDTH)
        rate = self.done / max(now - self._start, 1e-9)
        line = (
            f"\r{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {fraction:6.1%} "
            f"{human_bytes(self.done)}/{human_bytes(self.total)} {human_bytes(int(rate))}/s"
        )
        self._stream.write(line)
        self._stream.flush()

    def close(self) -> None:
        """Finish the bar's line (only if one was drawn)."""
        if self._drawn:
            self._draw(time.monotonic())
            self._stream.write("\n")
            self._stream.flush()
            self._drawn = False


def human_bytes(count: float) -> str:
    """Format a byte count for people: ``512 B``, ``1.5 KiB``, ``3.0 GiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - loop always returns
