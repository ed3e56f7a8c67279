"""The parts of :class:`ddpstate.CheckpointManager` that live outside its class: the node-local
tier and the split restore verification.
"""
