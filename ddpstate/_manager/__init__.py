"""The parts :class:`ddpstate.CheckpointManager` is composed of (the class: ``manager.py``).

Layers, lowest first (a module imports only those before it, and ``ddpstate._manifest``):
``entries`` (state entries, checks, RNG wire format), ``signals`` (preemption flag),
``snapshot`` (async CPU copies), ``writer`` (write, commit, rotate; the async write in
flight), ``agreement`` (what save's round checks), ``verify_split`` and ``local_tier``
(restore's split checksums, the node-local tier), ``save`` and ``restore`` (the two
collectives).
"""
