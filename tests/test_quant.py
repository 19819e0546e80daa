"""The 4-bit weight format (xla_shard/quant/bnb4.py) against bitsandbytes itself, on its CPU build.

bitsandbytes quantizes 4-bit weights on the CPU with its reference kernel (the arithmetic its CUDA kernel does).
For the double quantization's 8-bit step its CPU build calls a C kernel whose approximate binary search picks a
farther code for about 0.1% of values; xla_shard takes the nearest, as bitsandbytes' reference and CUDA kernels
do, and is compared with the reference kernel there (reached through torch's dispatcher), and with the C kernel
where the two agree. The 4-bit dequantization is bitsandbytes' as bench/bnb_reference.py holds it on every CPU."""

import pytest
import torch

from xla_shard.quant import bnb4

F = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is in the [test] extra")
from bench.bnb_reference import REFERENCE_KERNEL, hold_bitsandbytes_to_its_reference  # noqa: E402

hold_bitsandbytes_to_its_reference()

SHAPES = [(64, 48), (96, 128), (5, 7), (300, 33)]  # whole blocks, and a shorter last block (odd too)


@pytest.fixture(autouse=True)
def _eager_bitsandbytes():
    """bitsandbytes torch.compiles its reference unpacking (odd widths on the CPU): seconds of compiling for
    nothing the comparison needs."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        yield


def _weight(shape, dtype, seed=0):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02
    weight[0, 0] = 0.0  # an exact zero, and a block's largest value exactly representable
    weight[-1, -1] = -0.1
    return weight.to(dtype)


def _reference_blockwise(values: torch.Tensor):
    return torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(
        REFERENCE_KERNEL, values, F.create_dynamic_map(), bnb4.NESTED_BLOCKSIZE)


def test_the_codes_are_bitsandbytes():
    assert torch.equal(bnb4.dynamic_code(), F.create_dynamic_map())
    for kind in bnb4.KINDS:
        assert torch.equal(bnb4.code(kind), F.get_4bit_type(kind, device="cpu"))


@pytest.mark.parametrize("kind", bnb4.KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_weight_packs_to_bitsandbytes_bytes_and_scales_and_unpacks_to_its_values(kind, dtype):
    for shape in SHAPES:
        weight = _weight(shape, dtype)
        packed, state = F.quantize_4bit(weight, blocksize=bnb4.BLOCKSIZE, quant_type=kind)
        ours = bnb4.quantize(weight, kind)
        assert torch.equal(ours.packed, packed.reshape(-1)), (shape, dtype)
        assert torch.equal(ours.absmax, state.absmax), (shape, dtype)
        for out in (torch.float32, dtype):
            state.dtype = out
            assert torch.equal(bnb4.dequantize(ours, out), F.dequantize_4bit(packed, state)), (shape, out)


@pytest.mark.parametrize("kind", bnb4.KINDS)
def test_double_quantized_scales_are_bitsandbytes_reference_and_unpack_as_bitsandbytes_does(kind):
    weight = _weight((512, 160), torch.bfloat16)  # 1280 blocks: five scale blocks of 256
    packed, plain = F.quantize_4bit(weight, quant_type=kind)
    ours = bnb4.quantize(weight, kind, nested=True)
    offset = plain.absmax.mean()
    indices, nested_absmax = _reference_blockwise(plain.absmax - offset)
    assert torch.equal(ours.packed, packed.reshape(-1))
    assert torch.equal(ours.offset, offset)
    assert torch.equal(ours.absmax, indices) and torch.equal(ours.nested_absmax, nested_absmax)

    _, nested = F.quantize_4bit(weight, quant_type=kind, compress_statistics=True)  # the CPU build's C kernel
    assert torch.equal(nested.state2.absmax, ours.nested_absmax) and torch.equal(nested.offset, ours.offset)
    agree = nested.absmax == ours.absmax
    assert agree.float().mean() > 0.99
    code = F.create_dynamic_map()
    normed = (plain.absmax - offset) / ours.nested_absmax.repeat_interleave(bnb4.NESTED_BLOCKSIZE)[:len(agree)]
    distance = (normed.unsqueeze(1) - code).abs()
    ours_far = distance.gather(1, ours.absmax.long().unsqueeze(1))
    assert torch.all(ours_far <= distance.gather(1, nested.absmax.long().unsqueeze(1)) + 1e-7)  # never farther

    nested.absmax = ours.absmax  # bitsandbytes unpacking xla_shard's state
    for out in (torch.float32, torch.bfloat16):
        nested.dtype = out
        assert torch.equal(bnb4.dequantize(ours, out), F.dequantize_4bit(packed, nested))


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="int4"):
        bnb4.quantize(torch.ones(64), "int4")
