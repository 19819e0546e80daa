"""A backend's training state as checkpoints and pretrained loads see it: the `ShardedState` of
`checkpoint.contract`. Each backend's subclass, in its own module, says where its shards are; this base class
holds what they share (names, optimizer state made lazily, replicated tensors, the host RNGs)."""

from __future__ import annotations

import base64
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from xla_shard.backends.processes import Processes
from xla_shard.checkpoint.contract import Box, Chunk, StateTensor, unstack
from xla_shard.errors import UserError


class BackendState:
    """Tensors under the unwrapped, unstacked model's names, the boxes of them this process holds, its RNGs.
    Replicated tensors (the default here) are written by the main process alone."""

    def __init__(self, backend: Any):
        self.backend = backend  # the Backend that owns it (base.py imports this module, not the other way)

    # ---- who writes (the run's processes) -----------------------------------------------------------
    @property
    def processes(self) -> Processes:
        return self.backend.processes

    @property
    def is_main(self) -> bool:
        return self.processes.is_main

    @property
    def writer(self) -> tuple[int, int]:
        return self.processes.writer

    def any_rank(self, flag: bool) -> bool:
        return self.processes.any_rank(flag)

    # ---- names -------------------------------------------------------------------------------------
    def canonical(self, name: str) -> str:
        """A parameter or module name as the unwrapped model spells it (wrapper prefixes removed)."""
        return ".".join(part for part in name.split(".") if part not in self.backend.wrapper_prefixes)

    def named_parameters(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in model.named_parameters():
            yield self.canonical(name), param

    def layer_names(self, model: nn.Module) -> dict[str, list[str]]:
        """The tensors kept stacked as [layers, ...] (scanned layers): stacked name -> each layer's name."""
        return {}

    # ---- tensors -----------------------------------------------------------------------------------
    def tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                stored: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> list[StateTensor]:
        """Model parameters as `model/<name>` and optimizer state (if an optimizer is given) as
        `optim/<name>/<key>`, under the unstacked model's names (a stacked tensor is one entry per layer).

        Saving passes no `stored`; loading passes what the checkpoint holds, and optimizer state the optimizer
        has not created yet (it does so lazily at its first step) is created here, laid out like its parameter.
        """
        per_layer = self.layer_names(model)
        tensors = []
        for name, param in self.named_parameters(model):
            names = per_layer.get(name, [name])
            stacked = name in per_layer
            tensors += self.state_tensors([f"model/{n}" for n in names], param, stacked, frozen=not param.requires_grad)
            if optimizer is None:
                continue
            like_shape = tuple(param.shape[1:] if stacked else param.shape)
            for key, value in optimizer_state(optimizer.state[param], names[0], stored, like_shape,
                                              lambda param=param: self.zeros_like(param)):
                tensors += self.state_tensors([f"optim/{n}/{key}" for n in names], value, stacked)
        return tensors

    def state_tensors(self, names: list[str], tensor: torch.Tensor, stacked: bool,
                      frozen: bool = False) -> list[StateTensor]:
        whole = StateTensor(names[0], tuple(tensor.shape), tensor.dtype, lambda: self.local_chunks(tensor),
                            lambda: self.local_boxes(tensor), lambda values: self.fill_local(tensor, values), frozen)
        return unstack(whole, names) if stacked else [whole]

    def zeros_like(self, param: torch.Tensor) -> torch.Tensor:
        """A zero tensor laid out as `param`'s optimizer state (being restored before the optimizer made it)."""
        return torch.zeros_like(param)

    def local_chunks(self, tensor: torch.Tensor) -> list[Chunk]:
        """The boxes of `tensor` this process writes, copied to the host. Replicated tensors: the main process."""
        if not self.is_main:
            return []
        return [((0,) * tensor.dim(), tensor.detach().to("cpu", copy=True))]

    def local_boxes(self, tensor: torch.Tensor) -> list[Box]:
        return [((0,) * tensor.dim(), tuple(tensor.shape))]

    @torch.no_grad()
    def fill_local(self, tensor: torch.Tensor, values: list[torch.Tensor]) -> None:
        tensor.copy_(values[0])

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole (unsharded) value of a parameter, gradient or state, on the host.

        XLA tensors are global values already; backends whose tensors are local shards override this."""
        return tensor.detach().cpu()

    # ---- the rest of a checkpoint --------------------------------------------------------------------
    def rng_state(self) -> dict[str, Any]:
        """This process's random number generators, JSON-serialisable (it goes into the shard index)."""
        version, internal, gauss = random.getstate()
        return {"torch": pack_bytes(torch.get_rng_state()), "python": [version, list(internal), gauss]}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(unpack_bytes(state["torch"]))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))

    def describe(self) -> dict[str, Any]:
        """What a manifest records about this run."""
        backend = self.backend
        return {"backend": backend.name, "num_devices": backend.num_devices,
                "plan": backend.plan.describe() if backend.plan else None,
                "config": backend.cfg.model_dump(mode="json", by_alias=True)}

    def run_identity(self) -> dict[str, Any]:
        return self.backend.cfg.run_identity()


def optimizer_state(opt_state: dict, name: str, stored: dict | None, like_shape: tuple[int, ...],
                    zeros_like: Callable[[], torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) of one parameter's optimizer state. Saving (`stored` None): the tensors it has. Loading:
    the keys the checkpoint holds, creating those the optimizer has not made yet (it does so lazily at its
    first step): shaped like the parameter -> `zeros_like()`, laid out like it; scalars ('step') on the host."""
    if stored is None:
        return [(k, v) for k, v in opt_state.items() if torch.is_tensor(v)]
    out = []
    for key in [k.rsplit("/", 1)[1] for k in stored if k.startswith(f"optim/{name}/")]:
        if key not in opt_state:
            shape, dtype = stored[f"optim/{name}/{key}"]
            if tuple(shape) not in (like_shape, ()):  # what optimizers keep: per-element state, or a scalar
                raise UserError(f"the checkpoint's optim/{name}/{key} is {list(shape)}, neither the "
                                f"parameter's shape {list(like_shape)} nor a scalar: another optimizer or model")
            opt_state[key] = zeros_like() if tuple(shape) == like_shape else torch.zeros(shape, dtype=dtype)
        out.append((key, opt_state[key]))
    return out


def pack_bytes(state: torch.Tensor) -> str:
    """A byte tensor (an RNG state) as text for the JSON shard index."""
    return base64.b64encode(state.numpy().tobytes()).decode()


def unpack_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
