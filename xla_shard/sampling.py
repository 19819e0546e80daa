"""Sampling completions from the policy being trained, in shapes that never change: what an online method
(GRPO) generates with, on whatever backend the run trains on.

The prompts (left-padded) and the completions share one buffer of `prompt + max_new_tokens` positions, and the
keys and values a static cache of as many (transformers' `StaticCache`): the prompt's forward fills it, then each
token is a forward of one token at a position given as a device tensor. No shape grows with the completion: XLA
compiles the prompt's forward and the token's once, whatever the lengths, and a sharded model (FSDP2, SPMD) runs
them as it runs training's forward. A model whose forward takes no static cache samples with `cached=False`: a
forward over the whole buffer per token, its future positions masked out.

No work the answer does not need: rows that share a prompt (a GRPO group) run its forward once and share its
cache; the token loop ends once every row has ended (checked every `check_every` tokens: one small read of the
device's answer, where a check per token would wait on every step).

The token is drawn as transformers' `generate(do_sample=True)` draws it (temperature, then top-k, then top-p),
by the Gumbel-max trick with noise computed on the device from the row's key, the token's position and the
vocabulary index (a counter-based hash in integer arithmetic): the same draw on every backend, device and process
count, nothing copied from the host per token, and nothing to checkpoint (a row's key is derived from what the
run already knows: its seed, the generation and the row's place). A row's completion ends at its first
end-of-sequence token (kept, as TRL keeps it); the positions after it hold the pad token and are masked out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: transformers' and TRL's names and defaults (top_k 0: off; top_p 1: off).
    `check_every`: tokens between two checks whether every row has ended."""

    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    check_every: int = 8


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


def row_keys(stream: Sequence[int], places: Sequence[int]) -> torch.Tensor:
    """Each row's noise key (int64 [rows]), from the stream it belongs to (train.seed, the generation, ...) and its
    place: a row's draws do not depend on which rows share its batch or its process."""
    return torch.tensor([int(np.random.SeedSequence([*stream, place]).generate_state(1, np.uint64)[0] >> 1)
                         for place in places], dtype=torch.int64)


_LOW32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # below 2**27: a 32-bit value times it stays inside int64, on every device


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 tensors holding 32-bit values."""
    x = ((x >> 16) ^ x) * _MULTIPLIER & _LOW32
    x = ((x >> 16) ^ x) * _MULTIPLIER & _LOW32
    return (x >> 16) ^ x


def gumbel_noise(keys: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """-log(-log u), u uniform in (0, 1), for each row (`keys`, int64 [rows]) and vocabulary index at `position`
    (a device tensor, so every token runs one program: [1], or [rows], a position each), [rows, vocab] fp32 on
    the keys' device: argmax(scores + noise) samples softmax(scores). Integer arithmetic alone up to the uniform:
    the same bits on every device."""
    low, high = keys & _LOW32, (keys >> 32) & _LOW32
    row = _mix(_mix(low ^ _mix(high)) ^ (position.to(torch.int64) & _LOW32))[:, None]
    index = _mix(torch.arange(vocab, device=keys.device, dtype=torch.int64) + 0x9E3779B9 & _LOW32)
    bits = _mix(_mix(row ^ index) ^ high[:, None])
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * 2.0 ** -24
    return -torch.log(-torch.log(uniform))


def shared_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """The largest g such that each block of g consecutive rows holds one prompt (host tensors): their forward runs
    once and its cache is shared."""
    rows = prompt_ids.shape[0]
    for g in sorted((d for d in range(1, rows + 1) if rows % d == 0), reverse=True):
        ids, mask = prompt_ids.view(rows // g, g, -1), prompt_mask.view(rows // g, g, -1)
        if torch.equal(ids, ids[:, :1].expand_as(ids)) and torch.equal(mask, mask[:, :1].expand_as(mask)):
            return g
    return 1


def _share(cache, group: int) -> None:
    """The static cache filled for one row of each group, repeated for the group's rows."""
    for layer in cache.layers:
        layer.keys = layer.keys.repeat_interleave(group, 0)
        layer.values = layer.values.repeat_interleave(group, 0)
        layer.batch_size = layer.keys.shape[0]


@torch.no_grad()
def sample(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
           keys: torch.Tensor, after_token=None, cached: bool = True, group: int = 1,
           agreed: Callable[[bool], bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(completion ids, completion mask), [rows, max_new_tokens] each, on the prompts' device. `keys`: each row's
    noise key (`row_keys`). `after_token`: called after each token (XLA's step marker, so each token runs the one
    compiled forward). `cached`: keys and values in a static cache of prompt + max_new_tokens positions (one
    forward of one token per token); else a forward over the whole buffer per token (for a model whose forward
    takes no static cache). `group`: consecutive rows that share one prompt (`shared_prompts`). `agreed`: whether
    every process's rows have ended, given whether this one's have (processes that sample apart stop together: a
    sharded forward of one would wait on the others); None: this process's alone."""
    rows, prompt_len = prompt_ids.shape
    device, steps = prompt_ids.device, sampling.max_new_tokens
    total = prompt_len + steps
    keys = keys.to(device)
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
            shared = slice(None, None, group)
            logits = model(input_ids=prompt_ids[shared], attention_mask=mask[shared],
                           position_ids=position_ids[shared], cache=cache, cache_position=positions[:prompt_len],
                           use_cache=True).logits[:, -1]
            if group > 1:
                _share(cache, group)
                logits = logits.repeat_interleave(group, 0)
            next_position = prompt_mask.sum(-1, keepdim=True)
        for step in range(steps):
            # the position written, as a device tensor: every token runs the same program
            at = torch.tensor([prompt_len + step], device=device)
            if not cached:
                whole = (torch.where(positions >= at, 1, mask).cumsum(-1) - 1).clamp(min=0)
                logits = model(input_ids=ids, attention_mask=mask, position_ids=whole).logits
                logits = logits.index_select(1, at - 1).squeeze(1)
            scores = filtered(logits, sampling)
            token = (scores + gumbel_noise(keys, at, scores.shape[-1])).argmax(-1).to(ids.dtype)
            token = torch.where(done, sampling.pad_token_id, token)
            here = positions == at
            ids = torch.where(here, token[:, None], ids)
            mask = torch.where(here, (~done).to(mask.dtype)[:, None], mask)
            done = done | (token[:, None] == eos).any(-1)
            if after_token is not None:
                after_token()
            if step + 1 == steps or ((step + 1) % sampling.check_every == 0 and
                                     (agreed or bool)(bool(done.all()))):
                break
            if cached:
                logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_position,
                               cache=cache, cache_position=at, use_cache=True).logits[:, -1]
                next_position = next_position + 1
    finally:
        model.train(was_training)
    return ids[:, prompt_len:], mask[:, prompt_len:]
