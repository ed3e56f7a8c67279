"""The everyday types ddpstate saves and restores with ``weights_only``, by global name.

Torch-free, so the streaming engine (``ddpstate inspect``/``convert``/``verify``)
accepts the same files ``ddpstate.save`` writes; ``_io.savecheck`` resolves these
names to the objects it adds to torch's weights_only list while loading.
"""

from __future__ import annotations

__all__ = ["EVERYDAY_GLOBALS"]

#: ``module.name`` of every global such a value's pickle names. They carry data and
#: run no code of the file's choosing: numpy scalars and numeric arrays (numpy 1.x
#: and 2.x names), paths, datetime values, ``argparse.Namespace``, and ddpstate's
#: own ``defaultdict`` rebuilder, which only files of earlier versions name (save
#: now refuses a defaultdict; the factory comes from a fixed table of builtins).
EVERYDAY_GLOBALS: tuple[str, ...] = (
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.core.multiarray.scalar",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray.scalar",
    "numpy._core.multiarray._reconstruct",
    "builtins.bytes",
    "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath",
    "pathlib.PosixPath",
    "pathlib.WindowsPath",
    "pathlib._local.PurePosixPath",
    "pathlib._local.PureWindowsPath",
    "pathlib._local.PosixPath",
    "pathlib._local.WindowsPath",
    "datetime.datetime",
    "datetime.date",
    "datetime.time",
    "datetime.timedelta",
    "datetime.timezone",
    "argparse.Namespace",
    "ddpstate._io.savecheck._rebuild_defaultdict",
)
