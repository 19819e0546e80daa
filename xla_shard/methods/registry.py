"""Every fine-tuning method, a line each: its name (the config's `method`), the rows it trains on (`data.kind`),
its own keys (the config's section of its name, where it has any), and where its objective is built. The
config's schema composes its `method` key and the methods' sections from this table, and `method_for` builds a
run's method from it. It imports no torch (the config is read before torch is)."""

from __future__ import annotations

from dataclasses import dataclass

from xla_shard.config.section import MethodSection
from xla_shard.methods.dpo_config import DpoSection
from xla_shard.methods.grpo_config import GrpoSection


@dataclass(frozen=True)
class Entry:
    rows: tuple[str, ...]  # the data.kind values it trains on
    # MODULE:FUNCTION, imported when a run is built: (cfg, adapter, loss_fn) -> (its Objective, its needs, its
    # Rollout or None: the rows as read)
    build: str
    section: type[MethodSection] | None = None


METHODS: dict[str, Entry] = {
    "sft": Entry(("text", "chat", "prompt_completion"), "xla_shard.methods.objective:build_sft"),
    "dpo": Entry(("preference",), "xla_shard.methods.dpo:build", DpoSection),
    "grpo": Entry(("prompt",), "xla_shard.methods.grpo_objective:build", GrpoSection),
}
