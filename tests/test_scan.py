"""`fsdp.scan_layers`: which stacks can be scanned, and how a scanned stack stores its layers (stacked, named
back to the unrolled model's names). Exactness of scanned training and checkpoint interchange:
tests/test_checkpoint.py."""

import pytest
import torch
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


def test_scanning_stacks_each_layer_tensor_and_names_every_layer_as_the_unrolled_model_does():
    model = LlamaForCausalLM(LlamaConfig(**SMALL, num_hidden_layers=3))
    unrolled = {name: tensor.clone() for name, tensor in model.named_parameters()}
    assert xla_scan.scan_stack(model, FsdpSection(), checkpoint=False) == 3
    stack = model.model.layers
    names = xla_scan.layer_names(model, lambda name: name)
    stacked = dict(model.named_parameters())
    # One [layers, ...] tensor per layer tensor; the same values, under names that map back one to one.
    assert sorted(n for each in names.values() for n in each) == sorted(n for n in unrolled if ".layers." in n)
    for name, layers in names.items():
        assert torch.equal(stacked[name], torch.stack([unrolled[n] for n in layers])), name
    assert {n for n in stacked if n not in names} == {n for n in unrolled if ".layers." not in n}
    # The model's loop (`for layer in self.layers[:n]`) meets one callable, which reads like a layer.
    (only,) = list(stack[:3])
    assert callable(only) and only.self_attn.head_dim == 8 and len(stack) == 3
    with pytest.raises(TypeError, match="layer 1 cannot run alone"):
        stack[1](torch.zeros(1, 2, 16))


def test_what_the_optimizer_updates_does_not_grow_with_depth():
    """The cause of a scanned step's compile time growing with depth was per-layer tensors outside the loop."""
    counts = []
    for layers in (2, 8):
        model = LlamaForCausalLM(LlamaConfig(**SMALL, num_hidden_layers=layers))
        xla_scan.scan_stack(model, FsdpSection(), checkpoint=False)
        counts.append(len(list(model.parameters())))
    assert counts[0] == counts[1]


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
