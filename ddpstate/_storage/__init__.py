"""The engine behind :mod:`ddpstate.storage`: temp names, local and fsspec atomic writes."""
