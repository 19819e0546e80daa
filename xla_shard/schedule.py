"""The learning rate at each optimizer step: linear warm-up, then constant, linear or cosine decay, as the
transformers schedulers of those names give it (`get_constant_schedule_with_warmup`,
`get_linear_schedule_with_warmup`, `get_cosine_schedule_with_warmup`, and with `lr_min_ratio`,
`get_cosine_with_min_lr_schedule_with_warmup`'s `min_lr_rate`), so a recipe ported from the Trainer or TRL
trains on the same curve.

A pure function of the step, so a resumed run continues the schedule exactly from its checkpoint's step:
the step and the warm-up rule (recorded in each checkpoint) are the schedule's whole state. `lambda_lr` gives
the same schedule as a torch LambdaLR for users with their own loop; `make_optimizer` the optimizer it drives.
"""

from __future__ import annotations

import math

import torch

from xla_shard.config.schema import TrainSection

# Optimizer step k of the warm-up (0-based) runs at lr x k / lr_warmup_steps, as transformers': the first step at
# 0, lr reached at step lr_warmup_steps. Checkpoints written before this rule record none; their runs went one
# step ahead, lr x (k + 1) / lr_warmup_steps, and a resume mid-warm-up continues on that rule.
WARMUP_RULE = "k/warmup"
EARLIER_WARMUP_RULE = "(k+1)/warmup"


def lr_factor(step: int, train: TrainSection, total_steps: int, warmup_rule: str = WARMUP_RULE) -> float:
    """Multiplier of train.lr for optimizer step `step` (0-based) of `total_steps`."""
    warmup = train.lr_warmup_steps
    if step < warmup:
        return (step + (warmup_rule == EARLIER_WARMUP_RULE)) / warmup
    if train.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    shape = 1.0 - progress if train.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return train.lr_min_ratio + (1.0 - train.lr_min_ratio) * shape


def lambda_lr(optimizer: torch.optim.Optimizer, train: TrainSection, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, train, total_steps))


def make_optimizer(params, train: TrainSection, accelerator: str = "cpu") -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if train.optimizer == "sgd":
        return torch.optim.SGD(params, lr=train.lr, weight_decay=train.weight_decay)
    # On CPUs and TPUs, foreach=False: the same kernels on every backend (XLA and DTensor take different
    # foreach paths), which the cross-backend tests compare. On GPUs torch's default multi-tensor kernels: one
    # launch per group instead of several per parameter (6% of a 1B-parameter step on an H100).
    return torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay,
                             foreach=None if accelerator == "cuda" else False)
