"""GRPO's loss (`method: grpo`, on `data.kind: prompt` rows), as TRL's `GRPOTrainer.compute_loss` computes it, on
the examples its rollout made (`grpo_rollout`): the clipped policy loss of each micro-batch's completion tokens,
and TRL's metrics of them. Evaluation, as TRL's, samples held-out prompts through the same rollout."""

from __future__ import annotations

import torch
from torch import nn

from xla_shard.data import Batch
from xla_shard.errors import ConfigError
from xla_shard.methods import grpo
from xla_shard.methods.adapter import Adapter
from xla_shard.methods.grpo_rollout import GrpoRollout
from xla_shard.methods.objective import Objective

# What an evaluation's draws are keyed by beside train.seed: apart from every training generation's.
EVAL_STREAM = 2**32

# The mean of each of these device sums (over masked tokens) is logged under TRL's name.
TOKEN_METRICS = {"kl": "kl", "entropy": "entropy", "clip_ratio/low": "clip_ratio/low_mean",
                 "clip_ratio/high": "clip_ratio/high_mean", "clip_ratio/region": "clip_ratio/region_mean"}


class Grpo(Objective):
    def __init__(self, cfg, adapter: Adapter, rollout: GrpoRollout):
        section = cfg.grpo
        self.section, self.rollout, self.seed = section, rollout, cfg.train.seed
        self.forwards_without_grad = int(section.num_iterations > 1) + int(section.beta > 0)
        if section.beta > 0:
            self.choose_reference(section.reference, "grpo.reference", adapter, cfg.model.name)
        self._sums: dict[str, torch.Tensor] = {}  # the losses' masked sums (device), and their token counts

    def use_reference(self, model: nn.Module) -> None:
        self.reference = self.rollout.reference = model

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        s = self.section
        logps, entropy = grpo.completion_log_probs(model, batch, s.temperature)
        mask = batch["completion_mask"]
        loss, terms = grpo.policy_loss(logps, mask, batch["advantages"], old_logps=batch.get("old_logps"),
                                       ref_logps=batch.get("ref_logps"), loss_type=s.loss_type,
                                       epsilon_low=s.epsilon, epsilon_high=s.epsilon_high, beta=s.beta,
                                       kl_correction=s.kl_correction, max_completion_length=s.max_completion_length,
                                       tokens_in_step=batch["step_tokens"].mean(),
                                       importance_ratio=batch.get("importance_ratio"))
        weight = mask.to(logps.dtype)
        sums = {key: (value * weight).sum() for key, value in terms.items()}
        sums["entropy"] = (entropy.detach() * weight).sum()
        sums["count"] = weight.sum()
        self._sums = {key: self._sums[key] + value for key, value in sums.items()} if self._sums else sums
        return loss

    def counted(self, batch: Batch) -> None:
        return None

    @torch.no_grad()
    def evaluate(self, model: nn.Module, backend, source, batches: int, rows: range) -> dict[str, float]:
        """As TRL's GRPOTrainer evaluates: completions of every evaluation prompt sampled by the model (in eval
        mode), scored and trained on by nothing, the loss and TRL's metrics of them under `eval_` names. Each
        evaluation draws with the same noise (keyed by train.seed, the batch and the row's place), so
        evaluations at different steps differ by the weights alone."""
        training, self._sums = self._sums, {}
        model.eval()
        losses = []
        try:
            with self.rollout.apart():
                for index in range(batches):
                    made = self.rollout.generate(model, backend, source, [source.rows(index, rows)], [rows],
                                                 (self.seed, EVAL_STREAM, index), step=0)
                    for batch in made:
                        placed = backend.place(batch)
                        with backend.forward_context():
                            losses.append(self.loss(model, placed))
                        backend.after_step()
                metrics = {**self.rollout.step_metrics(), **self.step_metrics(backend.mean_loss)}
            metrics["loss"] = sum(backend.mean_loss(loss) for loss in losses) / len(losses)
        finally:
            model.train()
            self._sums = training
        return {f"eval_{key}": value for key, value in metrics.items()}

    def step_metrics(self, mean) -> dict[str, float]:
        """TRL's loss metrics since the last record: the masked means over every completion token of the
        micro-batches (the rollout's own are `GrpoRollout.step_metrics`)."""
        got = {}
        if self._sums:
            count = mean(self._sums["count"])
            for key, name in TOKEN_METRICS.items():
                if key in self._sums:
                    got[name] = mean(self._sums[key]) / count if count else 0.0
        self._sums = {}
        return got


def build(cfg, adapter: Adapter, loss_fn):
    """Method grpo (`registry.METHODS`): it generates, and with grpo.beta > 0 scores with a reference."""
    from xla_shard.methods import GENERATION, INFERENCE_ENGINE, REFERENCE_MODEL

    if loss_fn is not None:
        raise ConfigError("method", "grpo's loss is its own (the clipped policy loss of its completions); a loss_fn "
                                    "of yours replaces the objective of the other methods")
    rollout = GrpoRollout(cfg, adapter)
    needs = frozenset({GENERATION} | ({REFERENCE_MODEL} if cfg.grpo.beta > 0 else set())
                      | ({INFERENCE_ENGINE} if cfg.grpo.use_vllm else set()))
    return Grpo(cfg, adapter, rollout), needs, rollout
