"""Auto-wrap decides the same FSDP units for every backend; checked here on the model itself."""

import pytest
from torch import nn
from transformers import (
    DistilBertConfig,
    DistilBertForSequenceClassification,
    ElectraConfig,
    ElectraForSequenceClassification,
)
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP

from xla_shard import config
from xla_shard.errors import ConfigError
from xla_shard.models import build_model
from xla_shard.wrap import checkpoint_targets, inferred_layers, wrap_targets


def _model(name="tiny-llama", **overrides):
    return build_model(config.validate({"model": {"name": name, "overrides": overrides}}).model, seed=0)


def _fsdp(**keys):
    return config.validate({"fsdp": keys}).fsdp


def test_transformer_wrap_defaults_to_the_models_no_split_modules():
    model = _model(num_hidden_layers=3)
    targets = wrap_targets(model, _fsdp())
    assert targets == list(model.model.layers)
    assert all(isinstance(m, LlamaDecoderLayer) for m in targets)


def test_transformer_wrap_for_gpt2():
    model = _model("tiny-gpt2")
    assert wrap_targets(model, _fsdp()) == list(model.transformer.h)
    assert all(isinstance(m, GPT2Block) for m in model.transformer.h)


def test_named_classes_nest_children_first():
    model = _model()
    targets = wrap_targets(model, _fsdp(transformer_layer_cls_to_wrap=["LlamaDecoderLayer", "LlamaMLP"]))
    mlp0, layer0 = model.model.layers[0].mlp, model.model.layers[0]
    assert isinstance(mlp0, LlamaMLP)
    assert targets.index(mlp0) < targets.index(layer0)
    assert len(targets) == 2 * len(model.model.layers)


def test_size_based_wraps_once_unwrapped_params_reach_the_threshold():
    model = _model()
    layer_params = sum(p.numel() for p in model.model.layers[0].parameters())
    mlp_params = sum(p.numel() for p in model.model.layers[0].mlp.parameters())
    # Between the MLP and the whole layer: each layer is wrapped, none of its children.
    targets = wrap_targets(model, _fsdp(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=mlp_params + 1))
    for layer in model.model.layers:
        assert layer in targets
        assert not any(m in targets for m in layer.modules() if m is not layer)
    assert layer_params > mlp_params
    # Above the whole model: nothing but the root.
    total = sum(p.numel() for p in model.parameters())
    assert wrap_targets(model, _fsdp(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=total + 1)) == []
    # At the MLP's size: the MLPs are wrapped before their layers.
    small = wrap_targets(model, _fsdp(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=mlp_params))
    assert model.model.layers[0].mlp in small


def test_no_wrap():
    assert wrap_targets(_model(), _fsdp(auto_wrap_policy="NO_WRAP")) == []


def test_unknown_layer_class_names_key_and_alternatives():
    with pytest.raises(ConfigError) as err:
        wrap_targets(_model(), _fsdp(transformer_layer_cls_to_wrap=["BertLayer"]))
    assert err.value.key == "fsdp.transformer_layer_cls_to_wrap"
    assert "BertLayer" in str(err.value) and "LlamaDecoderLayer" in str(err.value)


def test_checkpointing_targets_layers_whatever_the_wrap_policy():
    model = _model()
    assert checkpoint_targets(model, _fsdp(auto_wrap_policy="NO_WRAP")) == list(model.model.layers)


@pytest.mark.parametrize("make, stack", [
    (lambda: ElectraForSequenceClassification(ElectraConfig(
        vocab_size=64, embedding_size=16, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=32)), "electra.encoder.layer"),
    (lambda: DistilBertForSequenceClassification(DistilBertConfig(
        vocab_size=64, dim=16, n_layers=3, n_heads=2, hidden_dim=32)), "distilbert.transformer.layer"),
])
def test_a_model_without_no_split_modules_wraps_the_blocks_of_its_layer_list(make, stack):
    """ELECTRA and DistilBERT declare no `_no_split_modules`: their largest list of repeated blocks is the stack,
    for wrapping and activation checkpointing alike, and the log says which it took."""
    model = make()
    assert not model._no_split_modules
    layers = list(model.get_submodule(stack))
    assert wrap_targets(model, _fsdp()) == layers
    assert checkpoint_targets(model, _fsdp(auto_wrap_policy="NO_WRAP")) == layers
    said = inferred_layers(model, _fsdp())
    assert f"{type(layers[0]).__name__} blocks of {stack} (3)" in said and "no _no_split_modules" in said
    assert inferred_layers(model, _fsdp(transformer_layer_cls_to_wrap=[type(layers[0]).__name__])) is None
    assert inferred_layers(model, _fsdp(auto_wrap_policy="SIZE_BASED_WRAP")) is None  # no layers used


def test_a_model_without_no_split_modules_or_a_layer_list_is_refused_naming_the_key():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    with pytest.raises(ConfigError) as err:
        wrap_targets(Flat(), _fsdp())
    assert err.value.key == "fsdp.transformer_layer_cls_to_wrap" and "no list of repeated blocks" in str(err.value)


@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_activations_make_the_stream_between_layers_bf16(bf16):
    """Under autocast the embedding's output and the residual adds are fp32 (not autocast ops): with
    `cast_activations` what each layer takes and gives is bf16, what activation checkpointing keeps."""
    import torch

    from xla_shard.wrap import cast_activations

    cfg = config.load(None, ["model=tiny-llama", "fsdp.mixed_precision=bf16",
                             f"fsdp.activation_dtype={'bfloat16' if bf16 else 'float32'}"])
    model = build_model(cfg.model, 0)
    if cfg.fsdp.bf16_activations:
        cast_activations(model, cfg.fsdp)
    seen = []
    for layer in checkpoint_targets(model, cfg.fsdp):
        layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=torch.randint(0, 256, (2, 16)))
    assert seen == [torch.bfloat16 if bf16 else torch.float32] * len(seen) and len(seen) == 2


def test_bf16_activations_without_bf16_compute_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="fsdp.activation_dtype"):
        config.load(None, ["fsdp.activation_dtype=bfloat16"])
