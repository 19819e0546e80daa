"""GRPO's sampler (`xla_shard.sampling`) against transformers' `generate`, the one TRL's GRPOTrainer samples with
when it runs without vLLM: generated tokens per second on the same model, prompts and sampling settings, side by
side in one run, and the ratio.

    python bench/grpo_sampler.py [--hidden 256 --layers 4 --prompts 16 --prompt-len 64 --new 64 --repeats 3]

A random Llama of that shape (nothing downloaded), left-padded prompts of varied lengths, temperature 1.0 and
top-p 0.95 (TRL's sampling defaults but for top-p), fp32 on this machine's CPU, one process, torch's threads. Each
sampler runs once to warm up, then `--repeats` times; the median wall time counts every row's `--new` tokens.
`generate` stops once every row has ended and grows its cache; the static-shape sampler always runs `--new`
tokens (the EOS token is set out of the vocabulary's reach, so both run them all), and its whole-buffer
variant (`cached=False`) is printed beside them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from xla_shard import sampling


def _timed(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
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
    ids = ids.masked_fill(mask == 0, 0)
    never = args.vocab + 1  # an EOS no draw reaches: every row runs --new tokens in both
    settings = sampling.Sampling(args.new, (never,), 0, temperature=1.0, top_p=0.95)
    tokens = args.prompts * args.new

    def generate():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                           do_sample=True, temperature=1.0, top_p=0.95, top_k=0, eos_token_id=never)

    found = {"transformers generate (dynamic cache)": _timed(generate, args.repeats),
             "xla_shard sampler (static cache)": _timed(
                 lambda: sampling.sample(model, ids, mask, settings, torch.Generator().manual_seed(1)), args.repeats),
             "xla_shard sampler (whole buffer)": _timed(
                 lambda: sampling.sample(model, ids, mask, settings, torch.Generator().manual_seed(1), cached=False),
                 args.repeats)}
    base = found["transformers generate (dynamic cache)"]
    print(f"Llama hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}; {args.prompts} prompts of up to "
          f"{args.prompt_len} tokens, {args.new} new tokens each, {torch.get_num_threads()} threads")
    print("| sampler | s | tokens/s | vs generate |")
    print("|---|---|---|---|")
    for name, seconds in found.items():
        print(f"| {name} | {seconds:.3f} | {tokens / seconds:.0f} | {base / seconds:.2f}x |")


if __name__ == "__main__":
    main()
