"""GRPO's keys (the config's `grpo` section), with TRL's GRPOTrainer's names and defaults, and what they ask of
the rest of the config. Imports no torch: the config's schema composes itself from it
(`xla_shard.methods.registry`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from xla_shard.config.section import MethodSection


class GrpoSection(MethodSection):
    """Group relative policy optimisation (method grpo, on data.kind prompt rows), with TRL's GRPOTrainer's keys and
    defaults: each prompt gets `num_generations` completions from the policy being trained, the reward functions
    score them, and each completion's advantage over its group weighs its tokens' clipped policy loss.
    train.global_batch_size counts completions (as TRL's per-device batch does): global_batch_size /
    num_generations prompts a step."""

    # The user's reward functions: import paths, MODULE:FUNCTION or path/to/file.py:FUNCTION, each called with
    # TRL's keywords (prompts, completions, completion_ids, the row's other columns) and returning a float (or
    # None) per completion; `reward_weights`: one weight each (null: 1 each).
    reward_funcs: list[str] = Field(default_factory=list)
    reward_weights: list[float] | None = None
    num_generations: int = Field(default=8, ge=2)
    # Tokens a completion may have; the prompt has train.seq_len minus these (longer prompts are dropped, counted).
    max_completion_length: int = Field(default=256, ge=1)
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)  # 0: off
    # dapo: over every completion token of the step (TRL's default); grpo: each sequence's mean, then their
    # mean; dr_grpo: over rows x max_completion_length; bnpo: over the micro-batch's tokens.
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = "dapo"
    # What a reward's advantage is divided by: its group's standard deviation, the batch's, or nothing.
    scale_rewards: Literal["group", "batch", "none"] = "group"
    epsilon: float = Field(default=0.2, gt=0)  # the ratio's clip below 1 (and above, unless epsilon_high)
    epsilon_high: float | None = Field(default=None, gt=0)
    # The KL term's weight; > 0 scores the completions with the reference too.
    beta: float = Field(default=0.0, ge=0)
    # Optimizer steps each generation trains (> 1: the ratio to the generating policy's probabilities moves).
    num_iterations: int = Field(default=1, ge=1)
    # Weigh each token's KL by its importance ratio (TRL's use_bias_correction_kl).
    kl_correction: bool = True
    # The reference model for beta > 0: a model directory; null: the policy with its LoRA adapters switched off
    # (model.lora), else the weights it starts from.
    reference: str | None = None

    @model_validator(mode="after")
    def _reference_needs_beta(self) -> GrpoSection:
        if self.reference is not None and self.beta == 0:
            raise ValueError("grpo.reference scores the KL term, and grpo.beta is 0: set grpo.beta > 0, or drop it")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"grpo.reward_weights has {len(self.reward_weights)} weight(s) for "
                             f"{len(self.reward_funcs)} reward function(s): give one each, or none")
        return self

    def check_run(self, cfg) -> None:
        train = cfg.train
        if not self.reward_funcs:
            raise ValueError("method grpo scores its completions with your reward functions: set grpo.reward_funcs "
                             "(MODULE:FUNCTION or path/to/file.py:FUNCTION, one or more)")
        if train.global_batch_size % self.num_generations:
            raise ValueError(f"train.global_batch_size={train.global_batch_size} counts completions, "
                             f"grpo.num_generations={self.num_generations} a prompt: the batch must hold whole groups")
        if self.max_completion_length >= train.seq_len:
            raise ValueError(f"grpo.max_completion_length={self.max_completion_length} leaves the prompt nothing of "
                             f"train.seq_len={train.seq_len} (a row is the prompt, then its completion)")
        if cfg.mesh.context > 1:
            raise ValueError(f"mesh.context={cfg.mesh.context} splits sequences; GRPO generates whole ones: set "
                             "mesh.context: 1")
        if cfg.fsdp.scan_layers:
            raise ValueError("fsdp.scan_layers runs the decoder layers as one XLA loop, which cannot carry the static "
                             "KV cache GRPO samples with (one per layer): set fsdp.scan_layers: false")
