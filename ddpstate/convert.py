"""File-to-file checkpoint conversion, inspection, comparison and verification.

The public names of the ``ddpstate`` file commands; each lives in its own module of
``ddpstate._convert`` (``rewrite``: :func:`convert_file`, ``inspect``:
:func:`inspect_file`, ``diff``: :func:`diff_files`, ``verify``: :func:`verify_file`,
``results``: the result types; ``common``: :class:`StateEdit`, what a conversion
changes), which read every torch file with torch's own reader.
"""

from __future__ import annotations

from typing import Final

from ddpstate import formats
from ddpstate._convert.common import StateEdit, default_destination
from ddpstate._convert.diff import diff_files
from ddpstate._convert.inspect import inspect_file
from ddpstate._convert.results import (
    ConvertResult,
    DiffResult,
    InspectResult,
    TensorInfo,
    VerifyResult,
)
from ddpstate._convert.rewrite import convert_file
from ddpstate._convert.verify import verify_file

__all__ = [
    "ConvertResult",
    "DiffResult",
    "StateEdit",
    "InspectResult",
    "TensorInfo",
    "VerifyResult",
    "convert_file",
    "default_destination",
    "diff_files",
    "inspect_file",
    "verify_file",
]


#: Output formats of :func:`convert_file` (:mod:`ddpstate.formats`' names).
PT: Final = formats.PT
SAFETENSORS: Final = formats.SAFETENSORS
