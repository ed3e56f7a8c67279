"""Writes `torch_tables.py` from the installed torch: `python -m ddpstate._streaming.gen_tables`.

The streaming scanner must not import torch (``ddpstate inspect``/``convert``
run in the memory and time of a copy), so it reads checked-in tables; this
script is where they come from, and ``tests/test_safe_globals.py`` fails as
soon as the installed torch would write different ones.
"""

from __future__ import annotations

import json
import pathlib
import warnings
from typing import Any

_HEADER = '''"""torch's own tables, for the torch-free scanner. GENERATED: do not edit.

Regenerate with ``python -m ddpstate._streaming.gen_tables`` after a torch
upgrade; ``tests/test_safe_globals.py`` fails while they differ from the
installed torch's.
"""
'''


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
    """The text of ``torch_tables.py`` for the installed torch.

    Returns:
        Python source, formatted as ``ruff format`` leaves it (strings quoted by
        ``json.dumps``: the names are plain ASCII, so JSON and Python agree).

    Example:
        >>> "SAFE_GLOBALS" in render()
        True
    """
    lines = [_HEADER]
    for name, value in tables().items():
        if isinstance(value, str):
            lines.append(f"{name} = {json.dumps(value)}")
            continue
        kind = "dict[str, int]" if name == "DTYPE_ITEMSIZE" else "dict[str, str]"
        if isinstance(value, list):
            lines.append(f"{name}: frozenset[str] = frozenset(")
            lines.append("    {")
            lines += [f"        {json.dumps(item)}," for item in value]
            lines.append("    }")
            lines.append(")")
            continue
        lines.append(f"{name}: {kind} = {{")
        lines += [f"    {json.dumps(key)}: {json.dumps(item)}," for key, item in value.items()]
        lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Write ``torch_tables.py`` next to this module."""
    target = pathlib.Path(__file__).with_name("torch_tables.py")
    target.write_text(render())
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
