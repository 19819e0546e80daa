"""Supervised fine-tuning data (data.kind chat and prompt_completion): the token ids and labels TRL's SFTTrainer
gives on the same rows and tokenizer, examples packed without seeing each other, and one line for rows that
cannot be trained on."""

import json

import pytest
import torch
from conftest import FIXTURES, backend_params, run_cli, runnable, sgd_losses
from model_dirs import CHAT_TEMPLATE_MARKED
from transformers import AutoModelForCausalLM, AutoTokenizer

from xla_shard import config
from xla_shard.data import build, completions, packing
from xla_shard.data.files import read_rows
from xla_shard.data.tokenize import IGNORE
from xla_shard.errors import ConfigError
from xla_shard.models import model_config, resolve_source

pytestmark = pytest.mark.torch_version  # its subject depends on torch's version

CHAT = FIXTURES / "chat.jsonl"
PROMPTS = FIXTURES / "prompt_completion.jsonl"
BACKENDS = {
    "xla_spmd": (["backend=xla_spmd", "cpu_devices=4"], 0),
    "xla_fsdp": (["backend=xla_fsdp", "cpu_devices=1"], 0),
    "torch_fsdp": (["backend=torch_fsdp"], 2),
}


def _cfg(model_dir, *sets):
    return config.load(None, [f"model.name={model_dir}", *sets])


def _examples(model_dir, path, seq_len, *sets, tokenizer=None):
    cfg = _cfg(model_dir, f"data.path={path}", f"train.seq_len={seq_len}", *sets)
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
    rows = read_rows(str(path), None, "data.path")
    return completions.examples(rows, tokenizer, completions.fields_of(cfg.data), seq_len, None, str(path))


def _trl_rows(model_dir, path, seq_len, tokenizer=None, **args):
    """TRL's SFTTrainer's own preparation of the same file (its tokenized training set)."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = datasets.Dataset.from_list([json.loads(line) for line in path.read_text().splitlines()])
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=rows,
                         args=SFTConfig(output_dir=str(path.parent / "unused"), max_length=seq_len, packing=False,
                                        report_to=[], use_cpu=True, bf16=False, **args))
    return trainer.train_dataset


@pytest.mark.parametrize("seq_len", [256, 40])  # 40 cuts long conversations and drops some whose answer is past it
def test_chat_ids_and_assistant_labels_equal_trls(model_dirs, seq_len):
    pytest.importorskip("trl")
    tokenizer = AutoTokenizer.from_pretrained(model_dirs.llama_chat)
    tokenizer.chat_template = CHAT_TEMPLATE_MARKED  # TRL's assistant_only_loss needs {% generation %} markers
    ours, dropped = _examples(model_dirs.llama_chat, CHAT, seq_len, "data.kind=chat", tokenizer=tokenizer)
    theirs = _trl_rows(model_dirs.llama_chat, CHAT, seq_len, tokenizer=tokenizer, assistant_only_loss=True)
    assert ours["input_ids"] == theirs["input_ids"]
    assert ours["labels"] == theirs["labels"]
    assert len(ours) + dropped == 24 and (dropped > 0) == (seq_len == 40)
    assert all(IGNORE in labels and set(labels) != {IGNORE} for labels in ours["labels"])


def test_a_template_without_generation_markers_labels_the_same_assistant_tokens(model_dirs):
    marked = AutoTokenizer.from_pretrained(model_dirs.llama_chat)
    marked.chat_template = CHAT_TEMPLATE_MARKED
    turn_by_turn, _ = _examples(model_dirs.llama_chat, CHAT, 256, "data.kind=chat")
    with_markers, _ = _examples(model_dirs.llama_chat, CHAT, 256, "data.kind=chat", tokenizer=marked)
    assert turn_by_turn["labels"] == with_markers["labels"]
    tokenizer = AutoTokenizer.from_pretrained(model_dirs.llama_chat)
    answers = [tokenizer.decode([t for t in labels if t != IGNORE]) for labels in turn_by_turn["labels"][:2]]
    rows = [json.loads(line)["messages"] for line in CHAT.read_text().splitlines()[:2]]
    assert answers == ["".join(m["content"] + "<|im_end|>\n" for m in row if m["role"] == "assistant") for row in rows]


def test_prompt_completion_ids_and_completion_labels_equal_trls(model_dirs):
    pytest.importorskip("trl")
    ours, _ = _examples(model_dirs.llama_chat, PROMPTS, 64, "data.kind=prompt_completion")
    theirs = _trl_rows(model_dirs.llama_chat, PROMPTS, 64)
    assert ours["input_ids"] == theirs["input_ids"]
    assert ours["labels"] == theirs["labels"]
    eos = AutoTokenizer.from_pretrained(model_dirs.llama_chat).eos_token_id
    assert all(ids[-1] == eos for ids in ours["input_ids"] if len(ids) < 64)


@pytest.mark.parametrize("path, kind", [(CHAT, "chat"), (PROMPTS, "prompt_completion")])
def test_completion_only_loss_false_labels_every_token_as_trl_does(model_dirs, path, kind):
    pytest.importorskip("trl")
    ours, _ = _examples(model_dirs.llama_chat, path, 64, f"data.kind={kind}", "data.completion_only_loss=false")
    theirs = _trl_rows(model_dirs.llama_chat, path, 64, completion_only_loss=False)
    assert ours["input_ids"] == theirs["input_ids"] and ours["labels"] == theirs["labels"]
    assert all(labels == ids for ids, labels in zip(ours["input_ids"], ours["labels"]))


def test_packing_keeps_examples_whole_and_apart(model_dirs):
    """Every packed row is seq_len tokens of whole examples, positions restarting at each one, then filler; and
    the model's logits for a packed row equal those of each example run alone, so no example attends to another."""
    examples, _ = _examples(model_dirs.llama_chat, CHAT, 96, "data.kind=chat")
    rows = packing.pack(examples, 192, 0, None)
    assert len(rows) < len(examples)
    unpacked = []
    for ids, labels, positions, real in zip(rows["input_ids"], rows["labels"], rows["position_ids"],
                                            rows["real_tokens"]):
        assert len(ids) == len(labels) == len(positions) == 192 and set(labels[real:]) <= {IGNORE}
        starts = [i for i, p in enumerate(positions[:real]) if p == 0] + [real]
        unpacked += [(ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:])]
    assert sorted(unpacked) == sorted((ids, [IGNORE] + labels[1:])
                                      for ids, labels in zip(examples["input_ids"], examples["labels"]))

    # use_cache=False, as xla_shard trains: with a KV cache transformers does not look for packed examples
    model = AutoModelForCausalLM.from_pretrained(model_dirs.llama_chat, attn_implementation="eager",
                                                 use_cache=False).eval()
    row = {key: torch.tensor(rows[key][:1]) for key in ("input_ids", "position_ids")}
    positions = row["position_ids"][0].tolist()
    starts = [i for i, p in enumerate(positions) if p == 0] + [192]
    assert len(starts) > 2, "the first row holds one example: nothing to tell apart"
    with torch.no_grad():
        packed_logits = model(**row).logits[0]
        for a, b in zip(starts, starts[1:]):
            alone = model(input_ids=row["input_ids"][:, a:b]).logits[0]
            torch.testing.assert_close(packed_logits[a:b], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
def test_best_fit_decreasing_packs_the_rows_trls_pack_dataset_packs(strategy):
    """The same lengths give TRL's rows, example for example and in its order: 2,500 examples of a long-tailed
    length distribution (some past seq_len), over two and a half of the thousand-example batches both pack in."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    torch.manual_seed(3)
    lengths = (torch.distributions.LogNormal(3.5, 1.2).sample((2500,)).long() + 1).clamp(max=700).tolist()
    ids = [[index] * n for index, n in enumerate(lengths)]  # an example is told by its tokens
    examples = Dataset.from_dict({"input_ids": ids, "labels": ids})
    ours = packing.pack(examples, 512, 0, None, split=strategy == "bfd_split")
    theirs = trl.pack_dataset(Dataset.from_dict({"input_ids": ids}), 512, strategy=strategy)
    assert len(ours) == len(theirs)
    for row, real, want in zip(ours["input_ids"], ours["real_tokens"], theirs["input_ids"]):
        assert row[:real] == want and real == len(want)
    assert 0.9 < packing.fill_rate(ours, 512) <= 1.0


def test_padded_examples_mask_the_padding(model_dirs):
    examples, _ = _examples(model_dirs.llama_chat, PROMPTS, 64, "data.kind=prompt_completion")
    rows = completions.padded(examples, 64, 0, None)
    for example, ids, mask, labels in zip(examples["input_ids"], rows["input_ids"], rows["attention_mask"],
                                          rows["labels"]):
        n = len(example)
        assert ids[:n] == example and sum(mask) == n and set(labels[n:]) <= {IGNORE}


def test_a_run_describes_what_it_trains_on(model_dirs):
    cfg = _cfg(model_dirs.llama_chat, f"data.path={CHAT}", "data.kind=chat", "train.seq_len=40")
    data = build(cfg, model_config(cfg.model), resolve_source(cfg.model).directory)
    assert "chat examples packed best-fit decreasing" in data.description and "assistant turns" in data.description
    assert "dropped" in data.description and data.uneven_labels
    batch = data.train.global_batch(0)
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["input_ids"].shape == (8, 40)


def _write(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


USER = {"role": "user", "content": "hello"}
ANSWER = {"role": "assistant", "content": "hi"}


@pytest.mark.parametrize("rows, sets, key, words", [
    ([{"messages": [USER]}], [], "data.messages_field", "row 0 has no assistant turn"),
    ([{"messages": [USER, ANSWER]}, {"messages": [{"role": "wizard", "content": "x"}, ANSWER]}], [],
     "data.messages_field", "row 1: message 0 has the unknown role 'wizard'"),
    ([{"messages": "hello"}], [], "data.messages_field", "row 0: 'messages' is str, not a list of messages"),
    ([{"chat": [USER, ANSWER]}], [], "data.messages_field", "no column 'messages'"),
    ([{"prompt": "a", "completion": [ANSWER]}], ["data.kind=prompt_completion"], "data.prompt_field",
     "both be text or both be lists"),
])
def test_rows_that_cannot_be_trained_on_are_refused_naming_the_key_and_row(model_dirs, tmp_path, rows, sets, key,
                                                                            words):
    path = _write(tmp_path, rows)
    with pytest.raises(ConfigError) as info:
        _examples(model_dirs.llama_chat, path, 64, "data.kind=chat", *sets)
    assert info.value.key == key and words in str(info.value)


def test_a_tokenizer_without_a_chat_template_is_refused(model_dirs):
    with pytest.raises(ConfigError, match="has none: name a tokenizer with one"):
        _examples(model_dirs.llama, CHAT, 64, "data.kind=chat")


@pytest.mark.parametrize("sets, words", [
    (["data.kind=chat", "data.streaming=true"], "data.streaming reads plain text only"),
    (["data.completion_only_loss=true", f"data.path={FIXTURES / 'corpus.jsonl'}"],
     "applies to data.kind chat and prompt_completion"),
    (["data.kind=chat", "data.format=txt"], "needs named columns"),
    (["data.kind=chat", "model.task=sequence_classification", "model.num_labels=2"], "trains a causal LM"),
    (["data.kind=prompt_completion", "data.path=synthetic"], "reads rows from a file"),
])
def test_settings_that_contradict_each_other_are_refused(sets, words):
    base = [] if any(s.startswith("data.path") for s in sets) else [f"data.path={CHAT}"]
    with pytest.raises(ConfigError, match=words):
        config.load(None, [*base, *sets])


def plain_sgd_losses(model_dir, cfg, steps: int) -> list[float]:
    """Plain transformers on one process: each step's whole global batch in one forward (the mean over every
    labelled token of the step), SGD."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", use_cache=False)
    return sgd_losses(model, build(cfg, model.config, str(model_dir)).train, cfg.train.lr, steps)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(list(BACKENDS)))
def test_chat_training_follows_plain_transformers_on_every_backend(model_dirs, tmp_path, backend):
    """Packed chat rows (position ids, labels on the answers only) trained in two micro-batches per step on each
    backend: the losses of plain transformers on the whole batch. The micro-batches and processes hold different
    numbers of answer tokens, so this holds only if each is weighted by its tokens."""
    sets, nproc = runnable(BACKENDS)[backend]
    common = [f"model.name={model_dirs.llama_chat}", f"data.path={CHAT}", "data.kind=chat", "train.seq_len=64",
              "train.optimizer=sgd", "train.lr=0.5", "train.grad_accum_steps=2", "train.steps=3"]
    out = tmp_path / "run"
    extra = ["--nproc-per-node", str(nproc)] if nproc else []
    done = run_cli("train", *[a for s in [*common, *sets, f"output_dir={out}"] for a in ("--set", s)], *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loss on the assistant turns" in done.stderr and "best-fit decreasing (bfd)" in done.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    want = plain_sgd_losses(model_dirs.llama_chat, _cfg(model_dirs.llama_chat, *common), 3)
    assert [r["loss"] for r in records] == pytest.approx(want, rel=2e-6), (backend, records, want)
    # every record says how many of the tokens it computed were examples', not packing's filler (this fixture's
    # conversations, cut at 64 tokens, fill their rows: the counts themselves are held in the packing tests above)
    assert all(0 < r["real_tokens_per_s"] <= r["tokens_per_s"] for r in records), [
        (r["real_tokens_per_s"], r["tokens_per_s"]) for r in records]
