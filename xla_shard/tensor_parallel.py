"""Which of a model's linears an MLP's tensor parallelism splits, read from their names: the projections into an
MLP split their outputs (column parallel), the one out of it its input (row parallel), as Megatron splits them.
What generation's split layout shards (xla_spmd, `mesh.generation`) and what the planner prices it by."""

from __future__ import annotations

from typing import Literal

from torch import nn

# transformers' names and the usual others
COLUMN_PARALLEL = frozenset({"gate_proj", "up_proj", "gate_up_proj", "w1", "w3", "fc1", "c_fc", "dense_h_to_4h"})
ROW_PARALLEL = frozenset({"down_proj", "w2", "fc2", "dense_4h_to_h"})
ADAPTERS = frozenset({"lora_A", "lora_B"})  # peft's, beside a base layer: small, kept whole


def mlp_role(name: str, module: nn.Module) -> Literal["column", "row"] | None:
    """'column' or 'row' for an MLP's linear (the module named `name`), else None (kept whole)."""
    if not isinstance(module, nn.Linear):
        return None
    parts = set(name.split(".")[-2:])  # (peft's base_layer sits under the projection's name)
    if parts & ADAPTERS:
        return None
    if parts & ROW_PARALLEL:
        return "row"
    return "column" if parts & COLUMN_PARALLEL else None


def mlp_params(model: nn.Module) -> int:
    """The parameters of the linears `mlp_role` splits."""
    return sum(p.numel() for name, module in model.named_modules() if mlp_role(name, module)
               for p in module.parameters(recurse=False))
