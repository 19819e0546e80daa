"""The planner on paper: ZeRO-3 (FULL_SHARD) against the cost model's pick, for Llama 7B-70B at scale.

    python bench/plan_at_scale.py [--efficiency 0.65] [--global-batch 1024]

Assumptions (also in the README): sequences of 2048 tokens and a fixed global batch of `--global-batch`
sequences (strong scaling, as in AMSP's measurements: fewer tokens per device as devices are added), at most 4
sequences per device at a time (gradient accumulation beyond that), bf16 compute with fp32 master weights and
reductions, AdamW, activation checkpointing, the link figures of `xla_shard.planner.hardware`, compute at
`--efficiency` of peak when it does not wait for communication. Each model is built on the meta device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (accelerator, device counts, its layout, the backend that runs there)
CLUSTERS = [("h100", [8, 64, 256, 1024], lambda n: dict(), "torch_fsdp"),  # hosts: full 8-GPU nodes
            ("v5p", [128, 256, 512, 1024], lambda n: dict(slices=1), "xla_spmd"),
            ("v5p", [1024], lambda n: dict(slices=4), "xla_spmd")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--efficiency", type=float, default=0.65)
    parser.add_argument("--global-batch", type=int, default=1024, help="sequences per step, all devices")
    parser.add_argument("--models", nargs="+", default=["llama-7b", "llama-13b", "llama-30b", "llama-70b"])
    args = parser.parse_args()

    from xla_shard import backends, config, planner

    print("| model | devices | ZeRO-3: fast / slow GB per device-step | ZeRO-3 step s (MFU) | planner's pick "
          "| pick: fast / slow GB | pick step s (MFU) | best the backend runs (MFU) |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for name, sizes, layout, backend in CLUSTERS:
            acc = planner.accelerator(name)
            for n in sizes:
                per_device = max(1, args.global_batch // n)
                micro = max(1, per_device // 4)
                cfg = config.load(None, [f"model={model}", "fsdp.mixed_precision=bf16",
                                         "fsdp.activation_checkpointing=true",
                                         "train.seq_len=2048", f"train.global_batch_size={per_device * n}",
                                         f"train.grad_accum_steps={micro}"])
                work = planner.workload(cfg, n, backends.capabilities(backend), acc)
                ranked = planner.plan(work, n, acc, efficiency=args.efficiency, **layout(n))
                base, best = ranked.baseline, ranked.best
                runnable = ranked.best_where(lambda t: backend in backends.running(t, n))
                slices = layout(n).get("slices", 1)
                where = f"{n} x {acc.name}" + (f" ({slices} slices)" if slices > 1 else "")

                def gb(e):
                    return f"{e.traffic[acc.fast_name] / 1e9:.1f} / {e.traffic[acc.slow_name] / 1e9:.1f}"

                fits = "" if base.fits else " (does not fit)"
                row = [model, where, gb(base), f"{base.step_s:.2f} ({base.mfu:.2f}){fits}"]
                row += ([str(best.triple), gb(best), f"{best.step_s:.2f} ({best.mfu:.2f})"] if best
                        else ["none fits", "", ""])
                row += [f"{backend}: {runnable.triple} ({runnable.mfu:.2f})" if runnable else f"{backend}: none"]
                print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
