"""What every section of the config is (strict keys, no infinities, no booleans for numbers), and what a
fine-tuning method's own section adds: a say over the rest of the config when the run is its method's."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, field_validator


class Section(BaseModel):
    # inf/nan are refused everywhere: an infinite lr or timeout is a mistake, never a setting.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info) -> Any:
        """YAML's `true` is an int to pydantic (steps: true would train one step): refuse it for numbers."""
        annotation = cls.model_fields[info.field_name].annotation
        kinds = set(get_args(annotation)) or {annotation}
        if isinstance(value, bool) and bool not in kinds and kinds & {int, float}:
            raise ValueError(f"expected a number, got {str(value).lower()}")
        return value


class MethodSection(Section):
    """A fine-tuning method's keys: the config's section named after the method (`xla_shard.methods.registry`).
    Its keys are refused where the config's `method` is another."""

    def check_run(self, cfg) -> None:
        """Raise ValueError, naming the keys, where the rest of `cfg` (whose method is this one) cannot run it."""

    def changed(self) -> list[str]:
        """The keys set to other than their defaults."""
        return [key for key, value in self if value != type(self).model_fields[key].get_default(
            call_default_factory=True)]


class ReferenceSection(MethodSection):
    """The keys of a method whose loss compares the policy with a frozen reference model (DPO; GRPO's KL term)."""

    # The reference model: a model directory (local or a URL), frozen, sharded like the policy and never saved;
    # null: the policy with its LoRA adapters switched off (model.lora), else the weights it starts from.
    reference: str | None = None
