"""`model.lora.use_dora`: DoRA, peft's weight-decomposed LoRA (the `Dora` adapter).

Beside LoRA's two matrices, each adapted layer trains a magnitude per output row (peft's
`lora_magnitude_vector`): the layer computes `m / ||W + s B A|| * (W + s B A)` row by row. The magnitude starts as
the norm of each row of the frozen base, which peft computes when it injects the adapter into a model already in
memory. Here the base is read shard by shard after the model is sharded, so the magnitudes are derived on the
device once it is (`derive`), from the sharded weights themselves; a resumed run reads them from its checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from xla_shard.methods.lora import ADAPTER, Lora

MAGNITUDE = ".lora_magnitude_vector."


def _layers(model: nn.Module):
    """(name, peft layer) of every layer with a DoRA magnitude."""
    from peft.tuners.lora import LoraLayer

    for name, layer in model.named_modules():
        if isinstance(layer, LoraLayer) and ADAPTER in getattr(layer, "lora_magnitude_vector", {}):
            yield name, layer


def derive(model: nn.Module) -> None:
    """Each magnitude set to its row norms in the base weight (with B still zero, `W + s B A` is `W`), computed in
    float32 on whatever the parameters are: sharded XLA tensors or FSDP2's DTensors, the row norm is a
    reduction their sharding carries through."""
    from peft.utils.other import transpose

    with torch.no_grad():
        for _, layer in _layers(model):
            magnitude = layer.lora_magnitude_vector[ADAPTER].weight
            weight = transpose(layer.get_base_layer().weight, layer.fan_in_fan_out)  # Conv1D stores [in, out]
            magnitude.copy_(torch.linalg.vector_norm(weight.float(), dim=1).to(magnitude.dtype))


class Dora(Lora):
    """LoRA whose layers also train a magnitude per output row, started from the base weights after loading."""

    added = "DoRA matrices initialised from train.seed, each magnitude then from its row's norm in the base"

    def inject(self, model: nn.Module, task: str, seed: int) -> dict[str, torch.Tensor]:
        values = super().inject(model, task, seed)
        # No value yet: `derive` computes them from the base. NaN, so a path that skipped it cannot train quietly.
        return {name: torch.full_like(value, float("nan")) if MAGNITUDE in name else value
                for name, value in values.items()}

    def derive(self, model: nn.Module) -> None:
        derive(model)
