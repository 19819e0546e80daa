"""`fsdp.scan_layers`: run a model's stack of identical decoder layers as one XLA loop (torch_xla's `scan`).

Unrolled, XLA compiles every layer's forward and backward again; scanned, it compiles one layer's body once.
The layers' parameters are kept stacked as [layers, ...] tensors (as MaxText and torchprime keep them), so what
stays per parameter outside the loop (the optimizer's update, the gradient annotations) does not grow with depth
either. Checkpoints, exports and pretrained loads still name one tensor per layer: the backend's state hands a
stacked tensor out as its layers (`checkpoint.contract.unstack`).

Under SPMD torch_xla's scan shards its backward with jax's `shard_alike`, through the torchax copy inside
torch_xla's wheel, which needs jax and flax (`pip install 'xla_shard[scan]'`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from xla_shard.config.schema import FsdpSection
from xla_shard.errors import ConfigError
from xla_shard.wrap import layer_classes, refuse_dropout, scanned_stacks

KEY = "fsdp.scan_layers"
_PER_LAYER = {"layer_idx"}  # attributes that differ between otherwise identical layers and only index a cache


def recompute_all(joint, inputs, **kwargs):
    """Activation checkpointing for a scanned layer: AOTAutograd's min-cut partitioner with no activation
    memory budget saves only what it cannot recompute (the layer's inputs), like checkpointing each layer."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._functorch import config

    with config.patch(activation_memory_budget=0.0):
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)


def scan_stack(model: nn.Module, fsdp: FsdpSection, checkpoint: bool) -> int:
    """Replace the model's decoder stack by a `ScannedLayers` holding the same modules; the layer count.
    Refuses a model whose layers are not one repeated layer."""
    stacks = scanned_stacks(model, fsdp)
    if len(stacks) != 1:
        found = ", ".join(name for name, _ in stacks) or "none"
        classes = layer_classes(model, fsdp.transformer_layer_cls_to_wrap)
        raise ConfigError(KEY, f"{type(model).__name__} needs exactly one list of its {classes[0].__name__} layers to "
                               f"scan (found: {found}); set it to false")
    name, stack = stacks[0]
    refuse_dropout(model, stack[0])
    difference = _first_difference(list(stack))
    if difference:
        raise ConfigError(KEY, f"the layers of {type(model).__name__}.{name} are not one repeated layer "
                               f"({difference}): scan runs one layer's program for all; set it to false")
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    rotary = getattr(parent, "rotary_emb", None)
    setattr(parent, attr, ScannedLayers(list(stack), recompute_all if checkpoint else None,
                                        rotary if isinstance(rotary, nn.Module) else None))
    return len(stack)


def _first_difference(layers: list[nn.Module]) -> str | None:
    """How a layer differs from the first (class, parameter or buffer shapes, plain attributes such as an
    attention type or sliding window), or None."""
    first = _signature(layers[0])
    for index, layer in enumerate(layers[1:], start=1):
        other = _signature(layer)
        for key in sorted(first.keys() | other.keys(), key=lambda k: (k.count("."), k)):
            if first.get(key) != other.get(key):
                return f"layer {index} {key}: {other.get(key)!r}, layer 0: {first.get(key)!r}"
    return None


def _signature(layer: nn.Module) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for prefix, module in layer.named_modules():
        where = f"{prefix}." if prefix else ""
        found[f"{where}class"] = type(module).__name__
        for key, value in vars(module).items():
            plain = isinstance(value, (bool, int, float, str, type(None)))
            if key not in _PER_LAYER and not key.startswith("_") and plain:
                found[where + key] = value
    found.update({f"{n} shape": tuple(p.shape) for n, p in layer.named_parameters()})
    found.update({f"{n} shape": tuple(b.shape) for n, b in layer.named_buffers()})
    return found


class ScannedLayers(nn.Module):
    """The decoder layers kept as one stack: each of the layer's parameters and buffers is one [layers, ...]
    tensor, under the layer's own module path (`model.layers.self_attn.q_proj.weight`, for every
    `model.layers.<i>.self_attn.q_proj.weight`). Iterated, as the model's forward does, it yields one callable
    that scans a meta-device copy of the layer over the stack.

    Stacked storage is what keeps the compiled program's size flat in depth: scanning separate layers would
    stack their parameters in every step, and the optimizer would update each layer's tensors apart.
    Checkpoints and pretrained loads still see one tensor per layer (`layer_names`)."""

    def __init__(self, layers: list[nn.Module], partition_fn: Callable | None, rotary: nn.Module | None = None):
        super().__init__()
        self._count = len(layers)
        self._partition_fn = partition_fn
        # The model's rotary embedding (its `rotary_emb`, beside the layers): the rotary tables are computed
        # inside each layer from the positions, as MaxText does, not stacked per layer as scan inputs.
        self._rotary = [rotary] if rotary is not None else []  # in a list: the model holds it, not the stack
        # {stacked tensor's name: what one layer's slice becomes before the layer uses it}: a backend's layout
        # hint (XLA SPMD: gathered whole, its gradient reduce-scattered), none by default.
        self.in_layer: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        # scan caches its trace by function: one body per call structure, each calling the template.
        self._bodies: dict[tuple, Callable] = {}
        self._template = [copy.deepcopy(layers[0]).to("meta")]  # in a list: not a submodule, holds nothing
        owners = [dict(layer.named_modules()) for layer in layers]
        for path, module in layers[0].named_modules():
            holder = self._holder(path)
            for key, param in module.named_parameters(recurse=False):
                values = torch.stack([getattr(owner[path], key).detach() for owner in owners])
                holder.register_parameter(key, nn.Parameter(values, requires_grad=param.requires_grad))
            for key, _ in module.named_buffers(recurse=False):
                persistent = key not in module._non_persistent_buffers_set
                holder.register_buffer(key, torch.stack([getattr(owner[path], key) for owner in owners]),
                                       persistent=persistent)

    def _holder(self, path: str) -> nn.Module:
        holder = self
        for part in filter(None, path.split(".")):
            if part not in holder._modules:
                holder.add_module(part, nn.Module())
            holder = holder._modules[part]
        return holder

    def layer_names(self, prefix: str) -> dict[str, list[str]]:
        """Each stacked tensor's name (under `prefix`, this module's name) -> the names of its layers' tensors."""
        names = [name for name, _ in self.named_parameters()] + [name for name, _ in self.named_buffers()]
        return {f"{prefix}.{name}": [f"{prefix}.{i}.{name}" for i in range(self._count)] for name in names}

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):  # the model's `self.layers[:num_hidden_layers]`
            return [_AllLayers(self, range(self._count)[index])]
        return _OneLayer(self._template[0], index)

    def __iter__(self):
        return iter([_AllLayers(self, range(self._count))])

    def run(self, chosen: range, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        from functorch.compile import default_partition
        from torch_xla.experimental.scan import scan

        if len(chosen) == 0:
            return hidden_states
        rotary = self._rotary_inside(kwargs)
        if rotary is not None:
            kwargs = {**kwargs, "position_embeddings": None}
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensor_at = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        statics = tuple(None if i in tensor_at else leaf for i, leaf in enumerate(leaves))
        body = self._body(spec, tensor_at, statics, rotary)
        every = chosen == range(self._count)
        stacked = {name: tensor if every else tensor[chosen.start:chosen.stop:chosen.step]
                   for name, tensor in [*self.named_parameters(), *self.named_buffers()]}

        def per_layer(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.unsqueeze(0).expand(len(chosen), *tensor.shape)

        # Inputs every layer shares (mask, positions) ride along each layer's slice: scan traces its carry with
        # gradients, which integer tensors cannot have. So do the rotary module's buffers, small.
        shared = [per_layer(leaves[i]) for i in tensor_at]
        buffers = {name: per_layer(b) for name, b in rotary.named_buffers()} if rotary is not None else {}
        out, _ = scan(body, hidden_states, (stacked, shared, buffers),
                      partition_fn=self._partition_fn or default_partition, is_fn_pure=True)
        return out

    def _rotary_inside(self, kwargs: dict) -> nn.Module | None:
        """The rotary module, where the layers get (cos, sin) from it and their positions: those tables (fp32
        or the stream's dtype, [batch, tokens, head_dim] each) are then computed in the layer, not stacked once
        per layer. None where the model passes something else."""
        tables, positions = kwargs.get("position_embeddings"), kwargs.get("position_ids")
        if not self._rotary or not isinstance(positions, torch.Tensor) or not (
                isinstance(tables, tuple) and len(tables) == 2 and all(isinstance(t, torch.Tensor) for t in tables)):
            return None
        return self._rotary[0]

    def _body(self, spec, tensor_at: tuple[int, ...], statics: tuple, rotary: nn.Module | None) -> Callable:
        key = (str(spec), tensor_at, repr(statics), self.training, rotary is not None)
        if key not in self._bodies:
            template, training, in_layer = self._template[0], self.training, dict(self.in_layer)

            def body(hidden, per_layer):
                tensors, shared, buffers = per_layer
                tensors = {name: in_layer[name](t) if name in in_layer else t for name, t in tensors.items()}
                leaves = list(statics)
                for index, tensor in zip(tensor_at, shared):
                    leaves[index] = tensor
                args, kwargs = pytree.tree_unflatten(leaves, spec)
                if rotary is not None:
                    kwargs["position_embeddings"] = torch.func.functional_call(
                        rotary, buffers, (hidden, kwargs["position_ids"]), strict=True)
                template.train(training)
                out = torch.func.functional_call(template, tensors, (hidden, *args), kwargs, strict=True)
                out = out[0] if isinstance(out, tuple) else out
                return out.to(hidden.dtype), None  # the carry keeps its dtype (bf16 activations: the stream's)

            self._bodies[key] = body
        return self._bodies[key]


class _AllLayers:
    """What the model's loop gets for its one iteration: called like a layer, it runs them all; attributes the
    loop reads (e.g. `layer.attention_type`, to pick a mask) are the layer's, the same in every layer."""

    def __init__(self, stack: ScannedLayers, chosen: range):
        self._stack, self._chosen = stack, chosen

    def __call__(self, hidden_states, *args, **kwargs):
        return self._stack.run(self._chosen, hidden_states, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._stack._template[0], name)


class _OneLayer:
    """`layers[i]` of a scanned stack: the layer's attributes can be read; it cannot run on its own."""

    def __init__(self, template: nn.Module, index: int):
        self._template, self._index = template, index

    def __call__(self, *args, **kwargs):
        raise TypeError(f"fsdp.scan_layers keeps the layers stacked: layer {self._index} cannot run alone "
                        "(iterate the stack, or set fsdp.scan_layers to false)")

    def __getattr__(self, name: str):
        return getattr(self._template, name)


def layer_names(model: nn.Module, canonical: Callable[[str], str]) -> dict[str, list[str]]:
    """Every stacked tensor of `model` (by its canonical name) -> the unstacked model's name for each layer."""
    names: dict[str, list[str]] = {}
    for path, module in model.named_modules():
        if isinstance(module, ScannedLayers):
            names.update(module.layer_names(canonical(path)))
    return names


def stacked_parameters(model: nn.Module) -> set[nn.Parameter]:
    return {param for module in model.modules() if isinstance(module, ScannedLayers) for param in module.parameters()}
