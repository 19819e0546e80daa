"""Build the transformers model a config's `model` section asks for: a preset, a config.json, or a model
directory (local or any fsspec URL) whose weights, if it has any, are loaded later, shard by shard.

Nothing is downloaded: a directory is read where it is; a preset is built from its fields.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import torch

try:  # transformers validates config fields with huggingface_hub's strict dataclasses (newer hubs)
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # pragma: no cover - older huggingface_hub
    class StrictDataclassError(Exception):
        """Stands in where huggingface_hub has no strict dataclasses: nothing raises it."""
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from xla_shard import attention, experts as experts_kernels
from xla_shard.checkpoint.model_config import train_without_cache
from xla_shard.config.presets import PRESETS
from xla_shard.config.schema import ModelSection
from xla_shard.errors import ConfigError, one_line
from xla_shard.io.model_dir import CONFIG, config_location, refuse_link_out, refuse_untrusted
from xla_shard.io.storage import Storage, StorageError
from xla_shard.io.untrusted_json import SchemaError, parse_json

# Parameters (the optimizer's master weights) are fp32 whatever dtype a config or weights file names; bf16
# compute is fsdp.mixed_precision's job. A bf16 file is converted on load, and the load says so.
MASTER_DTYPE = torch.float32
_AUTO_CLASSES = {"causal_lm": AutoModelForCausalLM, "sequence_classification": AutoModelForSequenceClassification}
@dataclass(frozen=True)
class ModelSource:
    """Where `model.name` points: a preset, a config.json file, or a directory (URL) that may hold weights."""

    name: str
    fields: dict[str, Any]  # the transformers config fields, model_type included
    directory: str | None = None  # the model directory's URL or path, when there is one
    generation: dict[str, Any] | None = None  # its generation_config.json, when it has one

    @property
    def is_preset(self) -> bool:
        return self.name in PRESETS


def resolve_source(section: ModelSection, retry_deadline_s: float = 120.0) -> ModelSource:
    if section.name in PRESETS:
        return ModelSource(section.name, dict(PRESETS[section.name]))
    name = section.name
    directory, file = config_location(name)
    try:
        storage = Storage(directory, retry_deadline_s)
        refuse_link_out(storage, file, "model.name")
        raw = storage.read_bytes(file)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise ConfigError("model.name", f"{name!r} is neither a preset ({', '.join(PRESETS)}) nor a transformers "
                                        f"model directory or config.json (no {file} there)") from None
    except StorageError as exc:  # an outage is not a wrong name: say which it was
        raise ConfigError("model.name", f"{name!r}: the storage could not be read ({exc})") from None
    where = f"{directory.rstrip('/')}/{file}"
    try:
        fields = parse_json(raw)
    except (UnicodeDecodeError, SchemaError) as exc:
        raise ConfigError("model.name", f"{where} is not valid UTF-8 JSON: {one_line(exc)}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ConfigError("model.name", f"{where} has no model_type: not a transformers config")
    _refuse_unbuildable(fields, f"{where}: ")
    if file != CONFIG:
        if "auto_map" in fields:
            raise ConfigError("model.name", f"{where} has 'auto_map': it needs Python code, which xla_shard never "
                                            "runs")
        return ModelSource(name, fields)
    refuse_untrusted(storage, "model.name", shown=directory)
    return ModelSource(name, fields, directory=directory, generation=_generation_fields(storage, directory))


GENERATION_CONFIG = "generation_config.json"


def _generation_fields(storage: Storage, directory: str) -> dict[str, Any] | None:
    """The model directory's generation_config.json (its end-of-turn tokens above all), which transformers reads
    only in `from_pretrained`: a model built from its config gets one derived from config.json, and EOS ids
    declared only here would never end a completion. Read once, with config.json; None where there is none."""
    from transformers import GenerationConfig

    where = f"{directory.rstrip('/')}/{GENERATION_CONFIG}"
    try:
        refuse_link_out(storage, GENERATION_CONFIG, "model.name")
        raw = storage.read_bytes(GENERATION_CONFIG)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except StorageError as exc:
        raise ConfigError("model.name", f"{where}: the storage could not be read ({exc})") from None
    try:
        fields = parse_json(raw)
        if not isinstance(fields, dict):
            raise SchemaError("(top level)", "not a JSON object")
        GenerationConfig.from_dict(fields)  # refused here, where config.json is: config check says it too
    except (UnicodeDecodeError, SchemaError, TypeError, ValueError) as exc:
        raise ConfigError("model.name", f"{where} is not a generation config: {one_line(exc)}") from None
    return fields


# Layer counts a config.json may claim (names across architectures, in nested text/vision configs too). Building
# costs time and memory per layer, even on the meta device: a million is minutes of `config check`.
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers",
                 "num_encoder_layers", "decoder_layers", "encoder_layers")


def _refuse_unbuildable(fields: dict, where: str, key: str = "model.name") -> None:
    """A config whose layer count no released model comes near (MAX_LAYERS) is not built at all."""
    from xla_shard.checkpoint.meta_model import MAX_LAYERS

    stack = [("", fields)]
    while stack:
        prefix, node = stack.pop()
        for name, value in node.items():
            if isinstance(value, dict):
                stack.append((f"{prefix}{name}.", value))
            elif name in _LAYER_COUNTS and isinstance(value, int) and not isinstance(value, bool) \
                    and not 0 <= value <= MAX_LAYERS:
                raise ConfigError(key, f"{where}{prefix}{name} is {value}; a model of more than {MAX_LAYERS} "
                                       "layers (or fewer than none) is not one xla_shard builds")


def _rederived_head_dim(fields: dict, overrides: dict) -> dict:
    """A saved config stores `head_dim` even where transformers derived it (hidden_size / num_attention_heads);
    overriding those widths alone would keep the old one silently. Derived again there; a head_dim the config
    set apart from its widths, or one the overrides name, is kept."""
    hidden, heads, stored = fields.get("hidden_size"), fields.get("num_attention_heads"), fields.get("head_dim")
    if ("head_dim" in overrides or not {"hidden_size", "num_attention_heads"} & set(overrides)
            or not (isinstance(hidden, int) and isinstance(heads, int) and heads) or stored != hidden // heads):
        return fields
    width, count = overrides.get("hidden_size", hidden), overrides.get("num_attention_heads", heads)
    return {**fields, "head_dim": width // count} if isinstance(width, int) and isinstance(count, int) and count \
        else fields


def model_config(section: ModelSection, source: ModelSource | None = None,
                 accelerator: str | None = None) -> PretrainedConfig:
    """The transformers config, with the attention kernel for `accelerator` ('tpu', 'cuda', 'cpu'; None
    before the runtime is known)."""
    source = source or resolve_source(section)
    fields = dict(source.fields)
    _refuse_unbuildable(dict(section.overrides), "", "model.overrides")
    model_type = fields.pop("model_type")
    config = _config_for(model_type, fields, "model.name", section.name)
    for key in section.overrides:
        if not hasattr(config, key):  # hasattr follows attribute_map (gpt2's hidden_size -> n_embd)
            close = difflib.get_close_matches(key, list(config.to_dict()), n=1)
            raise ConfigError(f"model.overrides.{key}", f"{type(config).__name__} has no field {key!r}"
                                                        + (f"; did you mean {close[0]!r}?" if close else ""))
    if section.overrides:
        overridden = {**_rederived_head_dim(fields, section.overrides), **section.overrides}
        config = _config_for(model_type, overridden, "model.overrides", section.name)
    if section.task == "sequence_classification":
        _set_labels(config, section, fields)
    config._attn_implementation = _attention(section, accelerator)
    return config


def _attention(section: ModelSection, accelerator: str | None) -> str:
    chosen = attention.choose(section.attn_implementation, accelerator)
    problem = attention.available(chosen)
    if chosen == attention.XLA_PALLAS and accelerator not in (None, "tpu"):
        problem = f"is torch_xla's Pallas kernel for TPUs; this run is on {accelerator}: use auto, sdpa or eager"
    if chosen in (attention.XLA_PALLAS, attention.SDPA_PACKED):
        attention.register()
    if chosen == "flash_attention_2" and accelerator not in (None, "cuda"):
        problem = f"runs on CUDA GPUs; this run is on {accelerator}: use auto, sdpa or eager"
    if problem:
        raise ConfigError("model.attn_implementation", f"{chosen} {problem}")
    return chosen


def _fused_attention(auto, config: PretrainedConfig) -> bool:
    """Whether transformers lets the model's class attend through SDPA: the fused kernels (SDPA's, flash
    attention's) compute plain softmax attention, and a class that declares no SDPA attends otherwise (Gemma 2's
    soft-capped scores). Unknown: yes (the build then says what it refuses)."""
    try:
        model_class = auto._model_mapping[type(config)]
    except (KeyError, ValueError):
        return True
    return getattr(model_class, "_supports_sdpa", True)


def _set_labels(config: PretrainedConfig, section: ModelSection, fields: dict[str, Any]) -> None:
    has_labels = "id2label" in fields or "num_labels" in fields
    if section.num_labels is None:
        if not has_labels:
            raise ConfigError("model.num_labels", f"model.task is sequence_classification and {section.name!r} "
                                                  "names no labels (no id2label in its config): set model.num_labels")
    elif not has_labels or section.num_labels != config.num_labels:
        config.num_labels = section.num_labels  # generic LABEL_0..; a stored head of another size is refused later
    if config.problem_type is None:  # what transformers infers at the first forward from integer labels, set
        # now so that the config a checkpoint records is the one a resumed run builds
        config.problem_type = "regression" if config.num_labels == 1 else "single_label_classification"


def _config_for(model_type: str, fields: dict[str, Any], key: str, source: str) -> PretrainedConfig:
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError, AttributeError, StrictDataclassError) as exc:
        raise ConfigError(key, f"transformers cannot build a {model_type!r} config from {source}: "
                               f"{one_line(exc)}") from None


def build_model(section: ModelSection, seed: int, empty: bool = False, source: ModelSource | None = None,
                accelerator: str | None = None, experts: str | None = None) -> PreTrainedModel:
    """Same seed, same weights, on every rank and every backend: no broadcast needed. `accelerator` picks the
    attention kernel (see `xla_shard.attention`), `experts` transformers' experts_implementation for MoE
    models (None: its default).

    `empty`: parameters on the meta device (no memory, no init), to be sharded and then filled from pretrained
    weights; buffers (rotary tables, position ids) are computed for real, as the model's own code does."""
    source = source or resolve_source(section)
    config = model_config(section, source, accelerator)
    if experts is not None:
        if experts == experts_kernels.XLA_GMM:
            experts_kernels.register()
        config._experts_implementation = experts
    auto = _AUTO_CLASSES[section.task]
    if section.attn_implementation == "auto" and not _fused_attention(auto, config):
        config._attn_implementation = "eager"  # what `auto` picks for a model the fused kernels do not compute
    key = "model.overrides" if section.overrides else "model.name"
    try:
        if empty:
            from accelerate import init_empty_weights

            with init_empty_weights(include_buffers=False):
                model = auto.from_config(config, dtype=MASTER_DTYPE)
            model.tie_weights()  # parameters re-registered on the meta device lose their ties: restore them
        else:
            torch.manual_seed(seed)
            model = auto.from_config(config, dtype=MASTER_DTYPE)
    except ValueError as exc:
        if "does not support" in str(exc) and "attn" in str(exc).lower():
            raise ConfigError("model.attn_implementation", f"{config._attn_implementation} is not available for "
                                                           f"this model: {one_line(exc)}") from None
        if "Unrecognized configuration class" in str(exc):
            task = section.task.replace("_", " ")
            raise ConfigError("model.task", f"transformers has no {task} model for {config.model_type!r} "
                                            f"({section.name}): {one_line(exc)}") from None
        raise ConfigError(key, f"transformers cannot build this model: {one_line(exc)}") from None
    except (TypeError, RuntimeError, AttributeError, ZeroDivisionError) as exc:
        raise ConfigError(key, f"transformers cannot build this model ({type(exc).__name__}: "
                               f"{one_line(exc)})") from None
    if source.generation is not None:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_dict(source.generation)
    train_without_cache(model)
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
