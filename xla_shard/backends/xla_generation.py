"""The layout xla_spmd generates in: the weights laid out once a generation, then every token runs on them.

Training's layout splits each weight over the devices (FSDP), so a token's forward in it gathers every weight
(the whole model, once a token). A generation instead copies the weights into an inference layout in one
program, samples every token on the copies, and drops them (training's weights are untouched meanwhile):

- split 1: every weight whole on every device; each device samples its own rows, and a token runs no
  collective at all.
- split t > 1: a mesh of (devices / t) x t, rows over the first axis, each MLP split over the second as tensor
  parallelism splits it (Megatron's column and row parallel: the projections into the MLP split their outputs,
  the one out of it its input), so a token's collectives are one all-reduce of a layer's MLP output. The
  attention, the embedding and the output head stay whole: split by heads, XLA's partitioner gathered the heads
  of the queries and of the cached keys and values back every token (measured on the CPU client: 3 all-gathers
  a layer, the whole cache among them), more than the weights it saves.

Which linears are an MLP's is read from their names (transformers' and the usual ones); a linear no name places
stays whole. Any layout computes the same values (XLA's partitioner keeps the program's meaning): the names
decide only which collectives run.
"""

from __future__ import annotations

import torch
from torch import nn

from xla_shard.tensor_parallel import mlp_role


def split_spec(name: str, module: nn.Module, param_name: str, param: torch.Tensor, whole: set[int],
               axis: str) -> tuple:
    """The partition spec of `module`'s parameter `param_name` (the module named `name`) split over `axis`:
    a column or row split for an MLP linear's weight (and a column's bias: `tensor_parallel`), else whole."""
    role = None if id(param) in whole else mlp_role(name, module)
    if role is None:
        return (None,) * param.dim()
    if param_name == "weight":
        return (None, axis) if role == "row" else (axis, None)
    return (None,) if role == "row" else (axis,)


def kept_whole(model: nn.Module) -> set[int]:
    """The parameters a split layout keeps whole whatever their name: the embedding's and the output head's (a
    split vocabulary would gather the logits every token for the draw)."""
    kept = set()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, get)() if hasattr(model, get) else None
        kept |= {id(p) for p in module.parameters()} if module is not None else set()
    return kept
