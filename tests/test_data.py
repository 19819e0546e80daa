"""Real data: the user's files through the model's tokenizer, in a deterministic order each process reads its
own part of; never raw bytes, never a silent misreading."""

import gzip
import json
import math
import shutil

import pytest
import torch
from conftest import FIXTURES, run_cli

from xla_shard import config
from xla_shard.data import build, micro_rows
from xla_shard.errors import ConfigError
from xla_shard.models import model_config, resolve_source

CORPUS = FIXTURES / "corpus.jsonl"
NLI = FIXTURES / "nli.csv"


def sources(model_dir, *sets):
    cfg = config.load(None, [f"model.name={model_dir}", "train.seq_len=32", *sets])
    return build(cfg, model_config(cfg.model), resolve_source(cfg.model).directory)


def test_packing_joins_documents_with_eos_into_full_blocks(model_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs.llama)
    found = sources(model_dirs.llama, f"data.path={CORPUS}", "train.global_batch_size=4")
    source = found.train
    assert not found.uneven_labels  # every token labelled: the step needs no token counts
    docs = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    stream = [t for doc in docs for t in tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id]]
    assert source.rows_per_epoch == len(stream) // 32  # one group of <= 1000 documents: only the tail is dropped
    rows = [list(source.table[i]["input_ids"]) for i in range(source.rows_per_epoch)]
    assert rows == [stream[i:i + 32] for i in range(0, len(stream) // 32 * 32, 32)]
    batch = source.global_batch(0)
    assert batch["input_ids"].shape == (4, 32) and torch.equal(batch["labels"], batch["input_ids"])


def test_padding_masks_the_padding_and_leaves_it_out_of_the_loss(model_dirs):
    found = sources(model_dirs.llama, f"data.path={CORPUS}", "data.packing=false", "train.seq_len=128")
    batch = found.train.global_batch(0)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    pads = batch["attention_mask"] == 0
    assert pads.any() and (batch["labels"][pads] == -100).all() and found.uneven_labels
    assert torch.equal(batch["labels"][~pads], batch["input_ids"][~pads])


def test_every_format_gives_the_same_rows(model_dirs, tmp_path):
    import pandas as pd

    frame = pd.read_json(CORPUS, lines=True)
    gz = tmp_path / "corpus.jsonl.gz"
    gz.write_bytes(gzip.compress(CORPUS.read_bytes()))
    frame.to_csv(tmp_path / "corpus.csv", index=False)
    frame.to_parquet(tmp_path / "corpus.parquet")
    shards = tmp_path / "shards"
    shards.mkdir()
    lines = CORPUS.read_text().splitlines(keepends=True)
    (shards / "a.jsonl").write_text("".join(lines[:10]))
    (shards / "b.jsonl").write_text("".join(lines[10:]))
    want = sources(model_dirs.llama, f"data.path={CORPUS}").train.global_batch(3)
    for path in (gz, tmp_path / "corpus.csv", tmp_path / "corpus.parquet", shards, f"{shards}/*.jsonl"):
        got = sources(model_dirs.llama, f"data.path={path}").train.global_batch(3)
        assert torch.equal(got["input_ids"], want["input_ids"]), path


@pytest.mark.parametrize("sets, key, words", [
    (["data.text_field=body"], "data.text_field", ["no column 'body'", "text, id"]),
    (["data.text_field=id"], "data.text_field", ["'id' holds int64, not text"]),
    (["data.path={tmp}/corpus.bin"], "data.path", ["cannot tell the format", "data.format"]),
    (["data.path={tmp}/nowhere.jsonl"], "data.path", ["no file or directory"]),
    (["data.tokenizer={tmp}"], "data.tokenizer", ["no tokenizer could be loaded"]),
    (["model.name=tiny-llama"], "data.tokenizer", ["not a model directory"]),
    (["model.name=tiny-llama", "data.tokenizer={llama}"], "data.tokenizer", ["up to 319 (320 tokens)", "256 rows"]),
])
def test_data_that_does_not_match_the_keys_is_refused_naming_them(model_dirs, tmp_path, sets, key, words):
    shutil.copy(CORPUS, tmp_path / "corpus.bin")
    sets = [s.format(tmp=tmp_path, llama=model_dirs.llama) for s in sets]
    with pytest.raises(ConfigError) as raised:
        sources(model_dirs.llama, f"data.path={CORPUS}", *sets)
    assert raised.value.key == key and all(w in str(raised.value) for w in words), str(raised.value)


def test_a_csv_for_classification_maps_label_names_through_label2id(model_dirs):
    got = sources(model_dirs.bert, f"data.path={NLI}", "model.task=sequence_classification",
                  "data.text_fields=[premise, hypothesis]", "train.seq_len=48")
    rows = got.train.table
    labels = {"entailment": 0, "neutral": 1, "contradiction": 2}  # the fixture model's label2id
    import csv

    with open(NLI) as f:
        want = [labels[row["label"]] for row in csv.DictReader(f)]
    assert [int(label) for label in rows["labels"]] == want
    batch = got.train.global_batch(0)
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    assert (batch["token_type_ids"].sum(1) > 0).all()  # the hypothesis is segment 1: the pair was encoded as a pair


@pytest.mark.parametrize("rows, words", [
    ("premise,hypothesis,label\na,b,maybe\n", ["label 'maybe' is not in", "entailment", "neutral", "contradiction"]),
    ("premise,hypothesis,label\na,b,7\n", ["label 7 is outside the model's 3 labels"]),
])
def test_labels_the_model_does_not_have_are_refused(model_dirs, tmp_path, rows, words):
    data = tmp_path / "bad.csv"
    data.write_text(rows * 1)
    with pytest.raises(ConfigError) as raised:
        sources(model_dirs.bert, f"data.path={data}", "model.task=sequence_classification",
                "data.text_fields=[premise, hypothesis]", "train.global_batch_size=1")
    assert raised.value.key == "data.label_field" and all(w in str(raised.value) for w in words), str(raised.value)


def test_an_evaluation_files_problem_is_named_by_its_own_key(model_dirs, tmp_path):
    bad = tmp_path / "eval.jsonl"
    bad.write_bytes(b'{"text": "a good row"}\n{"text": "a bad \xff\xfe row"}\n')
    with pytest.raises(ConfigError) as raised:
        sources(model_dirs.llama, f"data.path={CORPUS}", f"data.eval_path={bad}", "train.global_batch_size=2")
    assert raised.value.key == "data.eval_path" and f"{bad} is not UTF-8 text" in str(raised.value)


def test_the_order_is_a_seeded_shuffle_per_epoch_and_ranks_tile_the_batch(model_dirs):
    source = sources(model_dirs.llama, f"data.path={CORPUS}", "train.global_batch_size=8").train
    n = source.rows_per_epoch
    first_epoch = [i for step in range(n // 8) for i in source.indices(step, range(8))]
    assert len(set(first_epoch)) == len(first_epoch)  # no row twice within an epoch
    assert first_epoch != sorted(first_epoch)  # shuffled
    assert source.order(1).tolist() != source.order(0).tolist()  # reshuffled per epoch
    again = sources(model_dirs.llama, f"data.path={CORPUS}", "train.global_batch_size=8").train
    assert again.indices(5, range(8)) == source.indices(5, range(8))  # the same on every process and run
    for micros, world in ((1, 2), (2, 2), (4, 1), (2, 4)):
        parts = [i for micro in range(micros) for rank in range(world)
                 for i in micro_rows(8, micro, micros, rank, world)]
        assert parts == list(range(8)), (micros, world)


def test_eval_rows_are_held_out_of_training(model_dirs):
    got = sources(model_dirs.llama, f"data.path={CORPUS}", "data.eval_fraction=0.25", "train.global_batch_size=4")
    train_rows = {tuple(r) for r in got.train.table["input_ids"]}
    eval_rows = {tuple(r) for r in got.eval.table["input_ids"]}
    assert eval_rows and not train_rows & eval_rows


@pytest.mark.parametrize("task", ["causal_lm", "sequence_classification"])
def test_an_evaluation_set_with_nothing_to_predict_is_refused_before_training(task):
    """Every label masked (a causal LM's first label predicts nothing): said naming the eval key, not found
    as a division by zero after training."""
    from datasets import Dataset

    from xla_shard.data.source import EvalSource
    from xla_shard.data.source import check_eval_labels

    causal = task == "causal_lm"
    labels = [[5, -100, -100, -100]] * 3 if causal else [-100] * 3
    source = EvalSource(Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 3, "labels": labels}), batch=2)
    held_out = [f"data.path={FIXTURES / ('corpus.jsonl' if causal else 'nli.csv')}", "data.eval_fraction=0.1"]
    cfg = config.load(None, ["model.name=tiny-llama", *held_out] if causal else
                      ["model.name=tiny-bert", f"model.task={task}", "model.num_labels=2", *held_out,
                       "data.text_fields=[premise, hypothesis]"])
    with pytest.raises(ConfigError, match="no row of the evaluation set .3 rows. has a label") as refused:
        check_eval_labels(source, cfg)
    assert refused.value.key == "data.eval_fraction"
    one = [[5, -100, 7, -100]] if causal else [1]
    check_eval_labels(EvalSource(Dataset.from_dict({"input_ids": [[1, 2, 3, 4]], "labels": one}), batch=2), cfg)


@pytest.mark.e2e
def test_epochs_set_the_number_of_steps(model_dirs, tmp_path):
    out = tmp_path / "run"
    sets = [f"model.name={model_dirs.llama}", f"data.path={CORPUS}", "train.seq_len=32", "train.epochs=1.5",
            "train.global_batch_size=8", f"output_dir={out}", "cpu_devices=2", "train.lr_warmup_steps=500"]
    done = run_cli("train", *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "train.lr_warmup_steps=500 is not shorter than the run's" in done.stderr  # said, not silent
    rows = sources(model_dirs.llama, f"data.path={CORPUS}").train.rows_per_epoch
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == math.ceil(1.5 * rows / 8)
    assert records[-1]["epoch"] >= 1.5 > records[-2]["epoch"]


def test_a_bucket_serves_the_data(model_dirs, gcs):
    from xla_shard.io.storage import Storage

    url = gcs.url("data")
    Storage(url).write("corpus.jsonl", CORPUS.read_bytes())
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the tokenizer from a bucket too
        Storage(f"{url}/tokenizer").write(name, (model_dirs.llama / name).read_bytes())
    got = sources(model_dirs.llama, f"data.path={url}/corpus.jsonl",
                  f"data.tokenizer={url}/tokenizer").train.global_batch(2)
    want = sources(model_dirs.llama, f"data.path={CORPUS}").train.global_batch(2)
    assert torch.equal(got["input_ids"], want["input_ids"])


def test_streaming_packs_documents_as_read_and_repeats_exactly(model_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs.llama)
    docs = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    stream = [t for doc in docs for t in tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id]]
    unshuffled = sources(model_dirs.llama, f"data.path={CORPUS}", "data.streaming=true", "data.shuffle_buffer=1",
                         "train.global_batch_size=2").train
    assert unshuffled.global_batch(1)["input_ids"].tolist() == [stream[64:96], stream[96:128]]
    shuffled = sources(model_dirs.llama, f"data.path={CORPUS}", "data.streaming=true", "data.shuffle_buffer=8").train
    later = shuffled.global_batch(9)  # past the first epoch (57 blocks / 8 per batch)
    assert torch.equal(shuffled.global_batch(2)["input_ids"], sources(
        model_dirs.llama, f"data.path={CORPUS}", "data.streaming=true", "data.shuffle_buffer=8").train.global_batch(2)[
        "input_ids"])  # rewound and read again: the same rows
    assert torch.equal(shuffled.global_batch(9)["input_ids"], later["input_ids"])
    assert shuffled.global_batch(0)["input_ids"].tolist() != [stream[i * 32:(i + 1) * 32] for i in range(8)]


def test_a_stream_is_read_once_in_order_while_the_next_steps_are_prefetched(model_dirs, monkeypatch):
    """The trainer reads a step's rows and its real-token count together, in the prefetch thread
    (`Trainer._read`): a stream asked for a step behind the one it last read starts again from the top."""
    import functools
    import types

    from xla_shard.data import Prefetcher
    from xla_shard.data.stream import StreamSource
    from xla_shard.train import Trainer

    source = sources(model_dirs.llama, f"data.path={CORPUS}", "data.streaming=true",
                     "train.global_batch_size=2").train
    rewinds = []
    rewind = StreamSource._rewind
    monkeypatch.setattr(StreamSource, "_rewind", lambda self: (rewinds.append(1), rewind(self)))
    reader = types.SimpleNamespace(source=source, micro_batches=lambda step: [source.rows(step, range(2))])
    prefetch = Prefetcher(functools.partial(Trainer._read, reader), range(6))
    got = [prefetch.get(step) for step in range(6)]
    assert not rewinds
    assert all(real == 2 * 32 for _, real in got)  # packed blocks: every token real
    fresh = sources(model_dirs.llama, f"data.path={CORPUS}", "data.streaming=true", "train.global_batch_size=2").train
    for step, (batches, _) in enumerate(got):  # each step's own rows, as a stream read in order gives them
        assert torch.equal(batches[0]["input_ids"], fresh.global_batch(step)["input_ids"])


def test_padded_rows_cut_to_their_longest_give_the_same_loss():
    """Eager backends take each micro-batch cut to its longest row (`batches.trimmed`): the padding no row uses
    goes, and the model's loss is what it was (padding is masked and unlabelled); rows without a mask stay."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from xla_shard.data.batches import trimmed

    ids = torch.randint(3, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(3, 16, dtype=torch.long)
    for row, length in enumerate((9, 5, 11)):
        mask[row, :length] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    cut = trimmed(batch)
    assert {k: tuple(v.shape) for k, v in cut.items()} == {k: (3, 11) for k in batch}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**cut).loss, model(**batch).loss, rtol=1e-6, atol=0)
    packed = {"input_ids": ids, "labels": ids}
    assert trimmed(packed) is packed
