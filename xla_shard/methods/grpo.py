"""Group relative policy optimisation's arithmetic, as TRL's `GRPOTrainer` computes it: the group-relative
advantages of the rewards, and the clipped policy loss over the completions' tokens with its KL term.

A step's prompts each get `num_generations` completions; every completion's reward is the weighted sum of the
reward functions' scores. Its advantage is that reward less its group's mean, over the group's standard deviation
(`scale_rewards: group`), the whole batch's (`batch`) or nothing (`none`). The policy loss of a token is PPO's
clipped surrogate on the ratio of its probability now to the one it had when generated (`num_iterations` > 1
reuses a generation for several steps), plus beta times the k3 estimate of the KL divergence from the reference
(weighed by the same ratio, as TRL does by default).
The loss types differ only in what they average over: a sequence's tokens then the sequences (grpo), the
batch's tokens (bnpo), the rows times `max_completion_length` (dr_grpo), or every completion token of the
generation batch, across micro-batches and processes (dapo, TRL's default).

These are tensors in, tensors out, on the run's device: generation, the reward functions and the step around
them are the trainer's.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from xla_shard import lm_head

LossType = Literal["dapo", "grpo", "dr_grpo", "bnpo"]
RewardScale = Literal["group", "batch", "none"]
LOSS_TYPES: tuple[str, ...] = LossType.__args__
REWARD_SCALES: tuple[str, ...] = RewardScale.__args__
STD_FLOOR = 1e-4  # TRL's: added to the standard deviation a reward is divided by


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation with Bessel's correction over the values that are not NaN (NaN for fewer than two)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    count = (~values.isnan()).sum(dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    variance = torch.where(count > 1, variance, torch.full_like(variance, float("nan")))
    return variance.sqrt() if dim is None else variance.sqrt().squeeze(dim)


def advantages(scores: torch.Tensor, weights: torch.Tensor, num_generations: int,
               scale: RewardScale = "group") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each completion's advantage from `scores` ([completions, reward functions], NaN where a function did not
    score it; a group's completions are consecutive): (advantages, rewards, whether its scale was zero). A
    completion no function scored has a NaN reward, is left out of its group's mean and has no advantage."""
    if scale not in REWARD_SCALES:
        raise ValueError(f"grpo.scale_rewards is {scale!r}: one of {', '.join(REWARD_SCALES)}")
    unscored = scores.isnan().all(dim=1)
    rewards = (scores * weights.to(scores).unsqueeze(0)).nansum(dim=1)
    rewards[unscored] = float("nan")
    groups = rewards.view(-1, num_generations)
    baseline = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale == "batch":
        spread = (nanstd(rewards) if rewards.numel() > 1 else torch.zeros(())).expand_as(rewards)
    elif num_generations > 1:
        spread = nanstd(groups, dim=1).repeat_interleave(num_generations)
    else:
        spread = torch.zeros_like(rewards)
    found = rewards - baseline
    if scale != "none":
        found = found / (spread + STD_FLOOR)
    return torch.nan_to_num(found, nan=0.0), rewards, torch.isclose(spread, torch.zeros_like(spread))


def completion_log_probs(model: nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-probability under the sampling distribution, and its entropy ([rows, C] each,
    C the completion's tokens): the model's forward over prompt + completion, its head applied to the completion's
    positions alone, scored chunk by chunk where the model's head is (`lm_head`: the logits never whole)."""
    completion = batch["completion_mask"].shape[1]
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "logits_to_keep": completion + 1}
    head = lm_head.scorer(model)
    if head is None:
        logits = model(**inputs).logits[:, :-1][:, -completion:]
        return token_log_probs(logits, batch["input_ids"][:, -completion:], temperature)
    with head.scoring(batch["input_ids"][:, -(completion + 1):], temperature=temperature, entropies=True) as request:
        out = model(**inputs)
    request.tie(getattr(out, "logits", None))
    return request.logps, request.entropy


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's log-probability of its token under the sampling distribution (the logits over the
    temperature, in fp32), and that distribution's entropy (without gradient): ([rows, tokens] each)."""
    scaled = logits.float() / temperature
    log_probs = scaled.log_softmax(-1)
    picked = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():  # a metric: no graph (it would hold another [rows, tokens, vocabulary] until backward)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return picked, entropy


def policy_loss(logps: torch.Tensor, mask: torch.Tensor, advantage: torch.Tensor, *,
                old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                loss_type: LossType = "dapo", epsilon_low: float = 0.2, epsilon_high: float | None = None,
                beta: float = 0.0, kl_correction: bool = True, max_completion_length: int | None = None,
                tokens_in_step: float | None = None, importance_ratio: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's loss over its completions' tokens ([rows, tokens]: `logps` with gradient, `mask` 1 where
    a token counts, `advantage` [rows]), and per-token terms for TRL's metrics (`kl`, the `clip_ratio` flags).

    `old_logps`: the tokens' log-probabilities when generated (None: this is the step that generated them, the
    ratio is 1). `ref_logps`: the reference's, for `beta` > 0; `kl_correction` weighs each token's KL by its
    ratio, as the completion was drawn from the old policy (TRL's `use_bias_correction_kl`, on by default).
    Normalisers, as TRL's for one micro-batch of one process: dr_grpo divides by rows x `max_completion_length`;
    dapo by `tokens_in_step`, the completion tokens this micro-batch's share of the step holds (TRL's
    `num_items_in_batch` over processes and micro-batches). The step's loss is the sum of its micro-batches' for
    dapo, else their mean (the caller's). `importance_ratio` ([rows, tokens] or [rows, 1]): an inference engine's
    sampling corrected for (TRL's vllm_importance_sampling_correction), weighing each token's policy term, not
    its KL term."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"grpo.loss_type is {loss_type!r}: one of {', '.join(LOSS_TYPES)}")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    advantage = advantage.to(logps.dtype).unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * advantage, clipped * advantage)
    if importance_ratio is not None:
        per_token = per_token * importance_ratio.to(per_token.dtype)
    terms: dict[str, torch.Tensor] = {}
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("grpo.beta > 0 needs the reference's log-probabilities")
        gap = ref_logps - logps
        kl = torch.exp(gap) - gap - 1
        if kl_correction:
            kl = kl * ratio
        per_token = per_token + beta * kl
        terms["kl"] = kl.detach()
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("grpo.loss_type dr_grpo divides by max_completion_length: give it")
        loss = (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
    else:
        count = mask.sum() if tokens_in_step is None else torch.as_tensor(tokens_in_step, dtype=logps.dtype)
        loss = (per_token * mask).sum() / count.clamp(min=1.0)
    low = (ratio < 1 - epsilon_low) & (advantage < 0)
    high = (ratio > 1 + epsilon_high) & (advantage > 0)
    terms.update({"clip_ratio/low": low.detach().to(logps.dtype), "clip_ratio/high": high.detach().to(logps.dtype),
                  "clip_ratio/region": (low | high).detach().to(logps.dtype)})
    return loss, terms


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of `values` over the tokens `mask` counts (TRL's global masked mean, on one process)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)
