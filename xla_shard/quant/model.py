"""`model.quantization`: which of a model's linear layers become 4-bit (`Linear4bit`), as transformers decides
for bitsandbytes, and their weights quantized as they are read from the model directory.

transformers quantizes before peft adapts the model; here peft adapts first (its layers then hold the linear as
`base_layer`), so the layers kept whole are chosen on the model as transformers sees it (`kept`), and matched
by stored name afterwards.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from xla_shard.checkpoint.contract import region
from xla_shard.errors import ConfigError
from xla_shard.quant import bnb4, linear4bit

PREFIX = "quant4:"  # names of 4-bit parameters among the stored tensors' (never a stored name)
PARTS = ("weight_packed", "weight_scales")
# What transformers' save_pretrained writes beside a bitsandbytes 4-bit weight (its packed bytes, [n / 2, 1]).
STATE = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".quant_state.bitsandbytes__nf4",
         ".quant_state.bitsandbytes__fp4")


def stored_four_bit(tensors: dict[str, dict]) -> dict[str, list[str]]:
    """The weights a model directory stores in bitsandbytes' 4 bits (transformers' save_pretrained of a 4-bit
    model), each with the state tensors stored beside it."""
    packed = {name.removesuffix(".absmax") for name in tensors if name.endswith(".absmax")}
    return {name: [name + part for part in STATE if name + part in tensors] for name in sorted(packed)
            if name in tensors}


def check_stored(fields: dict, section, url: str) -> None:
    """A model directory saved 4-bit by transformers (its config.json's quantization_config) is read as it is
    stored: the run's model.quantization must say what it holds, since 4-bit weights cannot be quantized again."""
    stored = fields.get("quantization_config")
    if not isinstance(stored, dict) or stored.get("quant_method") != "bitsandbytes":
        return
    if not stored.get("load_in_4bit") and not stored.get("_load_in_4bit"):
        raise ConfigError("model.name", f"{url} is saved in 8 bits by bitsandbytes (its config.json's "
                                        "quantization_config); xla_shard reads 4-bit bases only")
    kind = stored.get("bnb_4bit_quant_type", "fp4")
    nested = bool(stored.get("bnb_4bit_use_double_quant", False))
    wanted = f"{{bnb_4bit_quant_type: {kind}, bnb_4bit_use_double_quant: {str(nested).lower()}}}"
    if section is None:
        raise ConfigError("model.quantization", f"{url} is saved in 4 bits by bitsandbytes ({kind}"
                                                f"{', double quantization' if nested else ''}): train adapters over "
                                                f"it with model.lora and model.quantization={wanted}")
    if (section.bnb_4bit_quant_type, section.bnb_4bit_use_double_quant) != (kind, nested):
        raise ConfigError("model.quantization", f"{url} is saved in 4 bits as {wanted}, and 4-bit weights are not "
                                                f"quantized again: set model.quantization={wanted}")


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
    """A 4-bit parameter (`part` of PARTS) of the stored weight `stored`: quantized as it is read, or read as
    stored where the directory holds it in 4 bits already (`packed`)."""

    stored: str
    part: str
    kind: str
    nested: bool
    packed: bool = False


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
            read = self._stored if source.packed else self._quantized
            first, parts = read(source, box[0][0], box[1][0])
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

    def _stored(self, source: Source, first: int, count: int) -> tuple[int, dict[str, torch.Tensor]]:
        """The parts of blocks [first, first + count) as bitsandbytes stored them: the packed bytes (32 a block)
        and the blocks' scales (double quantization: read whole and dequantized, as its 8-bit codes give them)."""
        half = bnb4.BLOCKSIZE // 2
        (packed,) = self.reader.read([(source.stored, ((first * half, 0), (count * half, 1)))])
        key = (source.stored, "scales")
        if key not in self._parts:
            self._parts = {key: {"weight_scales": self._scales(source)}}  # one weight's scales at a time
        scales = self._parts[key]["weight_scales"][first:first + count]
        return first, {"weight_packed": packed.reshape(count, half), "weight_scales": scales}

    def _scales(self, source: Source) -> torch.Tensor:
        state = {part: self._whole(source.stored + part) for part in STATE if source.stored + part in
                 self.manifest.tensors}
        blocks = math.prod(self.manifest.tensors[source.stored]["shape"]) * 2 // bnb4.BLOCKSIZE
        described = next((v for k, v in state.items() if ".quant_state." in k), None)
        about = json.loads(bytes(described.tolist()).decode()) if described is not None else {}
        where = f"{source.stored[len('model/'):]} (stored in 4 bits)"
        if about.get("quant_type", source.kind) != source.kind or about.get("blocksize", bnb4.BLOCKSIZE) != \
                bnb4.BLOCKSIZE or not torch.equal(state[".quant_map"].float(), bnb4.code(source.kind)) or (
                source.nested and not torch.equal(state[".nested_quant_map"].float(), bnb4.dynamic_code())):
            raise ConfigError("model.name", f"{where} is not bitsandbytes' {source.kind} in blocks of "
                                            f"{bnb4.BLOCKSIZE}: {about or 'its quant_map differs'}")
        if source.nested:
            quantized = bnb4.Quantized(torch.empty(0, dtype=torch.uint8), state[".absmax"], (blocks,), source.kind,
                                       state[".nested_absmax"], torch.tensor(float(about["nested_offset"])))
            scales = quantized.scales()
        else:
            scales = state[".absmax"]
        return scales.float().contiguous().view(torch.uint8).view(blocks, 4)

    def _whole(self, name: str) -> torch.Tensor:
        shape = tuple(self.manifest.tensors[name]["shape"])
        (tensor,) = self.reader.read([(name, ((0,) * len(shape), shape))])
        return tensor
