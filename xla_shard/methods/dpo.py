"""Direct preference optimisation (`data.kind: preference`), computed as TRL's `DPOTrainer` computes it.

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

from xla_shard.data import Batch
from xla_shard.data.tokenize import IGNORE
from xla_shard.methods.adapter import Adapter
from xla_shard.methods.objective import Objective


class Dpo(Objective):
    sequences_per_row = 2  # chosen and rejected
    forwards_without_grad = 1  # the reference's

    def __init__(self, section, adapter: Adapter, policy: str):
        """`policy`: the model directory the policy starts from (model.name)."""
        self.beta, self.loss_type, self.smoothing = section.beta, section.loss_type, section.label_smoothing
        self.adapter = adapter
        self.reference_directory = section.reference or (None if adapter.switches_off else policy)
        self.reference: nn.Module | None = None

    def use_reference(self, model: nn.Module) -> None:
        self.reference = model

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self._terms(model, batch)["loss"].mean()

    def eval_batch(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        terms = self._terms(model, batch)
        real = (batch["labels"][:, 0] != IGNORE).any(-1).float()  # the filler rows of the last batch have none
        sums = {key: (value.detach().float() * real).sum() for key, value in terms.items()}
        return {**sums, "count": real.sum()}

    def eval_result(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums["count"]
        names = {"loss": "eval_loss", "chosen": "eval_rewards/chosen", "rejected": "eval_rewards/rejected",
                 "accuracies": "eval_rewards/accuracies", "margins": "eval_rewards/margins",
                 "logps_chosen": "eval_logps/chosen", "logps_rejected": "eval_logps/rejected"}
        return {name: sums[key] / n for key, name in names.items()}

    def log_probs(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen and rejected completion log-probabilities ([rows] each), summed over their tokens."""
        rows, length = batch["input_ids"].shape[0], batch["input_ids"].shape[-1]
        inputs = {key: value.reshape(2 * rows, length) for key, value in batch.items() if key != "labels"}
        labels = batch["labels"].reshape(2 * rows, length)[:, 1:]
        logits = model(**inputs).logits[:, :-1].float()
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
