"""The sequence (context) axis: every sequence split over `mesh.context` devices, with attention computed across
the pieces, as MaxText's context parallelism (its default all_gather strategy) does.

Causal attention over a split sequence is unbalanced if each device holds one contiguous piece: the last
piece attends to everything, the first to itself. So the rows are reordered before they are placed: the sequence
is cut into 2c chunks and device i holds chunks i and 2c-1-i (MaxText's and torchtitan's load balancing); every
device then does the same causal work. Positions travel with their tokens (`position_ids`, the rotary's input);
labels stay in their own order, and the chunked loss reorders the targets to meet the hidden states
(`lm_head`). Attention gathers keys and values along the axis and masks by the tokens' places in the original
order and by their documents (packed rows' segments, found from the positions in that order), so the result is
the unsplit model's, whatever the reordering.

Two runtimes split a sequence. Under torch_xla's SPMD (xla_spmd) a row is one global tensor laid out over the
`context` mesh axis: on a TPU (or traced for one) attention is jax's splash attention kernel, given each device's
part of the mask as data (`_splash`); elsewhere the model's own eager attention with that mask (`xla_context`).
Under torch.distributed (torch_fsdp) each process of a group holds its piece of the reordered row (`piece`):
keys and values are all-gathered over the group, their gradients reduce-scattered back (torch's functional
collectives, as torch's FlexAttention context parallelism does). On a CPU attention runs block by block through
the flash kernel, the keys gathered for the forward and again for the backward, so a process keeps only its
share of the row (`BlockwiseAttention`); elsewhere it is SDPA with the mask's rows for this process's queries
(`torch_context`).
"""

from __future__ import annotations

import functools
import sys

import torch

XLA_CONTEXT = "xla_context"  # the transformers attention implementations a split sequence runs
TORCH_CONTEXT = "torch_context"
CONTEXT_AXIS = "context"

# The torch.distributed group each sequence is split over, one piece per process (torch_fsdp); None: none, or
# SPMD's mesh axis. Process-wide, as the attention functions transformers calls take no more arguments.
_group: list = [None]


def chunk_order(shards: int) -> list[int]:
    """The 2 x `shards` chunks of a sequence in their balanced order: shard i holds chunks i and 2 x shards - 1 - i."""
    return [i for shard in range(shards) for i in (shard, 2 * shards - 1 - shard)]


def _chunks_in(tensor: torch.Tensor, order: list[int], dim: int) -> torch.Tensor:
    """`tensor` cut into len(order) equal chunks along `dim`, put together in `order`: slices and one
    concatenation (static, so a traced loop body and XLA's partitioner take them as they are)."""
    pieces = tensor.chunk(len(order), dim)
    return torch.cat([pieces[i] for i in order], dim)


def reorder(tensor: torch.Tensor, shards: int, dim: int = -1) -> torch.Tensor:
    """Tokens along `dim` from their original order to the balanced one."""
    return _chunks_in(tensor, chunk_order(shards), dim) if shards > 1 else tensor


def restore(tensor: torch.Tensor, shards: int, dim: int = -1) -> torch.Tensor:
    """Tokens along `dim` from the balanced order back to the original one."""
    if shards == 1:
        return tensor
    order = chunk_order(shards)
    return _chunks_in(tensor, sorted(range(len(order)), key=order.__getitem__), dim)


def reorder_rows(rows: dict[str, torch.Tensor], shards: int, tokens: int) -> dict[str, torch.Tensor]:
    """A batch's host rows with every per-token field but the labels reordered (`reorder`); positions are added
    where the batch has none (the model would number the reordered tokens 0, 1, ... otherwise)."""
    if shards == 1:
        return rows
    out = dict(rows)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(tokens).expand(rows["input_ids"].shape)
    for key, value in out.items():
        if key != "labels" and _per_token(value, tokens):
            out[key] = reorder(value, shards)
    return out


def split_over(group) -> None:
    """Split each sequence over `group`'s processes (torch_fsdp), or over none (None)."""
    _group[0] = group


def piece(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """This process's piece of a reordered row along `dim`: its two chunks."""
    group = _group[0]
    size = tensor.shape[dim] // group.size()
    return tensor.narrow(dim, group.rank() * size, size)


def gathered(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """The group's pieces put together along `dim` (in the reordered order); autograd sums the gradient of the
    whole over the group and hands each process its piece's (a reduce-scatter)."""
    import torch.distributed._functional_collectives as funcol

    if tensor.dtype == torch.bool:  # gloo gathers no booleans
        return gathered(tensor.to(torch.uint8), dim).bool()
    return funcol.wait_tensor(funcol.all_gather_tensor_autograd(tensor.contiguous(), dim, _group[0]))


def pieces_of(rows: dict[str, torch.Tensor], tokens: int) -> dict[str, torch.Tensor]:
    """A batch's host rows as this process feeds them to the model: reordered (`reorder_rows`), each per-token
    field but the labels cut to this process's piece (the labels stay whole: the loss is the whole row's)."""
    shards = _group[0].size()
    out = reorder_rows(rows, shards, tokens)
    return {key: piece(value) if key != "labels" and _per_token(value, tokens) else value
            for key, value in out.items()}


def _per_token(value, tokens: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[-1] == tokens


def shards() -> int:
    """The sequence axis's size: the group's (torch_fsdp), or on torch_xla's global mesh (1 without one)."""
    if _group[0] is not None:
        return _group[0].size()
    from xla_shard import experts

    mesh, names = experts.spmd_mesh()
    if mesh is None or CONTEXT_AXIS not in names:
        return 1
    return int(mesh.mesh_shape[names.index(CONTEXT_AXIS)])


@functools.cache
def register() -> None:
    """Make `xla_context` a transformers attention implementation, with its mask function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(XLA_CONTEXT, context_attention)
    AttentionInterface.register(TORCH_CONTEXT, gathered_attention)
    for name in (XLA_CONTEXT, TORCH_CONTEXT):
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, padding_only)


def padding_only(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The batch's padding mask as it is ([rows, tokens], reordered with the tokens), or None: the causal and
    document masks are the attention's to make, from the original order (transformers' would follow the
    reordered one)."""
    if attention_mask is None or attention_mask.dim() != 2 or bool(attention_mask.all()):
        return None
    return attention_mask.bool()


def documents(position_ids: torch.Tensor, shards: int) -> torch.Tensor:
    """Each reordered token's document in its row ([rows, tokens], int32), numbered in the original order:
    packed rows restart their positions at each document."""
    from xla_shard.attention import segments

    original = restore(position_ids, shards)
    found = segments(original, original.shape[0])
    return reorder(found if found is not None else torch.zeros_like(original, dtype=torch.int32), shards)


def allowed(position_ids: torch.Tensor, padding: torch.Tensor | None, shards: int,
            queries: slice = slice(None)) -> torch.Tensor:
    """[rows, 1, queries, tokens] booleans over the reordered tokens: a token sees the tokens before it in the
    original order, in its own document, that are not padding (and always itself: a padded token's row is
    never empty). `queries`: the reordered tokens asking (all, or one process's piece)."""
    place = reorder(torch.arange(position_ids.shape[-1], device=position_ids.device), shards)
    return _seen(place, documents(position_ids, shards), padding, queries, slice(None))


def _seen(place: torch.Tensor, docs: torch.Tensor, padding: torch.Tensor | None, queries: slice,
          keys: slice) -> torch.Tensor:
    """`allowed`'s booleans for the reordered tokens `queries` asking and `keys` seen."""
    asking, seen_place = place[queries], place[keys]
    seen = (asking[:, None] >= seen_place[None, :]) & (docs[:, queries, None] == docs[:, None, keys])
    if padding is not None:
        seen = seen & padding[:, None, keys]
    seen = seen | (asking[:, None] == seen_place[None, :])
    return seen.unsqueeze(1)


def context_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over a split, reordered sequence ([rows, heads, tokens, head_dim] inputs, the tokens split
    over the sequence axis): keys and values gathered whole along it, the mask from the original order."""
    position_ids = _positions(kwargs).expand(query.shape[0], -1)
    count = shards()
    if use_kernel():
        return _splash(module, query, key, value, position_ids, attention_mask, scaling, count)
    seen = allowed(position_ids, attention_mask, count)
    additive = torch.zeros(seen.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~seen, torch.finfo(query.dtype).min)
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as eager
    return eager(module, query, key, value, additive, dropout=dropout, scaling=scaling, **kwargs)


def gathered_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """Attention over a sequence split over a process group (torch_fsdp): this process's queries against the
    keys and values gathered whole along the group (torch's FlexAttention context parallelism's all-gather,
    gradients reduce-scattered). On a CPU, block by block (`BlockwiseAttention`: memory that grows with the
    sequence, not its square); elsewhere, or with attention dropout, the model's SDPA with the mask's rows for
    these queries. Every process gathers positions and padding alike (even where its piece has none), so the
    collectives pair up."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = _positions(kwargs)
    cached = _masks[0]
    if cached is not None and cached[0] is position_ids and cached[1] is attention_mask:
        blocks = cached[2]  # the forward's layers (and checkpointing's recompute) share one
    else:
        blocks = _blocks(position_ids.expand(query.shape[0], -1), attention_mask, query.shape[2])
        _masks[0] = (position_ids, attention_mask, blocks)
    if query.device.type == "cpu" and not (dropout and module.training):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = BlockwiseAttention.apply(query, key, value, blocks, scale, _group[0])
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, gathered(key, 2), gathered(value, 2), blocks.whole(),
                                  dropout=dropout, scaling=scaling, **kwargs)


_masks: list = [None]  # (positions, padding, the `Blocks` made of them): the last forward's


_BLOCK_TOKENS = 1024  # a block's side: its mask is a few MiB, and the causal blocks nobody sees are skipped finely


def _cut(tokens: int) -> list[slice]:
    return [slice(start, min(start + _BLOCK_TOKENS, tokens)) for start in range(0, tokens, _BLOCK_TOKENS)]


class Blocks:
    """Which of the group's whole reordered row this process's queries see, a block at a time (blocks of up to
    `_BLOCK_TOKENS` queries and as many keys). Made of per-token vectors (original places, documents, padding),
    so a block's mask is built when it is used and dropped after: never the [rows, 1, queries, tokens] whole."""

    def __init__(self, place: torch.Tensor, docs: torch.Tensor, padding: torch.Tensor | None, mine: slice):
        self.place, self.docs, self.padding, self.mine = place, docs, padding, mine
        self.keys = _cut(place.shape[-1])
        self.queries = _cut(mine.stop - mine.start)  # within this process's piece

    def seen(self, queries: slice = slice(None), keys: slice = slice(None)) -> torch.Tensor:
        """[rows, 1, queries, keys] booleans (`queries` within this process's piece): a token sees the tokens
        before it in the original order, in its own document, that are not padding, and always itself."""
        start = self.mine.start + (queries.start or 0)
        stop = self.mine.start + (queries.stop if queries.stop is not None else self.mine.stop - self.mine.start)
        asking = slice(start, stop)
        return _seen(self.place, self.docs, self.padding, asking, keys)

    def whole(self) -> torch.Tensor:
        return self.seen()

    def additive(self, queries: slice, keys: slice, dtype: torch.dtype) -> tuple[bool, torch.Tensor | None]:
        """(whether the block is seen at all, its mask for the kernel: None where every pair is seen, else 0
        where seen and the dtype's lowest where not: a query that sees nothing of this block then weighs
        nothing in the merged softmax, without the NaN an all -inf row would give)."""
        seen = self.seen(queries, keys)
        if not bool(seen.any()):
            return False, None
        if bool(seen.all()):
            return True, None
        return True, torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen,
                                                                                           torch.finfo(dtype).min)


class BlockwiseAttention(torch.autograd.Function):
    """Softmax attention of this process's queries over the gathered keys, one (queries, keys) block at a time
    through torch's CPU flash kernel, which returns each block's log-sum-exp: the blocks' outputs are merged by
    their log-sum-exps (as ring attention merges them), blocks nobody sees are skipped, and the backward runs
    the kernel's backward per block against the merged output and log-sum-exp (exact: each block's share of the
    softmax is exp(score - merged log-sum-exp)). Masks are rebuilt per block, in the forward and again in the
    backward, and grouped key/value heads are repeated per block. Given a `group`, `key` and `value` are this
    process's pieces: they are gathered whole along it for the forward and again for the backward (as a ring
    passes them twice), and their gradients are reduce-scattered back; only the pieces are kept between the two,
    so what a process keeps per layer is its share of the row: its queries, keys, values, output and
    log-sum-exp."""

    @staticmethod
    def forward(ctx, query, key_piece, value_piece, blocks: Blocks, scale: float, group=None):
        key, value = _whole(key_piece, group), _whole(value_piece, group)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        groups = query.shape[1] // key.shape[1]
        rows, heads, tokens, dim = query.shape
        # laid out [rows, tokens, heads, dim] as the output projection reads it: the caller's transpose is a view,
        # and the projection keeps this tensor for its backward rather than a copy of it
        out = query.new_empty(rows, tokens, heads, dim).transpose(1, 2)
        lse = query.new_empty(rows, heads, tokens, dtype=torch.float32)
        for queries in blocks.queries:
            merged_out = merged_lse = None
            for keys in blocks.keys:
                used, mask = blocks.additive(queries, keys, query.dtype)
                if not used:
                    continue
                part, part_lse = flash(query[:, :, queries], _heads(key[:, :, keys], groups),
                                       _heads(value[:, :, keys], groups), 0.0, False, attn_mask=mask, scale=scale)
                if merged_out is None:
                    merged_out, merged_lse = part, part_lse
                    continue
                both = torch.logaddexp(merged_lse, part_lse)
                merged_out = (merged_out * (merged_lse - both).exp().unsqueeze(-1).to(part.dtype)
                              + part * (part_lse - both).exp().unsqueeze(-1).to(part.dtype))
                merged_lse = both
            out[:, :, queries] = merged_out
            lse[:, :, queries] = merged_lse
        ctx.save_for_backward(query, key_piece, value_piece, out, lse)
        ctx.blocks, ctx.scale, ctx.group = blocks, scale, group
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        key, value = _whole(key, ctx.group), _whole(value, ctx.group)
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        groups = query.shape[1] // key.shape[1]
        grads = [torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)]
        for queries in ctx.blocks.queries:
            for keys in ctx.blocks.keys:
                used, mask = ctx.blocks.additive(queries, keys, query.dtype)
                if not used:
                    continue
                dq, dk, dv = backward(grad[:, :, queries].contiguous(), query[:, :, queries],
                                      _heads(key[:, :, keys], groups), _heads(value[:, :, keys], groups),
                                      out[:, :, queries].contiguous(), lse[:, :, queries].contiguous(), 0.0, False,
                                      attn_mask=mask, scale=ctx.scale)
                grads[0][:, :, queries] += dq
                grads[1][:, :, keys] += _grouped(dk, groups)
                grads[2][:, :, keys] += _grouped(dv, groups)
        if ctx.group is not None:
            grads[1:] = [_summed_pieces(g, ctx.group) for g in grads[1:]]
        return *grads, None, None, None


def _whole(piece: torch.Tensor, group) -> torch.Tensor:
    """The group's pieces of a [rows, heads, tokens, dim] tensor put together along the tokens (no autograd:
    `BlockwiseAttention` handles its own gradients); the tensor itself without a group."""
    import torch.distributed._functional_collectives as funcol

    if group is None:
        return piece
    return funcol.wait_tensor(funcol.all_gather_tensor(piece.contiguous(), 2, group))


def _summed_pieces(grad: torch.Tensor, group) -> torch.Tensor:
    """Each process's piece of the group's summed gradients of the whole keys (or values): a reduce-scatter."""
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.reduce_scatter_tensor(grad.contiguous(), "sum", 2, group))


def _heads(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped key/value heads repeated for their query heads ([rows, heads, tokens, dim])."""
    return tensor.repeat_interleave(groups, 1) if groups > 1 else tensor


def _grouped(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The repeated heads' gradients summed back onto their key/value head."""
    if groups == 1:
        return grad
    rows, heads, tokens, dim = grad.shape
    return grad.view(rows, heads // groups, groups, tokens, dim).sum(2)


@torch.no_grad()
def _blocks(position_ids: torch.Tensor, padding: torch.Tensor | None, tokens: int) -> Blocks:
    """This process's `tokens` queries' view of the group's whole reordered row."""
    padding = padding if padding is not None else torch.ones_like(position_ids, dtype=torch.bool)
    whole = gathered(torch.stack([position_ids, padding.long()]), 2)
    group = _group[0]
    place = reorder(torch.arange(whole.shape[-1], device=whole.device), group.size())
    return Blocks(place, documents(whole[0], group.size()), whole[1].bool(),
                  slice(group.rank() * tokens, (group.rank() + 1) * tokens))


def _positions(kwargs: dict) -> torch.Tensor:
    """The per-row positions the backend fed the model (taken out of the attention's keywords), as given."""
    position_ids = kwargs.pop("position_ids", None)
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        raise RuntimeError("mesh.context: the attention was given no per-row positions (the backend adds them)")
    return position_ids


def use_kernel() -> bool:
    """Whether attention runs jax's splash kernel: on a TPU, or traced for one."""
    from xla_shard import experts

    return not experts.interpreted()


def _splash(module, query, key, value, position_ids, padding, scaling, count):
    """Splash attention over the split sequence (MaxText's all_gather strategy): each device's queries (their
    two chunks) against the keys and values gathered whole along the axis and put back in their original order,
    the causal mask computed in the kernel from each query's original position (a mask over 2c shards of
    queries, each device handed its shard's part as data), packed documents by segment ids; padding is a
    segment of its own (-1), which no real token's segment meets."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    docs = documents(position_ids, count)
    if padding is not None:
        docs = docs.masked_fill(~padding, -1)
    out, _ = torch.ops.xla_shard.context_attention(query * scale, key, value, docs, count)
    return out.transpose(1, 2).contiguous(), None


_BLOCK = 512  # the kernel's block along either sequence (MaxText's sa_block_* default)


@functools.cache
def _kernel(tokens: int, heads: int, count: int, interpret: bool):
    """The splash kernel for `heads` query heads over `tokens` reordered queries (in `count` shards) and as many
    keys in their original order: (its mask data as numpy leaves with their layouts, a function of those leaves
    and (queries, keys, values, query segments, key segments) that runs it on one device's rows)."""
    import jax
    import numpy as np
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    class _ReorderedCausal(masks._ComputableMask):
        """Causal by original position, the queries in the balanced order (`q_sequence`), keys in their own."""

        def __init__(self, shape):
            super().__init__(shape=shape, mask_function=lambda q, k: q >= k)
            chunks = np.arange(tokens, dtype=np.int32).reshape(2 * count, -1)
            self.q_sequence = np.concatenate([chunks[i] for i in chunk_order(count)])

        def __eq__(self, other):
            return isinstance(other, type(self)) and self.shape == other.shape

        def __hash__(self):
            return hash((type(self), self.shape, count))

    block = min(_BLOCK, tokens // count)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = masks.MultiHeadMask([_ReorderedCausal((tokens, tokens))] * heads)
    # save_residuals: the forward returns its output's log-sum-exp beside it, which the backward kernels take
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=count,
                                    interpret=interpret, save_residuals=True)
    leaves, tree = jax.tree_util.tree_flatten(kernel)
    # each leaf's dim split over the sequence axis (shard_map's spec of the kernel: its q blocks), or None
    specs = jax.tree_util.tree_leaves(kernel.manual_sharding_spec(_FakeSharding(count)),
                                      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    split = [next((d for d, axis in enumerate(spec) if axis is not None), None) for spec in specs]

    def forward(leaves, query, key, value, query_docs, key_docs):
        """(output, log-sum-exp) of each row."""
        bound = jax.tree_util.tree_unflatten(tree, leaves)

        def one(q, k, v, qs, ks):
            out, (logsumexp,) = bound(q, k, v, segment_ids=splash.SegmentIds(qs, ks))
            return out, logsumexp

        return jax.vmap(one)(query, key, value, query_docs, key_docs)

    def backward(leaves, query, key, value, query_docs, key_docs, out, logsumexp, grad):
        """(dq, dk, dv) of each row from the forward's output and log-sum-exp: the dq and dkv kernels alone,
        where differentiating the kernel (`jax.vjp`) would run its forward a third time in a checkpointed
        layer (MaxText's step keeps these residuals the same way)."""
        bound = jax.tree_util.tree_unflatten(tree, leaves)
        options = bound.kwargs

        def one(q, k, v, qs, ks, o, lse, do):
            residuals = (q, k, v, splash.SegmentIds(qs, ks), None, o, lse, bound.dq_mask_info, bound.dkv_mask_info)
            grads = splash._splash_attention_bwd(
                False, options["mask_value"], options["is_mqa"], options["block_sizes"], None,
                options["mask_function"], options["attn_logits_soft_cap"], options["interpret"], residuals, do)
            return grads[3:6]

        return jax.vmap(one)(query, key, value, query_docs, key_docs, out, logsumexp, grad)

    return [np.array(leaf) for leaf in leaves], split, forward, backward  # writable copies, for torch


class _FakeSharding:
    """What `SplashAttentionKernel.manual_sharding_spec` reads of a sharding: the kernel split over the query
    sequence only (its spec), every shape divisible."""

    def __init__(self, count: int):
        import jax

        self.spec = jax.sharding.PartitionSpec(None, CONTEXT_AXIS)
        self.count = count

    def shard_shape(self, shape):
        return (shape[0], shape[1] // self.count, *shape[2:])


@torch.library.custom_op("xla_shard::context_attention", mutates_args=())
def _splash_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, docs: torch.Tensor,
               count: int) -> list[torch.Tensor]:
    """The kernel inside a manual SPMD region (XLA runs it per device as written): its output and log-sum-exp
    (for the backward). An op, not Python the tracer walks into: under `scan_layers` torch_xla traces each
    layer with AOTAutograd, and the region (and the kernel's mask data, made here) needs real XLA tensors."""
    return list(_call(False, query, key, value, docs, count))


@_splash_op.register_fake
def _(query, key, value, docs, count):
    return [torch.empty_like(query), query.new_empty(query.shape[:-1], dtype=torch.float32)]


@torch.library.custom_op("xla_shard::context_attention_backward", mutates_args=())
def _splash_backward_op(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        docs: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor,
                        count: int) -> list[torch.Tensor]:
    """Each device's gradient of the whole keys and values is its partial sum: summed over the sequence axis on
    the way out (a reduce-scatter, to the keys' split)."""
    return list(_call(True, query, key, value, docs, count, (out, logsumexp, grad)))


@_splash_backward_op.register_fake
def _(grad, query, key, value, docs, out, logsumexp, count):
    return [torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)]


def _setup_context(ctx, inputs, output):
    *tensors, ctx.count = inputs
    ctx.save_for_backward(*tensors, *output)


def _splash_grads(ctx, grads):
    # grads: the output's, and the log-sum-exp's (nothing reads it but the backward, so none)
    dq, dk, dv = torch.ops.xla_shard.context_attention_backward(grads[0], *ctx.saved_tensors, ctx.count)
    return dq, dk, dv, None, None


_splash_op.register_autograd(_splash_grads, setup_context=_setup_context)


def _call(backward: bool, query, key, value, docs, count, residuals=None):
    import torch_xla.core.xla_builder as xb

    from xla_shard import experts

    mesh = experts.spmd_mesh()[0]
    rows = tuple(axis for axis in mesh.axis_names if axis != CONTEXT_AXIS)
    leaves, split, forward, backward_rows = _kernel(query.shape[2], query.shape[1], count, experts.interpreted())
    placed = [_leaf(leaf, dim, mesh, query.device) for leaf, dim in zip(leaves, split)]
    by_tokens, whole = (rows, None, CONTEXT_AXIS, None), (rows, None, None, None)
    # keys, values and their documents gathered whole along the axis (entering the region); put back in their
    # original order inside it
    args = [experts.to_local(query, mesh, by_tokens), experts.to_local(key, mesh, whole),
            experts.to_local(value, mesh, whole), experts.to_local(docs, mesh, (rows, CONTEXT_AXIS)),
            experts.to_local(docs, mesh, (rows, None))]
    if not backward:
        out, logsumexp = xb.call_jax(_forward, (placed, *args), {"run": forward, "count": count})
        return (experts.to_global(out, mesh, by_tokens, query.shape),
                experts.to_global(logsumexp, mesh, by_tokens[:-1], query.shape[:-1]))
    out, logsumexp, grad = residuals
    local = [experts.to_local(out, mesh, by_tokens), experts.to_local(logsumexp, mesh, by_tokens[:-1]),
             experts.to_local(grad, mesh, by_tokens)]
    dq, dk, dv = xb.call_jax(_backward, (placed, *args, *local), {"run": backward_rows, "count": count})
    dq = experts.to_global(dq, mesh, by_tokens, query.shape)
    # each device's partial sums over its queries (in the balanced order again), stacked on an axis split over
    # the sequence axis, moved to the keys' own split (an all-to-all: each device gets every device's partial
    # sum of its tokens) and summed there: a reduce-scatter's bytes. Summed as stacked, XLA all-reduces the
    # whole stack and slices it (c times the bytes)
    stacked, by_block = (CONTEXT_AXIS, rows, None, None, None), (None, rows, None, CONTEXT_AXIS, None)
    dk, dv = (_laid_out(experts.to_global(g.unsqueeze(0), mesh, stacked, (count, *key.shape)), mesh, by_block).sum(0)
              for g in (dk, dv))
    return dq, dk, dv


def _original(tensor, count: int, axis: int):
    """jax's `restore`: a balanced-order axis back to the original order."""
    import jax.numpy as jnp

    order = chunk_order(count)
    pieces = jnp.split(tensor, len(order), axis=axis)
    return jnp.concatenate([pieces[order.index(i)] for i in range(len(order))], axis=axis)


def _balanced(tensor, count: int, axis: int):
    """jax's `reorder`."""
    import jax.numpy as jnp

    pieces = jnp.split(tensor, 2 * count, axis=axis)
    return jnp.concatenate([pieces[i] for i in chunk_order(count)], axis=axis)


def _forward(leaves, query, key, value, docs, key_docs, *, run, count):
    # grouped keys and values: the kernel's own
    return run(leaves, query, _original(key, count, 2), _original(value, count, 2), docs,
               _original(key_docs, count, 1))


def _backward(leaves, query, key, value, docs, key_docs, out, logsumexp, grad, *, run, count):
    dq, dk, dv = run(leaves, query, _original(key, count, 2), _original(value, count, 2), docs,
                     _original(key_docs, count, 1), out, logsumexp, grad)
    return dq, _balanced(dk, count, 2), _balanced(dv, count, 2)


def _leaf(leaf, dim, mesh, device) -> torch.Tensor:
    """A kernel's mask array on the devices, this device's part of it inside the region (split over the
    sequence axis along `dim`, or whole)."""
    from xla_shard import experts

    spec = [None] * leaf.ndim
    if dim is not None:
        spec[dim] = CONTEXT_AXIS
    return experts.to_local(torch.from_numpy(leaf).to(device), mesh, tuple(spec))


def _laid_out(tensor: torch.Tensor, mesh, spec) -> torch.Tensor:
    """A copy of `tensor` annotated with the layout XLA's partitioner is to give it."""
    import torch_xla

    copy = tensor.clone()
    torch_xla._XLAC._xla_annotate_custom_sharding(copy, mesh.get_op_sharding(spec))
    return copy
