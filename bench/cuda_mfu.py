"""The torch_fsdp backend on CUDA (NCCL, bf16 mixed precision) against a hand-written FSDP2 loop, eager and
compiled, in one run.

    torchrun --nproc-per-node N bench/cuda_mfu.py [--hidden 2048 --layers 16 --seq-len 2048 --batch 4]
                                                  [--modes eager compiled]

Both sides train the same Llama (random init, synthetic tokens) with `fully_shard` per decoder layer,
MixedPrecisionPolicy(bf16 params, fp32 reduce), SDPA attention and AdamW; in `compiled` mode each decoder layer
is torch.compile'd before sharding on both sides (torchtitan's per-block way; xla_shard's `train.compile`).
Per mode, steps alternate raw / xla_shard so clock and thermal drift hit both alike; one mode's models are freed
before the next is built. Prints step time, tokens/s, MFU (PaLM's FLOP count over the device's dense bf16 peak)
and peak memory during each loop's steps (the other loop's state resident too), and the ratio xla_shard / raw.
Targets: ratio >= 0.95 eager, >= 1.0 compiled; MFU >= 0.38 compiled for the 0.95B default on one H100.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

WARMUP = 3


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4, help="rows per GPU")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    return parser.parse_args()


def _cfg(args, world: int, compiled: bool):
    from xla_shard import config

    fields = {"vocab_size": 32000, "hidden_size": args.hidden, "intermediate_size": args.hidden * 11 // 4,
              "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 128,
              "num_key_value_heads": args.hidden // 128, "max_position_embeddings": args.seq_len}
    return config.load(None, ["backend=torch_fsdp", "model=small-llama", f"model.overrides={json.dumps(fields)}",
                              "fsdp.mixed_precision=bf16", f"train.seq_len={args.seq_len}",
                              f"train.global_batch_size={args.batch * world}", "train.optimizer=adamw",
                              f"train.compile={compiled}", "output_dir=/tmp/xla_shard_cuda_bench"])


def _raw(cfg, rank: int, world: int, device: torch.device):
    """A torchtitan-style FSDP2 loop on the same model and batches."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from xla_shard.data import SyntheticSource, local_rows
    from xla_shard.models import build_model

    model = build_model(cfg.model, cfg.train.seed, accelerator="cuda").to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        if cfg.train.compile:
            layer.compile()
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    source = SyntheticSource(cfg.train.global_batch_size, cfg.train.seq_len, cfg.train.seed, model.config.vocab_size)

    def step(i):
        batch = {k: v.to(device) for k, v in local_rows(source.global_batch(i), rank, world).items()}
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().float()
        dist.all_reduce(total)
        return total.item() / world

    return step


def _measure(args, rank: int, world: int, device: torch.device, compiled: bool) -> dict:
    """One mode: both loops built, stepped alternately; median step time and peak memory of each."""
    from xla_shard.train import Trainer

    cfg = _cfg(args, world, compiled)
    trainer = Trainer(cfg).setup()
    loops = {"raw": _raw(cfg, rank, world, device),
             "ours": lambda i: trainer.backend.mean_loss(trainer.step(i))}
    times = {name: [] for name in loops}
    peaks = dict.fromkeys(loops, 0)
    for i in range(WARMUP + args.steps):
        for name, step in loops.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            step(i)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device))
    result = {"flops_per_token": trainer.flops_per_token, "plan": str(trainer.backend.plan),
              "params": sum(p.numel() for p in trainer.model.parameters())}
    for name in loops:
        result[name] = (statistics.median(times[name][WARMUP:]), peaks[name])
    return result  # both loops' models and optimizers go with this frame


def main() -> None:
    args = _parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    results = {}
    for mode in args.modes:
        results[mode] = _measure(args, rank, world, device, mode == "compiled")
        torch.cuda.empty_cache()
    if rank:
        dist.destroy_process_group()
        return

    from xla_shard.metrics import peak_for

    tokens = args.batch * world * args.seq_len
    peak = peak_for(torch.cuda.get_device_name(device)) or float("nan")
    first = next(iter(results.values()))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)} x{world}, Llama "
          f"{first['params'] / 1e9:.2f}B params, {args.batch} x {args.seq_len} tokens per GPU, bf16, median of "
          f"{args.steps} steps after {WARMUP} warm-up; peak {peak:.3g} FLOP/s per GPU")
    print(f"xla_shard's plan: {first['plan']}")
    print("| mode | loop | step ms | tokens/s | MFU | peak GiB |\n|---|---|---|---|---|---|")
    for mode, result in results.items():
        mfu = {}
        for name, label in (("raw", "raw FSDP2"), ("ours", "xla_shard torch_fsdp")):
            step_s, peak_bytes = result[name]
            mfu[name] = result["flops_per_token"] * tokens / step_s / (peak * world)
            print(f"| {mode} | {label} | {step_s * 1e3:.1f} | {tokens / step_s:,.0f} | {mfu[name]:.3f} | "
                  f"{peak_bytes / 2**30:.1f} |")
        target = 1.0 if mode == "compiled" else 0.95
        print(f"{mode}: ratio xla_shard / raw MFU {mfu['ours'] / mfu['raw']:.3f} (target >= {target})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
