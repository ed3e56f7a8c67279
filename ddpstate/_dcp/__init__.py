"""Sharded and parallel checkpoints through ``torch.distributed.checkpoint``: writing, reading into
models, inspecting and converting.
"""
