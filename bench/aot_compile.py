"""What `xla-shard compile` costs on this machine: host memory and time, to trace and to compile.

    python bench/aot_compile.py [--tpu v5p-64] [--scan] [--checkpointing] [--hidden 4096 --layers 32 ...]

The default shape is Llama-3-8B's (hidden 4096, 32 layers, 32 heads with 8 KV heads, MLP 14336, vocab 128256),
8192-token sequences, bf16, random init (nothing downloaded). It runs what `xla-shard compile` runs, in this
process, and prints each phase's wall time and the process's host-memory peak after it: the trace holds
placeholders for the parameters and optimizer state (no storage), so its peak does not grow with the model;
the TPU compiler's own working memory comes after, and grows with the program it is given (an unrolled stack
of layers is one copy of each layer's code; `--scan` compiles one). Beside it, the memory the model would take
at rest (fp32 parameters and AdamW state) had the trace allocated it.

With `--scan --checkpointing`, the default shape (32 x 8192) and the long-context ones (`--seq-len 65536` or
131072 `--batch 4 --context 8`) print the compiled program's memory, collectives and executed FLOPs per device
beside MaxText's `train_compile` of the same step (figures recorded below, from its own run: MaxText 0.2.5,
libtpu 0.0.52), with the ratios.

    python bench/aot_compile.py --packed-chat [--tpu v5p-8 --seq-len 8192 --batch 4]

compiles a small Llama (`--hidden 256 --layers 2` unless given; written with its tokenizer by tests/model_dirs.py)
twice for the slice: on chat rows packed best-fit decreasing (a long tail of lengths, bench/sft_packing.py's), and
on synthetic tokens (no mask, no segments). Both should run the Pallas flash kernel, the packed one with segment
ids, and need about the same memory: a dense block-diagonal mask would add batch x seq_len^2 per device.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xla_shard import config  # noqa: E402
from xla_shard.aot import compiler, target, trace  # noqa: E402
from xla_shard.aot.report import Report  # noqa: E402


# MaxText 0.2.5 `train_compile` (libtpu 0.0.52) of Llama-3-8B on a v5p-64, bf16 compute, fp32 weights and AdamW,
# full remat, flash attention, scanned layers, per device (GiB; executed TFLOP: its matmuls x loop trips and its
# attention kernels counted as ours are, forward F, dq 1.5 F, dkv 2 F). Keyed by (seq_len, global batch,
# mesh.context). 8K: model_name=llama3-8b compile_topology=v5p-64 per_device_batch_size=1 max_target_length=8192
# remat_policy=full attention=flash dtype=bfloat16 weight_dtype=float32 opt_type=adamw scan_layers=true
# dataset_type=synthetic. 64K and 128K: per_device_batch_size=0.125 max_target_length=65536 (131072)
# ici_fsdp_parallelism=4 ici_context_parallelism=8 context_parallel_strategy=all_gather, the rest the same.
MAXTEXT = {
    (8192, 32, 1): {"temporaries": 7.43, "total HBM": 10.28, "arguments": 2.80, "all-gather": 26.98,
                    "all-reduce": 0.0005, "executed TFLOP": 549.2},
    (65536, 4, 8): {"total HBM": 11.10, "executed TFLOP": 1226.5},
    (131072, 4, 8): {"total HBM": 17.09, "executed TFLOP": 4001.0},
}
GIB = 2**30


def host_peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def beside_maxtext(report: Report, theirs: dict[str, float]) -> None:
    ours = {"temporaries": report.compiled.temporaries / GIB, "total HBM": report.needed / GIB,
            "arguments": report.compiled.argument_bytes / GIB, "executed TFLOP": report.executed_flops / 1e12,
            **{kind: report.collectives.get(kind, {}).get("bytes", 0) / GIB for kind in ("all-gather", "all-reduce")}}
    print("\nper device, GiB | xla-shard compile | MaxText train_compile | ratio")
    print("|---|---|---|---|")
    for what, figure in theirs.items():
        print(f"| {what} | {ours[what]:.3f} | {figure:.4g} | {ours[what] / figure:.3f} |")


def described(report: Report) -> None:
    print(f"temporaries {report.compiled.temporaries / GIB:.2f} GiB, arguments "
          f"{report.compiled.argument_bytes / GIB:.2f} GiB; collectives GiB per device: "
          + ", ".join(f"{kind} {v.get('bytes', 0) / GIB:.2f}" for kind, v in report.collectives.items()))
    print("executed TFLOP per device: " + ", ".join(f"{what} {flops / 1e12:.1f}"
                                                   for what, flops in report.executed.items() if flops)
          + f"; total {report.executed_flops / 1e12:.1f}")
    largest = "; ".join(f"{slot.bytes / GIB:.2f} {what} ({slot.spelled})"
                        for what, slot in report.largest_temporaries())
    print(f"largest temporaries: {largest}")


def packed_chat(args, tpu_name: str) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO / "bench"))
    from model_dirs import CHAT_TEMPLATE, llama_dir
    from sft_packing import write_rows

    chosen = target.parse(tpu_name)
    tpu = compiler.describe(chosen.topology)
    with tempfile.TemporaryDirectory() as work:
        directory = llama_dir(Path(work) / "model", chat_template=CHAT_TEMPLATE, hidden=args.hidden,
                              layers=args.layers, positions=args.seq_len)
        data = Path(work) / "chat.jsonl"
        write_rows(data, rows=max(200, args.batch * args.seq_len // 100))
        common = [f"model.name={directory}", f"train.seq_len={args.seq_len}", f"train.global_batch_size={args.batch}",
                  "fsdp.mixed_precision=bf16"]
        print(f"{tpu_name} ({tpu.count} devices): a Llama of width {args.hidden}, {args.layers} layers, {args.batch} x "
              f"{args.seq_len} tokens, bf16, attention auto (Pallas flash attention on a TPU)")
        print("| rows | Pallas kernels | temporaries MiB | arguments MiB | per device MiB |")
        print("|---|---|---|---|---|")
        needed = {}
        for name, sets in (("chat, packed bfd (segment ids)", [f"data.path={data}", "data.kind=chat"]),
                           ("synthetic tokens (no mask)", [])):
            traced = trace.trace(config.load(None, common + sets), tpu)
            report = Report(chosen, traced, tpu.compile(traced.proto), chosen.per_device(tpu.count))
            needed[name] = report.needed
            print(f"| {name} | {traced.kernels} | {report.compiled.temporaries / 2**20:.1f} | "
                  f"{report.compiled.argument_bytes / 2**20:.1f} | {report.needed / 2**20:.1f} |")
        packed, plain = needed.values()
        mask = args.batch // tpu.count * args.seq_len**2 * 2  # a bf16 [batch, 1, S, S] mask per device
        print(f"packed / synthetic: {packed / plain:.3f}; a dense bf16 mask alone would add {mask / 2**20:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tpu", default=None, help="default v5p-64 (--packed-chat: v5p-8)")
    parser.add_argument("--packed-chat", action="store_true", help="packed chat rows against synthetic tokens")
    parser.add_argument("--hidden", type=int, default=None, help="default 4096 (--packed-chat: 256)")
    parser.add_argument("--layers", type=int, default=None, help="default 32 (--packed-chat: 2)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=None, help="global batch, in sequences (default 32; "
                                                                  "--packed-chat: 4)")
    parser.add_argument("--context", type=int, default=1, help="mesh.context: devices each sequence is split over")
    parser.add_argument("--scan", action="store_true", help="fsdp.scan_layers: true")
    parser.add_argument("--checkpointing", action="store_true", help="fsdp.activation_checkpointing: true")
    args = parser.parse_args()
    small = args.packed_chat
    args.hidden = args.hidden or (256 if small else 4096)
    args.layers = args.layers or (2 if small else 32)
    args.batch = args.batch or (4 if small else 32)
    tpu_name = args.tpu or ("v5p-8" if small else "v5p-64")
    if small:
        return packed_chat(args, tpu_name)
    llama3_8b = (tpu_name, args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab,
                 args.scan, args.checkpointing) == ("v5p-64", 4096, 32, 32, 8, 14336, 128256, True, True)
    theirs = MAXTEXT.get((args.seq_len, args.batch, args.context)) if llama3_8b else None
    overrides = (f"{{hidden_size: {args.hidden}, intermediate_size: {args.intermediate}, num_hidden_layers: "
                 f"{args.layers}, num_attention_heads: {args.heads}, num_key_value_heads: {args.kv_heads}, "
                 f"vocab_size: {args.vocab}, max_position_embeddings: {args.seq_len}}}")
    cfg = config.load(None, ["model=small-llama", f"model.overrides={overrides}", f"train.seq_len={args.seq_len}",
                             f"train.global_batch_size={args.batch}", "fsdp.mixed_precision=bf16",
                             f"mesh.context={args.context}",
                             f"fsdp.scan_layers={str(args.scan).lower()}",
                             f"fsdp.activation_checkpointing={str(args.checkpointing).lower()}"])
    chosen = target.parse(tpu_name)
    tpu = compiler.describe(chosen.topology)
    started = time.perf_counter()
    traced = trace.trace(cfg, tpu)
    traced_s, traced_peak = time.perf_counter() - started, host_peak()
    started = time.perf_counter()
    compiled = tpu.compile(traced.proto)
    compiled_s, compiled_peak = time.perf_counter() - started, host_peak()
    report = Report(chosen, traced, compiled, chosen.per_device(tpu.count))
    params = traced.parameters * tpu.count / 4  # fp32 master weights, whole
    print(f"{tpu_name} ({tpu.count} devices): a {params / 1e9:.2f}B-parameter Llama, {args.batch} x {args.seq_len} "
          f"tokens, bf16, scan_layers {args.scan}, activation checkpointing {args.checkpointing}, sequences split "
          f"{args.context}-way")
    print("| trace s | host peak after trace GiB | compile s | host peak after compile GiB | model fp32 + AdamW GiB "
          "| per device GiB (of HBM) | fits |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {traced_s:.1f} | {traced_peak:.2f} | {compiled_s:.1f} | {compiled_peak:.2f} | "
          f"{params * 12 / 2**30:.1f} | {report.needed / 2**30:.2f} ({report.available / 2**30:.0f}) | "
          f"{report.fits} |")
    described(report)
    if theirs:
        beside_maxtext(report, theirs)


if __name__ == "__main__":
    main()
