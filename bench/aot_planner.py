"""The planner's cost model beside the TPU compiler, for real model shapes on the slices users rent.

    python bench/aot_planner.py [--rows 8b-v5p,70b-v5p,...]

Each row traces a config's step as `xla-shard compile` does (placeholders: nothing at the model's size),
compiles it with libtpu for the slice, and prints, per device, what the planner predicts beside what the
compiled program holds and moves: parameters + optimizer state (against the compiled arguments less the
batch), gradient reductions (reduce-scatter + all-reduce result bytes), parameter all-gathers, and what else
moves (all-to-all, collective-permutes outside a windowed einsum), and the compiled total per device (arguments,
the buffer assignment's heap of temporaries, code: what `xla-shard compile` fits). Llama-3-8B
and -70B shapes, and a Qwen3-30B-A3B shape (mixture of experts: grouped-matmul experts on a TPU). Scanned layers,
activation checkpointing, bf16 and flash attention, as a large run is configured. TPU7x rows need the isolated
compiler (XLA_SHARD_TPU_COMPILER, see docs/planner.md); each row runs in a fresh process (the device count is
fixed per process).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA3_8B = ("{hidden_size: 4096, intermediate_size: 14336, num_hidden_layers: 32, num_attention_heads: 32, "
             "num_key_value_heads: 8, vocab_size: 128256, max_position_embeddings: 8192}")
LLAMA3_70B = ("{hidden_size: 8192, intermediate_size: 28672, num_hidden_layers: 80, num_attention_heads: 64, "
              "num_key_value_heads: 8, vocab_size: 128256, max_position_embeddings: 8192}")
# Qwen3-30B-A3B: 128 experts, 8 per token (a config.json only: the trace reads no weights)
QWEN3_30B_A3B = {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
                 "decoder_sparse_step": 1, "norm_topk_prob": True, "tie_word_embeddings": False}
ROWS = {  # name: (model: Llama overrides, or a qwen3_moe config; slice; global batch of 8192-token sequences)
    "8b-v5p": (LLAMA3_8B, "v5p-64", 32),
    "8b-v6e": (LLAMA3_8B, "v6e-32", 32),
    "8b-tpu7x": (LLAMA3_8B, "tpu7x-64", 64),
    "70b-v5p": (LLAMA3_70B, "v5p-128", 64),  # 64 devices: the most a trace takes (see docs/planner.md)
    "70b-v6e": (LLAMA3_70B, "v6e-64", 64),
    "70b-tpu7x": (LLAMA3_70B, "tpu7x-64", 64),
    "30b-a3b-v5p": (QWEN3_30B_A3B, "v5p-64", 32),
    "30b-a3b-v6e": (QWEN3_30B_A3B, "v6e-64", 64),
    "30b-a3b-tpu7x": (QWEN3_30B_A3B, "tpu7x-64", 64),
}
GiB = 2**30


def row(name: str) -> dict:
    """One row, in this process: trace, compile, predict."""
    from xla_shard import config, planner
    from xla_shard.aot import compiler, target, trace
    from xla_shard.backends.xla_spmd import XlaSpmdBackend
    from xla_shard.planner import cost, hlo
    from xla_shard.planner.settle import settle

    shape, slice_name, batch = ROWS[name]
    model = [f"model.name={_moe_dir(shape)}", "model.init=random"] if isinstance(shape, dict) else \
        ["model=small-llama", f"model.overrides={shape}"]
    cfg = config.load(None, [*model, "train.seq_len=8192",
                             f"train.global_batch_size={batch}", "fsdp.mixed_precision=bf16",
                             "fsdp.scan_layers=true", "fsdp.activation_checkpointing=true"])
    chosen = target.parse(slice_name)
    tpu = compiler.describe(chosen.topology)
    traced = trace.trace(cfg, tpu)
    compiled = tpu.compile(traced.proto)
    got = hlo.collective_totals(compiled.hlo_text, traced.loop_trips)
    work = planner.workload(cfg, tpu.count, XlaSpmdBackend.capabilities, chosen.chip)
    triple = settle(cfg, tpu.count, XlaSpmdBackend.capabilities, "tpu").degrees
    held = cost.memory(work, triple)
    predicted = cost.result_bytes(cost.collectives(work, triple, tpu.count))
    return {"row": name, "slice": slice_name, "devices": tpu.count, "params_b": work.params / 1e9,
            "planned_state": held["params"] + held["optimizer"],
            "compiled_state": compiled.argument_bytes - traced.batch,
            "planned_reductions": predicted.get("reduce-scatter", 0) + predicted.get("all-reduce", 0),
            "compiled_reductions": got["reduce-scatter"]["bytes"] + got["all-reduce"]["bytes"],
            "planned_gathers": predicted.get("all-gather", 0), "compiled_gathers": got["all-gather"]["bytes"],
            "compiled_other": got["all-to-all"]["bytes"] + got["collective-permute"]["bytes"],
            "compiled_total": compiled.argument_bytes + compiled.temporaries + compiled.code_bytes}


def _moe_dir(shape: dict) -> str:
    from transformers import AutoConfig

    directory = tempfile.mkdtemp(prefix="aot_planner_moe_")
    AutoConfig.for_model("qwen3_moe", **shape).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--row", help=argparse.SUPPRESS)  # a child process's one row
    args = parser.parse_args()
    if args.row:
        print(json.dumps(row(args.row)))
        return
    print("| model | slice (devices) | P+OS planned / compiled GiB | ratio | grad reductions planned / compiled GiB "
          "| ratio | gathers planned / compiled GiB | ratio | all-to-all + permutes compiled GiB "
          "| compiled per device GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.rows.split(","):
        done = subprocess.run([sys.executable, __file__, "--row", name], capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            print(f"| {name} | failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:150]} ||||||||")
            continue
        r = json.loads(lines[-1])
        print(f"| {r['params_b']:.1f}B | {r['slice']} ({r['devices']}) | {r['planned_state'] / GiB:.2f} / "
              f"{r['compiled_state'] / GiB:.2f} | {r['planned_state'] / r['compiled_state']:.3f} | "
              f"{r['planned_reductions'] / GiB:.2f} / {r['compiled_reductions'] / GiB:.2f} | "
              f"{r['planned_reductions'] / max(1, r['compiled_reductions']):.2f} | "
              f"{r['planned_gathers'] / GiB:.1f} / {r['compiled_gathers'] / GiB:.1f} | "
              f"{r['planned_gathers'] / max(1, r['compiled_gathers']):.2f} | {r['compiled_other'] / GiB:.1f} | "
              f"{r['compiled_total'] / GiB:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
