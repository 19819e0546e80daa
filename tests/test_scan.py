"""`fsdp.scan_layers`: which stacks can be scanned, and that scanning leaves the model's modules and names as
they were. Exactness of scanned training and checkpoint interchange: tests/test_checkpoint.py."""

import pytest
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from xla_shard.backends import xla_scan
from xla_shard.config.schema import FsdpSection
from xla_shard.errors import ConfigError

SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)


def test_scanning_keeps_every_layer_as_a_module_under_its_own_name():
    model = LlamaForCausalLM(LlamaConfig(**SMALL, num_hidden_layers=3))
    before = {name: tensor for name, tensor in model.state_dict().items()}
    layers = list(model.model.layers)
    assert xla_scan.scan_stack(model, FsdpSection(), checkpoint=False) == 3
    after = model.state_dict()
    assert list(after) == list(before) and all(after[k].data_ptr() == before[k].data_ptr() for k in before)
    stack = model.model.layers
    assert isinstance(stack, xla_scan.ScannedLayers) and [stack[i] for i in range(3)] == layers
    # The model's loop (`for layer in self.layers[:n]`) meets one callable, which reads like the first layer.
    (only,) = list(stack[:3])
    assert callable(only) and only.self_attn is layers[0].self_attn
    assert sum(1 for _ in model.parameters()) == sum(1 for _ in LlamaForCausalLM(model.config).parameters())


@pytest.mark.parametrize("model, words", [
    # Alternating attention: the same parameters, a different mask per layer.
    (lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, num_hidden_layers=2, sliding_window=8,
                                          layer_types=["full_attention", "sliding_attention"])),
     ["model.layers", "layer 1 self_attn.layer_type", "sliding_attention", "full_attention"]),
    # A dense layer among MoE ones: other modules, other parameters.
    (lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(**SMALL, num_hidden_layers=2, moe_intermediate_size=8, num_experts=4,
                                                num_experts_per_tok=2, shared_expert_intermediate_size=8,
                                                mlp_only_layers=[1])),
     ["model.layers", "layer 1 mlp.class", "Qwen2MoeMLP", "Qwen2MoeSparseMoeBlock"]),
])
def test_layers_that_are_not_one_repeated_layer_are_refused(model, words):
    with pytest.raises(ConfigError) as info:
        xla_scan.scan_stack(model(), FsdpSection(), checkpoint=False)
    message = str(info.value)
    assert "fsdp.scan_layers" in message and "set it to false" in message
    assert all(word in message for word in words), message


def test_a_model_without_one_stack_of_its_layers_is_refused():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

    class TwoStacks(nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = nn.ModuleList([Block(), Block()]), nn.ModuleList([Block(), Block()])

    with pytest.raises(ConfigError, match=r"fsdp.scan_layers.*exactly one list of its Block layers.*encoder, decoder"):
        xla_scan.scan_stack(TwoStacks(), FsdpSection(), checkpoint=False)
