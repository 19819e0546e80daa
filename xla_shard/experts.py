"""How MoE experts run on torch_xla: token-sorted grouped matmuls (jax's Megablox `gmm` Pallas kernel), as a
transformers experts implementation.

transformers' `batched_mm` (static shapes, what XLA takes on CPU) gathers one weight matrix per token and
expert: for a Qwen3-30B-A3B layer on a v5p-64 that is one 192 GiB buffer, which the TPU compiler refuses.
`xla_gmm` sorts each device's (token, expert) pairs by expert and multiplies each expert's rows by its weights
once, dropless, with nothing allocated per pair beyond the activations: what MaxText's Megablox path does.

Under SPMD the experts run in a manual region, one per device: each device routes its own tokens with the whole
expert weights (gathered, as FSDP gathers any layer's) and the weights' gradients are summed over devices on the
way out. On a TPU the kernel is compiled; on a CPU it is interpreted (slow, but the same kernel and result).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch

XLA_GMM = "xla_gmm"
_TILE = 512  # the kernel's largest tile per dimension (torch_xla's and MaxText's choice)
_LANES = 128

# Set while a step is traced for a TPU (`lowered_for_tpu`). Process-wide, not a context variable: autograd runs a
# device's backward (and activation checkpointing's recomputed forward) in threads of its own, which a context
# variable does not reach; they then took the CPU's path (eager attention over a split sequence: 6 GiB of scores
# per layer in the compiled program).
_for_tpu = [False]


def choose(default: str | None, accelerator: str | None) -> str | None:
    """The experts implementation for a torch_xla backend whose own choice is `default`: the grouped kernel on
    a TPU (or traced for one), `default` elsewhere."""
    return XLA_GMM if accelerator == "tpu" and default is not None else default


@contextlib.contextmanager
def lowered_for_tpu():
    """Kernels traced inside are compiled for a TPU (`xla-shard compile`), never interpreted, though this
    machine's jax runs on its CPU."""
    before, _for_tpu[0] = _for_tpu[0], True
    try:
        yield
    finally:
        _for_tpu[0] = before


@functools.cache
def register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(XLA_GMM, xla_gmm_experts_forward)


def grouped_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules `xla_gmm` computes (on a TPU, or traced for one): under SPMD their weights'
    gradients leave its manual region as one partial sum per device, which the TPU compiler reduces its own way
    (priced by the planner: `WholeReductions`)."""
    return [module for module in model.modules()
            if isinstance(getattr(module, "down_proj", None), torch.nn.Parameter) and module.down_proj.dim() == 3
            and hasattr(module, "has_gate") and _layout(module, "cpu") is not None]


def xla_gmm_experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward ([tokens, hidden], [tokens, k] ids and weights) with grouped matmuls."""
    from transformers.integrations.moe import batched_mm_experts_forward

    layout = _layout(module, hidden_states.device.type)
    if layout is None:
        _unsupported(type(module).__name__)
        return batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    up = module.gate_up_proj if module.has_gate else module.up_proj
    return torch.ops.xla_shard.moe_experts(hidden_states, top_k_index, top_k_weights, up, module.down_proj, layout)


def _layout(module: torch.nn.Module, device: str) -> str | None:
    """What the op needs of the module, as a string (a custom op takes no module): the activation, whether a
    gate multiplies it, whether weights are stored [experts, in, out], and the matmuls' dtype. None for experts
    this path does not compute (biases, a norm after each expert, an interleaved or custom gate, an activation
    without a gradient below)."""
    from transformers.integrations.moe import _default_apply_gate

    act = _activation_name(getattr(module, "act_fn", None))
    if (getattr(module, "has_bias", False) or getattr(module, "has_post_expert_norm", False)
            or not getattr(module, "is_concatenated", True) or act not in _ACTIVATION_GRADS
            or (module.has_gate and type(module)._apply_gate is not _default_apply_gate)):
        return None
    weight = module.gate_up_proj if module.has_gate else module.up_proj
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    return f"{act}|{int(module.has_gate)}|{int(bool(module.is_transposed))}|{str(dtype).removeprefix('torch.')}"


def _activation_name(act_fn) -> str | None:
    """The transformers name of the experts' own activation (not the config's `hidden_act`: Aria's experts
    use SiLU whatever the config says), among those with a gradient below."""
    from transformers.activations import ACT2FN

    return next((name for name in _ACTIVATION_GRADS if type(act_fn) is type(ACT2FN[name])), None)


@functools.cache
def _unsupported(name: str) -> None:
    warnings.warn(f"xla_gmm: {name} has biases, a post-expert norm, a custom gate or an activation the grouped "
                  "kernel path does not compute; transformers' batched_mm runs instead (one weight gathered per token "
                  "and expert: large at scale)", stacklevel=3)


@torch.library.custom_op("xla_shard::moe_experts", mutates_args=())
def _experts_op(hidden: torch.Tensor, index: torch.Tensor, route: torch.Tensor, up: torch.Tensor,
                down: torch.Tensor, layout: str) -> torch.Tensor:
    """An op, not Python the tracer walks into: under `scan_layers` torch_xla traces each layer with
    AOTAutograd, and the manual SPMD region needs real XLA tensors."""
    mesh, axes = spmd_mesh()
    if mesh is None:
        return _experts(hidden, index, route, up, down, layout)
    rows = (axes, None)
    out = _experts(*(to_local(t, mesh, rows) for t in (hidden, index, route)),
                   *(_whole(w, mesh) for w in (up, down)), layout)
    return to_global(out, mesh, rows, hidden.shape)


@_experts_op.register_fake
def _(hidden, index, route, up, down, layout):
    return torch.empty_like(hidden)


@torch.library.custom_op("xla_shard::moe_experts_backward", mutates_args=())
def _experts_backward_op(grad: torch.Tensor, hidden: torch.Tensor, index: torch.Tensor, route: torch.Tensor,
                         up: torch.Tensor, down: torch.Tensor, layout: str) -> list[torch.Tensor]:
    """Gradients of all four inputs, from the inputs alone: the grouped matmuls are recomputed (no per-pair
    activations are kept from forward) and differentiated by hand (an op's body records no autograd graph)."""
    mesh, axes = spmd_mesh()
    if mesh is None:
        d_hidden, d_route, d_up, d_down = _experts_grads(grad, hidden, index, route, up, down, layout)
        return [d_hidden, d_route, d_up.to(up.dtype), d_down.to(down.dtype)]
    rows = (axes, None)
    d_hidden, d_route, d_up, d_down = _experts_grads(*(to_local(t, mesh, rows) for t in (grad, hidden, index, route)),
                                                     *(_whole(w, mesh) for w in (up, down)), layout)
    # the weights' gradients summed over the devices in the compute dtype, as XLA reduces every other weight's,
    # then in the weights' own (fp32 under bf16 mixed precision: summed in it, they moved twice the bytes)
    return [to_global(d_hidden, mesh, rows, hidden.shape), to_global(d_route, mesh, rows, route.shape),
            _summed(d_up, mesh, axes, up).to(up.dtype), _summed(d_down, mesh, axes, down).to(down.dtype)]


@_experts_backward_op.register_fake
def _(grad, hidden, index, route, up, down, layout):
    return [torch.empty_like(hidden), torch.empty_like(route), torch.empty_like(up), torch.empty_like(down)]


def _setup_context(ctx, inputs, output):
    hidden, index, route, up, down, ctx.layout = inputs
    ctx.save_for_backward(hidden, index, route, up, down)


def _backward(ctx, grad):
    d_hidden, d_route, d_up, d_down = torch.ops.xla_shard.moe_experts_backward(grad, *ctx.saved_tensors, ctx.layout)
    return d_hidden, None, d_route, d_up, d_down, None


_experts_op.register_autograd(_backward, setup_context=_setup_context)


@dataclass(frozen=True)
class _Layout:
    act: str
    gated: bool
    stored_out_in: bool  # transformers' [experts, out, in] (is_transposed false): the kernel transposes it
    dtype: torch.dtype

    @classmethod
    def parse(cls, text: str) -> _Layout:
        act, gated, transposed, dtype = text.split("|")
        return cls(act, gated == "1", transposed == "0", getattr(torch, dtype))


@dataclass
class _Routed:
    """One device's (token, expert) pairs sorted by expert, and the forward's matmul results for them."""
    order: torch.Tensor  # pair index, by expert
    sizes: torch.Tensor  # pairs per expert (int32)
    x: torch.Tensor  # each pair's token
    pre: torch.Tensor  # the first projection (gate and up)
    act: torch.Tensor  # its activation: the second projection's input
    y: torch.Tensor  # the expert's output


def _route(hidden, index, up, down, layout: _Layout) -> _Routed:
    pairs = index.reshape(-1)
    order = torch.argsort(pairs, stable=True)
    sizes = torch.nn.functional.one_hot(pairs, up.shape[0]).sum(0).to(torch.int32)
    x = _rows(hidden, _token_of(order, index)).to(layout.dtype)
    pre = _grouped(x, up.to(layout.dtype), sizes, layout.stored_out_in)
    act = _activate(pre, layout)
    y = _grouped(act, down.to(layout.dtype), sizes, layout.stored_out_in)
    return _Routed(order, sizes, x, pre, act, y)


def _token_of(order: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The token of each sorted pair, from an iota rather than `order // k` (see `_rows`)."""
    tokens, k = index.shape
    return _rows(torch.arange(tokens, device=index.device).unsqueeze(1).expand(tokens, k).reshape(-1), order)


def _rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor[index] along the first dimension, as a gather. Inside a scanned layer's manual SPMD region,
    torch_xla lowers indexing (and any Python scalar) with an operand XLA's partitioner cannot place there (it
    aborts: `!IsManual()`), and index_select of a sort's indices aborts torch_xla 2.9 anywhere."""
    if tensor.dim() > 1:
        index = index.view(-1, *(1,) * (tensor.dim() - 1)).expand(-1, *tensor.shape[1:])
    return torch.gather(tensor, 0, index)


def _activate(pre: torch.Tensor, layout: _Layout) -> torch.Tensor:
    from transformers.activations import ACT2FN

    if not layout.gated:
        return ACT2FN[layout.act](pre)
    gate, up = _halves(pre)
    return ACT2FN[layout.act](gate) * up


def _halves(pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up of [gate; up]. The second half is taken from the reversed tensor: a slice that starts past
    0 aborts XLA's partitioner inside a scanned layer's manual region, as indexing does (see `_rows`)."""
    half = pre.shape[-1] // 2
    return pre[..., :half], pre.flip(-1)[..., :half].flip(-1)


def _unsorted_sum(pairs: torch.Tensor, routed: _Routed, tokens: int) -> torch.Tensor:
    """Pair rows back in token order, each token's k rows summed (transformers' reshape-and-sum)."""
    return _rows(pairs, torch.argsort(routed.order)).view(tokens, -1, pairs.shape[-1]).sum(dim=1)


def _experts(hidden, index, route, up, down, layout: str) -> torch.Tensor:
    """One device's tokens through their experts: the pairs sorted by expert, two grouped matmuls, the pairs
    put back in order and summed per token with their routing weights (as transformers' grouped_mm does)."""
    spec = _Layout.parse(layout)
    routed = _route(hidden, index, up, down, spec)
    weighted = routed.y * _rows(route.reshape(-1), routed.order).unsqueeze(-1)
    return _unsorted_sum(weighted, routed, index.shape[0]).to(hidden.dtype)


def _experts_grads(grad, hidden, index, route, up, down, layout: str):
    spec = _Layout.parse(layout)
    routed = _route(hidden, index, up, down, spec)
    order, sizes, dtype = routed.order, routed.sizes, spec.dtype
    tokens, k = index.shape
    g = _rows(grad, _token_of(order, index)).to(dtype)  # d(weighted pair rows): each pair's token's gradient
    d_route = _rows((g.float() * routed.y.float()).sum(-1), torch.argsort(order)).view(tokens, k).to(route.dtype)
    g = (g * _rows(route.reshape(-1), order).unsqueeze(-1)).to(dtype)  # d y
    d_down = _grouped_weight_grad(routed.act, g, sizes, spec.stored_out_in)
    g = _grouped(g, down.to(dtype), sizes, not spec.stored_out_in)  # d act
    g = _activation_grad(g, routed.pre, spec)  # d pre
    d_up = _grouped_weight_grad(routed.x, g, sizes, spec.stored_out_in)
    g = _grouped(g, up.to(dtype), sizes, not spec.stored_out_in)  # d x
    d_hidden = _unsorted_sum(g, routed, tokens).to(hidden.dtype)
    return d_hidden, d_route, d_up, d_down  # the weights' in the compute dtype (the callers cast them)


# d act(z) / dz, as aten computes it for transformers' activations of these names
_ACTIVATION_GRADS = {
    "silu": lambda g, z: torch.ops.aten.silu_backward(g, z),
    "swish": lambda g, z: torch.ops.aten.silu_backward(g, z),
    "gelu": lambda g, z: torch.ops.aten.gelu_backward(g, z, approximate="none"),
    "gelu_pytorch_tanh": lambda g, z: torch.ops.aten.gelu_backward(g, z, approximate="tanh"),
    "relu": lambda g, z: torch.ops.aten.threshold_backward(g, z, 0),
}


def _activation_grad(grad: torch.Tensor, pre: torch.Tensor, layout: _Layout) -> torch.Tensor:
    from transformers.activations import ACT2FN

    backward = _ACTIVATION_GRADS[layout.act]
    if not layout.gated:
        return backward(grad, pre)
    gate, up = _halves(pre)
    return torch.cat([backward(grad * up, gate), grad * ACT2FN[layout.act](gate)], dim=-1).to(pre.dtype)


def _grouped(lhs: torch.Tensor, rhs: torch.Tensor, sizes: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Rows of group g times rhs[g] (rhs[g].T when `transposed`), through the kernel's padded rows."""
    return _gmm(_pad_rows(lhs), rhs, sizes, transposed)[: lhs.shape[0]]


def _grouped_weight_grad(lhs: torch.Tensor, grad: torch.Tensor, sizes: torch.Tensor, transposed: bool):
    """d rhs of `_grouped(lhs, rhs, sizes, transposed)` given d out: per group lhs.T @ grad, or its transpose."""
    lhs, grad = _pad_rows(lhs), _pad_rows(grad)
    return _tgmm(grad.t(), lhs, sizes) if transposed else _tgmm(lhs.t(), grad, sizes)


def _row_tile(rows: int) -> int:
    return min(_TILE, -(-rows // _LANES) * _LANES)


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows padded to a multiple of the kernel's row tile; rows past the groups are never read back."""
    tile = _row_tile(x.shape[0])
    pad = -x.shape[0] % tile
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


def _tiling(rows: int, inner: int, outer: int) -> tuple[int, int, int]:
    return (_row_tile(rows), min(_TILE, -(-inner // _LANES) * _LANES), min(_TILE, -(-outer // _LANES) * _LANES))


def _gmm(lhs, rhs, sizes, transposed):
    import torch_xla.core.xla_builder as xb

    outer = rhs.shape[1] if transposed else rhs.shape[2]
    kwargs = {"tiling": _tiling(lhs.shape[0], lhs.shape[1], outer), "transpose_rhs": transposed,
              "interpret": interpreted()}
    return xb.call_jax(_megablox_gmm, (lhs, rhs, sizes), kwargs)


def _tgmm(lhs_t, rhs, sizes):
    import torch_xla.core.xla_builder as xb

    kwargs = {"tiling": _tiling(lhs_t.shape[1], lhs_t.shape[0], rhs.shape[1]), "interpret": interpreted()}
    return xb.call_jax(_megablox_tgmm, (lhs_t, rhs, sizes), kwargs)


def _megablox_gmm(lhs, rhs, sizes, *, tiling, transpose_rhs, interpret):
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm

    return gmm(lhs, rhs, sizes, lhs.dtype, tiling, transpose_rhs=transpose_rhs, interpret=interpret)


def _megablox_tgmm(lhs_t, rhs, sizes, *, tiling, interpret):
    from jax.experimental.pallas.ops.tpu.megablox.gmm import tgmm

    return tgmm(lhs_t, rhs, sizes, lhs_t.dtype, tiling, interpret=interpret)


def interpreted() -> bool:
    """Interpret the kernel unless it runs on a TPU or is lowered for one. Asked of torch_xla's runtime, not
    jax's: on a TPU VM torch_xla holds the chips."""
    if _for_tpu[0]:
        return False
    import torch_xla.runtime as xr

    return xr.device_type() != "TPU"


def spmd_mesh():
    """(mesh, its axis names) under SPMD with a global mesh, else (None, None)."""
    try:
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
    except ImportError:
        return None, None
    mesh = xs.get_global_mesh() if xr.is_spmd() else None
    return (mesh, tuple(mesh.axis_names)) if mesh is not None else (None, None)


def to_local(tensor: torch.Tensor, mesh, spec) -> torch.Tensor:
    """This device's piece of a global tensor split by `spec`: the entry to a manual SPMD region."""
    import torch_xla.distributed.spmd as xs

    return xs.enable_manual_sharding(tensor, spec, mesh=mesh).global_tensor


def to_global(tensor: torch.Tensor, mesh, spec, shape) -> torch.Tensor:
    import torch_xla.distributed.spmd as xs

    return xs.disable_manual_sharding(tensor, spec, shape, mesh=mesh).global_tensor


def _whole(weight: torch.Tensor, mesh) -> torch.Tensor:
    """A weight whole on every device inside the region (XLA gathers it). Annotated, not marked: marking would
    replace the parameter's own (sharded) layout."""
    import torch_xla

    whole = weight.clone()
    torch_xla._XLAC._xla_annotate_custom_sharding(whole, mesh.get_op_sharding((None,) * weight.dim()))
    return torch_xla._XLAC._spmd_full_to_shard_shape(whole)


def _summed(grad: torch.Tensor, mesh, axes, weight: torch.Tensor) -> torch.Tensor:
    """A weight's gradient, one partial sum per device, leaves the region stacked on a new axis split over
    the devices and is summed there: XLA runs that as a reduction over the devices, a reduce-scatter where the
    sum is given the weight's own layout."""
    import torch_xla

    stacked = to_global(grad.unsqueeze(0), mesh, (axes,) + (None,) * grad.dim(), (mesh.size(), *grad.shape))
    summed = stacked.sum(0)
    layout = torch_xla._XLAC._get_xla_op_sharding(weight)
    if layout is not None:
        torch_xla._XLAC._xla_annotate_custom_sharding(summed, layout)
    return summed
