"""Which attention kernel a model runs, per device, and torch_xla's Pallas flash attention as a transformers
attention function.

`model.attn_implementation: auto` picks the fastest kernel that computes the same thing on the device, as
measured by `bench/attention_kernels.py`: the Pallas flash attention kernel on TPUs under torch_xla; SDPA under
TorchTPU (fused kernels); `sdpa_packed` on torch's CPU (its flash kernel, each packed document alone: 1.2-2.3x
eager's SFT throughput and a fraction of its memory) and on CUDA GPUs (packed rows through variable-length flash
attention, others SDPA as is); and eager on XLA's CPU client, where XLA fuses eager's ops and lowers SDPA to
the same math, a little slower. Anything else the user names is used as named, or refused.
"""

from __future__ import annotations

import functools
import warnings

import torch

XLA_PALLAS = "xla_pallas"
SDPA_PACKED = "sdpa_packed"
# What `auto` resolves to, by accelerator (tpu: a TPU through torch_xla; torchtpu: a TPU through TorchTPU,
# which routes SDPA to its splash attention kernel; cuda; cpu: torch's own; xla_cpu: XLA's CPU client).
AUTO = {"tpu": XLA_PALLAS, "torchtpu": "sdpa", "cuda": SDPA_PACKED, "cpu": SDPA_PACKED, "xla_cpu": "eager"}


def choose(requested: str, device_type: str | None) -> str:
    """The kernel for `device_type` (a key of `AUTO`, or None before the runtime is known: eager, the one
    formula every runtime has)."""
    if requested != "auto":
        return requested
    return AUTO.get(device_type or "", "eager")


def available(name: str) -> str | None:
    """None if `name` can run here, else why not (one line, for a ConfigError)."""
    if name == "flash_attention_2":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            return "needs the flash-attn package (pip install flash-attn) and a CUDA GPU; use sdpa"
    return None


@functools.cache
def register() -> None:
    """Make `xla_pallas` and `sdpa_packed` transformers attention implementations, with their mask function
    (`documents_mask`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    for name, function in ((XLA_PALLAS, xla_pallas_attention), (SDPA_PACKED, sdpa_packed_attention)):
        AttentionInterface.register(name, function)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, documents_mask)


def documents_mask(*args, attention_mask: torch.Tensor | None = None, config=None, **kwargs):
    """No mask where causal attention within each document says it all: no padding, and a model whose attention
    is causal over every earlier position (no sliding window, no chunks). Packed rows then reach the attention
    function with their documents told apart by their positions (`segments`), instead of a [batch, 1, tokens,
    tokens] block-diagonal mask. Anything else: SDPA's mask."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and plain_causal(config):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, config=config, **kwargs)


def plain_causal(config) -> bool:
    """Whether every layer of the model attends causally to every earlier position (what the kernel computes)."""
    if config is None:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    windowed = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    layers = getattr(text, "layer_types", None)
    return not windowed and not getattr(text, "attention_chunk_size", None) and (
        not layers or all(kind == "full_attention" for kind in layers))


def segments(position_ids: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """Packed rows' documents, numbered within each row ([rows, tokens], int32) from their positions, which
    restart at each document (as transformers finds them: where a position is not the one before plus one);
    None where the positions are the model's own, one [1, tokens] range for all rows. (A single row's given
    positions look the same: they get segment ids, all 0 where it holds one document, which changes nothing.)"""
    if position_ids is None or position_ids.dim() != 2 or (position_ids.shape[0] == 1 and rows > 1):
        return None
    position_ids = position_ids.expand(rows, -1)
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1).to(torch.int32)


def xla_pallas_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """torch_xla's Pallas flash attention (TPU) for [batch, heads, seq, head_dim] inputs; under SPMD it is
    given the global mesh and a partition spec that shards the batch over every mesh axis, as the step does.
    Packed rows' documents are kept apart by segment ids (from their positions), which the kernel takes and
    shards with the batch.

    Batches with a padding mask, dropout in training, a non-causal module without a mask, a static cache's
    keys (generation), or a sequence the kernel's blocks do not tile fall back to SDPA, which computes the same
    thing (packed rows there with the mask their segment ids make)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    # Under autocast, models that normalise queries and keys (Qwen3's q_norm, k_norm) hand over fp32 queries
    # with bf16 values; neither the kernel nor SDPA casts for itself (eager's matmuls do, under autocast).
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    causal = getattr(module, "is_causal", True)
    # More keys than queries: a generation's static cache (one document a row, the unwritten positions after the
    # queries'), where the kernel's and the segments' causal masks (square) do not apply; SDPA's does.
    cached = key.shape[2] != query.shape[2]
    documents = segments(kwargs.get("position_ids"), query.shape[0]) if (
        attention_mask is None and causal and not cached) else None
    kernel = attention_mask is None and not (dropout and module.training) and causal and not cached
    if kernel and not (tiled(query.shape[2]) and tiled(key.shape[2])):
        _untiled(max(query.shape[2], key.shape[2]))
        kernel = False
    if not kernel:
        if documents is not None:  # the kernel's segments as a mask: causal, within one document
            attention_mask = segment_mask(documents, query.shape[2], key.shape[2])
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    from torch_xla.experimental import custom_kernel

    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    mesh, spec = _spmd_layout()
    out = custom_kernel.flash_attention(query, key, value, causal=True, q_segment_ids=documents,
                                        kv_segment_ids=documents, sm_scale=scale, partition_spec=spec, mesh=mesh)
    return out.transpose(1, 2).contiguous(), None


def sdpa_packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA, with each packed document attended alone, without a mask: on CUDA in half precision
    one variable-length flash call for the batch (torch's `varlen_attn`, as TRL's padding-free path), elsewhere
    one causal SDPA call a document (torch's flash kernel on a CPU, where FlexAttention's block mask has no
    backward, torch 2.15). A packed row then costs the sum of its documents' squares, not the row's square, and
    no [rows, 1, tokens, tokens] mask is built. Exact: each document computes what it would alone.

    Batches with a padding mask, a cache's keys (generation), a non-causal module, or a step being compiled
    (the documents' bounds are data) are transformers' SDPA as is (packed rows there with the mask their
    documents make)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("is_causal", None)
    causal = getattr(module, "is_causal", True)
    split = attention_mask is None and causal and key.shape[2] == query.shape[2]
    documents = segments(kwargs.get("position_ids"), query.shape[0]) if split else None
    if documents is not None and torch.compiler.is_compiling():  # no branch on the data inside a graph
        attention_mask, documents = segment_mask(documents, query.shape[2], key.shape[2]), None
    if documents is None or not documents.any():  # else one document a row: SDPA's own causal attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    starts = torch.diff(documents, dim=-1, prepend=documents[:, :1] - 1).nonzero()
    varlen_attn = _varlen(query, dropout and module.training)
    if varlen_attn is not None:
        return _varlen_attention(varlen_attn, query, key, value, starts, scaling), None
    bounds: list[list[int]] = [[] for _ in range(query.shape[0])]
    for row, start in starts.tolist():
        bounds[row].append(start)
    rows = []
    for row, begins in enumerate(bounds):
        ends = [*begins[1:], query.shape[2]]
        rows.append(torch.cat([sdpa_attention_forward(module, query[row:row + 1, :, a:b], key[row:row + 1, :, a:b],
                                                      value[row:row + 1, :, a:b], None, dropout=dropout,
                                                      scaling=scaling, **kwargs)[0]
                               for a, b in zip(begins, ends)], dim=1))
    return torch.cat(rows), None


def _varlen(query: torch.Tensor, dropout: bool):
    """torch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`, torch 2.10 on) where it
    runs: CUDA, half precision, no dropout; else None."""
    if query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16) or dropout:
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_attention(varlen_attn, query, key, value, starts: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Every document of every row in one variable-length flash call, as TRL's padding-free path runs
    flash-attn: the rows laid end to end ([rows x tokens, heads, dim]) and cut at the documents' starts
    (`starts`: [documents, 2] of (row, token)). Returns [rows, tokens, heads, dim], as transformers' SDPA does."""
    import inspect

    rows, heads, tokens, dim = query.shape
    flat = [t.transpose(1, 2).reshape(rows * tokens, t.shape[1], dim) for t in (query, key, value)]
    offsets = starts[:, 0] * tokens + starts[:, 1]
    cuts = torch.cat([offsets, offsets.new_tensor([rows * tokens])]).to(torch.int32)
    longest = int(torch.diff(cuts).max())
    options = inspect.signature(varlen_attn).parameters
    extra = {"window_size": (-1, 0)} if "window_size" in options else {"is_causal": True}
    if key.shape[1] != heads:
        if "enable_gqa" in options:
            extra["enable_gqa"] = True
        else:
            groups = heads // key.shape[1]
            flat[1:] = [t.repeat_interleave(groups, 1) for t in flat[1:]]
    out = varlen_attn(*flat, cuts, cuts, longest, longest, scale=scaling, **extra)
    return out.view(rows, tokens, heads, dim)


def segment_mask(documents: torch.Tensor, queries: int, keys: int) -> torch.Tensor:
    """[rows, 1, queries, keys] booleans: a position sees the earlier positions of its own document."""
    causal = torch.ones(queries, keys, dtype=torch.bool, device=documents.device).tril(keys - queries)
    same = documents[:, -queries:, None] == documents[:, None, :keys]
    return (causal & same).unsqueeze(1)



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
