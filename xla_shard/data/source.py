"""Token rows in a deterministic order, read a step at a time, each process only its own rows.

Position p of the stream (p = step * global_batch_size + row) is row perm(seed, epoch)[p mod N] of epoch
p // N: a fresh shuffle per epoch from (seed, epoch), the same on every process and backend. A resumed run
asks for the rows of its next step and gets exactly the samples it would have seen, by construction.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import torch

from xla_shard.data.batches import Batch
from xla_shard.data.packing import IGNORE
from xla_shard.errors import ConfigError


class DatasetSource:
    """Fixed-length token rows (a tokenized `datasets.Dataset`), shuffled per epoch."""

    def __init__(self, rows, global_batch_size: int, seed: int, shuffle: bool = True):
        self.table = rows.with_format("numpy")
        self.rows_per_epoch = len(rows)
        self.batch, self.seed, self.shuffle = global_batch_size, seed, shuffle
        self._orders: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def order(self, epoch: int) -> np.ndarray:
        with self._lock:
            if epoch not in self._orders:
                if len(self._orders) > 2:
                    self._orders.pop(min(self._orders))
                n = self.rows_per_epoch
                self._orders[epoch] = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                                       else np.arange(n))
            return self._orders[epoch]

    def indices(self, step: int, rows: range) -> list[int]:
        n = self.rows_per_epoch
        positions = [step * self.batch + r for r in rows]
        return [int(self.order(p // n)[p % n]) for p in positions]

    def rows(self, step: int, rows: range) -> Batch:
        """Rows `rows` of the global batch of `step` (a process reads these and nothing else)."""
        return _as_batch(self.table[self.indices(step, rows)])

    def global_batch(self, step: int) -> Batch:
        return self.rows(step, range(self.batch))

    def real_tokens(self, step: int) -> int:
        """Tokens of the global batch of `step` that are not packing's filler or padding."""
        return _real_tokens(self.table, self.indices(step, range(self.batch)))


def _real_tokens(table, picked: list[int]) -> int:
    """The real tokens of rows `picked` of a prepared table: packing's count, a padding mask's, or all of them."""
    if "real_tokens" in table.column_names:
        return int(np.asarray(table[picked]["real_tokens"]).sum())
    if "attention_mask" in table.column_names:
        return int(np.asarray(table[picked]["attention_mask"]).sum())
    return int(np.asarray(table[picked]["input_ids"]).size)


class EvalSource:
    """The evaluation rows, in file order, as batches of `batch` rows. Every row is evaluated: the last batch
    is filled up with copies of the first row whose labels are all ignored, so shapes stay static (XLA compiles
    one evaluation graph) and the filler counts for nothing in the loss or the accuracy."""

    def __init__(self, rows, batch: int):
        self.table = rows.with_format("numpy")
        self.batch = batch
        self.rows_total = len(rows)
        self.batches = -(-len(rows) // batch)

    def rows_covered(self, batches: int) -> int:
        return min(batches * self.batch, self.rows_total)

    def rows(self, index: int, rows: range) -> Batch:
        start = index * self.batch
        lo, hi = (min(start + r, self.rows_total) for r in (rows.start, rows.stop))
        filler = len(rows) - (hi - lo)
        if not filler:
            return _as_batch(self.table[lo:hi])
        template = _as_batch(self.table[0:1])
        padding = {key: value.expand(filler, *value.shape[1:]).clone() for key, value in template.items()}
        padding["labels"].fill_(IGNORE)
        if hi == lo:
            return padding
        real = _as_batch(self.table[lo:hi])
        return {key: torch.cat([real[key], padding[key]]) for key in real}


def _as_batch(picked: dict) -> Batch:
    """Columns as int64 tensors, the model's arguments (packing's `real_tokens` count is not one); packed
    causal-LM rows predict their own tokens (the model shifts them)."""
    batch = {key: torch.from_numpy(np.asarray(value)).long() for key, value in picked.items() if key != "real_tokens"}
    if "labels" not in batch:
        batch["labels"] = batch["input_ids"]
    return batch


class Prefetcher:
    """Reads the next steps' rows in a background thread while the current step runs."""

    def __init__(self, read, steps: range, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._steps = steps
        self._thread = threading.Thread(target=self._run, args=(read,), daemon=True)
        self._thread.start()

    def _run(self, read) -> None:
        for step in self._steps:
            try:
                self._queue.put((step, read(step), None))
            except BaseException as exc:  # handed to the consumer, raised there
                self._queue.put((step, None, exc))
                return

    def get(self, step: int):
        got, value, error = self._queue.get()
        if error is not None:
            raise error
        assert got == step, f"prefetched step {got}, wanted {step}"
        return value


def check_eval_labels(source, cfg) -> None:
    """An evaluation set with nothing to predict (every label masked: prompts without answers) is said before
    training, not found dividing by zero after it. (Generated completions, a prompt source's, have none to check.)"""
    if not getattr(source, "labelled", True):
        return
    causal = cfg.model.task == "causal_lm"
    for index in range(source.batches):
        labels = source.rows(index, range(source.batch))["labels"]
        if ((labels[..., 1:] if causal else labels) != IGNORE).any():
            return
    key = "data.eval_path" if cfg.data.eval_path else "data.eval_fraction"
    raise ConfigError(key, f"no row of the evaluation set ({source.rows_total} rows) has a label to predict: every "
                           "label is masked (a prompt without its answer, or an answer cut off by train.seq_len)")
