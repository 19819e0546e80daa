"""Named model configs (transformers config fields) for trying xla_shard without a model of one's own.

Data only, so that code that needs the names (config checks, deploy rendering) does not import torch.
"""

from typing import Any

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

# Llama sizes for planning (`xla-shard plan`) and GPU/TPU benchmarks: random init, never downloaded. On a CPU
# they only make sense on the meta device (the planner builds them there).
_LLAMA = dict(model_type="llama", vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)
PRESETS.update({
    "llama-7b": dict(_LLAMA, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32),
    "llama-13b": dict(_LLAMA, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=40),
    "llama-30b": dict(_LLAMA, hidden_size=6656, intermediate_size=17920, num_hidden_layers=60,
                      num_attention_heads=52, num_key_value_heads=52),
    "llama-70b": dict(_LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8),
})
