"""The versions a test run resolved: printed first by pytest and last by .ci/run.

A fresh install resolves the newest releases, so a failure that a warm environment
hides shows up with the versions that caused it. ``python -m tests.versions``
prints the same line.
"""

from __future__ import annotations

import platform
from importlib import metadata

# isal and zlib-ng: the CRC-32 libraries ddpstate picks from (ddpstate/_crc.py).
PACKAGES = (
    "torch",
    "pytest",
    "safetensors",
    "fsspec",
    "moto",
    "s3fs",
    "numpy",
    "hypothesis",
    "isal",
    "zlib-ng",
)


def resolved_versions() -> str:
    """One line, ``python 3.11.7, torch 2.13.0+cpu, ...``; a package not installed says so."""
    parts = [f"python {platform.python_version()}"]
    for name in PACKAGES:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} (not installed)")
    return ", ".join(parts)


if __name__ == "__main__":
    print(resolved_versions())
