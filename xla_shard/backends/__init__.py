"""Backend registry: a name in the config (or `auto`) -> the class that runs it."""

from __future__ import annotations

import torch

from xla_shard.backends.base import Backend, as_plan
from xla_shard.backends.torch_fsdp import TorchFsdpBackend
from xla_shard.backends.xla_fsdp import XlaFsdpBackend
from xla_shard.backends.xla_spmd import XlaSpmdBackend
from xla_shard.config.schema import Backend as BackendName
from xla_shard.config.schema import ShardConfig
from xla_shard.launch import on_tpu

BACKENDS: dict[str, type[Backend]] = {cls.name: cls for cls in (XlaSpmdBackend, XlaFsdpBackend, TorchFsdpBackend)}


def resolve_name(cfg: ShardConfig) -> str:
    """`auto`: a TPU runs SPMD FSDPv2, GPUs run FSDP2, a plain CPU runs SPMD on virtual devices."""
    if cfg.backend is not BackendName.AUTO:
        return cfg.backend.value
    if on_tpu():
        return "xla_spmd"
    if torch.cuda.is_available():
        return "torch_fsdp"
    return "xla_spmd"


def running(triple, devices: int) -> list[str]:
    """The backends that run a planner `Triple` on `devices` (what `xla-shard plan` shows per row)."""
    resolved = as_plan(triple, devices)
    return [name for name, cls in BACKENDS.items() if cls.triple_refusal(resolved) is None]


def create(cfg: ShardConfig) -> Backend:
    backend = BACKENDS[resolve_name(cfg)](cfg)
    backend.check()
    return backend


__all__ = ["BACKENDS", "Backend", "create", "resolve_name", "running"]
