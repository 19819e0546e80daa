"""`model.lora`: LoRA adapters injected by peft into the model before it is sharded (the `Lora` adapter).

peft's own layers do the work (`inject_adapter_in_model`): each target linear layer keeps its weight as
`<layer>.base_layer.weight`, frozen, beside trainable `<layer>.lora_A.default.weight` and `lora_B`. The model,
adapters included, is built on the meta device and sharded like any other: the frozen base is read shard by
shard from the model directory under its stored names (`stored_name`), the adapters start from peft's own
initialisation drawn from `train.seed` (the same on every process and backend), and the optimizer, which
holds state only for trainable parameters, never sees the base.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from xla_shard.methods.peft_export import ADAPTER, lora_config, quiet_moe_conversion, stored_name
from xla_shard.config.schema import LoraSection
from xla_shard.errors import ConfigError, one_line
from xla_shard.methods.adapter import Adapter
from xla_shard.quant.linear4bit import weight_count


def is_adapter(name: str) -> bool:
    """A LoRA matrix (not a module trained whole)."""
    return ".lora_" in name


def head_modules(model: nn.Module) -> list[str]:
    """The top-level modules outside the base model (a classifier head): trained whole with the adapters."""
    prefix = getattr(model, "base_model_prefix", "")
    return [name for name, child in model.named_children()
            if name != prefix and any(True for _ in child.parameters())]


def inject(model: nn.Module, section: LoraSection, task: str, seed: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Adapters into `model` in place, everything else frozen. Returns the adapters' initial values by
    parameter name (computed on the host from `seed`; the adapters themselves are left on the meta device when
    the base is, to be filled after sharding) and the modules trained whole."""
    config, modules_to_save = _adapt(model, section, task)
    values = _initial_values(model, config, seed)
    if section.base_dtype != "float32":
        dtype = getattr(torch, section.base_dtype)
        for param in model.parameters():
            if not param.requires_grad:
                param.data = param.data.to(dtype)  # the same Parameter: tied weights stay tied
    return values, modules_to_save


def _adapt(model: nn.Module, section: LoraSection, task: str):
    """peft's adapters put into `model`, still on the meta device (nothing allocated); (its LoraConfig, the
    modules trained whole)."""
    from peft import inject_adapter_in_model

    _check_targets(model, section)
    modules_to_save = list(section.modules_to_save)
    if task == "sequence_classification":
        modules_to_save += [m for m in head_modules(model) if m not in modules_to_save]
    config = lora_config(section, modules_to_save)
    try:
        with quiet_moe_conversion():
            inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    except (ValueError, TypeError) as exc:
        raise _refusal(model, section, exc) from None
    _check_ranks(model, section)
    return config, modules_to_save


def _refusal(model: nn.Module, section: LoraSection, exc: Exception) -> ConfigError:
    """peft's refusal as one line naming the key to change. peft adapts transformers 5's fused MoE experts as
    parameters (all-linear includes them), and its parameter adapters take neither DoRA nor dropout."""
    said = one_line(exc)
    if "ParamWrapper" in said and ("use_dora" in said or "lora_dropout" in said):
        key, what = ("model.lora.use_dora", "DoRA") if "use_dora" in said else ("model.lora.dropout", "dropout")
        return ConfigError(key, f"peft adapts the fused MoE experts of {type(model).__name__} as parameters "
                                f"(target_modules {section.target_modules} reaches them), and its parameter adapters "
                                f"do not support {what}: list the layers to adapt in model.lora.target_modules "
                                "without the experts (such as [q_proj, k_proj, v_proj, o_proj]), or turn it off")
    return ConfigError("model.lora.target_modules", f"peft cannot adapt {type(model).__name__}: {said[:300]}")


def trained_parameters(model: nn.Module, section: LoraSection, task: str) -> int:
    """How many parameters a LoRA run of `model` trains (the adapters, and the modules trained whole), counted
    by adapting it (in place) without allocating anything."""
    _adapt(model, section, task)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _named_by(name: str, targets: list[str]) -> bool:
    """peft's rule for a list of module names: the whole name, or its last dotted parts."""
    return any(name == t or name.endswith(f".{t}") for t in targets)


def _check_targets(model: nn.Module, section: LoraSection) -> None:
    """What peft would do silently or crash on, refused before anything is allocated: a module to train whole
    that names no module, and the output head when it shares its weight with the input embedding."""
    names = [name for name, _ in model.named_modules() if name]
    for wanted in section.modules_to_save:
        if not _named_by(wanted, names):
            raise ConfigError("model.lora.modules_to_save", f"{wanted!r} names no module of {type(model).__name__}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is None or embedding is None or head.weight is not embedding.weight:
        return
    for name, module in model.named_modules():
        if module is not head:
            continue
        if section.target_modules != "all-linear" and _named_by(name, section.target_modules):
            raise ConfigError("model.lora.target_modules", f"{name} shares its weight with the input embedding "
                                                           "(tie_word_embeddings): peft cannot adapt a tied head; "
                                                           "leave it out, or untie it with model.overrides: "
                                                           "{tie_word_embeddings: false}")
        if _named_by(name, section.modules_to_save):
            raise ConfigError("model.lora.modules_to_save", f"{name} shares its weight with the input embedding "
                                                            "(tie_word_embeddings): it cannot be trained apart from it")


def _check_ranks(model: nn.Module, section: LoraSection) -> None:
    """A rank above every adapted layer's smaller side, refused while the adapters are still empty (peft made them
    on the meta device): it is a mistake (a rank of 10**9 would be allocated as asked). A rank above some layers'
    smaller side only is peft's to take, as it does: all-linear reaches narrow layers (Qwen2-MoE's shared-expert
    gate has one output) beside wide ones."""
    from peft.tuners.lora import LoraLayer

    sides = {name: min(layer.in_features, layer.out_features) for name, layer in model.named_modules()
             if isinstance(layer, LoraLayer)}
    widest = max(sides, key=sides.get, default=None)
    if widest is not None and section.r > sides[widest]:
        raise ConfigError("model.lora.r", f"{section.r} is above the smaller side of every adapted layer (at most "
                                          f"{sides[widest]}, {widest}): a LoRA rank is at most {sides[widest]} here")


def trained_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that hold trained parameters (each adapter matrix, each module trained whole), for backends
    that must shard them apart from the frozen weights around them (FSDP2 wants one dtype per unit)."""
    return [module for name, module in model.named_modules()
            if name.endswith(f".{ADAPTER}") and any(p.requires_grad for p in module.parameters())]


def materialize(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Give a model built for real (random init) its adapters' initial values."""
    for name, value in values.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        setattr(module, leaf, nn.Parameter(value.clone(), requires_grad=True))


def _initial_values(model: nn.Module, config, seed: int) -> dict[str, torch.Tensor]:
    """peft's initialisation of each adapter (`reset_lora_parameters`: kaiming-uniform A, zero B), layer after
    layer in module order from `seed`, on the host; the adapters are put back on the device they were on."""
    from peft.tuners.lora import LoraLayer

    rng = torch.get_rng_state()
    torch.manual_seed(seed)
    values: dict[str, torch.Tensor] = {}
    try:
        for name, layer in model.named_modules():
            if not isinstance(layer, LoraLayer):
                continue
            adapters = [getattr(layer, attr) for attr in layer.adapter_layer_names if ADAPTER in getattr(layer, attr)]
            if any(isinstance(container, nn.ParameterDict) for container in adapters):
                raise ConfigError("model.lora.target_modules", f"{name} is an embedding; xla_shard adapts linear "
                                                               "layers (name those, or all-linear)")
            device = next(p.device for c in adapters for p in c[ADAPTER].parameters()) if adapters else None
            for container in adapters:
                container[ADAPTER].to_empty(device="cpu")
            layer.reset_lora_parameters(ADAPTER, config.init_lora_weights)
            for param_name, param in layer.named_parameters(prefix=name):
                if is_adapter(param_name):
                    values[param_name] = param.detach().clone()
            for container in adapters:
                container[ADAPTER].to(device)
    finally:
        torch.set_rng_state(rng)
    return values


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The base model's forward: every peft layer of `model` (wrapped or sharded, its modules are still peft's)
    skips its adapters. peft's own `disable_adapter` also sets the adapters' requires_grad, which sharded
    parameters must keep; the flag alone is what the forward reads."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def describe(model: nn.Module, section: LoraSection) -> str:
    """What is trained, for the log: the adapters' rank and targets, and the share of parameters trained."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total, four_bit = weight_count(model)
    whole = sorted({name.split(".modules_to_save")[0] for name, _ in model.named_parameters()
                    if ".modules_to_save." in name})
    targets = section.target_modules if isinstance(section.target_modules, str) else ", ".join(section.target_modules)
    return (f"rank {section.r} adapters on {targets}" + (f", {', '.join(whole)} trained whole" if whole else "")
            + f"; {trained:,} of {total:,} parameters trained ({100 * trained / total:.2f}%), the rest frozen"
            + (f" ({four_bit:,} of them in 4 bits: model.quantization)" if four_bit else ""))


class Lora(Adapter):
    """peft's LoRA over a frozen base (`model.lora`): what this module does, as the adapter the house asks."""

    freezes_base = True
    switches_off = True
    added = "LoRA matrices initialised from train.seed"

    def __init__(self, section: LoraSection):
        self.section = section

    def inject(self, model: nn.Module, task: str, seed: int) -> dict[str, torch.Tensor]:
        return inject(model, self.section, task, seed)[0]

    def materialize(self, model: nn.Module, values: dict[str, torch.Tensor]) -> None:
        materialize(model, values)

    def switched_off(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return adapters_off(model)

    def stored_name(self, name: str) -> str:
        return stored_name(name)

    def is_added(self, name: str) -> bool:
        return is_adapter(name)

    def describe(self, model: nn.Module) -> str:
        return f"model.lora: {describe(model, self.section)}"

    def trained_modules(self, model: nn.Module) -> list[nn.Module]:
        return trained_modules(model)

    def trained_parameters(self, model: nn.Module, task: str) -> int:
        return trained_parameters(model, self.section, task)

    @property
    def frozen_bytes(self) -> int:
        return 2 if self.section.base_dtype == "bfloat16" else 4
