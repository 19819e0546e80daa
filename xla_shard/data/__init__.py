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
    task = cfg.model.task
    labels = model_config.num_labels if task == "sequence_classification" else None
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
    try:
        train_rows, eval_rows, dropped, raw, raw_eval = _tokenized(cfg, tokenizer, model_config, task, generations)
    except UnicodeDecodeError as exc:  # arrow hands undecodable text on when the rows are first read
        raise ConfigError("data.path", f"{data.path} (or data.eval_path) is not UTF-8 text: byte {exc.start} of a "
                                       f"value cannot be decoded ({exc.reason})") from None
    evaluation = None
    if eval_rows is not None:
        if data.kind == "prompt":
            from xla_shard.data.prompts import PromptEvalSource

            evaluation = PromptEvalSource(eval_rows, raw_eval, tokenizer, generations, train.global_batch_size)
        else:
            evaluation = EvalSource(eval_rows, train.global_batch_size)
        if evaluation.batches == 0:
            raise ConfigError("data.eval_path" if data.eval_path else "data.eval_fraction",
                              f"gives no evaluation rows of train.seq_len={train.seq_len} tokens")
    rows = len(train_rows)
    if data.kind == "prompt":  # a prompt stands for its group of completions
        rows *= generations.per_prompt
    if rows < train.global_batch_size:
        raise ConfigError("data.path", f"{data.path} gives {rows} training rows of {train.seq_len} tokens, fewer "
                                       f"than one batch of train.global_batch_size={train.global_batch_size}")
    if data.kind == "prompt":
        from xla_shard.data.prompts import PromptSource

        return DataSources(PromptSource(train_rows, raw, tokenizer, generations, train.global_batch_size, train.seed),
                           evaluation,
                           description=f"{data.path}: {len(train_rows)} prompts, left-padded to "
                                       f"{generations.prompt_tokens(train.seq_len)} tokens, "
                                       f"{generations.per_prompt} completions each"
                                       + (f"; {dropped} prompt(s) longer dropped" if dropped else "")
                                       + (f", {len(eval_rows)} for evaluation" if eval_rows is not None else ""))
    if data.kind == "preference":
        what = "prompt + chosen and prompt + rejected, padded"
    elif task == "causal_lm" and data.packs == "wrapped":
        what = "documents joined and cut into rows (wrapped packing)"
    elif task == "causal_lm" and data.packs:
        what = (f"{'documents' if data.kind == 'text' else data.kind + ' examples'} packed best-fit decreasing "
                f"({data.packs})")
    else:
        what = f"{'documents' if data.kind == 'text' else data.kind + ' examples'}, one a row, padded"
    filled = real_fraction(train_rows, train.seq_len)
    fill = "" if filled is None else (f", {100 * filled:.1f}% of their tokens real (the rest "
                                      f"{'filler' if data.packs else 'padding'})")
    scope = {"text": "", "chat": "; loss on the assistant turns", "prompt_completion": "; loss on the completions",
             "preference": "; the loss on the completions' log-probabilities"}
    # A DPO loss is a mean over rows, every one of which counts: no tokens to weigh.
    uneven = task == "causal_lm" and data.kind != "preference" and (data.kind != "text" or data.packs != "wrapped")
    return DataSources(DatasetSource(train_rows, train.global_batch_size, train.seed), evaluation,
                       f"{data.path}: {rows} training rows of {train.seq_len} tokens: {what}{fill}"
                       + (f", {len(eval_rows)} for evaluation" if eval_rows is not None else "")
                       + (scope[data.kind] if data.completion_only_loss is not False else "")
                       + (f"; {dropped} example(s) dropped: nothing to learn within train.seq_len" if dropped else ""),
                       uneven_labels=uneven)


def real_fraction(rows, seq_len: int) -> float | None:
    """The share of the rows' tokens that are not filler or padding (None: every token is real)."""
    if "real_tokens" in rows.column_names:
        from xla_shard.data import packing

        return packing.fill_rate(rows, seq_len)
    if "attention_mask" in rows.column_names:
        import numpy as np

        mask = np.asarray(rows.with_format("numpy")["attention_mask"])
        return float(mask.mean()) if mask.size else None
    return None


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


def _tokenized(cfg, tokenizer, model_config, task, generations):
    """(training rows, evaluation rows or None, rows dropped, the raw training rows, the raw evaluation rows or
    None): the raw ones as split, so that a tokenized row's `row` indexes them."""
    from xla_shard.data import files, tokenize

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
        if data.kind == "preference":
            rows, cut = _preference_rows(cfg, tokenizer, rows, path)
            dropped += cut
            return rows
        if data.kind == "prompt":
            rows, cut = _prompt_rows(cfg, tokenizer, rows, path, generations)
            dropped += cut
            return rows
        if data.kind != "text":
            rows, cut = _sft_rows(cfg, tokenizer, model_config, rows, path)
            dropped += cut
            return rows
        if task == "causal_lm":
            return tokenize.causal_lm(rows, tokenizer, data.text_field, train.seq_len, data.packs, data.num_proc,
                                      path)
        return tokenize.classification(rows, tokenizer, data.text_fields, data.label_field,
                                       dict(model_config.label2id or {}), model_config.num_labels, train.seq_len,
                                       data.num_proc, path)

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


def _sft_rows(cfg, tokenizer, model_config, rows, path):
    """Chat or prompt/completion rows, tokenized as TRL does, then packed or padded to seq_len."""
    from xla_shard.data import completions, packing, tokenize

    data, seq_len = cfg.data, cfg.train.seq_len
    workers = tokenize.worker_count(len(rows), data.num_proc)
    examples, dropped = completions.examples(rows, tokenizer, completions.fields_of(data), seq_len, workers, path)
    pad = completions.pad_id(tokenizer)
    if data.packs:
        completions.require_position_ids(model_config)
        return packing.pack(examples, seq_len, pad, workers, split=data.packs == "bfd_split"), dropped
    return completions.padded(examples, seq_len, pad, workers), dropped


def _preference_rows(cfg, tokenizer, rows, path):
    """Prompt / chosen / rejected rows, tokenized as TRL's DPOTrainer does, both sequences of a row padded."""
    from xla_shard.data import completions, preference, tokenize

    workers = tokenize.worker_count(len(rows), cfg.data.num_proc)
    return preference.examples(rows, tokenizer, preference.fields_of(cfg.data), cfg.train.seq_len,
                               completions.pad_id(tokenizer), workers, path)


def _prompt_rows(cfg, tokenizer, rows, path, generations):
    """Prompts alone, tokenized as TRL's GRPOTrainer does, left-padded to what the completion leaves of seq_len."""
    from xla_shard.data import completions, prompts, tokenize

    workers = tokenize.worker_count(len(rows), cfg.data.num_proc)
    return prompts.examples(rows, tokenizer, prompts.fields_of(cfg.data),
                            generations.prompt_tokens(cfg.train.seq_len), completions.pad_id(tokenizer),
                            workers, path, generations.length_key)


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
