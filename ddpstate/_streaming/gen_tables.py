"""Writes `torch_tables.json` from the installed torch: `python -m ddpstate._streaming.gen_tables`.

The streaming scanner must not import torch (``ddpstate inspect``/``convert``
run in the memory and time of a copy), so it reads checked-in tables
(:mod:`ddpstate._streaming.torch_tables`); this script is where they come from,
and ``tests/streaming/test_safe_globals.py`` fails as soon as the installed torch would
write different ones.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from ddpstate._streaming import torch_tables


def tables() -> dict[str, Any]:
    """The installed torch's dtypes, storage classes and weights-only allowlist.

    Returns:
        ``{"TORCH_VERSION": str, "DTYPE_ITEMSIZE": {dtype name: bytes per element},
        "STORAGE_DTYPE": {storage class name: dtype name}, "SAFE_GLOBALS": [names]}``,
        each sorted.

    Example:
        >>> tables()["DTYPE_ITEMSIZE"]["bfloat16"]
        2
    """
    import torch
    from torch import _weights_only_unpickler

    dtypes = {
        name: value
        for name, value in vars(torch).items()
        # Aliases (torch.float, torch.half...) pickle under the canonical name.
        if isinstance(value, torch.dtype) and str(value) == f"torch.{name}"
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy classes' TypedStorage deprecation
        storages = {
            name: str(dtype).removeprefix("torch.")
            for name, value in vars(torch).items()
            # ``torch.Storage`` is an alias, pickled under its class's own name.
            if isinstance(value, type) and value.__name__ == name and name.endswith("Storage")
            if isinstance(dtype := getattr(value, "dtype", None), torch.dtype)
        }
    # Untyped storages hold bytes; torch gives the class no dtype of its own.
    storages["UntypedStorage"] = "uint8"
    return {
        "TORCH_VERSION": torch.__version__.split("+")[0],
        "DTYPE_ITEMSIZE": {name: dtypes[name].itemsize for name in sorted(dtypes)},
        "STORAGE_DTYPE": dict(sorted(storages.items())),
        # Private, but the only full list: torch.serialization.get_safe_globals()
        # returns the user's additions only, and torch's weights-only Unpickler
        # consults exactly this for every GLOBAL opcode.
        "SAFE_GLOBALS": sorted(_weights_only_unpickler._get_allowed_globals()),
    }


def render() -> str:
    """The text of ``torch_tables.json`` for the installed torch.

    Returns:
        The tables as JSON, one item a line (a torch upgrade reads as a short diff).

    Example:
        >>> "SAFE_GLOBALS" in render()
        True
    """
    return json.dumps(tables(), indent=1) + "\n"


def main() -> None:
    """Write ``torch_tables.json`` next to this module."""
    with open(torch_tables.PATH, "w", encoding="utf-8") as file:
        file.write(render())
    print(f"wrote {torch_tables.PATH}")


if __name__ == "__main__":
    main()
