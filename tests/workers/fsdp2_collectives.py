"""Train under torchrun, recording the collectives torch.distributed runs in the first step; rank 0 writes them
with the losses and the bytes of parameters, gradients and optimizer state on one process (JSON).

Usage: fsdp2_collectives.py OUT STEPS [KEY=VALUE ...] -- [KEY=VALUE ...] [-- ...]
Each `--` starts a run of its own with its overrides added (a sharding, say); the runs share the processes and
their process group (one start-up for all), and OUT holds the list of their results in order.
Recorded per (op, group size, stride): calls and the bytes of each op's result (the gathered or reduced tensor;
one shard for a reduce-scatter), as xla_shard.planner.hlo reads a compiled XLA step.
"""

import json
import sys
from collections import defaultdict

import torch.distributed as dist
from runs import split_runs

from bench.measure import bytes_after_backward
from xla_shard import config
from xla_shard.launch import exit_without_finalizing
from xla_shard.train import Trainer

# torch.distributed function: (op, the result tensor's parameter name and position). FSDP2 calls the *_tensor
# forms up to torch 2.14 and the *_single forms from 2.15; each torch has the names it has.
RECORDED = {"all_gather_into_tensor": ("all-gather", "output_tensor", 0),
            "all_gather_single": ("all-gather", "output_tensor", 0),
            "reduce_scatter_tensor": ("reduce-scatter", "output", 0),
            "reduce_scatter_single": ("reduce-scatter", "output", 0), "all_reduce": ("all-reduce", "tensor", 0)}


def main(out: str, steps: str, *args: str) -> None:
    common, *runs = split_runs(args)
    seen = defaultdict(lambda: {"count": 0, "bytes": 0})
    recording = [False]

    def wrap(op, result, result_at, original):
        def recorded(*args, **kwargs):
            if recording[0]:
                group = kwargs.get("group")
                ranks = sorted(dist.get_process_group_ranks(group) if group is not None
                               else range(dist.get_world_size()))
                tensor = kwargs[result] if result in kwargs else args[result_at]
                key = f"{op} {len(ranks)} {ranks[1] - ranks[0] if len(ranks) > 1 else 1}"
                seen[key]["count"] += 1
                seen[key]["bytes"] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)
        return recorded

    for name, (op, result, result_at) in RECORDED.items():
        if hasattr(dist, name):
            setattr(dist, name, wrap(op, result, result_at, getattr(dist, name)))
    results, trainer = [], None
    for index, run in enumerate(runs):
        seen.clear()
        recording[0] = True
        trainer = Trainer(config.load(None, [*common, *run, f"output_dir={out}.run{index}"])).setup()
        losses = []
        for step in range(int(steps)):
            losses.append(trainer.backend.mean_loss(trainer.step(step)))
            recording[0] = False
        memory = bytes_after_backward(trainer, int(steps))
        results.append({"losses": losses, "collectives": dict(seen), "memory": memory})
    if trainer.backend.processes.is_main:
        with open(out, "w") as f:
            json.dump(results, f)
    trainer.backend.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing(0)  # as xla-shard's own torchrun workers end: no gloo teardown at finalization
