"""What a step trains on, made from the rows read for it: a method's rollout, apart from its objective (the loss).

Offline methods (SFT, DPO) train on their rows as read: the base `Rollout`. An online method makes its examples
with the model first (GRPO: sample completions, score them, their advantages), as TRL's trainers generate apart
from `compute_loss` and torchtitan's RL keeps its rollouter apart from its loss. Another generator (an inference
engine) or another online method is another `Rollout`; neither the objective nor the backend grows for it.
"""

from __future__ import annotations

import torch
from torch import nn

from xla_shard.data import Batch
from xla_shard.sampling import Generation


class Rollout:
    """The rows as read. Subclasses make the micro-batches `Objective.loss` trains on."""

    # Whether the step may cut a batch's padding off its end (`data.batches.trimmed`): not where a batch lays out
    # other tensors by position (a generated completion beside its prompt).
    trims_padding = True
    # Optimizer steps that run each of the method's programs (an online method's generation and the steps that
    # reuse it): train.recompile_warmup_steps counts in these.
    steps_per_round = 1

    def describe(self) -> str:
        """How examples are made, for the run's log (empty: as read)."""
        return ""

    def prepare(self, model: nn.Module, backend) -> str:
        """Build what generation needs beside the model (an inference engine) before the first step, so what
        cannot run is said before training starts; what it built, for the run's log (empty: nothing)."""
        return ""

    def make(self, model: nn.Module, backend, source, step: int, micro_batches: list[Batch],
             rows: list[range]) -> list[Batch]:
        """What `step` trains on, from the rows read for it (host tensors; `rows`: each micro-batch's rows of the
        global batch). Every process calls it."""
        return micro_batches

    def state(self, next_step: int) -> dict[str, torch.Tensor]:
        """This process's examples that steps from `next_step` on still train on (one generation serves several
        steps), for the checkpoint taken before `next_step`: a resume there trains on them rather than on examples
        made again from newer weights. Empty: nothing to keep."""
        return {}

    def resume(self, step: int, state: dict[str, torch.Tensor]) -> str:
        """Take back what `state` kept, for a run resumed at `step`; what the run's log says of it (empty:
        nothing)."""
        return ""

    def generation(self, model: nn.Module, source) -> Generation | None:
        """What one of this rollout's generations runs for a global batch, for `xla-shard compile` to trace and
        compile (None: it generates nothing)."""
        return None

    def step_metrics(self) -> dict[str, float]:
        """Metrics of the examples made since the last call (host floats), for the step's record."""
        return {}
