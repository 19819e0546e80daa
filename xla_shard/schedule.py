"""The learning rate at each optimizer step: linear warm-up, then constant, linear or cosine decay.

A pure function of the step, so a resumed run continues the schedule exactly from its checkpoint's step:
the step is the schedule's whole state. `lambda_lr` gives the same schedule as a torch LambdaLR for users
with their own loop.
"""

from __future__ import annotations

import math

import torch

from xla_shard.config.schema import TrainSection


def lr_factor(step: int, train: TrainSection, total_steps: int) -> float:
    """Multiplier of train.lr for optimizer step `step` (0-based) of `total_steps`."""
    warmup = train.lr_warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if train.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    shape = 1.0 - progress if train.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return train.lr_min_ratio + (1.0 - train.lr_min_ratio) * shape


def lambda_lr(optimizer: torch.optim.Optimizer, train: TrainSection, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, train, total_steps))
