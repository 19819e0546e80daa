"""What `xla-shard compile` costs on this machine, beside what it would cost to find out on the TPU itself.

    python bench/aot_compile.py [--tpu v5p-8] [--hidden 2048 --layers 16]

Runs `xla-shard compile --json` for a Llama of the given shape (random init, nothing downloaded) in a fresh
process, and prints its wall time, its peak host memory (its maximum resident set), the
compiled per-device memory beside the model's own size, and the roofline. The trace holds the parameters and
optimizer state in host memory (sharded over the virtual devices: one copy), never the activations.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tpu", default="v5p-8")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    heads = max(1, args.hidden // 128)
    overrides = (f"{{hidden_size: {args.hidden}, intermediate_size: {args.hidden * 4}, num_hidden_layers: "
                 f"{args.layers}, num_attention_heads: {heads}, num_key_value_heads: {heads}, vocab_size: 32000, "
                 f"max_position_embeddings: {args.seq_len}}}")
    sets = ["model=small-llama", f"model.overrides={overrides}", f"train.seq_len={args.seq_len}",
            f"train.global_batch_size={args.batch}", "fsdp.mixed_precision=bf16"]
    command = [sys.executable, "-m", "xla_shard.cli", "compile", "--tpu", args.tpu, "--json",
               "--no-suggest", *[a for s in sets for a in ("--set", s)]]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    took = time.perf_counter() - started
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    report = json.loads(done.stdout)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child's peak, in KiB
    params = 12 * args.layers * args.hidden**2 + 2 * 32000 * args.hidden
    print(f"{args.tpu} ({report['devices']} devices): a {params / 1e9:.2f}B-parameter Llama, "
          f"{args.batch} x {args.seq_len} tokens, bf16")
    print("| wall s | host peak GiB | model fp32 + AdamW GiB | per device GiB (of HBM) | fits | roofline ms "
          "| MFU ceiling |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {took:.1f} | {peak / 2**30:.2f} | {params * 12 / 2**30:.2f} | "
          f"{report['needed_bytes_per_device'] / 2**30:.2f} ({report['hbm_bytes_per_device'] / 2**30:.0f}) | "
          f"{report['fits']} | "
          f"{report['roofline']['lower_bound_s'] * 1e3:.1f} | {report['roofline']['mfu_ceiling']:.2f} |")


if __name__ == "__main__":
    main()
