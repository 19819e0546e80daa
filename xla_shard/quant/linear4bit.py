"""QLoRA's frozen base: linear layers whose weights are held in bitsandbytes' 4-bit format (`bnb4`).

A layer holds its weight as two uint8 parameters, both [blocks, ...] so that FSDP shards them on block
boundaries and never casts them (mixed precision leaves integer parameters alone):
- `weight_packed` [blocks, BLOCKSIZE / 2]: two 4-bit codes a byte;
- `weight_scales` [blocks, 4]: each block's scale, an fp32 as its four bytes (little-endian), read back by
  arithmetic (`floats`): torch_xla does not trace `view(torch.float32)` of bytes, it copies them through the
  host (a sharded tensor gathered, every layer, every step). With double quantization the scales are those its
  8-bit codes give back (bitsandbytes' values, a half bit a weight more than its storage).
Its forward is bitsandbytes' `Linear4bit` as transformers builds it (given a compute dtype): the input cast
to the compute dtype, the weight dequantized in fp32 and cast to it, the output cast back to the input's dtype;
the input's gradient goes through the dtype the weight was quantized from, as bitsandbytes' backward does.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from xla_shard.quant import bnb4

_SCALE_BYTES = 4  # an fp32 scale


class _Dequantized(torch.autograd.Function):
    """linear(x, W, bias) with W given back in fp32: cast to x's dtype forward, through `stored` backward. The
    weight and bias are frozen: only x has a gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, stored):
        ctx.save_for_backward(weight)
        ctx.stored = stored
        return nn.functional.linear(x, weight.to(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(ctx.stored).to(grad.dtype), None, None, None


class Linear4bit(nn.Module):
    """A frozen `nn.Linear` in 4 bits. `dtype`: the weight's before quantization (bitsandbytes' quant_state
    dtype); `compute_dtype`: what the matmul runs in, whatever the input's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kind: str, nested: bool, dtype: torch.dtype,
                 compute_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.in_features, self.out_features, self.kind, self.nested = in_features, out_features, kind, nested
        self.dtype, self.compute_dtype = dtype, compute_dtype
        blocks = blocks_of(in_features, out_features)
        self.weight_packed = nn.Parameter(torch.empty(blocks, bnb4.BLOCKSIZE // 2, dtype=torch.uint8, device=device),
                                          requires_grad=False)
        self.weight_scales = nn.Parameter(torch.empty(blocks, _SCALE_BYTES, dtype=torch.uint8, device=device),
                                          requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        # the tables the weight is read back through, held by the layer: a traced loop over layers (torch_xla's
        # scan) takes no tensor from outside its body. Real even in a model built on the meta device, as the
        # models' own buffers are (`models.build_model`); each layer's own copy (a shared one is listed once).
        tables = None if device is None or torch.device(device).type == "meta" else device
        self.register_buffer("code", bnb4.code(kind).to(tables, copy=True), persistent=False)
        self.register_buffer("powers_of_two", _powers_of_two().to(tables, copy=True), persistent=False)

    def extra_repr(self) -> str:
        nested = ", double quantization" if self.nested else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}{nested}"

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor) -> None:
        """Quantize `weight` ([out, in]) into this layer's parameters."""
        packed, scales = quantized_parts(weight, self.kind, self.nested)
        self.weight_packed.copy_(packed)
        self.weight_scales.copy_(scales)

    def dequantized(self) -> torch.Tensor:
        """The weight back in fp32, [out, in]."""
        codes = self.code[bnb4.unpack(self.weight_packed)]
        scales = floats(self.weight_scales, self.powers_of_two)
        return (codes * scales[:, None]).reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return _Dequantized.apply(x.to(self.compute_dtype), self.dequantized(), bias, self.dtype).to(x.dtype)


@functools.cache
def _powers_of_two() -> torch.Tensor:
    """2 ** (e - 127) for each fp32 exponent field e (e = 0: 2 ** -126, a subnormal's scale), exactly."""
    return torch.tensor([2.0 ** (max(e, 1) - 127) for e in range(256)], dtype=torch.float32, device="cpu")


def floats(data: torch.Tensor, powers_of_two: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values whose little-endian bytes are `data` [..., 4] (uint8), exactly, in ops every backend traces:
    sign, exponent field and fraction taken apart in int32, the power of two looked up (in `powers_of_two`, the
    caller's copy of `_powers_of_two()` where it has one)."""
    b0, b1, b2, b3 = data.int().unbind(-1)
    exponent = b3 % 128 * 2 + b2 // 128
    fraction = (b2 % 128 * 65536 + b1 * 256 + b0).float() * 2.0 ** -23  # < 2 ** 23: exact in fp32
    powers = _powers_of_two().to(data.device) if powers_of_two is None else powers_of_two
    value = torch.where(exponent > 0, fraction + 1.0, fraction) * powers[exponent]
    return torch.where(b3 >= 128, -value, value)


def weight_count(model: nn.Module) -> tuple[int, int]:
    """(the model's weights, those held in 4 bits), a 4-bit layer's counted as the weights it stands for, not
    its bytes."""
    total = four_bit = 0
    for module in model.modules():
        if isinstance(module, Linear4bit):
            four_bit += module.in_features * module.out_features
        total += sum(p.numel() for p in module.parameters(recurse=False) if p.is_floating_point())
    return total + four_bit, four_bit


def blocks_of(in_features: int, out_features: int) -> int:
    return in_features * out_features // bnb4.BLOCKSIZE


def quantizable(linear: nn.Linear) -> bool:
    """Whether the weight splits into whole blocks (what the [blocks, ...] layout needs)."""
    return linear.in_features * linear.out_features % bnb4.BLOCKSIZE == 0


def quantized_parts(weight: torch.Tensor, kind: str, nested: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(`weight_packed`, `weight_scales`) of `weight` as `Linear4bit` holds them."""
    q = bnb4.quantize(weight, kind, nested)
    blocks = math.prod(weight.shape) // bnb4.BLOCKSIZE
    scales = q.scales().to(torch.float32).contiguous().view(torch.uint8).view(blocks, _SCALE_BYTES)
    return q.packed.view(blocks, bnb4.BLOCKSIZE // 2), scales
