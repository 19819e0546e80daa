"""The one small interface every backend implements; the runner and checkpointing speak only this."""

from __future__ import annotations

import abc
import contextlib
import types
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from xla_shard.config.schema import ShardConfig
from xla_shard.errors import ConfigError

CheckpointFn = Callable[..., Any]


class Backend(abc.ABC):
    name: ClassVar[str]

    def __init__(self, cfg: ShardConfig):
        self.cfg = cfg
        self.rank = 0  # this process's data-parallel rank: which rows of the global batch it feeds
        self.world = 1  # data-parallel processes (SPMD: 1 per host, devices are sharded inside)
        self.device = torch.device("cpu")
        self.device_kind = "cpu"
        self.num_devices = 1  # devices the model is sharded over, all processes together
        self.local_devices = 1  # devices this process drives

    # ---- decided before anything heavy runs -------------------------------------------------------
    def check(self) -> None:
        """Reject, with a ConfigError naming key and backend, every option this backend cannot honour."""
        fsdp = self.cfg.fsdp
        if fsdp.mixed_precision == "fp16":
            self.reject("fsdp.mixed_precision", "fp16 needs loss scaling, which xla_shard does not do; use bf16")
        if fsdp.xla_settings and self.name != "xla_fsdp":
            self.reject("fsdp.xla_settings", "these are XlaFullyShardedDataParallel arguments; use backend xla_fsdp")

    def reject(self, key: str, message: str) -> None:
        raise ConfigError(key, message, backend=self.name)

    # ---- lifecycle ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def setup(self) -> None:
        """Initialise the runtime (process group, mesh, device); fills rank/world/device/num_devices."""

    @abc.abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Move the model to the device and shard it: auto-wrap, activation checkpointing, precision."""

    def shutdown(self) -> None:
        pass

    # ---- the step ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def local_batch(self, global_batch: torch.Tensor) -> torch.Tensor:
        """This process's part of the global batch, on the device, laid out as the backend needs."""

    def forward_context(self):
        """Wraps the forward pass (autocast where the backend needs it)."""
        return contextlib.nullcontext()

    def after_step(self) -> None:
        """Cut the step (XLA: materialise the graph); a no-op for eager backends."""

    @abc.abstractmethod
    def mean_loss(self, loss: torch.Tensor) -> float:
        """The global-batch mean of the loss, as a Python float (this synchronises)."""

    def compilations(self) -> int | None:
        """Graph compilations so far (XLA), or None where nothing is compiled."""
        return None

    # ---- introspection -----------------------------------------------------------------------------
    @abc.abstractmethod
    def local_bytes(self, tensors: list[torch.Tensor]) -> list[int]:
        """Bytes each tensor occupies on *one* device (the largest shard), for the memory report."""

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole (unsharded) value of a parameter, gradient or state, on the host.

        XLA tensors are global values already; backends whose tensors are local shards override this."""
        return tensor.detach().cpu()

    @abc.abstractmethod
    def sharded_units(self, model: nn.Module) -> list[str]:
        """Qualified names (wrapper prefixes removed) of the modules sharded as their own unit; '' is the root."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        pass


def unit_names(model: nn.Module, unit_type: type, wrapper_prefixes: tuple[str, ...]) -> list[str]:
    names = []
    for name, module in model.named_modules():
        if isinstance(module, unit_type):
            parts = [p for p in name.split(".") if p not in wrapper_prefixes]
            names.append(".".join(parts))
    return names


def apply_activation_checkpointing(modules: list[nn.Module], checkpoint_fn: CheckpointFn) -> None:
    """Route each module's forward through `checkpoint_fn(forward, *args, **kwargs)`.

    Applied before sharding, so the sharding wrapper's hooks stay outside the recomputed region: parameters
    are gathered by the wrapper in backward, then the layer body is recomputed with them.
    """
    for module in modules:
        original = module.forward

        def forward(self, *args, _original=original, **kwargs):
            if not torch.is_grad_enabled():
                return _original(*args, **kwargs)
            return checkpoint_fn(_original, *args, **kwargs)

        # Bound, not a plain attribute: wrappers such as FSDPv2 insist on a real `forward` method.
        module.forward = types.MethodType(forward, module)
