"""Generated token batches (`data.path: synthetic`): no files, no tokenizer, for benchmarks and smoke runs."""

from __future__ import annotations

import torch

from xla_shard.data.batches import Batch


class SyntheticSource:
    """Arithmetic token sequences mod the vocabulary, a function of (seed, step): random enough to need
    training, regular enough that the loss falls. A classifier's label is the sequence's stride class."""

    rows_per_epoch = None  # endless

    def __init__(self, global_batch_size: int, seq_len: int, seed: int, vocab_size: int,
                 num_labels: int | None = None):
        self.batch, self.seq_len, self.seed, self.vocab = global_batch_size, seq_len, seed, vocab_size
        self.num_labels = num_labels

    def global_batch(self, step: int) -> Batch:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(0, self.vocab, (self.batch, 1), generator=gen)
        stride = torch.randint(1, 8, (self.batch, 1), generator=gen)
        tokens = (start + stride * torch.arange(self.seq_len)) % self.vocab
        if self.num_labels is None:
            return {"input_ids": tokens, "labels": tokens}
        return {"input_ids": tokens, "labels": stride[:, 0] % self.num_labels}

    def rows(self, step: int, rows: range) -> Batch:
        return {key: value[rows.start:rows.stop] for key, value in self.global_batch(step).items()}

    def real_tokens(self, step: int) -> int:
        """Tokens of the global batch of `step` that are not padding: all of them (nothing generated to count)."""
        return self.batch * self.seq_len
