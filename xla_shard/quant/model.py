"""`model.quantization`: which of a model's linear layers become 4-bit (`Linear4bit`), as transformers decides
for bitsandbytes, and their weights quantized as they are read from the model directory.

transformers quantizes before peft adapts the model; here peft adapts first (its layers then hold the linear as
`base_layer`), so the layers kept whole are chosen on the model as transformers sees it (`kept`), and matched
by stored name afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from xla_shard.checkpoint.contract import region
from xla_shard.errors import ConfigError
from xla_shard.quant import bnb4, linear4bit

PREFIX = "quant4:"  # names of 4-bit parameters among the stored tensors' (never a stored name)
PARTS = ("weight_packed", "weight_scales")


def kept(model: nn.Module, skip_modules: list[str] | None) -> list[str]:
    """The modules transformers keeps unquantized: the output embeddings, tied weights, the last module and the
    class's fp32 modules, or with `skip_modules` (llm_int8_skip_modules) those and the fp32 modules."""
    from transformers.quantizers.base import HfQuantizer

    return HfQuantizer.get_modules_to_not_convert(model, skip_modules, getattr(model, "_keep_in_fp32_modules", None))


def replace_linears(model: nn.Module, section, keep: list[str], stored_name: Callable[[str], str]) -> None:
    """Each frozen `nn.Linear` transformers would quantize becomes a `Linear4bit` (a materialized weight is
    quantized now; one on the meta device is quantized as it is loaded)."""
    from transformers.pytorch_utils import Conv1D

    conv = next((n for n, m in _replaced(model, keep, stored_name, Conv1D)), None)
    if conv is not None:  # transformers quantizes them transposed; left whole here, they would be a quiet difference
        layer = stored_name(f"{conv}.weight").removesuffix(".weight")
        raise ConfigError("model.quantization", f"{type(model).__name__} holds {layer} and its like as "
                                                "transformers' Conv1D (GPT-2's layers), which "
                                                "xla_shard does not hold in 4 bits yet; remove model.quantization")
    compute = getattr(torch, section.bnb_4bit_compute_dtype)
    for name, module in _replaced(model, keep, stored_name):
        stored = stored_name(f"{name}.weight").removesuffix(".weight")
        if not linear4bit.quantizable(module):
            raise ConfigError("model.quantization", f"{stored}'s weight ({module.out_features} x "
                                                    f"{module.in_features}) does not split into blocks of "
                                                    f"{bnb4.BLOCKSIZE}: add it to llm_int8_skip_modules")
        weight = module.weight
        layer = linear4bit.Linear4bit(module.in_features, module.out_features, module.bias is not None,
                                      section.bnb_4bit_quant_type, section.bnb_4bit_use_double_quant, weight.dtype,
                                      compute, device=weight.device)
        if weight.device.type != "meta":
            layer.set_weight(weight.detach())
            if module.bias is not None:
                layer.bias.data.copy_(module.bias.detach())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)


BYTES_PER_WEIGHT = 0.5 + 4 / bnb4.BLOCKSIZE  # a 4-bit code, and a block's fp32 scale shared by 64


def quantized_params(model: nn.Module, section, stored_name: Callable[[str], str]) -> int:
    """The weights `replace_linears` would hold in 4 bits (the adapters injected, nothing replaced yet)."""
    return sum(m.weight.numel() for _, m in _replaced(model, kept(model, section.llm_int8_skip_modules), stored_name))


def four_bit_weights(model: nn.Module, keep: list[str], stored_name: Callable[[str], str]) -> list[str]:
    """The stored names of the weights `replace_linears` holds in 4 bits (the adapters injected, nothing replaced
    yet; `keep` chosen before the adapters were)."""
    return [stored_name(f"{name}.weight") for name, _ in _replaced(model, keep, stored_name)]


def _replaced(model: nn.Module, keep: list[str], stored_name: Callable[[str], str], kind: type = nn.Linear):
    """(name, layer) of each frozen layer of `kind` transformers would quantize, by its stored name."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    for name, module in list(model.named_modules()):
        if (isinstance(module, kind) and not any(p.requires_grad for p in module.parameters())
                and should_convert_module(stored_name(f"{name}.weight").removesuffix(".weight"), keep)):
            yield name, module


@dataclass(frozen=True)
class Source:
    """A 4-bit parameter (`part` of PARTS) of the stored weight `stored`."""

    stored: str
    part: str
    kind: str
    nested: bool


class QuantReader:
    """A reader that also serves 4-bit parameters (`PREFIX` + name) from their stored weights. A box of blocks is
    quantized from the weight's rows that hold them alone (a block's scale is its own), so each process reads its
    share; double quantization scales each weight's block scales around their mean: it reads the weight whole."""

    def __init__(self, reader, sources: dict[str, Source], manifest):
        self.reader, self.sources, self.manifest = reader, sources, manifest
        self._parts: dict[tuple, dict[str, torch.Tensor]] = {}

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    def read(self, requests: list) -> list[torch.Tensor]:
        plain = [(name, box) for name, box in requests if name not in self.sources]
        values = iter(self.reader.read(plain) if plain else [])
        out = []
        for name, box in requests:
            if name not in self.sources:
                out.append(next(values))
                continue
            source = self.sources[name]
            first, parts = self._quantized(source, box[0][0], box[1][0])
            part = parts[source.part]
            out.append(part[region(box, ((first, 0), tuple(part.shape)))].clone())
        return out

    def _quantized(self, source: Source, first: int, count: int) -> tuple[int, dict[str, torch.Tensor]]:
        """(the first block quantized, the parts of blocks [first, first + count) and maybe a few around)."""
        rows, width = self.manifest.tensors[source.stored]["shape"]
        per_row = width // bnb4.BLOCKSIZE
        if source.nested or width % bnb4.BLOCKSIZE:
            low, high = 0, rows  # the weight whole
        else:
            low, high = first // per_row, -(-(first + count) // per_row)
        key = (source.stored, low, high)
        if key not in self._parts:
            (weight,) = self.reader.read([(source.stored, ((low, 0), (high - low, width)))])
            packed, scales = linear4bit.quantized_parts(weight, source.kind, source.nested)
            self._parts = {key: {"weight_packed": packed, "weight_scales": scales}}  # one weight's rows at a time
        return low * per_row, self._parts[key]
