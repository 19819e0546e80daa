"""A causal LM's next-token log-probabilities, computed chunk by chunk: its logits are never whole.

A causal LM's logits are [rows, tokens, vocabulary]: for a 128k vocabulary at 8192 tokens, 2 GiB per sequence in
bf16 and twice that as the fp32 the loss takes, more than a layer's weights and activations together. Here the
model runs as it is, up to its output head, whose forward (`Scorer` replaces the head module's, so every
wrapper's gathers still happen around it) scores the hidden states it is given a few positions at a time: the
head and the model's own post-processing (a soft cap, a scale) inside each chunk, in fp32 as transformers' loss
takes them, reduced to the label's log-probability (and, for evaluation, whether the most likely token is the
label); the model gets a placeholder for its logits. Backward computes each chunk again and passes its gradient
on: memory holds one chunk's logits, never all of them. Where the loss is a fixed weighting of the
log-probabilities (the token mean of SFT: `scoring(..., linear=True)`), the gradients are computed in the forward
chunk instead, as Liger's fused linear cross-entropy does, and backward only scales them: the head's logits are
computed once a step, not twice.

Which post-processing a model applies after its head is read from its class's forward (`logit_tail`); a model
that does anything there xla_shard does not know keeps its own loss, whole (said once).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from xla_shard.logit_tail import tail_of


IGNORE = -100
_ATTRIBUTE = "_xla_shard_scorer"  # on the causal LM: its Scorer
_WHY = "_xla_shard_unscored"  # ... or why it has none

MIN_CHUNK = 128  # positions per chunk `auto` keeps at least: a TPU tile's lanes


def chunks_for(requested: int | str, config, tokens: int) -> int:
    """How many chunks the positions are scored in: `auto` takes as many as the vocabulary is wider than the
    hidden states (a chunk's logits then take about what the hidden states take), each of at least `MIN_CHUNK`
    positions (shorter rows' logits are small: more chunks would only lengthen the compiled program)."""
    if requested != "auto":
        return max(1, min(int(requested), tokens))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return max(1, min(tokens // MIN_CHUNK, math.ceil(text.vocab_size / text.hidden_size)))


@dataclass
class _Request:
    """What one forward asks of the head: the label each position predicts ([rows, tokens], IGNORE where none),
    whether to say which positions the model gets right; and what it answers."""

    targets: torch.Tensor
    hits: bool
    temperature: float = 1.0  # the logits are scored over it (a sampling distribution's, GRPO's)
    entropies: bool = False  # also say each position's entropy (without gradient)
    # The loss is the labelled positions' log-probabilities times one scalar (a token mean): the head's gradients
    # are computed in the forward chunks, backward scales them (`_ChunkedLinear`)
    linear: bool = False
    logps: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    def tie(self, placeholder: torch.Tensor | None) -> None:
        """Make `logps` depend on what the model returned as its logits (a placeholder the head computed from
        them, zero-weighted), so that backward passes through the model's outputs first, as a wrapper expects."""
        if placeholder is not None and placeholder.requires_grad:
            self.logps = self.logps + placeholder.sum() * 0.0


class Partials:
    """How the devices of a backend share the chunked computation. Here, for eager backends and FSDP (whose
    wrapper gathers the head's parameters around the model's forward): one device's rows, the parameters as they
    are, nothing to order. A backend whose compiler partitions one program over its devices gives its own: the
    rows split per device, the weight gathered whole once for every chunk, and each device's partial sum of its
    gradient kept apart until one sum over the devices after the last chunk (left to itself, a partitioner
    reduces each chunk's weight gradient apart, or gathers every chunk's hidden states from all devices)."""

    orders = False  # whether `barrier` does anything

    def pieces(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states ([rows, tokens, width], as the model made them) and the targets ([rows, tokens], in
        the labels' order), laid out to be scored against each other. A sequence axis reorders the tokens and
        splits them over devices (`sequence`): the targets are reordered to meet them."""
        return hidden, targets

    def joined(self, scores: torch.Tensor) -> torch.Tensor:
        """Per-token `scores` in the `pieces` layout -> [rows, tokens] in the labels' order."""
        return scores

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """[rows, ...] -> [devices, rows per device, ...]."""
        return tensor.unsqueeze(0)

    def whole(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`param` whole on every device, in `dtype`, for every chunk's use; its gradient comes back summed."""
        return param.to(dtype)

    def hold(self, partial: torch.Tensor) -> None:
        """Keep `partial` ([devices, ...], each device's partial sum so far) one block per device until the sum
        over devices: a partitioner would otherwise move each chunk's into the sum's layout apart."""

    def summed(self, partial: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """[devices, ...] partial sums -> their sum over the devices, laid out as `param`'s gradient."""
        return partial.sum(0)

    def barrier(self, tensors: list[torch.Tensor]) -> None:
        """Keep a compiler from moving work across this point (the tensors are rewritten in place): XLA would
        otherwise run the chunks side by side, each chunk's logits alive at once, and merge backward's recompute
        of a chunk with forward's."""


class Scorer:
    """A causal LM whose output head computes label log-probabilities chunk by chunk (see the module's text),
    laid out over the devices by the backend's `partials`. A plain linear head is computed here from its weight
    (`_ChunkedLinear`); any other (a LoRA-adapted one) through its module, its parameters' gradients summed per
    chunk (`_ChunkedModule`)."""

    def __init__(self, model: nn.Module, head_name: str, tail, chunks: int, partials: Partials | None = None):
        self.model, self.head = model, getattr(model, head_name)
        self.tail, self.chunks, self.partials = tail, chunks, partials or Partials()
        self.linear = type(self.head) is nn.Linear
        # The head's parameters by name, read from the module at each use: a wrapper may hold them otherwise by
        # then (FSDP2's unsharded parameters during forward, FSDPv1's views of its flat parameter).
        self.names = [name for name, _ in self.head.named_parameters()]
        # What a model that adds its router's load-balancing loss to its own (MoE) weighs it by.
        self.router_aux_loss_coef = getattr(model, "router_aux_loss_coef", None)
        self._request: _Request | None = None
        self._inside = False
        self._forward = self.head.forward
        self.head.forward = self._head_forward  # the instance's: wrappers around the module stay as they are

    @contextlib.contextmanager
    def scoring(self, labels: torch.Tensor, hits: bool = False, temperature: float = 1.0, entropies: bool = False,
                linear: bool = False):
        """Within it, the model's forward scores `labels` (a causal LM's: each position predicts the next label);
        the request it yields holds, once the forward ran, `logps` (the log-probability of the next label at
        each position, [rows, tokens - 1]), with `hits`, `correct` (whether it is the most likely token), with
        `entropies`, `entropy` (the distribution's, no gradient). `temperature` divides the logits first.
        `linear`: the caller's loss is the sum of the labelled positions' `logps` times one scalar (each
        position's gradient the same, the unlabelled ones' none), so the head's weight gradient is computed in
        the forward (a loss of another shape would get a wrong one)."""
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
        request = self._request = _Request(targets, hits, temperature, entropies, linear)
        try:
            yield request
        finally:
            self._request = None

    def finish(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output as the model's loss takes it: the tail applied, in fp32."""
        return (self.tail(logits) if self.tail is not None else logits).float()

    def module_scores(self, hidden: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The logits of `hidden` through the head module with its parameters `tensors`, then the tail."""
        self._inside = True
        try:
            logits = torch.func.functional_call(self.head, dict(zip(self.names, tensors)), (hidden,), strict=True)
        finally:
            self._inside = False
        return self.finish(logits)

    def _head_forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        request = self._request
        if request is None or self._inside or args or kwargs:
            return self._forward(hidden, *args, **kwargs)
        state = _State(self, hidden.device.type, request)
        hidden, targets = self.partials.pieces(hidden, request.targets)
        if self.linear:
            weight = self.partials.whole(self.head.weight, _compute_dtype(self.head.weight, state))
            logps = _ChunkedLinear.apply(state, hidden, targets, weight, self.head.bias)
        else:
            tensors = [_attribute(self.head, name) for name in self.names]
            logps = _ChunkedModule.apply(state, hidden, targets, *tensors)
        logps = self.partials.joined(logps)
        request.logps = logps[:, :-1]
        if request.hits:
            request.correct = self.partials.joined(state.correct)[:, :-1]
        if request.entropies:
            request.entropy = self.partials.joined(state.entropy)[:, :-1]
        # The model gets [rows, tokens, 1] in place of its logits, computed from the scores: a wrapper's hooks on
        # the model's outputs (FSDP's pre-backward gather of the head) run before the scores' backward needs them,
        # once the loss depends on it (`Request.tie`).
        return logps.unsqueeze(-1)


def _compute_dtype(weight: torch.Tensor, state: _State) -> torch.dtype:
    """The dtype the head's matmul computes in (autocast's, where on): the weight is gathered in it, and its
    gradient summed over the chunks in it, as one matmul's would be."""
    enabled, dtype = state.autocast
    return dtype if enabled and weight.is_floating_point() else weight.dtype


def _attribute(module: nn.Module, name: str) -> torch.Tensor:
    for part in name.split("."):
        module = getattr(module, part)
    return module


class _State:
    """What the chunked computation carries from forward to backward besides tensors."""

    def __init__(self, scorer: Scorer, device_type: str, request: _Request):
        self.scorer, self.device_type, self.hits = scorer, device_type, request.hits
        self.temperature, self.entropies, self.linear = request.temperature, request.entropies, request.linear
        self.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        self.correct: torch.Tensor | None = None
        self.entropy: torch.Tensor | None = None
        self._correct: list[torch.Tensor] = []
        self._entropy: list[torch.Tensor] = []

    def scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """A chunk's scores as the loss takes them (the tail applied, fp32), over the temperature."""
        return logits if self.temperature == 1.0 else logits / self.temperature

    def scored(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A chunk's label log-probabilities (forward), keeping what the request asked beside them."""
        self.kept(logits, targets)
        return _label_logps(logits, targets)

    def kept(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """What the request asked beside the log-probabilities, of a chunk's logits (no gradient)."""
        with torch.no_grad():
            if self.hits:
                self._correct.append(logits.argmax(-1) == targets)
            if self.entropies:
                log_probs = logits.log_softmax(-1)
                self._entropy.append(-(log_probs.exp() * log_probs).sum(-1))

    def close(self) -> None:
        if self.hits:
            self.correct = torch.cat(self._correct, dim=1)
        if self.entropies:
            self.entropy = torch.cat(self._entropy, dim=1)
        self._correct, self._entropy = [], []

    def bounds(self, tokens: int) -> list[tuple[int, int]]:
        k = max(1, min(self.scorer.chunks, tokens))
        edges = [round(i * tokens / k) for i in range(k + 1)]
        return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]

    def after(self, tensors: list[torch.Tensor], previous: list[torch.Tensor]) -> list[torch.Tensor]:
        """`tensors` waiting for `previous`, the last chunk's results (copies, for a barrier rewrites what it
        is given): chunks run one after the other."""
        partials = self.scorer.partials
        if not partials.orders:
            return tensors
        tensors = [t.clone() for t in tensors]
        partials.barrier([*tensors, *previous])
        return tensors

    def autocasting(self):
        enabled, dtype = self.autocast
        return torch.autocast(self.device_type, enabled=enabled, dtype=dtype)


def _label_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each position's log-probability of its target. The target's logit is picked by comparing each vocabulary
    index with it (a select and a sum, as cheap as the logsumexp beside it), not by a gather: XLA's partitioner
    moves a gather's index tuples between devices, a select stays with its rows."""
    vocabulary = torch.arange(logits.shape[-1], device=logits.device)
    picked = torch.where(vocabulary == targets.unsqueeze(-1), logits, torch.zeros((), dtype=logits.dtype,
                                                                                  device=logits.device)).sum(-1)
    return picked - logits.logsumexp(-1)


class _ChunkedLinear(torch.autograd.Function):
    """hidden [rows, tokens, width], targets [rows, tokens], a linear head's weight (whole, in its compute
    dtype) and bias -> each position's log-probability of its target.

    Backward computes each chunk's logits again, takes their gradient through the tail and the log-softmax, and
    does the linear layer's own backward by hand: the hidden states' gradient against the whole weight, and the
    weight's as each device's partial sum over its own rows, added up over the chunks and summed over the
    devices once (`Partials.summed`). Under a linear loss (`_State.linear`) the forward does that work on the
    logits it has just computed, with a gradient of 1 at each labelled position (each position's own gradient
    for the hidden states; their sum for the weight and bias), and backward multiplies: the hidden states' by
    each position's upstream gradient, the weight's and bias's by the one scalar the loss weighs them all by."""

    @staticmethod
    def forward(ctx, state: _State, hidden, targets, weight, bias):
        scorer, out = state.scorer, []
        ahead = state.linear and any(ctx.needs_input_grad[1:5])
        grads: list[torch.Tensor] = []
        weight_grad = bias_grad = None
        with torch.no_grad():
            for start, end in state.bounds(hidden.shape[1]):
                done = [g for g in (weight_grad, bias_grad) if g is not None]
                (piece,) = state.after([hidden[:, start:end]], out[-1:] + grads[-1:] + done)
                if not ahead:
                    logits = state.scaled(scorer.finish(torch.nn.functional.linear(piece, weight, bias)))
                    out.append(state.scored(logits, targets[:, start:end]))
                    continue
                logps, piece_grad, weight_grad, bias_grad = _chunk_grads(
                    state, piece, targets[:, start:end], weight, bias, torch.ones_like(targets[:, start:end],
                                                                                       dtype=torch.float32),
                    weight_grad, bias_grad, labelled_only=True, wants=ctx.needs_input_grad[3:5])
                out.append(logps)
                grads.append(piece_grad)
        state.close()
        ctx.state, ctx.ahead = state, ahead
        if ahead:
            if weight_grad is not None:
                weight_grad = scorer.partials.summed(weight_grad, scorer.head.weight).to(weight.dtype)
            ctx.save_for_backward(torch.cat(grads, dim=1), targets, weight_grad,
                                  bias_grad.to(bias.dtype) if bias_grad is not None else None)
        else:
            ctx.save_for_backward(hidden, targets, weight, bias)
        return torch.cat(out, dim=1)

    @staticmethod
    def backward(ctx, grad):
        state = ctx.state
        if ctx.ahead:
            hidden_grad, targets, weight_grad, bias_grad = ctx.saved_tensors
            labelled = (targets != IGNORE).to(grad.dtype)
            # the one scalar the loss weighs every labelled position by (linear: the same at each of them)
            scale = (grad * labelled).sum() / labelled.sum().clamp(min=1.0)
            return (None, (hidden_grad * grad.unsqueeze(-1).to(hidden_grad.dtype)), None,
                    weight_grad * scale.to(weight_grad.dtype) if weight_grad is not None else None,
                    bias_grad * scale.to(bias_grad.dtype) if bias_grad is not None else None)
        hidden, targets, weight, bias = ctx.saved_tensors
        grads, weight_grad, bias_grad = [], None, None
        for start, end in state.bounds(hidden.shape[1]):
            done = [g for g in (weight_grad, bias_grad) if g is not None]
            piece, upstream = state.after([hidden[:, start:end].detach(), grad[:, start:end]], grads[-1:] + done)
            _, piece_grad, weight_grad, bias_grad = _chunk_grads(state, piece, targets[:, start:end], weight, bias,
                                                                 upstream, weight_grad, bias_grad)
            grads.append(piece_grad.to(hidden.dtype))
        weight_grad = state.scorer.partials.summed(weight_grad, state.scorer.head.weight).to(weight.dtype)
        return (None, torch.cat(grads, dim=1), None, weight_grad,
                bias_grad.to(bias.dtype) if bias is not None else None)


def _chunk_grads(state: _State, piece, targets, weight, bias, upstream, weight_grad, bias_grad,
                 labelled_only: bool = False, wants: tuple[bool, bool] = (True, True)):
    """One chunk's logits, their label log-probabilities (scored as the request asks, when `labelled_only`: the
    forward's), and the linear layer's backward by hand for the gradient `upstream` of those log-probabilities:
    (logps, the hidden states' gradient, the weight's partial sums and the bias's with this chunk's added).
    `labelled_only`: the weight's and bias's sums take the labelled positions alone (a linear loss's). `wants`:
    whether the weight's and the bias's are asked for (a frozen head's are not)."""
    partials, scorer = state.scorer.partials, state.scorer
    with torch.no_grad(), state.autocasting():
        logits = torch.nn.functional.linear(piece, weight, bias)
    logits = logits.detach().requires_grad_()
    with torch.enable_grad():
        scaled = state.scaled(scorer.finish(logits))
        if labelled_only:
            state.kept(scaled, targets)
        logps = _label_logps(scaled, targets)
        torch.autograd.backward(logps, upstream)
    scores = logits.grad  # d loss / d logits, in the logits' dtype
    with torch.no_grad(), state.autocasting():
        piece_grad = torch.matmul(scores, weight).to(piece.dtype)
        if labelled_only:
            scores = scores * (targets != IGNORE).unsqueeze(-1).to(scores.dtype)
        if wants[0]:  # [devices, vocabulary, rows x tokens] x [devices, rows x tokens, width], added to the sum
            left = partials.rows(scores).flatten(1, 2).transpose(1, 2)
            right = partials.rows(piece.to(scores.dtype)).flatten(1, 2)
            weight_grad = torch.bmm(left, right) if weight_grad is None else torch.baddbmm(weight_grad, left, right)
    if wants[0]:
        partials.hold(weight_grad)
    if bias is not None and wants[1]:
        summed = scores.sum((0, 1))
        bias_grad = summed if bias_grad is None else bias_grad + summed
    return logps.detach(), piece_grad, weight_grad, bias_grad


class _ChunkedModule(torch.autograd.Function):
    """The same through the head module (any head: a LoRA-adapted one), its parameters as the module holds
    them; their gradients are summed chunk by chunk as autograd passes them on."""

    @staticmethod
    def forward(ctx, state: _State, hidden, targets, *tensors):
        scorer, out = state.scorer, []
        with torch.no_grad():
            for start, end in state.bounds(hidden.shape[1]):
                (piece,) = state.after([hidden[:, start:end]], out[-1:])
                logits = state.scaled(scorer.module_scores(piece, list(tensors)))
                out.append(state.scored(logits, targets[:, start:end]))
        state.close()
        ctx.state = state
        ctx.save_for_backward(hidden, targets, *tensors)
        return torch.cat(out, dim=1)

    @staticmethod
    def backward(ctx, grad):
        state = ctx.state
        hidden, targets, *tensors = ctx.saved_tensors
        wants = ctx.needs_input_grad
        leaves = [t.detach().requires_grad_(wants[3 + i]) for i, t in enumerate(tensors)]
        grads: list[torch.Tensor] = []
        for start, end in state.bounds(hidden.shape[1]):
            piece, upstream = state.after([hidden[:, start:end].detach(), grad[:, start:end]],
                                          grads[-1:] + [leaf.grad for leaf in leaves if leaf.grad is not None])
            piece = piece.requires_grad_(wants[1])
            with torch.enable_grad(), state.autocasting():
                logps = _label_logps(state.scaled(state.scorer.module_scores(piece, leaves)), targets[:, start:end])
            if logps.requires_grad:
                torch.autograd.backward(logps, upstream)
            if wants[1]:
                grads.append(piece.grad if piece.grad is not None else torch.zeros_like(piece))
        return (None, torch.cat(grads, dim=1) if grads else None, None, *[leaf.grad for leaf in leaves])


def install(model: nn.Module, chunks: int | str, tokens: int, partials: Partials | None = None) -> str | None:
    """Score `model` (a transformers causal LM, not yet wrapped) chunk by chunk from now on: its output head's
    forward gives the hidden states' label log-probabilities inside `scorer(model).scoring(...)`, and is the
    head elsewhere. Returns why it cannot (the model keeps its own loss), or None; `describe` says which.
    `chunks`: a count, or auto (see `chunks_for`) for sequences of `tokens`."""
    why = unscorable(model)
    if why is None:
        head_name = next(name for name, child in model.named_children() if child is model.get_output_embeddings())
        tail, _ = tail_of(model, head_name)
        model.__dict__[_ATTRIBUTE] = Scorer(model, head_name, tail, chunks_for(chunks, model.config, tokens), partials)
    else:
        model.__dict__[_WHY] = why
    return why


def unscorable(model: nn.Module) -> str | None:
    """Why `model`'s loss cannot be computed in chunks (it keeps its own), or None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = [name for name, child in model.named_children() if child is head]
    if head is None or len(names) != 1:
        return f"{type(model).__name__} has no output head of its own to score with"
    _, why = tail_of(model, names[0])
    if why:
        return why
    if getattr(model.config, "output_router_logits", False) and not hasattr(model, "router_aux_loss_coef"):
        return f"{type(model).__name__} adds a router loss xla_shard cannot add back"
    return None


def scorer(model: nn.Module) -> Scorer | None:
    """The `Scorer` installed in `model` (or in the model a wrapper holds), else None."""
    cached = model.__dict__.get(_ATTRIBUTE)
    if cached is not None:
        return cached
    found = next((m.__dict__[_ATTRIBUTE] for m in model.modules() if _ATTRIBUTE in m.__dict__), None)
    if found is not None:
        model.__dict__[_ATTRIBUTE] = found
    return found


def describe(model: nn.Module, key: str = "train.loss_chunks") -> str | None:
    """How the model's loss is computed, for the log; None where nothing was asked (a classifier)."""
    found = scorer(model)
    if found is not None:
        return (f"loss: the output head scored in {found.chunks} chunk(s) of the positions, its logits never whole "
                f"({key})")
    why = next((m.__dict__[_WHY] for m in model.modules() if _WHY in m.__dict__), None)
    return f"loss: the model's own, over its whole logits: {why}" if why else None
