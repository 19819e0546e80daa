"""`fsdp.scan_layers`: run a model's stack of identical decoder layers as one XLA loop (torch_xla's `scan`).

Unrolled, XLA compiles every layer's forward and backward again; scanned, it compiles one layer's body once.
What stays per parameter outside the loop (stacking the parameters, the optimizer's update) still grows with
depth: measured in the README. The layers stay separate modules with their own parameters (so state dicts,
checkpoints and exports are unchanged): only iterating the stack, as the model's forward does
(`for layer in self.layers[:n]`), yields one callable that stacks their parameters and scans over them.

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

from xla_shard.backends.xla_common import absl_quiet
from xla_shard.config.schema import FsdpSection
from xla_shard.errors import ConfigError
from xla_shard.wrap import layer_classes

KEY = "fsdp.scan_layers"
_PER_LAYER = {"layer_idx"}  # attributes that differ between otherwise identical layers and only index a cache


def recompute_all(joint, inputs, **kwargs):
    """Activation checkpointing for a scanned layer: AOTAutograd's min-cut partitioner with no activation
    memory budget saves only what it cannot recompute (the layer's inputs), like checkpointing each layer."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._functorch import config

    with config.patch(activation_memory_budget=0.0):
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)


def check_available() -> None:
    try:
        with absl_quiet():
            import jax  # noqa: F401
            import torchax  # noqa: F401
    except ImportError as exc:
        raise ConfigError(KEY, f"torch_xla's scan needs jax and flax under SPMD ({exc.name} is not installed): "
                               "pip install 'xla_shard[scan]', or set it to false") from None


def scan_stack(model: nn.Module, fsdp: FsdpSection, checkpoint: bool) -> int:
    """Replace the model's decoder stack by a `ScannedLayers` holding the same modules; the layer count.
    Refuses a model whose layers are not one repeated layer."""
    classes = layer_classes(model, fsdp.transformer_layer_cls_to_wrap)
    stacks = [(name, m) for name, m in model.named_modules()
              if isinstance(m, nn.ModuleList) and len(m) > 1 and all(isinstance(c, classes) for c in m)]
    if len(stacks) != 1:
        found = ", ".join(name for name, _ in stacks) or "none"
        raise ConfigError(KEY, f"{type(model).__name__} needs exactly one list of its {classes[0].__name__} layers to "
                               f"scan (found: {found}); set it to false")
    name, stack = stacks[0]
    difference = _first_difference(list(stack))
    if difference:
        raise ConfigError(KEY, f"the layers of {type(model).__name__}.{name} are not one repeated layer "
                               f"({difference}): scan runs one layer's program for all; set it to false")
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, ScannedLayers(list(stack), recompute_all if checkpoint else None))
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


class ScannedLayers(nn.ModuleList):
    """The decoder layers, unchanged as modules; iterated, one callable that runs them all in one scan."""

    def __init__(self, layers: list[nn.Module], partition_fn: Callable | None):
        super().__init__(layers)
        self._partition_fn = partition_fn
        # Shared with slices of this list. scan caches its trace by function, so one body per call structure;
        # the template layer (on the meta device) is what each body calls with a layer's parameters.
        self._cache: dict[str, Any] = {"bodies": {}, "template": None}

    def __getitem__(self, index):
        if isinstance(index, slice):  # the model's `self.layers[:num_hidden_layers]`
            chosen = ScannedLayers(list(self._modules.values())[index], self._partition_fn)
            chosen._cache = self._cache
            chosen.train(self.training)
            return chosen
        return super().__getitem__(index)

    def __iter__(self):
        return iter([_AllLayers(self)])

    def _run(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        from functorch.compile import default_partition
        from torch_xla.experimental.scan import scan

        layers = list(self._modules.values())
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensor_at = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        statics = tuple(None if i in tensor_at else leaf for i, leaf in enumerate(leaves))
        body = self._body(spec, tensor_at, statics)
        stacked = pytree.tree_map(lambda *ts: torch.stack(ts), *[_tensors(layer) for layer in layers])
        # Inputs every layer shares (mask, rotary tables, positions) ride along each layer's slice: scan traces
        # its carry with gradients, which integer tensors cannot have.
        shared = [leaves[i].unsqueeze(0).expand(len(layers), *leaves[i].shape) for i in tensor_at]
        out, _ = scan(body, hidden_states, (stacked, shared), partition_fn=self._partition_fn or default_partition,
                      is_fn_pure=True)
        return out

    def _body(self, spec, tensor_at: tuple[int, ...], statics: tuple) -> Callable:
        key = (str(spec), tensor_at, repr(statics), self.training)
        bodies = self._cache["bodies"]
        if key not in bodies:
            if self._cache["template"] is None:
                self._cache["template"] = copy.deepcopy(next(iter(self._modules.values()))).to("meta")
            template = self._cache["template"]
            training = self.training

            def body(hidden, per_layer):
                params, shared = per_layer
                leaves = list(statics)
                for index, tensor in zip(tensor_at, shared):
                    leaves[index] = tensor
                args, kwargs = pytree.tree_unflatten(leaves, spec)
                template.train(training)
                out = torch.func.functional_call(template, params, (hidden, *args), kwargs, strict=True)
                return (out[0] if isinstance(out, tuple) else out), None

            bodies[key] = body
        return bodies[key]


class _AllLayers:
    """What the model's loop gets for its one iteration: called like a layer, it runs them all; attributes the
    loop reads (e.g. `layer.attention_type`, to pick a mask) are the first layer's, the same in every layer."""

    def __init__(self, stack: ScannedLayers):
        self._stack = stack

    def __call__(self, hidden_states, *args, **kwargs):
        return self._stack._run(hidden_states, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._stack[0], name)


def _tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(layer.named_parameters()), **dict(layer.named_buffers())}
