"""'Pretrained' model directories made here, never downloaded: small transformers models written with
`save_pretrained`, with a tokenizer trained by the `tokenizers` library on the text shipped in fixtures/; and
the helpers that compare what a run holds with what such a directory stores."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus.txt"
VOCAB = 320
LABELS = {0: "entailment", 1: "neutral", 2: "contradiction"}
# A ChatML template whose assistant turns carry {% generation %} markers (what TRL's assistant_only_loss needs),
# and the same template without them: the two must label the same tokens.
CHAT_TEMPLATE_MARKED = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>\n' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHAT_TEMPLATE = CHAT_TEMPLATE_MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")


@functools.cache
def _trained_bpe() -> str:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(CORPUS)], trainer)
    return tok.to_str()


def bpe_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """Byte-level BPE (a Llama-style tokenizer) with <s> and </s>; with a chat template, also ChatML's
    <|im_start|> and <|im_end|>. Trained once per process on the shipped corpus."""
    tok = Tokenizer.from_str(_trained_bpe())
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tokenizer.chat_template = chat_template
    return tokenizer


def wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """A BERT-style WordPiece tokenizer: [CLS] a [SEP] b [SEP], with token type ids."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train([str(CORPUS)], trainers.WordPieceTrainer(vocab_size=VOCAB, special_tokens=special))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])


def llama_dir(path: Path, tied: bool = False, files: int = 1, dtype: torch.dtype = torch.float32,
              hidden: int = 64, layers: int = 2, seed: int = 7, chat_template: str | None = None,
              positions: int = 256, heads: int = 4) -> Path:
    """A Llama causal LM as `save_pretrained` writes it (`heads` query heads, half as many key/value heads);
    `files` > 1 splits the weights with an index."""
    tokenizer = bpe_tokenizer(chat_template)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=positions, tie_word_embeddings=tied,
                         bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    shard = f"{total // files // 1000 + 1}KB" if files > 1 else "10GB"
    model.save_pretrained(path, max_shard_size=shard)
    tokenizer.save_pretrained(path)
    return path


def bert_classifier_dir(path: Path, base_only: bool = False, seed: int = 11) -> Path:
    """A BERT sequence classifier (3 NLI labels), or only its encoder (`BertModel`: no classifier head)."""
    tokenizer = wordpiece_tokenizer()
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                        id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config)
    (model.bert if base_only else model).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def stored_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def assemble(saved: list[dict]) -> dict[str, torch.Tensor]:
    """Whole parameters from the boxes each process holds; NaN where no process holds a value."""
    full = {}
    for process in saved:
        for name, (shape, chunks) in process["chunks"].items():
            tensor = full.setdefault(name, torch.full(shape, float("nan")))
            for offsets, chunk in chunks:
                tensor[tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape))] = chunk
    return full


# Mixture-of-experts families, as small as their configs allow: their files store one tensor per expert, which
# transformers fuses into one parameter per layer on load.
MOE_FAMILIES = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16,
                  "decoder_sparse_step": 1},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
}


def moe_model(family: str, seed: int = 5, vocab_size: int = VOCAB):
    """A small MoE causal LM of `family` (see MOE_FAMILIES), in memory, randomly initialised from `seed`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = bpe_tokenizer()
    config = AutoConfig.for_model(family, vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, tie_word_embeddings=False,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, **MOE_FAMILIES[family])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def moe_dir(path: Path, family: str, seed: int = 5) -> Path:
    """A small MoE causal LM of `family` as `save_pretrained` writes it, with the BPE tokenizer."""
    tokenizer = bpe_tokenizer()
    moe_model(family, seed, len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Every architecture family the README says is covered: (model_type, task, config fields beyond the common
# ones). Encoders are sequence classifiers; the MoE families are in MOE_FAMILIES.
FAMILIES = {
    "llama": ("llama", "causal_lm", {"num_key_value_heads": 2}),
    "mistral": ("mistral", "causal_lm", {"num_key_value_heads": 2}),
    "qwen2": ("qwen2", "causal_lm", {"num_key_value_heads": 2}),
    "qwen3": ("qwen3", "causal_lm", {"num_key_value_heads": 2, "head_dim": 16}),
    "gemma": ("gemma", "causal_lm", {"num_key_value_heads": 2, "head_dim": 16}),
    "gemma2": ("gemma2", "causal_lm", {"num_key_value_heads": 2, "head_dim": 16}),
    "gemma3": ("gemma3_text", "causal_lm", {"num_key_value_heads": 2, "head_dim": 16}),
    "phi": ("phi", "causal_lm", {}),
    "phi3": ("phi3", "causal_lm", {"num_key_value_heads": 2}),
    "gpt2": ("gpt2", "causal_lm", {}),
    "gpt_neox": ("gpt_neox", "causal_lm", {}),
    "opt": ("opt", "causal_lm", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    "falcon": ("falcon", "causal_lm", {}),
    "olmo2": ("olmo2", "causal_lm", {"num_key_value_heads": 2}),
    "starcoder2": ("starcoder2", "causal_lm", {"num_key_value_heads": 2}),
    "granite": ("granite", "causal_lm", {"num_key_value_heads": 2}),
    "smollm3": ("smollm3", "causal_lm", {"num_key_value_heads": 2}),
    "stablelm": ("stablelm", "causal_lm", {"num_key_value_heads": 2}),
    "cohere": ("cohere", "causal_lm", {"num_key_value_heads": 2}),
    "glm4": ("glm4", "causal_lm", {"num_key_value_heads": 2}),
    "bert": ("bert", "sequence_classification", {}),
    "roberta": ("roberta", "sequence_classification", {}),
    "electra": ("electra", "sequence_classification", {}),
    "distilbert": ("distilbert", "sequence_classification", {"dim": 64, "hidden_dim": 128, "n_layers": 2,
                                                             "n_heads": 4}),
}


def family_model(family: str, seed: int = 3):
    """A small model of `family` (see FAMILIES), in memory, randomly initialised from `seed`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    model_type, task, fields = FAMILIES[family]
    tokenizer = bpe_tokenizer()
    labels = {"id2label": LABELS, "label2id": {v: k for k, v in LABELS.items()}} if task != "causal_lm" else {}
    # A few rows to spare: some families' tokenizer classes add a special token of their own when loaded.
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer) + 8, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, **labels, **fields)
    auto = AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification
    torch.manual_seed(seed)
    return auto.from_config(config)


def family_dir(path: Path, family: str, seed: int = 3) -> Path:
    """A small model of `family` (see FAMILIES) as `save_pretrained` writes it, with the BPE tokenizer."""
    family_model(family, seed).save_pretrained(path)
    bpe_tokenizer().save_pretrained(path)
    return path


def four_bit_dir(path: Path, source: Path, nested: bool, skip: list[str] | None = None) -> Path:
    """`source` loaded in 4 bits by transformers + bitsandbytes (nf4; `nested`: double quantization) and saved
    as such (packed weights, their absmax and quant_state beside them), with its tokenizer."""
    import shutil

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    with torch._dynamo.config.patch(disable=True):  # bitsandbytes' CPU paths compile with torch.compile
        settings = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=nested,
                                      llm_int8_skip_modules=skip)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, quantization_config=settings)
        model.save_pretrained(path)
    for file in source.glob("tokenizer*"):
        shutil.copy(file, path)
    return path
