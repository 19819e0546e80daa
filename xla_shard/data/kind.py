"""What every data.kind's rows implement (`RowKind`): raw rows -> token rows, the sources a run reads them
from, and the line the run's log says of them. One subclass per kind, in the kind's module; the registry
(`config.data_kinds.KINDS`) names it."""

from __future__ import annotations

import importlib
from typing import Any

from xla_shard.config.data_kinds import KINDS


class RowKind:
    loss_scope = ""  # what the loss covers, said in the data line (where data.completion_only_loss is not false)

    def __init__(self, name: str):
        self.name = name

    def encode(self, cfg, tokenizer, model_config, rows, path: str, generations) -> tuple[Any, int]:
        """(token rows, examples dropped) from the raw rows of `path`, each row `train.seq_len` tokens."""
        raise NotImplementedError

    def training_rows(self, encoded: int, generations) -> int:
        """The training rows `encoded` token rows give a step's batch."""
        return encoded

    def train_source(self, cfg, rows, raw, tokenizer, generations):
        from xla_shard.data.source import DatasetSource

        return DatasetSource(rows, cfg.train.global_batch_size, cfg.train.seed)

    def eval_source(self, cfg, rows, raw, tokenizer, generations):
        from xla_shard.data.source import EvalSource

        return EvalSource(rows, cfg.train.global_batch_size)

    def uneven_labels(self, cfg) -> bool:
        """Whether rows can hold different numbers of labelled tokens (answers only, padding): a fact of the data,
        which an objective whose loss is such a mean weighs its micro-batches by."""
        return True

    def layout(self, cfg) -> str:
        """How the examples sit in the rows."""
        packs, examples = cfg.data.packs, f"{self.name} examples"
        return f"{examples} packed best-fit decreasing ({packs})" if packs else f"{examples}, one a row, padded"

    def describe(self, cfg, rows, count: int, evaluated: int | None, dropped: int, generations) -> str:
        """The run's data line: `count` training rows (`rows`, as encoded), `evaluated` rows for evaluation."""
        from xla_shard.data.packing import real_fraction

        data, seq_len = cfg.data, cfg.train.seq_len
        filled = real_fraction(rows, seq_len)
        fill = "" if filled is None else (f", {100 * filled:.1f}% of their tokens real (the rest "
                                          f"{'filler' if data.packs else 'padding'})")
        return (f"{data.path}: {count} training rows of {seq_len} tokens: {self.layout(cfg)}{fill}"
                + (f", {evaluated} for evaluation" if evaluated is not None else "")
                + (self.loss_scope if data.completion_only_loss is not False else "")
                + (f"; {dropped} example(s) dropped: nothing to learn within train.seq_len" if dropped else ""))


def row_kind(name: str) -> RowKind:
    module, _, cls = KINDS[name].rows.partition(":")
    return getattr(importlib.import_module(module), cls)(name)
