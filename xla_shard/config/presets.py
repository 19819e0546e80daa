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
