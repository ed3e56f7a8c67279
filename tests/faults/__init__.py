"""Fault and bad-input campaign: crashes, write failures, corrupt and malicious files, lost ranks.

The CI subset lives in ``tests/faults/test_*.py``; ``python -m tests.faults.campaign``
runs the same harness (``tests/faults/_harness.py``) at scale.
"""
