"""Sharded, atomic, async checkpoints on any fsspec URL; see `manager` for the save protocol."""

from xla_shard.checkpoint.manager import (CheckpointError, Checkpointer, Manifest, committed_steps, read_manifest)
from xla_shard.checkpoint.storage import Storage, StorageError

__all__ = ["CheckpointError", "Checkpointer", "Manifest", "Storage", "StorageError", "committed_steps",
           "read_manifest"]
