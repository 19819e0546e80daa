"""Rows of text -> fixed-length token rows, with `datasets.map` (cached, in parallel for large corpora).

Every output row has exactly `seq_len` tokens, so every step has the same shapes and XLA compiles the step
once: causal-LM documents are packed into blocks (or padded), classifier inputs padded or truncated.
"""

from __future__ import annotations

import os
from typing import Any

from xla_shard.data import packing as packer
from xla_shard.data.kind import RowKind
from xla_shard.data.packing import IGNORE
from xla_shard.errors import ConfigError

_PARALLEL_FROM = 10_000  # rows: below this, worker processes cost more than they save


def with_eos(doc: list[int], eos: int) -> list[int]:
    """A document's tokens ending in EOS once (tokenizers that add it themselves are not given a second)."""
    return doc if doc[-1:] == [eos] else doc + [eos]


def worker_count(rows: int, num_proc: int | None) -> int | None:
    if num_proc is not None:
        return num_proc if num_proc > 1 else None
    return min(os.cpu_count() or 1, 8) if rows >= _PARALLEL_FROM else None


def require_columns(rows, columns: list[str], key: str, path: str) -> None:
    missing = [c for c in columns if c not in rows.column_names]
    if missing:
        raise ConfigError(key, f"{path} has no column {missing[0]!r} (its columns: {', '.join(rows.column_names)})")


def causal_lm(rows, tokenizer, text_field: str, seq_len: int, packing: str | None, num_proc: int | None,
              path: str):
    """Packing `wrapped`: each document's tokens, then EOS, all joined and cut into `seq_len` blocks (the tail of
    each group of 1,000 documents that does not fill a block is dropped). `bfd` / `bfd_split`: each document and
    its EOS an example, packed best-fit decreasing (`data.packing`). Padding (None): one document per row, cut at
    `seq_len`, padded, with the padding masked and left out of the loss."""
    require_columns(rows, [text_field], "data.text_field", path)
    _require_text(rows, text_field, path, "data.text_field")
    workers = worker_count(len(rows), num_proc)
    if packing:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ConfigError("data.packing", "the tokenizer has no EOS token to separate packed documents; set "
                                              "data.packing: false (one padded document per row)")

        def tokenize(batch: dict[str, list]) -> dict[str, list]:
            ids = tokenizer(batch[text_field])["input_ids"]
            return {"ids": [with_eos(doc, eos) for doc in ids]}

        if packing != "wrapped":
            def examples(batch: dict[str, list]) -> dict[str, list]:
                ids = tokenize(batch)["ids"]
                return {"input_ids": ids, "labels": ids}

            documents = rows.map(examples, batched=True, remove_columns=rows.column_names, num_proc=workers)
            return packer.pack(documents, seq_len, eos, workers, split=packing == "bfd_split")

        def blocks(batch: dict[str, list]) -> dict[str, list]:
            stream = [token for doc in batch["ids"] for token in doc]
            cut = len(stream) // seq_len * seq_len
            return {"input_ids": [stream[i:i + seq_len] for i in range(0, cut, seq_len)]}

        tokenized = rows.map(tokenize, batched=True, remove_columns=rows.column_names, num_proc=workers)
        packed = tokenized.map(blocks, batched=True, batch_size=1000, remove_columns=["ids"], num_proc=workers)
        if len(packed) == 0:
            raise ConfigError("data.path", f"{path} holds fewer than train.seq_len={seq_len} tokens: not one block")
        return packed
    if tokenizer.pad_token_id is None:
        raise ConfigError("data.packing", "false pads each document, but the tokenizer has no pad token; use "
                                          "packing or a tokenizer with one")

    def padded(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(batch[text_field], truncation=True, max_length=seq_len, padding="max_length")
        encoded["labels"] = [[t if m else IGNORE for t, m in zip(ids, mask)]
                             for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])]
        return dict(encoded)

    return rows.map(padded, batched=True, remove_columns=rows.column_names, num_proc=workers)


def classification(rows, tokenizer, text_fields: list[str], label_field: str, label2id: dict[str, int],
                   num_labels: int, seq_len: int, num_proc: int | None, path: str):
    """One row per example: the text (or text pair) padded or cut to `seq_len`, and its label as an integer
    (strings through the model config's label2id)."""
    require_columns(rows, text_fields, "data.text_fields", path)
    require_columns(rows, [label_field], "data.label_field", path)
    for field in text_fields:
        _require_text(rows, field, path, "data.text_fields")
    if tokenizer.pad_token_id is None:
        raise ConfigError("data.tokenizer", "has no pad token, which classification rows need to be one length")
    labels = rows.unique(label_field)
    to_id = _label_map(labels, label2id, num_labels, label_field, path)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        texts = [batch[field] for field in text_fields]
        encoded = tokenizer(*texts, truncation=True, max_length=seq_len, padding="max_length")
        encoded["labels"] = [to_id[label] for label in batch[label_field]]
        return dict(encoded)

    return rows.map(encode, batched=True, remove_columns=rows.column_names, num_proc=worker_count(len(rows), num_proc))


def _label_map(labels: list[Any], label2id: dict[str, int], num_labels: int, field: str, path: str) -> dict:
    if any(label is None for label in labels):
        raise ConfigError("data.label_field", f"{path}: some rows have no {field!r}")
    if all(isinstance(label, int) and not isinstance(label, bool) for label in labels):
        wrong = sorted(label for label in labels if not 0 <= label < num_labels)
        if wrong:
            raise ConfigError("data.label_field", f"{path}: label {wrong[0]} is outside the model's {num_labels} "
                                                  f"labels (0..{num_labels - 1}); set model.num_labels")
        return {label: label for label in labels}
    unknown = sorted(str(label) for label in labels if str(label) not in label2id)
    if unknown:
        known = ", ".join(label2id) or "none"
        raise ConfigError("data.label_field", f"{path}: label {unknown[0]!r} is not in the model config's label2id "
                                              f"({known}); give the model an id2label naming it, or use integers")
    return {label: label2id[str(label)] for label in labels}


def _require_text(rows, field: str, path: str, key: str) -> None:
    kind = getattr(rows.features.get(field), "dtype", None)
    if kind not in ("string", "large_string"):
        raise ConfigError(key, f"{path}: column {field!r} holds {kind or rows.features.get(field)}, not text")
    column = rows.data.column(field)
    if column.null_count:  # a missing value (null in jsonl, an empty cell in some CSVs): no text to train on
        import pyarrow.compute as pc

        first = pc.index(pc.is_null(column), True).as_py()
        raise ConfigError(key, f"{path}: row {first} has no {field!r} (null; {column.null_count} row(s) in all); "
                               "every row needs its text")


class TextRows(RowKind):
    """data.kind text: a causal LM's documents (packed or padded), or a classifier's texts and labels."""

    def encode(self, cfg, tokenizer, model_config, rows, path, generations):
        data, seq_len = cfg.data, cfg.train.seq_len
        if cfg.model.task == "causal_lm":
            return causal_lm(rows, tokenizer, data.text_field, seq_len, data.packs, data.num_proc, path), 0
        return classification(rows, tokenizer, data.text_fields, data.label_field, dict(model_config.label2id or {}),
                              model_config.num_labels, seq_len, data.num_proc, path), 0

    def uneven_labels(self, cfg) -> bool:  # wrapped documents and classifier rows are labelled throughout
        return cfg.model.task == "causal_lm" and cfg.data.packs != "wrapped"

    def layout(self, cfg) -> str:
        packs = cfg.data.packs if cfg.model.task == "causal_lm" else None  # a classifier's rows are never packed
        if packs == "wrapped":
            return "documents joined and cut into rows (wrapped packing)"
        return f"documents packed best-fit decreasing ({packs})" if packs else "documents, one a row, padded"
