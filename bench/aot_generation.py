"""GRPO's generation on a TPU slice, compiled by libtpu on this machine (no TPU): what a rollout costs per device
and per token before the slice is rented.

    python bench/aot_generation.py [--tpu v5p-64] [--split 1] [--layers 32] [--prompts 256 --generations 8
                                   --prompt-len 512 --completion 1024]

The default shape is Llama-3-8B's (hidden 4096, 32 layers, 32 heads with 8 KV heads, MLP 14336, vocab 128256),
bf16, random init (nothing downloaded; the tokenizer is the tests' own). It traces and compiles what
`xla-shard compile` compiles for the generation (`xla_shard.aot.generation`: the weights laid out for it, the
prompts' forward, a token's forward and draw), without the training step (whose unrolled 32 layers take more host
memory than this machine has: `xla-shard compile` refuses that before tracing), and prints a row per program and
the phase: memory per device, collectives (the token's, per token), and the decode roofline (HBM, compute, ICI
each alone), with the trace's and compile's wall time and this process's host-memory peak.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from xla_shard import config  # noqa: E402
from xla_shard.aot import compiler, generation, target, trace  # noqa: E402

GIB = 2**30


def host_peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tpu", default="v5p-64")
    parser.add_argument("--split", type=int, default=1, help="mesh.generation: devices each MLP is split over")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--prompts", type=int, default=256, help="prompts a generation")
    parser.add_argument("--generations", type=int, default=8, help="completions a prompt (grpo.num_generations)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--completion", type=int, default=1024, help="grpo.max_completion_length")
    parser.add_argument("--json", help="also write the report's figures (as `xla-shard compile --json`) here")
    args = parser.parse_args()
    from model_dirs import CHAT_TEMPLATE, llama_dir

    rows, seq_len = args.prompts * args.generations, args.prompt_len + args.completion
    chosen = target.parse(args.tpu)
    tpu = compiler.describe(chosen.topology)
    with tempfile.TemporaryDirectory() as work:
        directory = llama_dir(Path(work) / "model", chat_template=CHAT_TEMPLATE)
        prompts = Path(work) / "prompts.jsonl"  # the tests' prompts, repeated to a generation's
        fixture = (REPO / "tests/fixtures/prompts.jsonl").read_text().splitlines()
        prompts.write_text("\n".join(fixture[i % len(fixture)] for i in range(args.prompts)) + "\n")
        overrides = (f"{{hidden_size: {args.hidden}, intermediate_size: {args.intermediate}, num_hidden_layers: "
                     f"{args.layers}, num_attention_heads: {args.heads}, num_key_value_heads: {args.kv_heads}, "
                     f"head_dim: {args.hidden // args.heads}, "
                     f"vocab_size: {args.vocab}, max_position_embeddings: {seq_len}}}")
        cfg = config.load(None, [
            f"model.name={directory}", f"model.overrides={overrides}", "method=grpo", "data.kind=prompt",
            f"data.path={prompts}",
            f"grpo.reward_funcs=[{REPO / 'tests/fixtures/rewards.py'}:low_token_share]",
            f"grpo.num_generations={args.generations}", f"grpo.max_completion_length={args.completion}",
            f"train.seq_len={seq_len}", f"train.global_batch_size={rows}", "fsdp.mixed_precision=bf16",
            "backend=xla_spmd", f"mesh.generation={args.split}"])
        started = time.perf_counter()
        with trace.traced_trainer(cfg, tpu) as trainer, compiler.kernels_lowered_for(tpu):
            resting = sum(trace.resting_bytes(trainer))
            traced = generation.trace(trainer)
        print({name: len(proto) for name, proto in traced.programs.items()}, flush=True)
        traced_s, traced_peak = time.perf_counter() - started, host_peak()
        started = time.perf_counter()
        compiled = generation.compile_programs(traced, tpu, say=lambda line: print(line, flush=True))
        compiled_s = time.perf_counter() - started
    report = generation.GenerationReport(traced, compiled, chosen.per_device(tpu.count), resting, chosen.chips)
    print(f"{args.tpu} ({tpu.count} devices, {chosen.chips} chips): Llama of width {args.hidden}, {args.layers} "
          f"layers, vocab {args.vocab}, bf16; {args.prompts} prompts x {args.generations} completions of "
          f"{args.completion} tokens after {args.prompt_len}-token prompts; mesh.generation {args.split}")
    print(f"trace {traced_s:.0f} s (host peak {traced_peak:.1f} GiB), compile of the three programs {compiled_s:.0f} s "
          f"(host peak {host_peak():.1f} GiB)")
    print("\n".join(report.lines()))
    data = report.as_dict()
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    roof = data["decode_roofline"]
    token = data["programs"]["token"]
    per_token = sum(v["bytes"] for v in token.get("collectives", {}).values())
    print("| slice | mesh.generation | phase GiB per device (HBM) | fits | layout / prompt / token GiB | "
          "collective bytes a token | ms a token (roofline) | tokens/s (a chip) |")
    print("|---|---|---|---|---|---|---|---|")
    held = " / ".join(f"{data['programs'][name]['held_bytes_per_device'] / GIB:.2f}" for name in generation.PROGRAMS)
    speed = (f"{roof['token_s'] * 1e3:.2f} | {roof['tokens_per_s']:,.0f} ({roof['tokens_per_s_per_chip']:,.0f})"
             if roof else "- | -")
    print(f"| {args.tpu} | {args.split} | {data['needed_bytes_per_device'] / GIB:.2f} "
          f"({chosen.per_device(tpu.count).hbm_bytes / GIB:.0f}) | {data['fits']} | {held} | "
          f"{per_token / 2**20:.2f} MiB | {speed} |")


if __name__ == "__main__":
    main()
