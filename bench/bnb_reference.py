"""bitsandbytes as the reference the tests hold xla_shard's 4-bit base to, the same on every x86 CPU.

Two paths of bitsandbytes 0.50's CPU build depend on the CPU it runs on, and the reference must not:
- Its AVX-512 4-bit dequantization kernel reads each block of 64 values as lying within one row of the weight,
  while its quantization (and its scalar, pure-torch and CUDA paths) lays the blocks over the flattened tensor. A
  weight whose rows are not whole blocks (48 wide, an expert's 96-wide projection) then dequantizes to values that
  were never stored. Where this CPU's kernel does so (checked, not assumed), bitsandbytes' reference kernel (its
  `default` backend, pure torch) takes its place.
- On a CPU with AVX512-BF16, `Linear4bit` in eval mode repacks its weight and multiplies in bfloat16: the reference
  runs, which compare at fp32 tolerance, keep the fp32 path every other CPU takes.
"""

import warnings

import torch

# bitsandbytes registers its pure-torch reference kernels for this key; its native CPU kernels for CPU.
REFERENCE_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
_held: list = []  # once held: the Library the dequantization override lives in (it lasts as long as this object)


def reference_dequantize_4bit(A, absmax, blocksize, quant_type, shape, dtype):
    return torch.ops.bitsandbytes.dequantize_4bit.default.redispatch(
        REFERENCE_KERNEL, A, absmax, blocksize, quant_type, shape, dtype)


def hold_bitsandbytes_to_its_reference() -> None:
    """Call before bitsandbytes builds or runs a layer, in each process that computes a reference."""
    if _held:
        return
    import bitsandbytes.functional as F
    import bitsandbytes.nn.modules as modules

    weight = torch.randn(2, 48, generator=torch.Generator().manual_seed(0))  # 96 values: a block spans both rows
    packed, state = F.quantize_4bit(weight, quant_type="nf4")
    library = None
    if not torch.equal(F.dequantize_4bit(packed, state), reference_dequantize_4bit(
            packed, state.absmax, state.blocksize, "nf4", weight.shape, weight.dtype)):
        library = torch.library.Library("bitsandbytes", "IMPL")
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": what is meant
            warnings.simplefilter("ignore", UserWarning)
            library.impl("dequantize_4bit", reference_dequantize_4bit, "CPU", allow_override=True)
    _held.append(library)
    modules.has_avx512bf16 = lambda: False
