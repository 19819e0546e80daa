"""The sampler online methods generate with (`xla_shard.sampling`): transformers' draw, TRL's end of a
completion, one compiled program on XLA whatever the lengths, and draws a saved generator state repeats."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from xla_shard import sampling


def _prompts(vocab: int):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 5), generator=generator)
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, :2] = mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 5, 0.8), (1.0, 0, 0.5), (1.3, 12, 1.0)])
def test_the_filter_is_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2)) * 3
    want = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1:
        want = TopPLogitsWarper(top_p)(None, want)
    got = sampling.filtered(logits, sampling.Sampling(4, (1,), 0, temperature, top_k, top_p))
    assert torch.equal(got.isinf(), want.isinf()) and torch.allclose(got[~got.isinf()], want[~want.isinf()])


def test_a_draw_follows_the_filtered_distribution():
    """20000 draws of one row: each kept token's frequency is its probability after the filter (within 0.01),
    and a token the filter dropped is never drawn."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    scores = sampling.filtered(logits, sampling.Sampling(1, (9,), 0, temperature=0.8, top_p=0.95))
    generator = torch.Generator().manual_seed(3)
    noise = sampling.gumbel_noise((20000, 6), generator)
    counts = torch.bincount((scores + noise).argmax(-1), minlength=6) / 20000
    assert torch.allclose(counts, scores.softmax(-1)[0], atol=0.01) and counts[-1] == 0


def test_greedy_sampling_is_generates_with_eos_ending_a_row(model_dirs):
    """top_k 1 is greedy decoding: the tokens are transformers' `generate(do_sample=False)` on left-padded
    prompts; a row that draws the end-of-sequence token keeps it and holds the pad token, masked out, after it,
    as generate's output and TRL's completion mask do."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs.llama, attn_implementation="eager")
    ids, mask = _prompts(model.config.vocab_size)
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[:, 5:]
    eos = int(plain[1, 2])  # row 1 ends at its third token
    assert eos not in plain[1, :2].tolist()
    want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=eos,
                          pad_token_id=0)[:, 5:]
    got, got_mask = sampling.sample(model, ids, mask, sampling.Sampling(6, (eos,), 0, top_k=1),
                                    torch.Generator().manual_seed(0))
    assert torch.equal(got[:, :want.shape[1]], want) and (got[:, want.shape[1]:] == 0).all()
    ended = [(row == eos).nonzero()[0, 0].item() + 1 if (row == eos).any() else 6 for row in got]
    assert ended[1] == 3 and got_mask.tolist() == [[1] * n + [0] * (6 - n) for n in ended]
    assert not model.training  # the caller's mode is given back: eval, as loaded, then training
    model.train()
    sampling.sample(model, ids, mask, sampling.Sampling(2, (eos,), 0), torch.Generator().manual_seed(0))
    assert model.training


def test_a_saved_generator_state_draws_the_same_completions(model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs.llama, attn_implementation="eager")
    ids, mask = _prompts(model.config.vocab_size)
    generator = torch.Generator().manual_seed(4)
    settings = sampling.Sampling(5, (1,), 0, temperature=1.2, top_p=0.9)
    sampling.sample(model, ids, mask, settings, generator)
    saved = generator.get_state()
    first = sampling.sample(model, ids, mask, settings, generator)[0]
    resumed = torch.Generator()
    resumed.set_state(saved)
    again = sampling.sample(model, ids, mask, settings, resumed)[0]
    later = sampling.sample(model, ids, mask, settings, generator)[0]
    assert torch.equal(first, again) and not torch.equal(first, later)


@pytest.mark.xla
@pytest.mark.e2e
def test_on_xla_the_sampler_compiles_its_programs_once_not_per_token(model_dirs):
    """On torch_xla's CPU device, 12 new tokens compile as many programs as 6 do (the prompt's forward, the
    token's, the draw), a second batch of prompts of the same shape compiles nothing, and the tokens are the
    host's."""
    xla = pytest.importorskip("torch_xla")
    from xla_shard.backends.xla_common import compilations

    model = AutoModelForCausalLM.from_pretrained(model_dirs.llama, attn_implementation="eager")
    ids, mask = _prompts(model.config.vocab_size)
    device = xla.device()
    on_device = AutoModelForCausalLM.from_pretrained(model_dirs.llama, attn_implementation="eager").to(device)
    found = []
    for steps, seed in ((6, 5), (12, 5), (12, 6)):
        settings = sampling.Sampling(steps, (1,), 0, temperature=0.9, top_k=20)
        before = compilations().graphs
        got = sampling.sample(on_device, ids.to(device), mask.to(device), settings,
                              torch.Generator().manual_seed(seed), after_token=xla.sync)[0].cpu()
        found.append(compilations().graphs - before)
        host = sampling.sample(model, ids, mask, settings, torch.Generator().manual_seed(seed))[0]
        assert torch.equal(got, host), steps
        ids = ids.roll(1, 0)
    assert found[1] == found[0] and found[2] == 0, found


def test_the_cached_sampler_draws_what_the_whole_buffer_forward_draws(model_dirs):
    """The static cache changes the cost, not the draw: with one generator state, sampling at temperature 1.1
    and top-p 0.9 gives the same completions and masks with the cache and without it."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs.llama, attn_implementation="eager")
    ids, mask = _prompts(model.config.vocab_size)
    settings = sampling.Sampling(7, (5,), 0, temperature=1.1, top_p=0.9)
    cached = sampling.sample(model, ids, mask, settings, torch.Generator().manual_seed(8))
    whole = sampling.sample(model, ids, mask, settings, torch.Generator().manual_seed(8), cached=False)
    assert torch.equal(cached[0], whole[0]) and torch.equal(cached[1], whole[1])
    assert len(set(cached[0].flatten().tolist())) > 5  # drawn, not one token repeated
