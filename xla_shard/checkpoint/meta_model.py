"""The model a checkpoint's `hf_config` describes, built on the meta device (nothing allocated): what an export
asks transformers about, such as which layers are Conv1D or how `save_pretrained` names MoE experts."""

from __future__ import annotations

import re
from typing import Any

from xla_shard.checkpoint.manifest import CheckpointError
from xla_shard.errors import one_line

# More layers than any released model has by an order of magnitude. Building costs about a millisecond per
# layer even on the meta device, so a manifest must not choose the count freely.
MAX_LAYERS = 4096
_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def build(url: str, hf_config: dict[str, Any], names: list[str]):
    """The transformers model of `hf_config` (a classifier where its architectures say so, else a causal LM),
    with only as many layers as the checkpoint tensors `names` reach: later layers hold nothing to ask about.

    A manifest is untrusted input: a config transformers cannot build, or tensor names past `MAX_LAYERS`, is
    one line, and its layer count is cut before transformers reads it (a config claiming a million layers
    would otherwise take minutes to build)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        fields = _with_layers(hf_config, hf_config["model_type"], lambda count, key: min(count, reached(url, names)))
        fields = {k: v for k, v in fields.items() if k not in ("auto_map", "model_type")}
        config = AutoConfig.for_model(hf_config["model_type"], **fields)
        auto = AutoModelForSequenceClassification if any("SequenceClassification" in a for a in
                                                         config.architectures or []) else AutoModelForCausalLM
        with torch.device("meta"):
            return auto.from_config(config)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{url}: the manifest's hf_config does not build a transformers model: "
                              f"{type(exc).__name__}: {one_line(exc)[:200]}") from None


def reached(url: str, names: list[str]) -> int:
    """How many layers the tensors `names` hold at least: one past the largest index in a name."""
    count = 1 + max((int(i) for name in names for i in _INDEX.findall(name)), default=0)
    if count > MAX_LAYERS:
        raise CheckpointError(f"{url}: the manifest's tensor names reach index {count - 1}, beyond the {MAX_LAYERS} "
                              "layers xla_shard builds a model of")
    return count


def check_whole(url: str, hf_config: dict[str, Any], names: list[str]) -> None:
    """Refuse a whole model's export whose config claims layers its tensors lack: transformers would load it
    with those layers freshly initialised, and say so only in a warning."""
    claims: list[tuple[str, int]] = []

    def claim(count: int, key: str) -> int:
        claims.append((key, count))
        return count

    _with_layers(hf_config, hf_config.get("model_type"), claim)
    have = reached(url, names)
    for key, count in claims:
        if count > have and key.rpartition(".")[0] in ("", "text_config"):  # the language model's own layers
            raise CheckpointError(f"{url}: the manifest's hf_config.{key} is {count}, but its tensors hold "
                                  f"{have} layer(s): the exported model would not be the one trained")


def _with_layers(fields: dict[str, Any], model_type: Any, change, prefix: str = "") -> dict[str, Any]:
    """`fields` with each layer count (under any alias the config class maps to `num_hidden_layers`, in its
    sub-configs too) replaced by `change(count, its dotted key)`, and per-layer lists cut to match."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type] if isinstance(model_type, str) and model_type in CONFIG_MAPPING else None
    aliases = {"num_hidden_layers"} | {k for k, v in getattr(cls, "attribute_map", {}).items()
                                       if v == "num_hidden_layers"}
    subs = getattr(cls, "sub_configs", {}) or {}
    out, counted = dict(fields), None
    for key, value in fields.items():
        if key in aliases and isinstance(value, int) and not isinstance(value, bool):
            out[key] = counted = change(value, prefix + key)
        elif isinstance(value, dict) and key in subs:
            sub = subs[key]
            out[key] = _with_layers(value, value.get("model_type", getattr(sub, "model_type", None)), change,
                                    prefix + key + ".")
    if counted is not None and isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][:counted]
    return out
