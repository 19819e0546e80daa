"""What a training step computes and what evaluation reports: one `Objective` object per fine-tuning method.

The trainer (and a loop of your own) asks the objective for a micro-batch's loss, for how the step's
micro-batches weigh in it, and for the evaluation metrics; it never branches on the task or the data's kind.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from xla_shard import lm_head
from xla_shard.data import Batch
from xla_shard.data.batches import scored


class Objective:
    """A fine-tuning method's step and evaluation. Subclasses give `loss`, and `counted` where the loss is a
    mean over some labelled items (tokens, rows), then `eval_batch` and `eval_result` for evaluation."""

    sequences_per_row = 1  # sequences of seq_len tokens a row holds: what tokens_per_s counts
    forwards_without_grad = 0  # extra forward passes per step with no backward (a reference model's): for MFU
    # A model directory the trainer builds frozen beside the policy, sharded like it and never saved, and hands
    # to `use_reference` (DPO's reference model); None: nothing. `reference_key`: the config key that names it.
    reference_directory: str | None = None
    reference_key: str | None = None
    reference: nn.Module | None = None  # that model, once `use_reference` gave it

    def choose_reference(self, given: str | None, key: str, adapter, policy: str) -> None:
        """The reference model a loss compares the policy with: the directory `given` (config `key`); else, where
        the adapter switches off, the policy itself with its adapters off (nothing to build); else the weights
        the policy starts from (`policy`, model.name)."""
        self.reference_directory = given or (None if adapter.switches_off else policy)
        self.reference_key = key if given else "model.name"

    def step_flops_per_token(self, train_flops_per_token: float) -> float:
        """A step's FLOPs per token with its forwards without backward (a reference's), each a third of a
        training step's: what MFU and the planner count."""
        return train_flops_per_token * (1 + self.forwards_without_grad / 3)

    def tokens_per_step(self, train) -> int:
        """Tokens a training step reads over every device (`train`: the config's train section): what
        tokens_per_s, MFU, the planner and the compile report count."""
        return train.global_batch_size * train.seq_len * self.sequences_per_row

    def describe(self) -> str:
        """What the step trains, for the run's log (empty: the method's name says it)."""
        return ""

    def use_reference(self, model: nn.Module) -> None:
        """The frozen model built from `reference_directory`, on its devices and in eval mode."""

    def step_metrics(self, mean) -> dict[str, float]:
        """Metrics of the training steps since the last call, for the step's record beside the loss; `mean`
        (the backend's `mean_loss`) averages a device scalar over the processes. None by default."""
        return {}

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The micro-batch's loss (a device scalar): `batch` holds this process's rows, on its device."""
        raise NotImplementedError

    def counted(self, batch: Batch) -> torch.Tensor | None:
        """Where `loss` averages (a boolean mask over the batch's labels), or None where it is no such mean."""
        return None

    def weights(self, micro_batches: list[Batch], processes, world: int, uneven: bool = True) -> list[float]:
        """Each micro-batch's share of the step's loss (host rows, before they are placed). Where the loss is a
        mean over labelled items and micro-batches hold different numbers of them (answers only, padded rows),
        the step's loss is the mean over all of the step's items, on every process together: what one process
        training the whole batch gets, on every backend alike. Else the plain mean: 1/k each. A process per
        device has a loss over its own rows, and its gradients are averaged over the `world` of them; SPMD
        (world 1) has one loss over the rows of every host. `uneven=False` (rows that cannot differ) skips the
        count, a collective with a host sync on torchrun. Equal shares are exactly `1.0 / k`: the step tests
        for that value to take the plain mean."""
        k = len(micro_batches)
        plain = [1.0 / k] * k
        masks = [self.counted(rows) for rows in micro_batches] if uneven else []
        if not masks or any(mask is None for mask in masks):
            return plain
        counts = [int(mask.sum()) for mask in masks]
        totals = processes.total(counts)
        tokens = sum(totals)
        counted = totals if world == 1 else counts
        if tokens == 0 or all(count * world * k == tokens for count in counted):
            return plain
        return [count * world / tokens for count in counted]

    def eval_batch(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        """Sums over one evaluation batch (device scalars), added up over batches and processes."""
        raise NotImplementedError

    def eval_result(self, sums: dict[str, float]) -> dict[str, float]:
        """The evaluation metrics from the sums over every evaluation row."""
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, model: nn.Module, backend, source, batches: int, rows: list[int]) -> dict[str, float]:
        """`eval_result` over `batches` batches of `source` (this process's `rows` of each), in eval mode. Every
        process calls it."""
        model.eval()
        sums: dict[str, torch.Tensor] = {}
        try:
            for index in range(batches):
                batch = backend.place(source.rows(index, rows))
                with backend.forward_context():
                    got = self.eval_batch(model, batch)
                sums = got if not sums else {key: sums[key] + value for key, value in got.items()}
                backend.after_step()
        finally:
            model.train()
        # Means over processes: their ratios are the ratios of the sums.
        return self.eval_result({key: backend.mean_loss(value) for key, value in sums.items()})


class ModelLoss(Objective):
    """The loss transformers computes from `labels`, averaged over what has a label: a causal LM's next
    tokens (`causal`), a sequence classifier's rows. Evaluation: the loss over every labelled item and how many
    of them the model's most likely prediction gets right (TRL's mean_token_accuracy for a causal LM: position t
    predicts the label at t + 1), plus a causal LM's perplexity."""

    def __init__(self, causal: bool):
        self.causal = causal

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        head = lm_head.scorer(model) if self.causal else None
        if head is None:
            return model(**batch).loss
        request, out = scored_forward(model, head, batch, linear=True)
        counted = scored(batch["labels"], True)
        loss = -(request.logps * counted).sum() / counted.sum()  # the mean over labelled tokens, as transformers'
        return loss + router_loss(head, out)

    def counted(self, batch: Batch) -> torch.Tensor:
        return scored(batch["labels"], self.causal)

    def eval_batch(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        labels = batch["labels"]
        counts = scored(labels, self.causal)
        n = counts.sum().float()
        head = lm_head.scorer(model) if self.causal else None
        if head is not None:
            request, out = scored_forward(model, head, batch, hits=True)
            loss = -(request.logps * counts).sum() + router_loss(head, out) * n
            return {"loss": loss.detach().float(), "count": n, "correct": (request.correct & counts).sum().float()}
        out = model(**batch)
        # A process whose rows are all filler gets a NaN mean (0/0): it contributes 0, not NaN.
        loss = torch.where(n > 0, out.loss.detach().float() * n, torch.zeros_like(n))
        predicted, wanted = (out.logits[:, :-1].argmax(-1), labels[:, 1:]) if self.causal else \
            (out.logits.argmax(-1), labels)
        return {"loss": loss, "count": n, "correct": ((predicted == wanted) & counts).sum().float()}

    def eval_result(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss"] / sums["count"]
        if not self.causal:
            return {"eval_loss": loss, "eval_accuracy": sums["correct"] / sums["count"]}
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)),
                "eval_mean_token_accuracy": sums["correct"] / sums["count"]}


def scored_forward(model: nn.Module, head: lm_head.Scorer, batch: Batch, hits: bool = False, linear: bool = False):
    """The model's forward on `batch`, its output head scoring the labels chunk by chunk: (the request, holding
    each position's log-probability of its next label [and whether it is the most likely], the model's output).
    `linear`: the loss is the labelled positions' log-probabilities times one scalar (`Scorer.scoring`)."""
    with head.scoring(batch["labels"], hits=hits, linear=linear) as request:
        out = model(**{key: value for key, value in batch.items() if key != "labels"})
    request.tie(getattr(out, "logits", None))
    return request, out


def router_loss(head: lm_head.Scorer, out) -> torch.Tensor | float:
    """What an MoE model adds to its own loss (the router's load-balancing loss, where its config asks), added
    back where the loss is computed outside it."""
    aux = getattr(out, "aux_loss", None)
    return 0.0 if aux is None or not head.router_aux_loss_coef else head.router_aux_loss_coef * aux


class CustomLoss(ModelLoss):
    """A loss of the user's own (`loss_fn(model, batch)`): its values are averaged over micro-batches as they
    are (xla_shard cannot know what they are means over); evaluation reports the model's own loss."""

    def __init__(self, loss_fn, causal: bool):
        super().__init__(causal)
        self.loss_fn = loss_fn

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self.loss_fn(model, batch)

    def counted(self, batch: Batch) -> None:
        return None


def build_sft(cfg, adapter, loss_fn) -> tuple[Objective, frozenset[str], None]:
    """Method sft (`registry.METHODS`): the model's own loss, or `loss_fn`'s, on the rows as read."""
    causal = cfg.model.task == "causal_lm"
    return (ModelLoss(causal) if loss_fn is None else CustomLoss(loss_fn, causal)), frozenset(), None
