"""DPO's keys (the config's `dpo` section), with TRL's DPOTrainer's names and defaults. Imports no torch: the
config's schema composes itself from it (`xla_shard.methods.registry`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from xla_shard.config.section import ReferenceSection


class DpoSection(ReferenceSection):
    """Direct preference optimisation (method dpo, on data.kind preference rows), with TRL's DPOTrainer's keys and
    defaults: the loss pushes the policy's log-probability ratio of chosen over rejected completions above the
    reference model's."""

    # How far the policy may move from the reference: the rewards are beta x (log-ratio to the reference).
    beta: float = Field(default=0.1, gt=0)
    # sigmoid: -log sigmoid(beta x margin), DPO's own; robust: Robust DPO, for labels flipped with probability
    # `label_smoothing`.
    loss_type: Literal["sigmoid", "robust"] = "sigmoid"
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)

    @model_validator(mode="after")
    def _smoothing_is_robusts(self) -> DpoSection:
        if self.label_smoothing and self.loss_type != "robust":
            raise ValueError("dpo.label_smoothing is Robust DPO's flip probability; TRL's sigmoid loss does not use "
                             "it: set dpo.loss_type: robust, or drop it")
        return self
