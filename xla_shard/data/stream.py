"""`data.streaming`: a causal-LM corpus tokenized as it is read, for corpora not worth preparing up front.

`datasets` streams the files (an `IterableDataset`) through a seeded shuffle buffer reshuffled per epoch;
documents are tokenized in groups and packed into `seq_len` blocks on the fly (a block may span documents and
epochs never drop a tail). The sequence of blocks is a function of (files, seed, buffer size), so a resumed
run re-reads the stream up to its step and continues at exactly the next block; every process reads the
whole stream and keeps its own rows of each batch. Nothing is cached: a restart pays the skip.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from xla_shard.data.batches import Batch, real_tokens
from xla_shard.data.tokenize import IGNORE, with_eos
from xla_shard.errors import ConfigError

_GROUP = 256  # documents tokenized per tokenizer call


class StreamSource:
    """Global batches in order, read from a stream; `rows(step, ...)` for steps in increasing order (the
    trainer's), rewinding to the start when asked for an earlier one."""

    rows_per_epoch = None  # unknown until the stream ends

    def __init__(self, open_stream, tokenizer, text_field: str, seq_len: int, packing: bool, global_batch_size: int,
                 path: str):
        self.open_stream, self.tokenizer = open_stream, tokenizer
        self.text_field, self.seq_len, self.packing, self.batch, self.path = text_field, seq_len, packing, \
            global_batch_size, path
        if packing and tokenizer.eos_token_id is None:
            raise ConfigError("data.packing", "the tokenizer has no EOS token to separate packed documents")
        if not packing and tokenizer.pad_token_id is None:
            raise ConfigError("data.packing", "false pads each document, but the tokenizer has no pad token")
        self._rewind()

    def _rewind(self) -> None:
        self._blocks = self._all_epochs()
        self._next_step = 0
        self._cached: tuple[int, Batch] | None = None

    def _all_epochs(self) -> Iterator[dict[str, list[int]]]:
        for epoch in itertools.count():
            produced = False
            for block in self._blocks_of(self.open_stream(epoch)):
                produced = True
                yield block
            if not produced:
                raise ConfigError("data.path", f"{self.path} holds fewer than train.seq_len={self.seq_len} tokens")

    def _blocks_of(self, rows) -> Iterator[dict[str, list[int]]]:
        carry: list[int] = []
        eos = self.tokenizer.eos_token_id
        iterator = iter(rows)
        while group := list(itertools.islice(iterator, _GROUP)):
            texts = [row.get(self.text_field) for row in group]
            if not all(isinstance(text, str) for text in texts):
                bad = next(t for t in texts if not isinstance(t, str))
                raise ConfigError("data.text_field", f"{self.path}: a row's {self.text_field!r} is "
                                                     f"{type(bad).__name__}, not text "
                                                     f"(its keys: {', '.join(group[0])})")
            if self.packing:
                for doc in self.tokenizer(texts)["input_ids"]:
                    carry += with_eos(doc, eos)
                    while len(carry) >= self.seq_len:
                        yield {"input_ids": carry[:self.seq_len]}
                        carry = carry[self.seq_len:]
            else:
                encoded = self.tokenizer(texts, truncation=True, max_length=self.seq_len, padding="max_length")
                for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"]):
                    yield {"input_ids": ids, "attention_mask": mask,
                           "labels": [t if m else IGNORE for t, m in zip(ids, mask)]}

    def global_batch(self, step: int) -> Batch:
        if self._cached and self._cached[0] == step:
            return self._cached[1]
        if step < self._next_step:
            self._rewind()
        while self._next_step <= step:  # steps before the one asked for are read and dropped (a resume)
            rows = list(itertools.islice(self._blocks, self.batch))
            self._next_step += 1
        batch = {key: torch.tensor([row[key] for row in rows]) for key in rows[0]}
        batch.setdefault("labels", batch["input_ids"])
        self._cached = (step, batch)
        return batch

    def rows(self, step: int, rows: range) -> Batch:
        return {key: value[rows.start:rows.stop] for key, value in self.global_batch(step).items()}

    def real_tokens(self, step: int) -> int:
        """Tokens of the global batch of `step` that are not padding."""
        return real_tokens(self.global_batch(step))
