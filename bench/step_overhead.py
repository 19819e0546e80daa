"""xla_shard's training step against hand-written raw loops on the same model, in one invocation.

    python bench/step_overhead.py [--model small-llama] [--steps 20] [--seq-len 64] [--batch 8]

Part 1 (this process): torch_xla SPMD FSDPv2 on CPU_NUM_DEVICES virtual devices, raw loop vs xla_shard's
xla_spmd backend. Part 2 (torchrun, 2 gloo processes): raw FSDP2 `fully_shard` loop vs the torch_fsdp backend.
Steps alternate raw / xla_shard. Prints step time (median of the timed steps), the ratio xla_shard / raw
(target <= 1.03), XLA compilations after
warm-up (target 0) and per-device bytes against unsharded. Both sides sync every step (loss.item()).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

WARMUP = 3


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--devices", type=int, default=4, help="XLA virtual devices for part 1")
    parser.add_argument("--fsdp2-worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _cfg(args, backend: str):
    from xla_shard import config

    return config.load(None, [f"backend={backend}", f"model={args.model}", f"train.seq_len={args.seq_len}",
                              f"train.global_batch_size={args.batch}", "train.optimizer=adamw",
                              f"cpu_devices={args.devices}", "output_dir=/tmp/xla_shard_bench"])


def _time_interleaved(raw, ours, steps: int, compilations=lambda: 0) -> tuple[dict, dict]:
    """Alternate raw and xla_shard steps, so drift in a shared 2-core machine hits both sides alike."""
    times = {"raw": [], "ours": []}
    compiled = {}
    for i in range(WARMUP + steps):
        for name, step_fn in (("raw", raw), ("ours", ours)):
            if i == WARMUP and name == "raw":
                compiled["start"] = compilations()
            start = time.perf_counter()
            step_fn(i)
            times[name].append(time.perf_counter() - start)
    # Compilations are process-wide under XLA; both sides share the count, so it is reported for the pair.
    new = compilations() - compiled["start"]
    return tuple({"step_s": statistics.median(times[name][WARMUP:]), "compiles_after_warmup": new}
                 for name in ("raw", "ours"))


def _ours(cfg):
    """(step function, trainer) for xla_shard's own loop."""
    from xla_shard.train import Trainer

    trainer = Trainer(cfg).setup()
    return (lambda i: trainer.backend.mean_loss(trainer.step(i))), trainer


def _memory(trainer) -> dict:
    memory = trainer.memory_report()  # after zero_grad(set_to_none=True): parameters and optimizer state
    return {"bytes_per_device": memory.params + memory.optimizer,
            "bytes_unsharded": memory.params_unsharded + memory.optimizer_unsharded}


def _raw_xla_fsdpv2(cfg):
    """What a torch_xla user writes by hand (torch_xla's FSDPv2 docs), on the same model and batches."""
    import functools

    import numpy as np
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

    from xla_shard.data import SyntheticSource
    from xla_shard.models import build_model

    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    model = build_model(cfg.model, cfg.train.seed)
    layer_cls = {type(model.model.layers[0])}
    source = SyntheticSource(cfg.train.global_batch_size, cfg.train.seq_len, cfg.train.seed, model.config.vocab_size)

    def shard_output(output, mesh):
        tensor = output if isinstance(output, torch.Tensor) else output.logits
        xs.mark_sharding(tensor, mesh, ("fsdp",) + (None,) * (tensor.dim() - 1))

    model = FSDPv2(model.to("xla"), mesh=mesh, shard_output=shard_output,
                   auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_cls))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, foreach=False)

    def step(i):
        batch = {k: v.to("xla") for k, v in source.global_batch(i).items()}
        for value in batch.values():
            xs.mark_sharding(value, mesh, ("fsdp", None))
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch_xla.sync()
        return loss.item()

    def compiles():
        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    return step, compiles


def _raw_fsdp2(cfg):
    """A hand-written FSDP2 loop (torchtitan style) on the same model and batches."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from xla_shard.data import SyntheticSource, local_rows
    from xla_shard.models import build_model

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg.model, cfg.train.seed)
    source = SyntheticSource(cfg.train.global_batch_size, cfg.train.seq_len, cfg.train.seed, model.config.vocab_size)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, foreach=False)

    def step(i):
        batch = local_rows(source.global_batch(i), rank, world)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item()

    return step


def _fsdp2_worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    raw_step = _raw_fsdp2(_cfg(args, "torch_fsdp"))
    ours_step, trainer = _ours(_cfg(args, "torch_fsdp"))
    raw, ours = _time_interleaved(raw_step, ours_step, args.steps)
    ours.update(_memory(trainer))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"raw": raw, "ours": ours}), flush=True)
    dist.destroy_process_group()


def _row(name: str, raw: dict, ours: dict) -> str:
    ratio = ours["step_s"] / raw["step_s"]
    memory = ours["bytes_per_device"] / ours["bytes_unsharded"]
    return (f"| {name} | {raw['step_s'] * 1e3:.1f} | {ours['step_s'] * 1e3:.1f} | {ratio:.3f} | "
            f"{ours['compiles_after_warmup']} | "
            f"{ours['bytes_per_device'] / 2**20:.2f} / {ours['bytes_unsharded'] / 2**20:.2f} MiB ({memory:.2f}) |")


def main(argv=None) -> None:
    args = _parse(argv)
    if args.fsdp2_worker:
        return _fsdp2_worker(args)

    from xla_shard.backends.xla_common import configure_runtime

    configure_runtime(args.devices)
    import torch_xla.runtime as xr

    xr.use_spmd()
    cfg = _cfg(args, "xla_spmd")
    raw_step, compiles = _raw_xla_fsdpv2(cfg)
    ours_step, trainer = _ours(cfg)
    raw_xla, ours_xla = _time_interleaved(raw_step, ours_step, args.steps, compiles)
    ours_xla.update(_memory(trainer))

    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_USE_SPMD")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           __file__, "--fsdp2-worker", *(argv or sys.argv[1:])],
                          env=env, capture_output=True, text=True)
    result_line = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not result_line:
        sys.exit(f"FSDP2 part failed:\n{done.stderr[-3000:]}")
    fsdp2 = json.loads(result_line[0].removeprefix("RESULT "))

    print(f"\nmodel {args.model}, global batch {args.batch} x {args.seq_len} tokens, AdamW, "
          f"median of {args.steps} steps after {WARMUP} warm-up")
    print("| backend | raw step ms | xla_shard step ms | ratio (target <= 1.03) | compiles after warm-up, both "
          "(target 0) | per-device / unsharded params + optimizer state |")
    print("|---|---|---|---|---|---|")
    print(_row(f"xla_spmd ({args.devices} XLA CPU devices) vs raw FSDPv2", raw_xla, ours_xla))
    print(_row("torch_fsdp (2 gloo processes) vs raw FSDP2", fsdp2["raw"], fsdp2["ours"]))


if __name__ == "__main__":
    main()
