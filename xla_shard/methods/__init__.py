"""The room for fine-tuning methods. A run's method (`method` in the config) is resolved once, by `method_for`,
into a `Method`: how the model is changed (its `Adapter`: full fine-tuning, LoRA, DoRA), what a step computes and
evaluation reports (its `Objective`: the model's own loss, one of yours, DPO), and what it needs of a backend.
The trainer, the pretrained loader, the planner and the backends are handed that object, or ask `method_for`;
nothing outside this package names a concrete method (tests/test_layout.py holds that). A method is a module
here with its tests, and a line in `METHODS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from xla_shard.methods.adapter import Adapter
from xla_shard.methods.objective import Objective

# What a method may need of a backend beyond training a model (`Method.needs`).
REFERENCE_MODEL = "a frozen reference model beside the policy"
GENERATION = "generation with the policy being trained"


@dataclass(frozen=True)
class Method:
    """A run's fine-tuning method, as every part of the run sees it."""

    name: str  # the config's `method`
    adapter: Adapter
    objective: Objective
    needs: frozenset[str] = frozenset()  # REFERENCE_MODEL, ...: a backend that cannot refuses the run
    # What a method that generates its completions asks of its prompt rows (`data.prompts.Generations`).
    generations: object | None = None

    def describe(self) -> str:
        return self.objective.describe() or self.name


def _sft(cfg, adapter: Adapter, loss_fn) -> tuple[Objective, frozenset[str]]:
    from xla_shard.methods.objective import CustomLoss, ModelLoss

    causal = cfg.model.task == "causal_lm"
    return (ModelLoss(causal) if loss_fn is None else CustomLoss(loss_fn, causal)), frozenset()


def _dpo(cfg, adapter: Adapter, loss_fn) -> tuple[Objective, frozenset[str]]:
    if loss_fn is not None:  # a loss of the user's own on preference rows
        return _sft(cfg, adapter, loss_fn)
    from xla_shard.methods.dpo import Dpo

    return Dpo(cfg.dpo, adapter, cfg.model.name), frozenset({REFERENCE_MODEL})


def _grpo(cfg, adapter: Adapter, loss_fn) -> tuple[Objective, frozenset[str]]:
    if loss_fn is not None:
        from xla_shard.errors import ConfigError

        raise ConfigError("method", "grpo's loss is its own (the clipped policy loss of its completions); a loss_fn "
                                    "of yours replaces the objective of methods sft and dpo")
    from xla_shard.methods.grpo_objective import Grpo

    objective = Grpo(cfg, adapter)
    return objective, frozenset({GENERATION} | ({REFERENCE_MODEL} if cfg.grpo.beta > 0 else set()))


# The config's `method` -> what builds its objective (and says what it needs), given the config and the adapter.
METHODS: dict[str, Callable] = {"sft": _sft, "dpo": _dpo, "grpo": _grpo}


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


def method_for(cfg, loss_fn=None) -> Method:
    """The method `cfg` trains (with `loss_fn(model, batch)`, a loss of your own in its objective's place)."""
    adapter = adapter_for(cfg)
    objective, needs = METHODS[cfg.method](cfg, adapter, loss_fn)
    return Method(cfg.method, adapter, objective, needs, getattr(objective, "generations", None))


def objective_for(cfg, loss_fn=None) -> Objective:
    """The objective of the method `cfg` trains (your own loop's step: `objective.loss(model, batch)`)."""
    return method_for(cfg, loss_fn).objective


__all__ = ["GENERATION", "METHODS", "REFERENCE_MODEL", "Adapter", "Method", "Objective", "adapter_for", "method_for",
           "objective_for"]
