"""torch's own tables for the torch-free scanner, read once from the generated JSON file.

``torch_tables.json`` beside this module is GENERATED: regenerate it with
``python -m ddpstate._streaming.gen_tables`` after a torch upgrade;
``tests/streaming/test_safe_globals.py`` fails while it differs from the installed torch's.
"""

from __future__ import annotations

import json
import os

#: The generated file (shipped as package data).
PATH = os.path.join(os.path.dirname(__file__), "torch_tables.json")

with open(PATH, encoding="utf-8") as _file:
    _TABLES = json.load(_file)

#: The torch the tables come from.
TORCH_VERSION: str = _TABLES["TORCH_VERSION"]
#: Every dtype torch can pickle, by its canonical name, and its element size in bytes.
DTYPE_ITEMSIZE: dict[str, int] = _TABLES["DTYPE_ITEMSIZE"]
#: Each storage class (``FloatStorage``...) and the dtype of its elements.
STORAGE_DTYPE: dict[str, str] = _TABLES["STORAGE_DTYPE"]
#: torch's weights-only allowlist: the globals ``torch.load(weights_only=True)`` accepts.
SAFE_GLOBALS: frozenset[str] = frozenset(_TABLES["SAFE_GLOBALS"])
