"""Hugging Face sharded checkpoints (an index JSON plus shard files): reading and writing."""
