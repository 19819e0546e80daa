"""Token batches that depend only on (seed, step): every backend and world size sees the same global batch,
and a resumed run continues at the same data position by construction."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from xla_shard.config.load import read_utf8
from xla_shard.config.schema import TrainSection
from xla_shard.errors import ConfigError


class TokenSource:
    """`global_batch(step)` -> int64 [global_batch_size, seq_len]; ranks slice their rows from it."""

    def __init__(self, train: TrainSection, vocab_size: int):
        self.batch, self.seq_len, self.seed, self.vocab = train.global_batch_size, train.seq_len, train.seed, vocab_size
        self.tokens = None if train.data == "synthetic" else _byte_tokens(train.data, train.seq_len)
        if self.tokens is not None and vocab_size < 256:
            raise ConfigError("train.data", f"byte-level text needs a vocabulary of at least 256, the model has "
                                            f"{vocab_size}")

    def global_batch(self, step: int) -> torch.Tensor:
        if self.tokens is None:
            return self._synthetic(step)
        n = self.tokens.numel() - self.seq_len
        starts = [((step * self.batch + row) * self.seq_len) % n for row in range(self.batch)]
        return torch.stack([self.tokens[s:s + self.seq_len] for s in starts])

    def _synthetic(self, step: int) -> torch.Tensor:
        # Arithmetic sequences mod vocab: random enough to need training, regular enough that loss falls.
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(0, self.vocab, (self.batch, 1), generator=gen)
        stride = torch.randint(1, 8, (self.batch, 1), generator=gen)
        return (start + stride * torch.arange(self.seq_len)) % self.vocab


def local_rows(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    rows = batch.shape[0] // world
    return batch[rank * rows:(rank + 1) * rows]


def _byte_tokens(path: str, seq_len: int) -> torch.Tensor:
    file = Path(path)
    if not file.is_file():
        raise ConfigError("train.data", f"expected 'synthetic' or a local .txt/.jsonl file; no file at {path}")
    if file.suffix == ".jsonl":
        text = read_utf8(file, "train.data", "JSON lines must be UTF-8")
        texts = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                texts.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError("train.data", f"{path}:{number} is not a JSON object with a 'text' field") from None
        data = "\n".join(texts).encode()
    else:
        data = file.read_bytes()
    if len(data) <= seq_len:
        raise ConfigError("train.data", f"{path} holds {len(data)} bytes, fewer than train.seq_len={seq_len} + 1")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
