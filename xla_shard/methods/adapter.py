"""How a model is changed for fine-tuning before it is sharded: one `Adapter` object per method.

The pretrained loader asks it for each parameter's stored name and the new parameters' initial values; the
trainer for what to log and whether checkpoints hold only what trains; the planner for what trains; a backend
for the modules it must shard apart. None of them names a method. The base class changes nothing: full
fine-tuning.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class Adapter:
    """Full fine-tuning: every parameter trains, under the name the model directory stores it by."""

    freezes_base = False  # frozen parameters exist: checkpoints leave them out, a resume reads them again
    added = "adapter parameters initialised from train.seed"  # what the log says of the parameters it adds
    switches_off = False  # whether `switched_off` gives the model it was changed from

    def inject(self, model: nn.Module, task: str, seed: int) -> dict[str, torch.Tensor]:
        """Change `model` in place (on the meta device: nothing allocated); the initial values, by parameter
        name, of the parameters it added (computed on the host from `seed`, the same on every process)."""
        return {}

    def materialize(self, model: nn.Module, values: dict[str, torch.Tensor]) -> None:
        """Give a model built for real (random init, not on the meta device) the added parameters' values."""

    def derive(self, model: nn.Module) -> None:
        """Set the added parameters whose first values come from the base weights, once those are in place in
        `model` (wrapped and loaded, or randomly initialised): never on a resume, whose checkpoint holds them."""

    def switched_off(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which `model` computes as the model it was changed from (a DPO reference with no copy
        of the weights), where `switches_off`."""
        raise NotImplementedError(f"{type(self).__name__} changes the model in a way that cannot be switched off")

    def stored_name(self, name: str) -> str:
        """A parameter's name as the model directory stores it."""
        return name

    def is_added(self, name: str) -> bool:
        """A parameter the adapter added (initialised by it, not read from the model directory)."""
        return False

    def describe(self, model: nn.Module) -> str | None:
        """What is trained, for the log (None: everything, nothing to say)."""
        return None

    def trained_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules whose parameters train beside frozen ones, which FSDP2 must shard as units of their own (it
        wants one dtype per unit)."""
        return []

    def trained_parameters(self, model: nn.Module, task: str) -> int | None:
        """How many parameters train, counted by adapting `model` on the meta device (None: all of them)."""
        return None

    @property
    def frozen_bytes(self) -> int:
        """Bytes per element of the frozen parameters."""
        return 4
