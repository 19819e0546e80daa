"""The room for fine-tuning methods: what a step computes and what evaluation reports (`Objective`).

The trainer, a loop of your own and evaluation ask `objective_for(cfg)` and the object it returns; nothing
outside this package names a concrete method (tests/test_layout.py holds that). A method is a module here
with its tests, and a line in `objective_for`.
"""

from __future__ import annotations

from xla_shard.methods.objective import Objective


def objective_for(cfg, loss_fn=None) -> Objective:
    """The objective `cfg` trains (with `loss_fn(model, batch)`, a loss of your own in its place)."""
    from xla_shard.methods.objective import CustomLoss, ModelLoss

    causal = cfg.model.task == "causal_lm"
    return ModelLoss(causal) if loss_fn is None else CustomLoss(loss_fn, causal)


__all__ = ["Objective", "objective_for"]
