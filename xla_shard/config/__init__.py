from xla_shard.config.load import (apply_overrides, dump, load, load_with_notes, read_raw, revalidated, to_native,
                                   validate)
from xla_shard.config.schema import Backend, ShardConfig, ShardingStrategy, WrapPolicy

__all__ = ["Backend", "ShardConfig", "ShardingStrategy", "WrapPolicy", "apply_overrides", "dump", "load",
           "load_with_notes", "read_raw", "revalidated", "to_native", "validate"]
