"""Sampling completions from the policy being trained, in shapes that never change: what an online method
(GRPO) generates with, on whatever backend the run trains on.

The prompts (left-padded) and the completions share one buffer of `prompt + max_new_tokens` positions, and the
keys and values a static cache of as many (transformers' `StaticCache`): the prompt's forward fills it, then each
token is a forward of one token at a position given as a device tensor. No shape grows with the completion: XLA
compiles the prompt's forward and the token's once, whatever the lengths, and a sharded model (FSDP2, SPMD) runs
them as it runs training's forward. A model whose forward takes no static cache samples with `cached=False`: a
forward over the whole buffer per token, its future positions masked out.

The token is drawn as transformers' `generate(do_sample=True)` draws it (temperature, then top-k, then top-p),
by the Gumbel-max trick with noise from a host `torch.Generator`: the draw is the same on every backend and
device, and the generator's state is what a checkpoint keeps to resume the same draws. A row's completion ends
at its first end-of-sequence token (kept, as TRL keeps it); the positions after it hold the pad token and are
masked out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: transformers' and TRL's names and defaults (top_k 0: off; top_p 1: off)."""

    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


def filtered(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[rows, vocab] fp32 logits over the temperature with what top-k and top-p leave out at -inf, as
    transformers' warpers do (each keeps at least one token)."""
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        dropped = ordered.softmax(-1).cumsum(-1) <= 1 - sampling.top_p
        dropped[..., -1] = False
        scores = scores.masked_fill(dropped.scatter(-1, order, dropped), float("-inf"))
    return scores


def gumbel_noise(shape: tuple[int, ...], generator: torch.Generator | Sequence[torch.Generator]) -> torch.Tensor:
    """-log(-log u) for u uniform in (0, 1), drawn on the host: argmax(scores + noise) samples softmax(scores).
    A generator per row (a sequence of them) draws each row's noise from its own: a row's draws then do not
    depend on which rows share its batch or its process."""
    if isinstance(generator, torch.Generator):
        uniform = torch.rand(shape, generator=generator, dtype=torch.float32)
    else:
        uniform = torch.stack([torch.rand(shape[1:], generator=each, dtype=torch.float32) for each in generator])
    uniform = uniform.clamp_(1e-20, 1.0 - 1e-7)
    return -torch.log(-torch.log(uniform))


@torch.no_grad()
def sample(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
           generator: torch.Generator | Sequence[torch.Generator], after_token=None,
           cached: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(completion ids, completion mask), [rows, max_new_tokens] each, on the prompts' device. `generator`: one
    for the batch, or one per row (see `gumbel_noise`). `after_token`:
    called after each token (XLA's step marker, so each token runs the one compiled forward). `cached`: keys and
    values in a static cache of prompt + max_new_tokens positions (one forward of one token per token); else a
    forward over the whole buffer per token (for a model whose forward takes no static cache)."""
    rows, prompt_len = prompt_ids.shape
    device, steps = prompt_ids.device, sampling.max_new_tokens
    total = prompt_len + steps
    ids = torch.cat([prompt_ids, torch.full((rows, steps), sampling.pad_token_id, dtype=prompt_ids.dtype,
                                            device=device)], 1)
    mask = torch.cat([prompt_mask, torch.zeros(rows, steps, dtype=prompt_mask.dtype, device=device)], 1)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    eos = torch.tensor(sampling.eos_token_ids, dtype=ids.dtype, device=device)
    positions = torch.arange(total, device=device)
    # numbered as generate numbers a left-padded row: from its first real token
    position_ids = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    was_training = model.training
    model.eval()
    try:
        if cached:
            from transformers import StaticCache

            cache = StaticCache(config=model.config, max_cache_len=total)
            logits = model(input_ids=prompt_ids, attention_mask=mask, position_ids=position_ids, cache=cache,
                           cache_position=positions[:prompt_len], use_cache=True).logits[:, -1]
            next_position = prompt_mask.sum(-1, keepdim=True)
        for step in range(steps):
            # the position written, as a device tensor: every token runs the same program
            at = torch.tensor([prompt_len + step], device=device)
            if not cached:
                whole = (torch.where(positions >= at, 1, mask).cumsum(-1) - 1).clamp(min=0)
                logits = model(input_ids=ids, attention_mask=mask, position_ids=whole).logits
                logits = logits.index_select(1, at - 1).squeeze(1)
            scores = filtered(logits, sampling)
            token = (scores + gumbel_noise(tuple(scores.shape), generator).to(device)).argmax(-1).to(ids.dtype)
            token = torch.where(done, sampling.pad_token_id, token)
            here = positions == at
            ids = torch.where(here, token[:, None], ids)
            mask = torch.where(here, (~done).to(mask.dtype)[:, None], mask)
            done = done | (token[:, None] == eos).any(-1)
            if cached and step + 1 < steps:
                logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_position,
                               cache=cache, cache_position=at, use_cache=True).logits[:, -1]
                next_position = next_position + 1
            if after_token is not None:
                after_token()
    finally:
        model.train(was_training)
    return ids[:, prompt_len:], mask[:, prompt_len:]
