"""The transformers config a checkpoint records (and an export writes as config.json): the model as trained,
but with the settings a user of the trained model expects back."""

from __future__ import annotations

from typing import Any

from torch import nn

_USE_CACHE = "_xla_shard_use_cache"  # the model's own use_cache, kept on the model while training has it off


def train_without_cache(model: nn.Module) -> None:
    """Training never reads a KV cache: turn it off, remembering the value the model came with for exports."""
    setattr(model, _USE_CACHE, getattr(model.config, "use_cache", None))
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False


def inference_config(model: nn.Module) -> dict[str, Any]:
    """The model's config as its `config.json` should say for users of the trained model: as trained, with the
    KV-cache setting the model came with."""
    fields = model.config.to_dict()
    use_cache = getattr(model, _USE_CACHE, None)
    if use_cache is not None:
        fields["use_cache"] = use_cache
    return fields


def hf_config(model: nn.Module) -> dict[str, Any] | None:
    """The transformers config of a (possibly wrapped) model, as its `config.json` would hold it; None for a
    model that is not a transformers model."""
    from transformers import PreTrainedModel

    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if inner is None:
        return None
    # FSDP2 swaps in a subclass it makes on the fly (FSDPLlamaForCausalLM): name the model's own class.
    cls = next(c for c in type(inner).__mro__
               if issubclass(c, PreTrainedModel) and not c.__module__.startswith("torch."))
    return {**inference_config(inner), "architectures": [cls.__name__]}
