"""Pickle payloads that run a command if anything ever unpickles them for real."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class RunsCommand:
    """Pickles as a call to os.system that creates ``marker``: its existence proves execution."""

    def __init__(self, marker: Path | str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))
