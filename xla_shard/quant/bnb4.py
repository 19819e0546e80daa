"""bitsandbytes' 4-bit weight format (NF4 and FP4, optionally double-quantized), in plain torch ops.

Plain ops because XLA compiles them and SPMD shards them (bitsandbytes has no TPU backend), and so that a weight
quantized here has bitsandbytes' bytes exactly: a model saved 4-bit by transformers + bitsandbytes loads as it
is, and an adapter trained here loads onto bitsandbytes' base. The arithmetic follows bitsandbytes' reference
(its `default` backend, which its CPU build runs for 4-bit quantization): blocks of `BLOCKSIZE` values of the
flattened weight, each scaled by its absolute maximum, rounded to the nearest code by bucketing against the
codes' midpoints, two codes a byte (the first in the high nibble). Double quantization stores the blocks'
scales in 8 bits (bitsandbytes' dynamic code, blocks of `NESTED_BLOCKSIZE`) around their mean.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256
KINDS = ("nf4", "fp4")

_NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
# FP4 (1 sign, 2 exponent, 1 mantissa bits, exponent bias 2) in bit-pattern order, normalized to [-1, 1]
_FP4 = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)


@functools.cache
def code(kind: str) -> torch.Tensor:
    """The 16 values a 4-bit index stands for (bitsandbytes' `get_4bit_type`), on the host whatever device a
    caller's context sets (cached: a table made under `torch.device("meta")` would stay empty)."""
    values = torch.tensor(_NF4 if kind == "nf4" else _FP4, dtype=torch.float32, device="cpu")
    return values / values.abs().max()


@functools.cache
def dynamic_code() -> torch.Tensor:
    """bitsandbytes' signed dynamic 8-bit code (`create_dynamic_map()`): a decimal exponent and a fraction whose
    bits shrink as the exponent grows, sorted."""
    data: list[float] = [0.0, 1.0]
    for i in range(7):  # 7 exponent bits, 7 bits beside the sign: 2 ** i fractions at exponent i
        bounds = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32, device="cpu")
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10 ** (i - 6)
        data += (scale * means).tolist() + (-scale * means).tolist()
    return torch.tensor(sorted(data), dtype=torch.float32, device="cpu")


def _blocks(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each value over its block's absolute maximum, clamped to [-1, 1]; the maxima). A last, shorter block
    has its own maximum, as in bitsandbytes."""
    n = flat.numel()
    full = n - n % blocksize
    whole = flat[:full].reshape(-1, blocksize)
    absmax = whole.abs().max(dim=-1)[0]
    scaled = torch.clamp(whole * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    if full < n:
        last = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, last.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / last, -1, 1)])
    return scaled, absmax


def _nearest(scaled: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The index into `table` of the code nearest each value: bucketed against the sorted codes' midpoints."""
    order = torch.argsort(table)  # FP4's codes are not sorted; NF4's and the dynamic code's order is the identity
    return order[torch.bucketize(scaled, (table[order[:-1]] + table[order[1:]]) / 2, out_int32=True)]


def _times_scales(values: torch.Tensor, scales: torch.Tensor, blocksize: int) -> torch.Tensor:
    """Each of the flat `values` times its block's scale (a last, shorter block has its own)."""
    n = values.numel()
    padded = torch.nn.functional.pad(values, (0, -n % blocksize))
    return (padded.view(-1, blocksize) * scales.view(-1, 1)).reshape(-1)[:n]


def quantize_blockwise(values: torch.Tensor, blocksize: int = NESTED_BLOCKSIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit indices into `dynamic_code()` and each block's absolute maximum."""
    scaled, absmax = _blocks(values.reshape(-1).float(), blocksize)
    return _nearest(scaled, dynamic_code().to(values.device)).to(torch.uint8), absmax


def dequantize_blockwise(indices: torch.Tensor, absmax: torch.Tensor,
                         blocksize: int = NESTED_BLOCKSIZE) -> torch.Tensor:
    return _times_scales(dynamic_code().to(indices.device)[indices.reshape(-1).long()], absmax, blocksize)


@dataclass
class Quantized:
    """One weight in bitsandbytes' 4-bit layout: `packed` uint8 [(n + 1) // 2]; `absmax` fp32 [blocks], or with
    double quantization uint8 [blocks] beside `nested_absmax` (fp32, a value per `NESTED_BLOCKSIZE` blocks) and
    `offset` (their mean, a 0-d fp32)."""

    packed: torch.Tensor
    absmax: torch.Tensor
    shape: tuple[int, ...]
    kind: str
    nested_absmax: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    def scales(self) -> torch.Tensor:
        """Each block's absolute maximum in fp32 (the double quantization undone)."""
        if self.nested_absmax is None:
            return self.absmax
        return dequantize_blockwise(self.absmax, self.nested_absmax) + self.offset


def quantize(weight: torch.Tensor, kind: str = "nf4", nested: bool = False, blocksize: int = BLOCKSIZE) -> Quantized:
    """`weight` (fp32, bf16 or fp16: its values as they are, widened to fp32) in 4 bits."""
    if kind not in KINDS:
        raise ValueError(f"4-bit kind {kind!r}: use one of {', '.join(KINDS)}")
    scaled, absmax = _blocks(weight.reshape(-1).float(), blocksize)
    if scaled.numel() % 2:
        scaled = torch.nn.functional.pad(scaled, (0, 1))
    indices = _nearest(scaled, code(kind).to(weight.device)).to(torch.uint8)
    packed = (indices[::2] << 4) | indices[1::2]
    if not nested:
        return Quantized(packed, absmax, tuple(weight.shape), kind)
    offset = absmax.mean()
    indices8, nested_absmax = quantize_blockwise(absmax - offset)
    return Quantized(packed, indices8, tuple(weight.shape), kind, nested_absmax, offset)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit indices of packed bytes, in order, as int32 for indexing (int64 is emulated on a TPU). The
    high nibbles and the low ones side by side, then interleaved by a gather along the last dimension: never a
    [..., 2] array, whose minor dimension a TPU pads to 128 lanes (stacking the nibbles last made Llama-3-70B's
    MLP weight a 56 GiB buffer in its QLoRA step). The order is made from `arange` inside the program, so a
    scanned layer's body captures no tensor."""
    n = packed.shape[-1]
    place = torch.arange(2 * n, device=packed.device)
    order = place % 2 * n + place // 2  # 0, n, 1, n + 1, ...
    return torch.cat([packed >> 4, packed & 0xF], dim=-1).int().index_select(-1, order)


def dequantize(quantized: Quantized, dtype: torch.dtype = torch.float32, blocksize: int = BLOCKSIZE) -> torch.Tensor:
    """The weight back, in `dtype`: each code times its block's scale in fp32, then cast (as bitsandbytes)."""
    values = code(quantized.kind).to(quantized.packed.device)[unpack(quantized.packed.reshape(-1))]
    out = _times_scales(values[:math.prod(quantized.shape)], quantized.scales(), blocksize)
    return out.reshape(quantized.shape).to(dtype)
