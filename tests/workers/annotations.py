"""Count the sharding annotations xla_spmd makes while training, step by step.

Usage: annotations.py OUT.json [KEY=VALUE ...]   (config overrides)
Saves: the optimizer's step post-hooks, the number of parameters and of optimizer state tensors, and per step:
how many calls went through torch_xla's Python `mark_sharding` (slow: it looks for jax and torchax every time),
how many of those annotated an optimizer state tensor, and how many annotations reached torch_xla's C++ side
(however made) on a gradient.
"""

import json
import sys

import torch_xla
import torch_xla.distributed.spmd as xs

from xla_shard import config
from xla_shard.train import Trainer


def main(out: str, *overrides: str) -> None:
    counts: dict[str, list[int]] = {"python_marks": [], "state_marks": [], "grad_marks": []}
    python_mark, native_mark = xs.mark_sharding, torch_xla._XLAC._xla_mark_sharding

    def counting_python(tensor, *args, **kwargs):
        if counts["python_marks"]:
            counts["python_marks"][-1] += 1
            counts["state_marks"][-1] += id(tensor) in state_ids()
        return python_mark(tensor, *args, **kwargs)

    def counting_native(tensor, *args):
        if counts["grad_marks"]:
            counts["grad_marks"][-1] += any(tensor is p.grad for p in trainer.model.parameters())
        return native_mark(tensor, *args)

    xs.mark_sharding, torch_xla._XLAC._xla_mark_sharding = counting_python, counting_native
    trainer = Trainer(config.load(None, overrides)).setup()
    optimizer = trainer.optimizer

    def state_ids():
        return {id(v) for state in optimizer.state.values() for v in state.values()}

    for step in range(3):
        for series in counts.values():
            series.append(0)
        trainer.step(step)
    tensors = sum(1 for state in optimizer.state.values() for v in state.values() if v.dim() > 0)
    with open(out, "w") as f:
        json.dump({"post_hooks": len(optimizer._optimizer_step_post_hooks), "state_tensors": tensors,
                   "params": sum(1 for _ in trainer.model.parameters()), "triple": trainer.backend.plan.triple,
                   **{f"{name}_per_step": series for name, series in counts.items()}}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
