"""The torch_fsdp backend on CUDA (NCCL, bf16 mixed precision) against a hand-written FSDP2 loop, in one run.

    torchrun --nproc-per-node N bench/cuda_mfu.py [--hidden 2048 --layers 16 --seq-len 2048 --batch 4]

Both sides train the same Llama (random init, synthetic tokens) with `fully_shard` per decoder layer,
MixedPrecisionPolicy(bf16 params, fp32 reduce), SDPA attention and AdamW; steps alternate raw / xla_shard so
clock and thermal drift hit both alike. Prints tokens/s and MFU (PaLM's FLOP count over the device's dense
bf16 peak) for each, and the ratio xla_shard / raw (target >= 0.95).
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
    return parser.parse_args()


def _cfg(args, world: int):
    from xla_shard import config

    fields = {"vocab_size": 32000, "hidden_size": args.hidden, "intermediate_size": args.hidden * 11 // 4,
              "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 128,
              "num_key_value_heads": args.hidden // 128, "max_position_embeddings": args.seq_len}
    return config.load(None, ["backend=torch_fsdp", "model=small-llama", f"model.overrides={json.dumps(fields)}",
                              "fsdp.mixed_precision=bf16", f"train.seq_len={args.seq_len}",
                              f"train.global_batch_size={args.batch * world}", "train.optimizer=adamw",
                              "output_dir=/tmp/xla_shard_cuda_bench"])


def _raw(cfg, rank: int, world: int, device: torch.device):
    """A torchtitan-style FSDP2 loop on the same model and batches."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from xla_shard.data import SyntheticSource, local_rows
    from xla_shard.models import build_model

    model = build_model(cfg.model, cfg.train.seed, accelerator="cuda").to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
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


def main() -> None:
    args = _parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    cfg = _cfg(args, world)

    from xla_shard.metrics import peak_for
    from xla_shard.train import Trainer

    trainer = Trainer(cfg).setup()
    ours = lambda i: trainer.backend.mean_loss(trainer.step(i))  # noqa: E731
    raw = _raw(cfg, rank, world, device)
    times = {"raw": [], "ours": []}
    for i in range(WARMUP + args.steps):
        for name, step in (("raw", raw), ("ours", ours)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(i)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    if rank:
        dist.destroy_process_group()
        return
    tokens = args.batch * world * args.seq_len
    flops = trainer.flops_per_token * tokens
    peak = peak_for(torch.cuda.get_device_name(device)) or float("nan")
    params = sum(p.numel() for p in trainer.model.parameters())
    print(f"{torch.cuda.get_device_name(device)} x{world}, Llama {params / 1e9:.2f}B params, {args.batch} x "
          f"{args.seq_len} tokens per GPU, bf16, median of {args.steps} steps after {WARMUP} warm-up; peak "
          f"{peak:.3g} FLOP/s per GPU; peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB (both)")
    print(f"xla_shard's plan: {trainer.backend.plan}")
    print("| loop | step ms | tokens/s | MFU |\n|---|---|---|---|")
    result = {}
    for name in ("raw", "ours"):
        step_s = statistics.median(times[name][WARMUP:])
        result[name] = flops / step_s / (peak * world)
        label = "raw FSDP2" if name == "raw" else "xla_shard torch_fsdp"
        print(f"| {label} | {step_s * 1e3:.1f} | {tokens / step_s:,.0f} | {result[name]:.3f} |")
    print(f"ratio xla_shard / raw MFU: {result['ours'] / result['raw']:.3f} (target >= 0.95)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
