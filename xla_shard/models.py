"""Build a transformers causal LM from a config, with random weights (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from xla_shard.config.schema import ModelSection
from xla_shard.errors import ConfigError

# Small enough to train on a 2-core CPU; shapes chosen to shard evenly over 1, 2, 4 and 8 devices.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, tie_word_embeddings=False),
    "small-llama": dict(model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=688,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                        max_position_embeddings=1024, tie_word_embeddings=False),
    "tiny-gpt2": dict(model_type="gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                      bos_token_id=0, eos_token_id=0),
    # The FSDP guide's example wraps BertLayer; a BERT causal LM lets that config run unchanged.
    "tiny-bert": dict(model_type="bert", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512, is_decoder=True),
}


def model_config(section: ModelSection) -> PretrainedConfig:
    if section.name in PRESETS:
        fields = dict(PRESETS[section.name])
    else:
        path = Path(section.name)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError("model.name", f"{section.name!r} is neither a preset ({', '.join(PRESETS)}) "
                                            "nor a local transformers config.json")
        try:
            fields = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError("model.name", f"{path} is not valid JSON: {exc}") from None
        if "model_type" not in fields:
            raise ConfigError("model.name", f"{path} has no model_type")
    fields.update(section.overrides)
    model_type = fields.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as exc:
        raise ConfigError("model.name", f"transformers cannot build model_type {model_type!r}: {exc}") from None
    # Eager attention computes the same thing on every backend (SDPA kernels differ between XLA and CPU).
    config._attn_implementation = "eager"
    return config


def build_model(section: ModelSection, seed: int) -> PreTrainedModel:
    """Same seed, same weights, on every rank and every backend: no broadcast needed."""
    config = model_config(section)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        raise ConfigError("model.name", f"{section.name!r} is not a causal LM: {exc}") from None
    model.config.use_cache = False
    return model


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
