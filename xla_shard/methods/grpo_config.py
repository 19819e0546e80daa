"""GRPO's keys (the config's `grpo` section), with TRL's GRPOTrainer's names and defaults, and what they ask of
the rest of the config. Imports no torch: the config's schema composes itself from it
(`xla_shard.methods.registry`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from xla_shard.config.section import ReferenceSection


class GrpoSection(ReferenceSection):
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

    # vLLM draws the completions (`xla_shard.methods.vllm_engine`), TRL's keys: an engine colocated with each
    # training process, built from model.name's directory, the policy's weights pushed to it before each
    # generation (under model.lora, the adapters alone).
    use_vllm: bool = False
    vllm_mode: Literal["colocate", "server"] = "colocate"
    # CUDA: the share of GPU memory the engine takes (weights and KV cache); CPU: the most host memory its KV
    # cache may take (sized for one generation's rows within that share).
    vllm_gpu_memory_utilization: float = Field(default=0.3, gt=0, lt=1)
    vllm_tensor_parallel_size: int = Field(default=1, ge=1)
    vllm_max_model_length: int | None = Field(default=None, ge=1)  # null: train.seq_len
    vllm_enable_sleep_mode: bool = False
    # TRL's truncated importance-sampling correction for the engine's numerics differing from the trainer's.
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                           "sequence_mask"] = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = Field(default=3.0, gt=0)
    vllm_importance_sampling_clip_min: float | None = Field(default=None, ge=0)
    # The run stops when the engine's log-probabilities of its sampled tokens are further than this from the
    # trainer's, on average over a step's tokens (a sync that did not happen, or pushed other weights). null:
    # 1e-3 where both compute in fp32, 0.1 in bf16/fp16.
    vllm_logp_difference_limit: float | None = Field(default=None, gt=0)

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
        if self.use_vllm:
            self._check_engine(cfg)
        if cfg.fsdp.scan_layers:
            raise ValueError("fsdp.scan_layers runs the decoder layers as one XLA loop, which cannot carry the static "
                             "KV cache GRPO samples with (one per layer): set fsdp.scan_layers: false")

    def _check_engine(self, cfg) -> None:
        """What the colocated engine cannot do, refused before anything is built (what needs the runtime, the
        engine's own checks, is `vllm_engine.check_runtime`'s)."""
        if self.vllm_mode == "server":
            raise ValueError("grpo.vllm_mode server (an engine in its own process, weights over its update API) is "
                             "not built yet: use vllm_mode colocate, an engine beside each training process")
        longest = self.vllm_max_model_length
        if longest is not None and longest < cfg.train.seq_len:
            raise ValueError(f"grpo.vllm_max_model_length={longest} is shorter than train.seq_len="
                             f"{cfg.train.seq_len}, a prompt and its completion: raise it, or leave it null")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low > high:
            raise ValueError(f"grpo.vllm_importance_sampling_clip_min={low} is above clip_max={high}")
        lora = cfg.model.lora
        if lora is not None and lora.use_dora:
            raise ValueError("grpo.use_vllm pushes the adapters through vLLM's LoRA loading, which has no DoRA: "
                             "set model.lora.use_dora: false, or grpo.use_vllm: false")
        if lora is not None and lora.modules_to_save:
            raise ValueError("grpo.use_vllm pushes the adapters through vLLM's LoRA loading, which takes no "
                             "module trained whole: empty model.lora.modules_to_save, or set grpo.use_vllm: false")
