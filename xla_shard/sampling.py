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

import inspect
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


@dataclass(frozen=True)
class Generation:
    """One generation's shape: `rows` completions (every process's), each of up to `sampling.max_new_tokens`
    tokens after a left-padded prompt of `prompt_len` positions, `group` consecutive rows sharing one prompt."""

    sampling: Sampling
    rows: int
    prompt_len: int
    group: int = 1


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


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >> bits as a shift: torch_xla lowers the operator `>>` to a division, which the TPU compiler expands for
    int64 into hundreds of ops per element (a token's program compiled 5-15x slower for it)."""
    return torch.bitwise_right_shift(x, bits)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 tensors holding 32-bit values."""
    x = (_shr(x, 16) ^ x) * _MULTIPLIER & _LOW32
    x = (_shr(x, 16) ^ x) * _MULTIPLIER & _LOW32
    return _shr(x, 16) ^ x


def gumbel_noise(keys: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """-log(-log u), u uniform in (0, 1), for each row (`keys`, int64 [rows]) and vocabulary index at `position`
    (a device tensor, so every token runs one program: [1], or [rows], a position each), [rows, vocab] fp32 on
    the keys' device: argmax(scores + noise) samples softmax(scores). Integer arithmetic alone up to the uniform:
    the same bits on every device."""
    low, high = keys & _LOW32, _shr(keys, 32) & _LOW32
    row = _mix(_mix(low ^ _mix(high)) ^ (position.to(torch.int64) & _LOW32))[:, None]
    index = _mix(torch.arange(vocab, device=keys.device, dtype=torch.int64) + 0x9E3779B9 & _LOW32)
    bits = _mix(_mix(row ^ index) ^ high[:, None])
    uniform = (_shr(bits, 8).to(torch.float32) + 0.5) * 2.0 ** -24
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


def _last_logits_only(model: nn.Module) -> dict:
    """The prompt's forward scores its last position alone where the model takes transformers' `logits_to_keep`
    (else every position's logits: prompt x vocabulary a row, of which the draw reads one)."""
    forward = getattr(type(model), "forward", None)
    try:
        named = forward is not None and "logits_to_keep" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        named = False
    return {"logits_to_keep": 1} if named else {}


def _cache_argument(model: nn.Module) -> str:
    """The forward's keyword for the KV cache: `cache` (transformers 5.20 on) or `past_key_values` (before), which
    an older forward would otherwise swallow into its **kwargs, filling no cache."""
    forward = getattr(type(model), "forward", None)
    try:
        named = forward is not None and "cache" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        named = True
    return "cache" if named else "past_key_values"


def _share(cache, group: int) -> None:
    """The static cache filled for one row of each group, repeated for the group's rows."""
    for layer in cache.layers:
        layer.keys = layer.keys.repeat_interleave(group, 0)
        layer.values = layer.values.repeat_interleave(group, 0)
        layer.batch_size = layer.keys.shape[0]


class Decoding:
    """A generation's state on the device between two tokens, and the three calls that move it on: the prompt's
    forward (made with the instance), `draw` (the token at a step, written into the buffer) and `advance` (the
    forward of the token just drawn). `sample` runs them in turn; `xla-shard compile` traces the same calls as
    the prompt's program (construction + `draw(0)`) and the token's (`advance` + `draw`), so what it compiles is
    what runs. `carried()` is what one token's program hands the next."""

    def __init__(self, model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
                 keys: torch.Tensor, cached: bool = True, group: int = 1):
        rows, self.prompt_len = prompt_ids.shape
        self.model, self.sampling, self.cached = model, sampling, cached
        device, steps = prompt_ids.device, sampling.max_new_tokens
        total = self.prompt_len + steps
        self.device, self.keys = device, keys.to(device)
        self.ids = torch.cat([prompt_ids, torch.full((rows, steps), sampling.pad_token_id, dtype=prompt_ids.dtype,
                                                     device=device)], 1)
        self.mask = torch.cat([prompt_mask, torch.zeros(rows, steps, dtype=prompt_mask.dtype, device=device)], 1)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.eos = torch.tensor(sampling.eos_token_ids, dtype=self.ids.dtype, device=device)
        self.positions = torch.arange(total, device=device)
        self.token = self.cache = self.next_position = self.logits = None
        if not cached:
            return
        from transformers import StaticCache

        # numbered as generate numbers a left-padded row: from its first real token
        position_ids = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = StaticCache(config=model.config, max_cache_len=total)
        shared = slice(None, None, group)
        self.cache_argument = _cache_argument(model)
        self.logits = model(input_ids=prompt_ids[shared], attention_mask=self.mask[shared],
                            position_ids=position_ids[shared], **{self.cache_argument: self.cache},
                            cache_position=self.positions[:self.prompt_len], use_cache=True,
                            **_last_logits_only(model)).logits[:, -1]
        if group > 1:
            _share(self.cache, group)
            self.logits = self.logits.repeat_interleave(group, 0)
        self.next_position = prompt_mask.sum(-1, keepdim=True)

    def at(self, step: int) -> torch.Tensor:
        """The position `step` writes, as a device tensor: every token runs the same program."""
        return torch.tensor([self.prompt_len + step], device=self.device)

    def draw(self, step: int) -> None:
        at, sampling = self.at(step), self.sampling
        if not self.cached:
            whole = (torch.where(self.positions >= at, 1, self.mask).cumsum(-1) - 1).clamp(min=0)
            logits = self.model(input_ids=self.ids, attention_mask=self.mask, position_ids=whole).logits
            self.logits = logits.index_select(1, at - 1).squeeze(1)
        scores = filtered(self.logits, sampling)
        token = (scores + gumbel_noise(self.keys, at, scores.shape[-1])).argmax(-1).to(self.ids.dtype)
        self.token = torch.where(self.done, sampling.pad_token_id, token)
        here = self.positions == at
        self.ids = torch.where(here, self.token[:, None], self.ids)
        self.mask = torch.where(here, (~self.done).to(self.mask.dtype)[:, None], self.mask)
        self.done = self.done | (self.token[:, None] == self.eos).any(-1)

    def advance(self, step: int) -> None:
        """The forward of the token `draw(step)` wrote (cached only: uncached, `draw` runs the whole buffer)."""
        if self.cached:
            self.logits = self.model(input_ids=self.token[:, None], attention_mask=self.mask,
                                     position_ids=self.next_position, **{self.cache_argument: self.cache},
                                     cache_position=self.at(step),
                                     use_cache=True).logits[:, -1]
            self.next_position = self.next_position + 1

    def carried(self) -> dict[str, torch.Tensor]:
        """The tensors one token's program hands the next (the buffer, which rows ended, the cache's tensors)."""
        state = {"token": self.token, "ids": self.ids, "mask": self.mask, "done": self.done,
                 "next_position": self.next_position}
        for index, layer in enumerate(self.cache.layers if self.cache is not None else ()):
            state.update({f"cache.{index}.{name}": value for name, value in vars(layer).items()
                          if isinstance(value, torch.Tensor)})
        return {name: value for name, value in state.items() if value is not None}

    def replace_carried(self, make: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        """Each carried tensor replaced by `make(name, tensor)` (`xla-shard compile`: a placeholder laid out as the
        runtime lays it out, so the token's program starts from inputs, not from the prompt's program)."""
        for name, value in self.carried().items():
            if name.startswith("cache."):
                _, index, attribute = name.split(".")
                setattr(self.cache.layers[int(index)], attribute, make(name, value))
            else:
                setattr(self, name, make(name, value))


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
    steps = sampling.max_new_tokens
    was_training = model.training
    model.eval()
    try:
        decoding = Decoding(model, prompt_ids, prompt_mask, sampling, keys, cached, group)
        for step in range(steps):
            decoding.draw(step)
            if after_token is not None:
                after_token()
            if step + 1 == steps or ((step + 1) % sampling.check_every == 0 and
                                     (agreed or bool)(bool(decoding.done.all()))):
                break
            decoding.advance(step)
    finally:
        model.train(was_training)
    prompt_len = decoding.prompt_len
    return decoding.ids[:, prompt_len:], decoding.mask[:, prompt_len:]
