"""Auto-wrap decides the same FSDP units for every backend; checked here on the model itself."""

import pytest
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP

from xla_shard import config
from xla_shard.errors import ConfigError
from xla_shard.models import build_model
from xla_shard.wrap import checkpoint_targets, wrap_targets


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
