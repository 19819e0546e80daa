"""Batches and which rows of them each process takes.

A batch is a dict of row-aligned tensors, the model's keyword arguments: `input_ids`, `labels` (the tokens
themselves for a causal LM, which shifts them, with -100 where nothing is to be predicted; one class per row
for a classifier) and, for padded rows, `attention_mask` (and `token_type_ids` where the tokenizer makes them).
"""

from __future__ import annotations

import torch

from xla_shard.data.packing import IGNORE

Batch = dict[str, torch.Tensor]


def local_rows(batch: Batch | torch.Tensor, rank: int, world: int) -> Batch | torch.Tensor:
    """Rows [rank * n/world, (rank+1) * n/world) of a tensor, or of each tensor of a batch."""
    if isinstance(batch, dict):
        return {key: local_rows(value, rank, world) for key, value in batch.items()}
    rows = batch.shape[0] // world
    return batch[rank * rows:(rank + 1) * rows]


def micro_rows(global_batch_size: int, micro: int, micros: int, rank: int, world: int) -> range:
    """The rows of a step's global batch that process `rank` feeds in micro-batch `micro` of `micros`: the
    micro-batches tile the global batch, and each is split over the processes like a whole batch would be."""
    per_micro = global_batch_size // micros
    per_rank = per_micro // world
    start = micro * per_micro + rank * per_rank
    return range(start, start + per_rank)


def scored(labels: torch.Tensor, causal: bool) -> torch.Tensor:
    """Where a label counts in the model's own loss, which is a mean over these: a causal LM's from the second
    position on (it shifts them: the first is never predicted), a classifier's every row; never IGNORE."""
    return (labels[:, 1:] if causal else labels) != IGNORE


def real_tokens(batch: Batch) -> int:
    """Tokens of a batch that are not padding (its attention mask), all of them where it has none."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())


def trimmed(batch: Batch) -> Batch:
    """A right-padded batch cut to its longest row: the positions no row uses (its attention mask's) dropped from
    every tensor laid out by position. Nothing a row computes changes: padding is masked and unlabelled. Rows
    without a mask (packed, or cut to one length) are left as they are."""
    mask = batch.get("attention_mask")
    if mask is None:
        return batch
    used = mask.reshape(-1, mask.shape[-1]).any(0)
    length = int(used.nonzero().max()) + 1 if used.any() else 1
    if length == mask.shape[-1]:
        return batch
    return {key: value[..., :length] if value.shape[-1] == mask.shape[-1] and value.dim() == mask.dim() else value
            for key, value in batch.items()}


def process_rows(train, processes) -> list[range]:
    """The rows of every step's global batch a process feeds, in each of its micro-batches."""
    k = train.grad_accum_steps
    return [micro_rows(train.global_batch_size, j, k, *processes.batch_part) for j in range(k)]
