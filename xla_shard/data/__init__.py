"""What the model trains and evaluates on: synthetic tokens, or the user's files through their tokenizer.

`build` turns the config's `data` section into a training source (rows of any step, for any process) and,
if asked for, an evaluation source; both yield batches of `seq_len`-token rows (see `batches`).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xla_shard.data.batches import Batch, local_rows, micro_rows, process_rows
from xla_shard.data.kind import row_kind
from xla_shard.data.source import DatasetSource, EvalSource, Prefetcher
from xla_shard.data.synthetic import SyntheticSource
from xla_shard.errors import ConfigError, one_line
from xla_shard.io.model_dir import copy_companions, refuse_untrusted
from xla_shard.io.storage import Storage

__all__ = ["Batch", "DataSources", "DatasetSource", "EvalSource", "Prefetcher", "SyntheticSource", "build",
           "load_tokenizer", "local_rows", "micro_rows", "process_rows"]


@dataclass
class DataSources:
    train: Any  # SyntheticSource | DatasetSource
    eval: EvalSource | None = None
    description: str = "synthetic tokens"
    # Rows can hold different numbers of labelled tokens (answers only, padding), so the step weighs its
    # micro-batches by them; packed text and classifier rows are labelled throughout.
    uneven_labels: bool = False


def build(cfg, model_config, model_directory: str | None = None, generations=None) -> DataSources:
    """The sources for a run: `model_config` is the transformers config of the model being trained (its
    vocabulary and labels), `model_directory` the directory it came from, whose tokenizer is the default.
    Processes of one host call it one after the other (`backend.processes.main_first`): the first tokenizes and
    fills the `datasets` cache, the others read it. `generations` (`prompts.Generations`): what a method that
    generates its completions asks of prompt rows (its `Method.generations`)."""
    data, train = cfg.data, cfg.train
    labels = model_config.num_labels if cfg.model.task == "sequence_classification" else None
    if data.path == "synthetic":
        return DataSources(SyntheticSource(train.global_batch_size, train.seq_len, train.seed,
                                           model_config.vocab_size, labels))
    from xla_shard.data.files import resolve_files

    for key, path in (("data.path", data.path), ("data.eval_path", data.eval_path)):
        if path:
            resolve_files(path, key)  # a missing file is named before anything else is tried
    tokenizer = load_tokenizer(data.tokenizer or model_directory, model_config, explicit=data.tokenizer is not None,
                               model_name=cfg.model.name)
    if data.streaming:
        return _streamed(cfg, tokenizer, model_config)
    kind = row_kind(data.kind)
    try:
        train_rows, eval_rows, dropped, raw, raw_eval = _tokenized(cfg, kind, tokenizer, model_config, generations)
    except UnicodeDecodeError as exc:  # arrow hands undecodable text on when the rows are first read
        raise ConfigError("data.path", f"{data.path} (or data.eval_path) is not UTF-8 text: byte {exc.start} of a "
                                       f"value cannot be decoded ({exc.reason})") from None
    evaluation = None
    if eval_rows is not None:
        evaluation = kind.eval_source(cfg, eval_rows, raw_eval, tokenizer, generations)
        if evaluation.batches == 0:
            raise ConfigError("data.eval_path" if data.eval_path else "data.eval_fraction",
                              f"gives no evaluation rows of train.seq_len={train.seq_len} tokens")
    rows = kind.training_rows(len(train_rows), generations)
    if rows < train.global_batch_size:
        raise ConfigError("data.path", f"{data.path} gives {rows} training rows of {train.seq_len} tokens, fewer "
                                       f"than one batch of train.global_batch_size={train.global_batch_size}")
    evaluated = len(eval_rows) if eval_rows is not None else None
    return DataSources(kind.train_source(cfg, train_rows, raw, tokenizer, generations), evaluation,
                       kind.describe(cfg, train_rows, rows, evaluated, dropped, generations),
                       uneven_labels=kind.uneven_labels(cfg))


def _streamed(cfg, tokenizer, model_config) -> DataSources:
    import datasets

    from xla_shard.data import files
    from xla_shard.data.stream import StreamSource

    data, train = cfg.data, cfg.train
    if cfg.model.task != "causal_lm":
        raise ConfigError("data.streaming", "streams causal-LM corpora; classification rows are prepared up front "
                                            "(set it to false)")
    paths = files.resolve_files(data.path, "data.path")
    builder = files.BUILDERS[files.file_format(paths, data.format, "data.path")]
    paths = [files.local_copy(p) if "://" in p else p for p in paths]

    def open_stream(epoch: int):
        rows = datasets.load_dataset(builder, data_files=paths, split="train", streaming=True)
        rows = rows.shuffle(seed=train.seed, buffer_size=data.shuffle_buffer)
        rows.set_epoch(epoch)
        return rows

    source = StreamSource(open_stream, tokenizer, data.text_field, train.seq_len, data.packing,
                          train.global_batch_size, data.path)
    evaluation = None
    if data.eval_path:
        from xla_shard.data import tokenize

        raw_eval = files.read_rows(data.eval_path, data.format, "data.eval_path")
        evaluation = EvalSource(tokenize.causal_lm(raw_eval, tokenizer, data.text_field, train.seq_len, data.packs,
                                                   data.num_proc, data.eval_path), train.global_batch_size)
    return DataSources(source, evaluation, f"{data.path}: streamed, tokenized as read (shuffle buffer "
                                           f"{data.shuffle_buffer} rows)", uneven_labels=not data.packing)


def _tokenized(cfg, kind, tokenizer, model_config, generations):
    """(training rows, evaluation rows or None, rows dropped, the raw training rows, the raw evaluation rows or
    None): the raw ones as split, so that a tokenized row's `row` indexes them."""
    from xla_shard.data import files

    data, train = cfg.data, cfg.train
    raw = files.read_rows(data.path, data.format, "data.path")
    raw_eval = files.read_rows(data.eval_path, data.format, "data.eval_path") if data.eval_path else None
    if data.eval_fraction:
        if math.ceil(len(raw) * data.eval_fraction) >= len(raw):  # held out as datasets counts it
            raise ConfigError("data.eval_fraction", f"{data.eval_fraction:g} of the {len(raw)} rows of {data.path} "
                                                    "leaves no training rows")
        split = raw.train_test_split(test_size=data.eval_fraction, seed=train.seed, shuffle=True)
        raw, raw_eval = split["train"], split["test"]

    dropped = 0

    def encode(rows, path):
        nonlocal dropped
        rows, cut = kind.encode(cfg, tokenizer, model_config, rows, path, generations)
        dropped += cut
        return rows

    train_rows = encode(raw, data.path)
    if raw_eval is None:
        return train_rows, None, dropped, raw, None
    try:
        return train_rows, encode(raw_eval, data.eval_path or data.path), dropped, raw, raw_eval
    except ConfigError as exc:  # the evaluation file's problem is named by its own key
        if data.eval_path and exc.key == "data.path":
            raise ConfigError("data.eval_path", exc.message, exc.backend) from None
        raise
    except UnicodeDecodeError as exc:
        if not data.eval_path:
            raise
        raise ConfigError("data.eval_path", f"{data.eval_path} is not UTF-8 text: byte {exc.start} of a value "
                                            f"cannot be decoded ({exc.reason})") from None


def load_tokenizer(location: str | None, model_config, explicit: bool, model_name: str):
    """A transformers tokenizer from a directory (local, or a URL whose tokenizer files are copied to a
    temporary directory first), checked against the model's embedding. Its files are untrusted input: no code
    from them runs, and whatever fails to parse in them is one error naming the key."""
    from transformers import AutoTokenizer

    key = "data.tokenizer" if explicit else "model.name"
    if location is None:
        raise ConfigError("data.tokenizer", f"model.name {model_name!r} is not a model directory, so it has no "
                                            "tokenizer: name one (a directory save_pretrained wrote)")
    if "://" not in location and not Path(location).is_dir():
        raise ConfigError(key, f"{location} is not a directory holding a tokenizer (nothing is downloaded: name a "
                               "directory save_pretrained wrote, local or at a URL)")
    local = _local_copy(location, key) if "://" in location else location
    refuse_untrusted(Storage(local), key, shown=location)
    try:
        tokenizer = AutoTokenizer.from_pretrained(local, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - a damaged tokenizer file fails in many ways, all the user's to fix
        raise ConfigError(key, f"no tokenizer could be loaded from {location}: {type(exc).__name__}: "
                               f"{one_line(exc)[:300]}") from None
    largest = max([len(tokenizer) - 1, *tokenizer.get_vocab().values()])  # added tokens included
    if largest >= model_config.vocab_size:
        raise ConfigError(key, f"the tokenizer at {location} has token ids up to {largest} ({len(tokenizer)} tokens); "
                               f"the model's embedding has {model_config.vocab_size} rows, so those ids would be out "
                               "of range (XLA would clamp them silently)")
    return tokenizer


def _local_copy(url: str, key: str) -> str:
    target = tempfile.mkdtemp(prefix="xla_shard_tokenizer_")
    if not copy_companions(url, Storage(target), extra=("config.json",)):
        raise ConfigError(key, f"{url} holds no tokenizer files")
    return target
