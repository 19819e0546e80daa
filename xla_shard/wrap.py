"""Which submodules get their own FSDP unit, decided once for every backend.

Backends receive a list of module objects; they never re-implement a policy, so `auto-wrap picks the same
modules` holds across FSDPv1, FSDPv2 and FSDP2 by construction.
"""

from __future__ import annotations

import torch
from torch import nn

from xla_shard.config.schema import FsdpSection, WrapPolicy
from xla_shard.errors import ConfigError


def layer_classes(model: nn.Module, names: list[str]) -> tuple[type[nn.Module], ...]:
    """Resolve class names against the model's own modules. Empty means the model's `_no_split_modules`, or,
    where it declares none, the blocks of its repeated layer list (`repeated_blocks`)."""
    wanted = list(names) or sorted(getattr(model, "_no_split_modules", None) or [])
    if not wanted:
        found = repeated_blocks(model)
        if found is None:
            raise ConfigError("fsdp.transformer_layer_cls_to_wrap",
                              f"{type(model).__name__} declares no _no_split_modules and holds no list of repeated "
                              "blocks; name the layer class to wrap")
        return found[1]
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [name for name in wanted if name not in present]
    if missing:
        candidates = sorted(n for n in present if "layer" in n.lower() or "block" in n.lower()) or sorted(present)
        raise ConfigError("fsdp.transformer_layer_cls_to_wrap",
                          f"no module of {type(model).__name__} is a {missing[0]!r}; "
                          f"layer-like classes in this model: {', '.join(candidates)}")
    return tuple(present[name] for name in wanted)


def repeated_blocks(model: nn.Module) -> tuple[str, tuple[type[nn.Module], ...]] | None:
    """(name, entry classes) of the model's largest `nn.ModuleList` (by parameters) of two or more entries: its
    layer stack, for models that do not declare `_no_split_modules` (ELECTRA, DistilBERT). None if it has none."""
    lists = [(sum(p.numel() for p in m.parameters()), name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        return None
    _, name, stack = max(lists, key=lambda entry: entry[0])
    return name, tuple(dict.fromkeys(type(block) for block in stack))


def inferred_layers(model: nn.Module, fsdp: FsdpSection) -> str | None:
    """What the log says when the layer classes were found from the model's structure, not named by it."""
    uses_layers = (fsdp.auto_wrap_policy is WrapPolicy.TRANSFORMER_BASED_WRAP or fsdp.activation_checkpointing
                   or fsdp.scan_layers)
    if not uses_layers or fsdp.transformer_layer_cls_to_wrap or getattr(model, "_no_split_modules", None):
        return None
    found = repeated_blocks(model)
    if found is None:
        return None
    name, classes = found
    return (f"{type(model).__name__} declares no _no_split_modules: its layers are the "
            f"{'/'.join(c.__name__ for c in classes)} blocks of {name} ({len(model.get_submodule(name))}); "
            "fsdp.transformer_layer_cls_to_wrap names others")


def wrap_targets(model: nn.Module, fsdp: FsdpSection) -> list[nn.Module]:
    """Modules to shard as their own unit, children before parents (the root is never listed)."""
    if fsdp.auto_wrap_policy is WrapPolicy.NO_WRAP:
        return []
    if fsdp.auto_wrap_policy is WrapPolicy.TRANSFORMER_BASED_WRAP:
        classes = layer_classes(model, fsdp.transformer_layer_cls_to_wrap)
        return [m for m in _post_order(model) if m is not model and isinstance(m, classes)]
    targets: list[nn.Module] = []
    _size_based(model, model, fsdp.min_num_params, targets)
    return targets


def checkpoint_targets(model: nn.Module, fsdp: FsdpSection) -> list[nn.Module]:
    """Activation checkpointing wraps whole transformer layers, whatever the wrap policy."""
    names = fsdp.transformer_layer_cls_to_wrap if fsdp.auto_wrap_policy is WrapPolicy.TRANSFORMER_BASED_WRAP else []
    classes = layer_classes(model, names)
    return [m for m in model.modules() if isinstance(m, classes)]


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


def _size_based(root: nn.Module, module: nn.Module, min_params: int, out: list[nn.Module]) -> int:
    """torch's size_based_auto_wrap_policy: wrap a module once the parameters not yet wrapped below it
    reach `min_params`. Returns the count still unwrapped."""
    unwrapped = sum(p.numel() for p in module.parameters(recurse=False))
    for child in module.children():
        unwrapped += _size_based(root, child, min_params, out)
    if module is not root and unwrapped >= min_params:
        out.append(module)
        return 0
    return unwrapped


def scanned_stacks(model: nn.Module, fsdp: FsdpSection) -> list[tuple[str, nn.ModuleList]]:
    """The lists of two or more layers of the wrapped classes: what fsdp.scan_layers scans (it needs one)."""
    classes = layer_classes(model, fsdp.transformer_layer_cls_to_wrap)
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and len(m) > 1 and all(isinstance(c, classes) for c in m)]


def check_scannable(model: nn.Module, fsdp: FsdpSection) -> None:
    """What `config check` can tell of fsdp.scan_layers on the meta device: the layer it would scan runs no
    dropout (`refuse_dropout`). A model with no single stack is refused by the scan itself, naming what it found."""
    stacks = scanned_stacks(model, fsdp)
    if len(stacks) == 1:
        refuse_dropout(model, stacks[0][1][0])


def refuse_dropout(model: nn.Module, layer: nn.Module) -> None:
    """torch_xla's scan cannot carry dropout inside a scanned layer through its backward (it writes a float into
    the boolean mask dropout keeps: "PRED vs F32" at step 1): refused, naming the model's dropout settings that
    turn it off."""
    active = [f"{name or type(layer).__name__} ({module.p:g})" for name, module in layer.named_modules()
              if isinstance(module, nn.Dropout) and module.p > 0]
    active += [f"{name}.{key} ({value:g})" if name else f"{key} ({value:g})" for name, module in layer.named_modules()
               for key, value in vars(module).items()
               if "dropout" in key and isinstance(value, float) and value > 0]
    if active:
        settings = getattr(model, "config", None)
        keys = [k for k, v in (settings.to_dict() if settings is not None else {}).items()
                if "drop" in k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]
        raise ConfigError("fsdp.scan_layers", f"{type(layer).__name__} runs dropout ({', '.join(active[:3])}), which "
                                              "torch_xla's scan cannot carry through its backward: set it to false, or "
                                              "the dropout to 0 with model.overrides"
                                              + (f" ({', '.join(f'{k}: 0' for k in keys)})" if keys else ""))


def cast_activations(model: nn.Module, fsdp: FsdpSection, dtype: torch.dtype = torch.bfloat16) -> None:
    """`fsdp.activation_dtype: bfloat16`: the input embedding's output and every decoder layer's output leave in
    `dtype`, so the residual stream between layers (and what activation checkpointing keeps of it) is bf16.
    Under autocast the embedding (a lookup) and the residual adds are not autocast ops: its stream stays fp32.
    Inside a layer nothing changes (matmuls in bf16 under autocast or FSDP's cast parameters; norms, softmax and
    the loss as the model computes them). Forward hooks, so they hold whatever wraps the module's forward
    (activation checkpointing, FSDP)."""
    def cast(module, args, output):
        if isinstance(output, torch.Tensor):
            return output.to(dtype) if output.is_floating_point() else output
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (output[0].to(dtype), *output[1:])
        return output

    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is not None:
        embedding.register_forward_hook(cast)
    for layer in checkpoint_targets(model, fsdp):
        layer.register_forward_hook(cast)
