"""FSDP training on Cloud TPUs (torch_xla) with a CUDA FSDP2 fallback, from one config.

The public API, for your own training loop (see the README's "Use from Python"):

    load_config / ShardConfig      the one config schema (also reads accelerate and transformers FSDP configs)
    start_backend                  the backend the config asks for (xla_spmd, xla_fsdp, torch_fsdp, torch_tpu), started,
                                   its plan settled for the devices it has (`backend.plan`)
    create_backend                 the same, checked but not started
    ShardingPlan                   how the backend shards
    load_model                     the config's model wrapped by a backend, with its pretrained weights if any
    build_model                    a transformers model from the config's `model` section (architecture only)
    build_data                     the config's data: training (and evaluation) batches for any step and process
    Checkpointer                   sharded, atomic, async checkpoints on any fsspec URL, with `restore`
    Trainer                        the whole job for a config, with a `loss_fn` hook
    method_for                     the config's fine-tuning method: adapter, objective, needs (`xla_shard.methods`)
    objective_for                  what a step computes and evaluation reports (the method's objective)
    evaluate                       loss (perplexity, accuracy) over every row of an evaluation source
    ConfigError, CheckpointError   what user mistakes raise (one line each)

Names are imported on first use, so `import xla_shard` stays light (and torch_xla is imported only by the
XLA backends).
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "load_config": ("xla_shard.config", "load"),
    "ShardConfig": ("xla_shard.config", "ShardConfig"),
    "create_backend": ("xla_shard.backends", "create"),
    "start_backend": ("xla_shard.backends", "start"),
    "Backend": ("xla_shard.backends", "Backend"),
    "ShardingPlan": ("xla_shard.plan", "ShardingPlan"),
    "build_model": ("xla_shard.models", "build_model"),
    "load_model": ("xla_shard.pretrained", "load_model"),
    "build_data": ("xla_shard.train", "build_data"),
    "Checkpointer": ("xla_shard.checkpoint", "Checkpointer"),
    "Trainer": ("xla_shard.train", "Trainer"),
    "evaluate": ("xla_shard.methods", "evaluate"),
    "method_for": ("xla_shard.methods", "method_for"),
    "objective_for": ("xla_shard.methods", "objective_for"),
    "make_optimizer": ("xla_shard.schedule", "make_optimizer"),
    "ConfigError": ("xla_shard.errors", "ConfigError"),
    "UserError": ("xla_shard.errors", "UserError"),
    "CheckpointError": ("xla_shard.checkpoint", "CheckpointError"),
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'xla_shard' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    if module.startswith("xla_shard.backends") or module in ("xla_shard.train", "xla_shard.models",
                                                             "xla_shard.pretrained", "xla_shard.data"):
        from xla_shard.io.device import declare_xla_device

        declare_xla_device()  # before transformers imports torch_xla (through accelerate)
    value = getattr(import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
