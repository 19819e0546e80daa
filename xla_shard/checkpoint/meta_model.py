"""The model a checkpoint's `hf_config` describes, built on the meta device (nothing allocated): what an export
asks transformers about, such as which layers are Conv1D or how `save_pretrained` names MoE experts."""

from __future__ import annotations

from typing import Any

from xla_shard.checkpoint.manifest import CheckpointError
from xla_shard.errors import one_line


def build(hf_config: dict[str, Any]):
    """The transformers model of `hf_config` (a classifier where its architectures say so, else a causal LM).
    A manifest is untrusted input: a config transformers cannot build is one line."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    fields = {k: v for k, v in hf_config.items() if k not in ("auto_map", "model_type")}
    try:
        config = AutoConfig.for_model(hf_config["model_type"], **fields)
        auto = AutoModelForSequenceClassification if any("SequenceClassification" in a for a in
                                                         config.architectures or []) else AutoModelForCausalLM
        with torch.device("meta"):
            return auto.from_config(config)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"the manifest's hf_config does not build a transformers model: "
                              f"{type(exc).__name__}: {one_line(exc)[:200]}") from None
