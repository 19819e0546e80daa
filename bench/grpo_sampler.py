"""GRPO's sampler (`xla_shard.sampling`) against transformers' `generate`, the one TRL's GRPOTrainer samples with
when it runs without vLLM: generated tokens per second on the same model, prompts and sampling settings, side by
side in one run, and the ratio; then what each of the sampler's savings is worth, each measured against the
sampler without it.

    python bench/grpo_sampler.py [--hidden 256 --layers 4 --prompts 4 --generations 4 --prompt-len 64 --new 64]

A random Llama of that shape (nothing downloaded), `--prompts` left-padded prompts of varied lengths, each
`--generations` times in a row (a GRPO group), temperature 1.0 and top-p 0.95 (TRL's sampling defaults but for
top-p), fp32 on this machine's CPU, one process, one thread (pinned alike for every leg). Each leg runs once to
warm up, then `--repeats` times, the legs interleaved; the median wall time counts every row's `--new` tokens.

The legs of the first table run every token (the EOS is out of the vocabulary's reach); `generate` grows its
cache, the sampler's is static. The savings:
- a group's prompt forward once, its cache shared (`group`), against each row's own prompt forward;
- the loop's end once every row has ended (EOS: any of the lowest eighth of the vocabulary, so rows end within a
  few tokens), against running every token;
- the noise computed on the device from each row's key, against the same number of uniforms drawn on the host
  from a generator per row and copied over (what the sampler did before), timed alone for a token's draw.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from xla_shard import sampling


def _interleaved(legs: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each leg, the legs run in turn `repeats` times after one warm-up each."""
    times: dict[str, list[float]] = {name: [] for name in legs}
    for run in legs.values():
        run()
    for _ in range(repeats):
        for name, run in legs.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(found) for name, found in times.items()}


def _host_noise(rows: int, vocab: int, generators: list[torch.Generator]) -> torch.Tensor:
    """The former draw: a row's uniforms from its own host generator, stacked, Gumbel-transformed."""
    uniform = torch.stack([torch.rand(vocab, generator=g) for g in generators]).clamp_(1e-20, 1.0 - 1e-7)
    return -torch.log(-torch.log(uniform))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=4096)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    ids = torch.randint(3, args.vocab, (args.prompts, args.prompt_len))
    mask = torch.ones_like(ids)
    for row in range(args.prompts):  # left-padded: lengths from half the prompt to all of it
        mask[row, : (row * args.prompt_len) // (2 * args.prompts)] = 0
    ids = ids.masked_fill(mask == 0, 0).repeat_interleave(args.generations, 0)
    mask = mask.repeat_interleave(args.generations, 0)
    rows = ids.shape[0]
    keys = sampling.row_keys([1], range(rows))
    never = args.vocab + 1  # an EOS no draw reaches: every row runs --new tokens
    settings = sampling.Sampling(args.new, (never,), 0, temperature=1.0, top_p=0.95)
    group = sampling.shared_prompts(ids, mask)
    tokens = rows * args.new

    def generate():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                           do_sample=True, temperature=1.0, top_p=0.95, top_k=0, eos_token_id=never)

    found = _interleaved({
        "transformers generate (dynamic cache)": generate,
        "xla_shard sampler (static cache, a group's prompt once)":
            lambda: sampling.sample(model, ids, mask, settings, keys, group=group),
        "xla_shard sampler (whole buffer)": lambda: sampling.sample(model, ids, mask, settings, keys, cached=False),
    }, args.repeats)
    base = found["transformers generate (dynamic cache)"]
    print(f"Llama hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}; {args.prompts} prompts x "
          f"{args.generations} of up to {args.prompt_len} tokens, {args.new} new tokens each, {args.threads} thread(s)")
    print("| sampler | s | tokens/s | vs generate |")
    print("|---|---|---|---|")
    for name, seconds in found.items():
        print(f"| {name} | {seconds:.3f} | {tokens / seconds:.0f} | {base / seconds:.2f}x |")

    ending = sampling.Sampling(args.new, tuple(range(3, args.vocab // 8)), 0, temperature=1.0, top_p=0.95)
    no_check = sampling.Sampling(args.new, ending.eos_token_ids, 0, temperature=1.0, top_p=0.95,
                                 check_every=args.new)
    generators = [torch.Generator().manual_seed(r) for r in range(rows)]
    at = torch.tensor([args.prompt_len])
    noise_repeats = 50
    savings = _interleaved({
        "prompt per row": lambda: sampling.sample(model, ids, mask, settings, keys, group=1),
        "a group's prompt once": lambda: sampling.sample(model, ids, mask, settings, keys, group=group),
        "every token (EOS reachable)": lambda: sampling.sample(model, ids, mask, no_check, keys, group=group),
        "ends with its rows": lambda: sampling.sample(model, ids, mask, ending, keys, group=group),
        "host noise x50": lambda: [_host_noise(rows, args.vocab, generators) for _ in range(noise_repeats)],
        "device noise x50": lambda: [sampling.gumbel_noise(keys, at, args.vocab) for _ in range(noise_repeats)],
    }, args.repeats)
    print()
    print("| saving | without (s) | with (s) | ratio |")
    print("|---|---|---|---|")
    for name, (without, with_) in {"a group's prompt forward once": ("prompt per row", "a group's prompt once"),
                                   "the loop ends once every row has": ("every token (EOS reachable)",
                                                                        "ends with its rows"),
                                   "noise from the row's key (50 tokens' draws)": ("host noise x50",
                                                                                    "device noise x50")}.items():
        print(f"| {name} | {savings[without]:.3f} | {savings[with_]:.3f} | {savings[without] / savings[with_]:.2f}x |")


if __name__ == "__main__":
    main()
