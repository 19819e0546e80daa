"""Direct preference optimisation (`method: dpo`, on `data.kind: preference` rows), computed as TRL's `DPOTrainer`
computes it.

A row holds a prompt with its chosen and its rejected completion ([2, seq_len], see `xla_shard.data.preference`);
the two sequences of every row go through the model in one forward. Each completion's log-probability is the
sum over its tokens; the reference's comes first, without gradients: from `dpo.reference` (a model directory,
built frozen beside the policy), else the same model with the adapter switched off (LoRA: the base, no second
copy of the weights), else the weights the policy starts from, built beside it. The sigmoid loss is
-log sigmoid(beta * margin), margin = (policy - reference log-ratio of chosen) - (the same of rejected); Robust
DPO's adds the flipped-label term. Evaluation reports TRL's metrics over every evaluation row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xla_shard import lm_head
from xla_shard.data import Batch
from xla_shard.data.packing import IGNORE
from xla_shard.methods.adapter import Adapter
from xla_shard.methods.objective import Objective, scored_forward


# TRL's names for what each step reports beside the loss (evaluation: the same with eval_ before them).
TRAINING_METRICS = {"chosen": "rewards/chosen", "rejected": "rewards/rejected", "accuracies": "rewards/accuracies",
                    "margins": "rewards/margins", "logps_chosen": "logps/chosen", "logps_rejected": "logps/rejected"}


class Dpo(Objective):
    sequences_per_row = 2  # chosen and rejected
    forwards_without_grad = 1  # the reference's

    def __init__(self, section, adapter: Adapter, policy: str):
        """`policy`: the model directory the policy starts from (model.name)."""
        self.beta, self.loss_type, self.smoothing = section.beta, section.loss_type, section.label_smoothing
        self.adapter = adapter
        self.choose_reference(section.reference, "dpo.reference", adapter, policy)
        self.reference: nn.Module | None = None
        # Sums of each training micro-batch's means since the last record, and how many: kept on the device (added
        # inside the step's graph), read only when a record is written.
        self._sums: dict[str, torch.Tensor] = {}
        self._micro_batches = 0

    def describe(self) -> str:
        return f"dpo ({self.loss_type}, beta {self.beta:g}) on the completions' log-probabilities"

    def use_reference(self, model: nn.Module) -> None:
        self.reference = model

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        terms = self._terms(model, batch)
        means = {key: terms[key].mean() for key in TRAINING_METRICS}
        self._sums = {key: self._sums[key] + value for key, value in means.items()} if self._sums else means
        self._micro_batches += 1
        return terms["loss"].mean()

    def step_metrics(self, mean) -> dict[str, float]:
        """TRL's training metrics, averaged over the micro-batches since the last record (TRL, too, averages what
        it logs over the steps since its last log)."""
        sums, count = self._sums, self._micro_batches
        self._sums, self._micro_batches = {}, 0
        return {name: mean(sums[key]) / count for key, name in TRAINING_METRICS.items()} if count else {}

    def eval_batch(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        terms = self._terms(model, batch)
        real = (batch["labels"][:, 0] != IGNORE).any(-1).float()  # the filler rows of the last batch have none
        sums = {key: (value.detach().float() * real).sum() for key, value in terms.items()}
        return {**sums, "count": real.sum()}

    def eval_result(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums["count"]
        names = {"loss": "loss", **TRAINING_METRICS}
        return {f"eval_{name}": sums[key] / n for key, name in names.items()}

    def log_probs(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen and rejected completion log-probabilities ([rows] each), summed over their tokens."""
        rows = batch["input_ids"].shape[0]
        # (a sequence split between processes feeds each its piece of the tokens, and the labels whole)
        both = {key: value.reshape(2 * rows, value.shape[-1]) for key, value in batch.items()}
        labels = both["labels"][:, 1:]
        head = lm_head.scorer(model)
        if head is not None:  # the output head scored chunk by chunk: the logits are never whole
            picked = scored_forward(model, head, both)[0].logps
        else:
            logits = model(**{k: v for k, v in both.items() if k != "labels"}).logits[:, :-1].float()
            picked = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
        summed = (picked * (labels != IGNORE)).sum(-1).view(rows, 2)
        return summed[:, 0], summed[:, 1]

    def _terms(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        """Per row: the loss, the rewards and their margin, and the policy's log-probabilities."""
        with torch.no_grad():
            if self.reference is not None:
                reference = self.log_probs(self.reference, batch)
            else:
                with self.adapter.switched_off(model):
                    reference = self.log_probs(model, batch)
        chosen, rejected = self.log_probs(model, batch)
        chosen_ratio, rejected_ratio = chosen - reference[0], rejected - reference[1]
        margin = self.beta * (chosen_ratio - rejected_ratio)
        loss = -F.logsigmoid(margin)
        if self.loss_type == "robust":
            eps = self.smoothing
            loss = ((1 - eps) * loss + eps * F.logsigmoid(-margin)) / (1 - 2 * eps)
        rewards = self.beta * chosen_ratio.detach(), self.beta * rejected_ratio.detach()
        return {"loss": loss, "chosen": rewards[0], "rejected": rewards[1],
                "accuracies": (rewards[0] > rewards[1]).float(), "margins": rewards[0] - rewards[1],
                "logps_chosen": chosen.detach(), "logps_rejected": rejected.detach()}


def build(cfg, adapter: Adapter, loss_fn) -> tuple[Objective, frozenset[str], None]:
    """Method dpo (`registry.METHODS`); with `loss_fn`, a loss of the user's own on preference rows."""
    from xla_shard.methods import REFERENCE_MODEL
    from xla_shard.methods.objective import build_sft

    if loss_fn is not None:
        return build_sft(cfg, adapter, loss_fn)
    return Dpo(cfg.dpo, adapter, cfg.model.name), frozenset({REFERENCE_MODEL}), None
