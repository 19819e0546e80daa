"""Which attention kernel a model runs, per device, and torch_xla's Pallas flash attention as a transformers
attention function.

`model.attn_implementation: auto` picks the fastest kernel that computes the same thing on the device: the
Pallas flash attention kernel on TPUs under torch_xla, SDPA on CUDA GPUs and under TorchTPU (fused kernels),
and eager on CPUs, where the backends are cross-checked against each other and eager is one formula on all of
them (XLA lowers SDPA to the same math there). Anything else the user names is used as named, or refused.
"""

from __future__ import annotations

import functools
import warnings

import torch

XLA_PALLAS = "xla_pallas"
# What `auto` resolves to, by accelerator (tpu: a TPU through torch_xla; torchtpu: a TPU through TorchTPU,
# which routes SDPA to its splash attention kernel; cuda; anything else).
_AUTO = {"tpu": XLA_PALLAS, "torchtpu": "sdpa", "cuda": "sdpa"}


def choose(requested: str, device_type: str | None) -> str:
    """The kernel for `device_type` ('tpu', 'torchtpu', 'cuda', 'cpu', or None before the runtime is known:
    eager)."""
    if requested != "auto":
        return requested
    return _AUTO.get(device_type or "", "eager")


def available(name: str) -> str | None:
    """None if `name` can run here, else why not (one line, for a ConfigError)."""
    if name == "flash_attention_2":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            return "needs the flash-attn package (pip install flash-attn) and a CUDA GPU; use sdpa"
    return None


@functools.cache
def register() -> None:
    """Make `xla_pallas` a transformers attention implementation (and its mask function: the sdpa one, which
    gives no mask at all for plain causal batches, the case the kernel takes)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(XLA_PALLAS, xla_pallas_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(XLA_PALLAS, sdpa_mask)


def xla_pallas_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """torch_xla's Pallas flash attention (TPU) for [batch, heads, seq, head_dim] inputs; under SPMD it is
    given the global mesh and a partition spec that shards the batch over every mesh axis, as the step does.

    Batches with a padding mask, dropout in training, a non-causal module without a mask, or a sequence the
    kernel's blocks do not tile fall back to SDPA, which computes the same thing."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    # Under autocast, models that normalise queries and keys (Qwen3's q_norm, k_norm) hand over fp32 queries
    # with bf16 values; neither the kernel nor SDPA casts for itself (eager's matmuls do, under autocast).
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    causal = getattr(module, "is_causal", True)
    kernel = attention_mask is None and not (dropout and module.training) and causal
    if kernel and not (tiled(query.shape[2]) and tiled(key.shape[2])):
        _untiled(max(query.shape[2], key.shape[2]))
        kernel = False
    if not kernel:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    from torch_xla.experimental import custom_kernel

    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    mesh, spec = _spmd_layout()
    out = custom_kernel.flash_attention(query, key, value, causal=True, sm_scale=scale, partition_spec=spec,
                                        mesh=mesh)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def tiled(length: int) -> bool:
    """Whether torch_xla's flash attention kernel takes a sequence of `length`: each of its block sizes (forward
    and backward), capped at the length, must divide it, and no block may be narrower than the TPU's 128
    lanes. So 128 or 256, or a multiple of 1024 (of 512 up to 1024): what the TPU compiler, not a CPU run,
    found (`xla-shard compile`)."""
    from torch_xla.experimental.custom_kernel import FlashAttention

    blocks = [size for name, size in FlashAttention.DEFAULT_BLOCK_SIZES.items() if name != "block_b"]
    return length % FlashAttention.MIN_BLOCK_SIZE == 0 and all(length % min(size, length) == 0 for size in blocks)


@functools.cache
def _untiled(length: int) -> None:
    warnings.warn(f"xla_pallas: the flash attention kernel's blocks do not tile {length}-token sequences; SDPA "
                  "runs instead (same result). Lengths it takes: 128, 256, 512, 1024, 2048, 3072, ...",
                  stacklevel=3)


def _spmd_layout():
    """(mesh, partition spec) under SPMD: the batch split over all mesh axes; (None, None) otherwise."""
    try:
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
    except ImportError:
        return None, None
    if not xr.is_spmd():
        return None, None
    mesh = xs.get_global_mesh()
    if mesh is None:
        return None, None
    return mesh, (tuple(mesh.axis_names), None, None, None)
