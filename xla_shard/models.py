"""Build a transformers causal LM from a config, with random weights (nothing is downloaded)."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from xla_shard.config.presets import PRESETS
from xla_shard.config.schema import ModelSection
from xla_shard.errors import ConfigError, one_line

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
    model_type = fields.pop("model_type")
    config = _config_for(model_type, fields, "model.name", section.name)
    for key in section.overrides:
        if not hasattr(config, key):  # hasattr follows attribute_map (gpt2's hidden_size -> n_embd)
            close = difflib.get_close_matches(key, list(config.to_dict()), n=1)
            raise ConfigError(f"model.overrides.{key}", f"{type(config).__name__} has no field {key!r}"
                                                        + (f"; did you mean {close[0]!r}?" if close else ""))
    if section.overrides:
        config = _config_for(model_type, {**fields, **section.overrides}, "model.overrides", section.name)
    config._attn_implementation = section.attn_implementation  # as asked; eager is the default (see the schema)
    return config


def _config_for(model_type: str, fields: dict[str, Any], key: str, source: str) -> PretrainedConfig:
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError, AttributeError, StrictDataclassError) as exc:
        raise ConfigError(key, f"transformers cannot build a {model_type!r} config from {source}: "
                               f"{one_line(exc)}") from None


def build_model(section: ModelSection, seed: int) -> PreTrainedModel:
    """Same seed, same weights, on every rank and every backend: no broadcast needed."""
    config = model_config(section)
    torch.manual_seed(seed)
    key = "model.overrides" if section.overrides else "model.name"
    try:
        model = AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        if "does not support" in str(exc) and "attn" in str(exc).lower():
            raise ConfigError("model.attn_implementation", f"{section.attn_implementation} is not available for "
                                                           f"this model: {one_line(exc)}") from None
        if "Unrecognized configuration class" in str(exc):
            raise ConfigError("model.name", f"{section.name!r} is not a causal LM: {one_line(exc)}") from None
        raise ConfigError(key, f"transformers cannot build this model: {one_line(exc)}") from None
    except (TypeError, RuntimeError, AttributeError, ZeroDivisionError) as exc:
        raise ConfigError(key, f"transformers cannot build this model ({type(exc).__name__}: "
                               f"{one_line(exc)})") from None
    model.config.use_cache = False
    return model


def max_positions(config: PretrainedConfig) -> int | None:
    """How many positions the model has embeddings (or a rotary table sized) for, if it says."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_sequence_length(config: PretrainedConfig, seq_len: int) -> None:
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise ConfigError("train.seq_len", f"{seq_len} is longer than the model's {limit} positions "
                                           "(max_position_embeddings); positions past it would be out of range")
