"""The room for fine-tuning methods: how the model is changed (`Adapter`: full fine-tuning, LoRA, DoRA) and what a
step computes and evaluation reports (`Objective`: the model's own loss, one of yours, DPO).

The trainer, the pretrained loader, the planner, the backends and a loop of your own ask `adapter_for(cfg)`
and `objective_for(cfg)` and the objects they return; nothing outside this package names a concrete method
(tests/test_layout.py holds that). A method is a module here with its tests, and a line in one of the two.
"""

from __future__ import annotations

from xla_shard.methods.adapter import Adapter
from xla_shard.methods.objective import Objective


def adapter_for(cfg) -> Adapter:
    """The adapter `cfg` fine-tunes with: DoRA (`model.lora.use_dora`), LoRA (`model.lora`), or none (every
    parameter trains)."""
    if cfg.model.lora is not None and cfg.model.lora.use_dora:
        from xla_shard.methods.dora import Dora

        return Dora(cfg.model.lora)
    if cfg.model.lora is not None:
        from xla_shard.methods.lora import Lora

        return Lora(cfg.model.lora)
    return Adapter()


def objective_for(cfg, loss_fn=None) -> Objective:
    """The objective `cfg` trains (with `loss_fn(model, batch)`, a loss of your own in its place)."""
    from xla_shard.methods.objective import CustomLoss, ModelLoss

    if cfg.data.kind == "preference" and loss_fn is None:
        from xla_shard.methods.dpo import Dpo

        return Dpo(cfg.dpo, adapter_for(cfg), cfg.model.name)
    causal = cfg.model.task == "causal_lm"
    return ModelLoss(causal) if loss_fn is None else CustomLoss(loss_fn, causal)


__all__ = ["Adapter", "Objective", "adapter_for", "objective_for"]
