"""The engine behind :mod:`ddpstate.keys`: wrapper detection, key renaming, matching, lookup."""
