"""Count the sharding annotations xla_spmd makes on optimizer state, step by step.

Usage: annotations.py OUT.json [KEY=VALUE ...]   (config overrides)
Saves: the optimizer's step post-hooks, the state tensors after the steps, and per step how many
`mark_sharding` calls annotated an optimizer state tensor.
"""

import json
import sys

import torch_xla.distributed.spmd as xs

from xla_shard import config
from xla_shard.train import Trainer


def main(out: str, *overrides: str) -> None:
    trainer = Trainer(config.load(None, overrides)).setup()
    optimizer, counts = trainer.optimizer, []
    mark = xs.mark_sharding

    def counting(tensor, *args, **kwargs):
        states = {id(v) for state in optimizer.state.values() for v in state.values()}
        counts[-1] += id(tensor) in states
        return mark(tensor, *args, **kwargs)

    xs.mark_sharding = counting
    for step in range(3):
        counts.append(0)
        trainer.step(step)
    tensors = sum(1 for state in optimizer.state.values() for v in state.values() if v.dim() > 0)
    with open(out, "w") as f:
        json.dump({"post_hooks": len(optimizer._optimizer_step_post_hooks), "state_tensors": tensors,
                   "state_marks_per_step": counts, "triple": trainer.backend.plan.triple}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
