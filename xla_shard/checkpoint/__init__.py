"""Sharded, atomic, async checkpoints on any fsspec URL; see `manager` for the save protocol.

`layout` is the on-storage format, `manifest` and `reader` the reading side, `manager` the writing side and
resume, `run_record` what a resume checks it goes on with, `inspect` and `export` the tools built on the reader.
"""

from xla_shard.checkpoint.manager import Checkpointer, NoCheckpoints
from xla_shard.checkpoint.manifest import (CheckpointError, CorruptCheckpointError, Manifest, committed_steps,
                                           read_manifest)
from xla_shard.checkpoint.reader import ChunkReader
from xla_shard.checkpoint.run_record import RunRecord, finished_message, nothing_to_train
from xla_shard.io.storage import Storage, StorageError

__all__ = ["CheckpointError", "Checkpointer", "ChunkReader", "CorruptCheckpointError", "Manifest", "NoCheckpoints",
           "RunRecord", "Storage", "StorageError", "committed_steps", "finished_message", "nothing_to_train",
           "read_manifest"]
