"""What `xla-shard compile` costs on this machine: host memory and time, to trace and to compile.

    python bench/aot_compile.py [--tpu v5p-64] [--scan] [--checkpointing] [--hidden 4096 --layers 32 ...]

The default shape is Llama-3-8B's (hidden 4096, 32 layers, 32 heads with 8 KV heads, MLP 14336, vocab 128256),
8192-token sequences, bf16, random init (nothing downloaded). It runs what `xla-shard compile` runs, in this
process, and prints each phase's wall time and the process's host-memory peak after it: the trace holds
placeholders for the parameters and optimizer state (no storage), so its peak does not grow with the model;
the TPU compiler's own working memory comes after, and grows with the program it is given (an unrolled stack
of layers is one copy of each layer's code; `--scan` compiles one). Beside it, the memory the model would take
at rest (fp32 parameters and AdamW state) had the trace allocated it.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xla_shard import config  # noqa: E402
from xla_shard.aot import compiler, target, trace  # noqa: E402
from xla_shard.aot.report import Report  # noqa: E402


def host_peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tpu", default="v5p-64")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=32, help="global batch, in sequences")
    parser.add_argument("--scan", action="store_true", help="fsdp.scan_layers: true")
    parser.add_argument("--checkpointing", action="store_true", help="fsdp.activation_checkpointing: true")
    args = parser.parse_args()
    overrides = (f"{{hidden_size: {args.hidden}, intermediate_size: {args.intermediate}, num_hidden_layers: "
                 f"{args.layers}, num_attention_heads: {args.heads}, num_key_value_heads: {args.kv_heads}, "
                 f"vocab_size: {args.vocab}, max_position_embeddings: {args.seq_len}}}")
    cfg = config.load(None, ["model=small-llama", f"model.overrides={overrides}", f"train.seq_len={args.seq_len}",
                             f"train.global_batch_size={args.batch}", "fsdp.mixed_precision=bf16",
                             f"fsdp.scan_layers={str(args.scan).lower()}",
                             f"fsdp.activation_checkpointing={str(args.checkpointing).lower()}"])
    chosen = target.parse(args.tpu)
    tpu = compiler.describe(chosen.topology)
    started = time.perf_counter()
    traced = trace.trace(cfg, tpu)
    traced_s, traced_peak = time.perf_counter() - started, host_peak()
    started = time.perf_counter()
    compiled = tpu.compile(traced.proto)
    compiled_s, compiled_peak = time.perf_counter() - started, host_peak()
    report = Report(chosen, traced, compiled, chosen.per_device(tpu.count))
    params = traced.parameters * tpu.count / 4  # fp32 master weights, whole
    print(f"{args.tpu} ({tpu.count} devices): a {params / 1e9:.2f}B-parameter Llama, {args.batch} x {args.seq_len} "
          f"tokens, bf16, scan_layers {args.scan}, activation checkpointing {args.checkpointing}")
    print("| trace s | host peak after trace GiB | compile s | host peak after compile GiB | model fp32 + AdamW GiB "
          "| per device GiB (of HBM) | fits |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {traced_s:.1f} | {traced_peak:.2f} | {compiled_s:.1f} | {compiled_peak:.2f} | "
          f"{params * 12 / 2**30:.1f} | {report.needed / 2**30:.2f} ({report.available / 2**30:.0f}) | "
          f"{report.fits} |")


if __name__ == "__main__":
    main()
