"""The room for fine-tuning methods. A run's method (`method` in the config) is resolved once, by `method_for`,
into a `Method`: how the model is changed (its `Adapter`: full fine-tuning, LoRA, DoRA), what a step computes and
evaluation reports (its `Objective`: the model's own loss, one of yours, DPO, GRPO), what a step trains on (its
`Rollout`: the rows as read, or examples an online method makes with the model), and what it needs of a
backend. The trainer hands that object to the pretrained loader, the planner and the backend; nothing outside this
package names a concrete method (tests/test_layout.py holds that). A method is its modules here (its objective,
its section's keys), its tests, and a line in `registry.METHODS`.

Importing this package imports no torch (the config's schema reads the registry beside it); `Adapter` and
`Objective` are imported when first asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

# The config first: its schema composes itself from the registry, whose sections build on the config's, so the
# registry is first imported from inside the schema whichever of the two a program imports first.
import xla_shard.config  # noqa: F401  (isort: skip)
from xla_shard.errors import ConfigError
from xla_shard.methods.registry import METHODS

if TYPE_CHECKING:
    from xla_shard.methods.adapter import Adapter
    from xla_shard.methods.objective import Objective
    from xla_shard.methods.rollout import Rollout

# What a method may need of a backend beyond training a model (`Method.needs`).
REFERENCE_MODEL = "a frozen reference model beside the policy"
GENERATION = "generation with the policy being trained"
INFERENCE_ENGINE = "an inference engine beside its processes (grpo.use_vllm)"


@dataclass(frozen=True)
class Method:
    """A run's fine-tuning method, as every part of the run sees it."""

    name: str  # the config's `method`
    adapter: Adapter
    objective: Objective
    rollout: Rollout
    needs: frozenset[str] = frozenset()  # REFERENCE_MODEL, ...: a backend that cannot refuses the run
    # What a method that generates its completions asks of its prompt rows (`data.prompts.Generations`).
    generations: object | None = None

    def describe(self) -> str:
        return self.rollout.describe() or self.objective.describe() or self.name

    def step_metrics(self, mean) -> dict[str, float]:
        """The metrics of the steps since the last record: the rollout's (host), then the objective's (`mean`:
        the backend's `mean_loss`)."""
        return {**self.rollout.step_metrics(), **self.objective.step_metrics(mean)}


def adapter_for(cfg) -> Adapter:
    """The adapter `cfg` fine-tunes with: DoRA (`model.lora.use_dora`), LoRA (`model.lora`), or none (every
    parameter trains)."""
    if cfg.model.lora is not None and cfg.model.lora.use_dora:
        from xla_shard.methods.dora import Dora

        return Dora(cfg.model.lora)
    if cfg.model.lora is not None:
        from xla_shard.methods.lora import Lora

        return Lora(cfg.model.lora)
    from xla_shard.methods.adapter import Adapter

    return Adapter()


def method_for(cfg, loss_fn=None) -> Method:
    """The method `cfg` trains (with `loss_fn(model, batch)`, a loss of your own in its objective's place)."""
    from xla_shard.methods.rollout import Rollout

    adapter = adapter_for(cfg)
    module, _, function = METHODS[cfg.method].build.partition(":")
    objective, needs, rollout = getattr(importlib.import_module(module), function)(cfg, adapter, loss_fn)
    rollout = rollout or Rollout()
    return Method(cfg.method, adapter, objective, rollout, needs, getattr(rollout, "generations", None))


def objective_for(cfg, loss_fn=None) -> Objective:
    """The objective of the method `cfg` trains (your own loop's step: `objective.loss(model, batch)`)."""
    return method_for(cfg, loss_fn).objective


def evaluate(model, backend, source, cfg, objective: Objective | None = None) -> dict[str, float]:
    """The objective's metrics (the config's unless given) over every row of an evaluation source
    (`train.eval_steps` batches if set), with the model in eval mode. A causal LM's or classifier's loss and
    accuracy are summed over the tokens or rows that have a label, then divided by their count, so filler rows
    and padding count for nothing. (The Trainer and TRL average each batch's mean instead; the two agree where
    every batch has as many labelled tokens.) Every process calls it."""
    if source is None:
        raise ConfigError("data.eval_path", "there is no evaluation set to evaluate on: set data.eval_path (a file "
                                            "of held-out rows) or data.eval_fraction (rows held out of data.path)")
    from xla_shard.data import micro_rows

    train = cfg.train
    batches = min(source.batches, train.eval_steps or source.batches)
    rows = micro_rows(train.global_batch_size, 0, 1, *backend.processes.batch_part)
    result = (objective or method_for(cfg).objective).evaluate(model, backend, source, batches, rows)
    return {**result, "eval_batches": batches, "eval_rows": source.rows_covered(batches)}


def __getattr__(name: str):
    if name in ("Adapter", "Objective"):
        module = importlib.import_module(f"xla_shard.methods.{name.lower()}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GENERATION", "INFERENCE_ENGINE", "METHODS", "REFERENCE_MODEL", "Adapter", "Method", "Objective",
           "adapter_for", "evaluate", "method_for", "objective_for"]
