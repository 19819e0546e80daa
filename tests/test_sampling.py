"""The sampler online methods generate with (`xla_shard.sampling`): transformers' draw, TRL's end of a
completion, one compiled program on XLA whatever the lengths, draws fixed by each row's key, and no work the
answer does not need (a group's prompt forward once, no tokens after every row has ended)."""

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
    """20000 draws (rows of their own keys, and one row's 20000 positions): each kept token's frequency is its
    probability after the filter (within 0.01), and a token the filter dropped is never drawn."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    scores = sampling.filtered(logits, sampling.Sampling(1, (9,), 0, temperature=0.8, top_p=0.95))
    keys = sampling.row_keys([3], range(20000))
    across_rows = sampling.gumbel_noise(keys, torch.tensor([5]), 6)
    one_row = sampling.gumbel_noise(keys[:1].expand(20000), torch.arange(20000), 6)  # a position per row
    for noise in (across_rows, one_row):
        counts = torch.bincount((scores + noise).argmax(-1), minlength=6) / 20000
        assert torch.allclose(counts, scores.softmax(-1)[0], atol=0.01) and counts[-1] == 0


def test_the_noise_is_the_rows_key_and_position_alone():
    """A row's noise depends on its key and the position, not on the rows beside it; another key or position
    draws other noise (no two of 64 rows alike); its uniforms are spread over (0, 1) (mean 1/2, variance 1/12)."""
    keys = sampling.row_keys([1, 2], range(64))
    noise = sampling.gumbel_noise(keys, torch.tensor([7]), 4096)
    assert torch.equal(sampling.gumbel_noise(keys[10:12].flip(0), torch.tensor([7]), 4096), noise[10:12].flip(0))
    assert not torch.equal(sampling.gumbel_noise(keys, torch.tensor([8]), 4096), noise)
    assert len({tuple(row[:8].tolist()) for row in noise}) == 64
    uniform = torch.exp(-torch.exp(-noise.double()))
    assert abs(uniform.mean() - 0.5) < 0.005 and abs(uniform.var() - 1 / 12) < 0.002


@pytest.fixture(scope="module")
def torch_xla():
    """torch_xla imported (~6 s) as the test's setup, not its call."""
    return pytest.importorskip("torch_xla")


@pytest.mark.xla
def test_on_xla_the_noise_is_shifts_and_draws_what_the_host_draws(torch_xla):
    """The noise's program on torch_xla holds no integer division (torch_xla lowers `>>` to one, which the TPU
    compiler expands for int64 into hundreds of ops: 5-15x a token program's compile) and draws the host's
    bits (their logarithms within float32's rounding)."""
    xla = torch_xla
    keys, position = sampling.row_keys([4], range(6)), torch.tensor([3])
    noise = sampling.gumbel_noise(keys.to(xla.device()), position.to(xla.device()), 50)
    hlo = xla._XLAC._get_xla_tensors_hlo([noise])
    assert "shift-right" in hlo and " divide(s64" not in hlo and " divide(u64" not in hlo
    torch.testing.assert_close(noise.cpu(), sampling.gumbel_noise(keys, position, 50), rtol=1e-6, atol=1e-6)


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
                                    sampling.row_keys([0], range(3)))
    assert torch.equal(got[:, :want.shape[1]], want) and (got[:, want.shape[1]:] == 0).all()
    ended = [(row == eos).nonzero()[0, 0].item() + 1 if (row == eos).any() else 6 for row in got]
    assert ended[1] == 3 and got_mask.tolist() == [[1] * n + [0] * (6 - n) for n in ended]
    assert not model.training  # the caller's mode is given back: eval, as loaded, then training
    model.train()
    sampling.sample(model, ids, mask, sampling.Sampling(2, (eos,), 0), sampling.row_keys([0], range(3)))
    assert model.training


def test_a_rows_key_draws_its_completion_whatever_rows_share_its_batch(model_dirs):
    """The same keys draw the same completions; a row sampled with other rows around it (the batch reversed)
    draws what it drew before; other keys draw otherwise."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs.llama, attn_implementation="eager")
    ids, mask = _prompts(model.config.vocab_size)
    settings = sampling.Sampling(5, (1,), 0, temperature=1.2, top_p=0.9)
    keys = sampling.row_keys([4], range(3))
    first = sampling.sample(model, ids, mask, settings, keys)[0]
    again = sampling.sample(model, ids, mask, settings, keys)[0]
    reversed_ = sampling.sample(model, ids.flip(0), mask.flip(0), settings, keys.flip(0))[0]
    other = sampling.sample(model, ids, mask, settings, sampling.row_keys([5], range(3)))[0]
    assert torch.equal(first, again) and torch.allclose(reversed_.flip(0), first) and not torch.equal(first, other)


def test_a_groups_prompt_runs_once_and_shares_its_cache(model_dirs):
    """Rows in groups of one prompt (GRPO's completions of a prompt) draw, with the prompt's forward run once
    for the group (its head scoring the last position alone), what each row draws with its own forward;
    `shared_prompts` finds the groups."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs.llama, attn_implementation="eager")
    ids, mask = _prompts(model.config.vocab_size)
    ids, mask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)
    assert sampling.shared_prompts(ids, mask) == 4 and sampling.shared_prompts(ids.roll(1, 0), mask) == 1
    settings = sampling.Sampling(6, (5,), 0, temperature=1.1, top_k=30)
    keys = sampling.row_keys([9], range(12))
    calls, scored = [], []
    hook = model.model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape),
                                                 with_kwargs=True)
    head = model.lm_head.register_forward_hook(lambda module, args, out: scored.append(out.shape[1]))
    shared = sampling.sample(model, ids, mask, settings, keys, group=4)
    hook.remove(), head.remove()
    alone = sampling.sample(model, ids, mask, settings, keys)
    assert torch.equal(shared[0], alone[0]) and torch.equal(shared[1], alone[1])
    assert calls[0] == (3, 5) and all(shape == (12, 1) for shape in calls[1:])
    assert scored == [1] * len(calls)  # the prompt's forward scores its last position alone (logits_to_keep)


def test_the_token_loop_stops_once_every_row_has_ended(model_dirs):
    """Greedy rows that all end early run no forward after the check that finds them ended, and return what a
    run of every token returns."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs.llama, attn_implementation="eager")
    ids, mask = _prompts(model.config.vocab_size)
    first = sampling.sample(model, ids, mask, sampling.Sampling(1, (1,), 0, top_k=1), sampling.row_keys([0], range(3)))
    eos = tuple(first[0][:, 0].tolist())  # every row ends at its first token
    calls = []
    hook = model.register_forward_pre_hook(lambda *args: calls.append(1))
    got = sampling.sample(model, ids, mask, sampling.Sampling(40, eos, 0, top_k=1, check_every=4),
                          sampling.row_keys([0], range(3)))
    hook.remove()
    full = sampling.sample(model, ids, mask, sampling.Sampling(40, eos, 0, top_k=1, check_every=40),
                           sampling.row_keys([0], range(3)))
    assert torch.equal(got[0], full[0]) and torch.equal(got[1], full[1]) and got[1].sum() == 3
    assert len(calls) == 4  # the prompt's forward, then tokens 2-4: the check after token 4 ends the loop


@pytest.mark.xla
@pytest.mark.e2e
def test_on_xla_the_sampler_compiles_its_programs_once_not_per_token(model_dirs):
    """On torch_xla's CPU device, 24 new tokens compile as many programs as 12 do (the prompt's forward with the
    first draw, a token's forward with its draw, the check whether every row has ended), a second batch of
    prompts of the same shape compiles nothing, and the tokens are the host's."""
    xla = pytest.importorskip("torch_xla")
    from xla_shard.backends.xla_common import compilations

    model = AutoModelForCausalLM.from_pretrained(model_dirs.llama, attn_implementation="eager")
    ids, mask = _prompts(model.config.vocab_size)
    device = xla.device()
    on_device = AutoModelForCausalLM.from_pretrained(model_dirs.llama, attn_implementation="eager").to(device)
    found = []
    for steps, seed in ((12, 5), (24, 5), (24, 6)):
        settings = sampling.Sampling(steps, (1,), 0, temperature=0.9, top_k=20)
        before = compilations().graphs
        got = sampling.sample(on_device, ids.to(device), mask.to(device), settings,
                              sampling.row_keys([seed], range(3)), after_token=xla.sync)[0].cpu()
        found.append(compilations().graphs - before)
        host = sampling.sample(model, ids, mask, settings, sampling.row_keys([seed], range(3)))[0]
        assert torch.equal(got, host), steps
        ids = ids.roll(1, 0)
    assert found[1] <= found[0] <= 4 and found[2] == 0, found  # (the first also compiles the check)


def test_the_cached_sampler_draws_what_the_whole_buffer_forward_draws(model_dirs):
    """The static cache changes the cost, not the draw: with one generator state, sampling at temperature 1.1
    and top-p 0.9 gives the same completions and masks with the cache and without it."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs.llama, attn_implementation="eager")
    ids, mask = _prompts(model.config.vocab_size)
    settings = sampling.Sampling(7, (5,), 0, temperature=1.1, top_p=0.9)
    cached = sampling.sample(model, ids, mask, settings, sampling.row_keys([8], range(3)))
    whole = sampling.sample(model, ids, mask, settings, sampling.row_keys([8], range(3)), cached=False)
    assert torch.equal(cached[0], whole[0]) and torch.equal(cached[1], whole[1])
    assert len(set(cached[0].flatten().tolist())) > 5  # drawn, not one token repeated


def test_sampling_through_xla_pallas_draws_what_eager_draws(model_dirs):
    """`xla_pallas` (what `auto` runs on a TPU) with a static cache: the keys outnumber the queries, and prompts
    without padding reach the attention function with no mask (transformers drops an all-ones one). The sampler
    must draw eager's completions (it crashed there: segment masks built for a square of positions)."""
    from xla_shard import attention

    attention.register()
    ids = torch.randint(3, 200, (4, 6))
    mask = torch.ones_like(ids)  # no padding: the mask is dropped
    settings = sampling.Sampling(5, (10**6,), 0, temperature=1.0)
    drawn = {}
    for kernel in ("eager", "xla_pallas"):
        model = AutoModelForCausalLM.from_pretrained(model_dirs.llama, attn_implementation=kernel)
        drawn[kernel] = sampling.sample(model, ids, mask, settings, sampling.row_keys([2], range(4)), group=2)
    assert torch.equal(drawn["eager"][0], drawn["xla_pallas"][0])
