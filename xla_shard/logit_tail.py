"""What a causal LM does to its head's output before the loss (a soft cap, a scale), read from its class's
forward: the statements between the head's call and the loss, matched against the ones xla_shard knows, so the
chunked scoring (`lm_head`) applies the same post-processing inside each chunk."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import torch
from torch import nn

# The lines a causal LM's forward may run between its head's call and its loss, each as the post-processing
# it stands for (`model` is the causal LM). The empty tail (logits used as the head returns them) is most models'.
_TAILS: dict[tuple[str, ...], Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor] | None]] = {
    (): lambda model: None,
    ("if self.config.final_logit_softcapping is not None:", "logits = logits / self.config.final_logit_softcapping",
     "logits = torch.tanh(logits)", "logits = logits * self.config.final_logit_softcapping"):
        lambda model: _soft_cap(model.config.final_logit_softcapping),
    ("logits = logits / self.config.logits_scaling",):
        lambda model: (lambda x, s=model.config.logits_scaling: x / s),
    ("logits = logits * self.logit_scale",):
        lambda model: (lambda x, s=model.logit_scale: x * s),
}


def _soft_cap(cap: float | None):
    if cap is None:
        return None
    return lambda x: torch.tanh(x / cap) * cap


def _tail_lines(model: nn.Module, head_name: str) -> tuple[str, ...] | None:
    """The statements of the model class's forward between `logits = self.<head>(...)` and its loss, or None
    where the forward does not read that way."""
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return None
    lines = [line.split("#")[0].strip() for line in source.splitlines()]
    lines = [line for line in lines if line]
    call = re.compile(rf"^(logits|lm_logits) = self\.{re.escape(head_name)}\((hidden_states|outputs\[0\])"
                      r"(\[:, slice_indices, :\])?\)(\.contiguous\(\))?$")
    starts = [i for i, line in enumerate(lines) if call.match(line)]
    if len(starts) != 1:
        return None
    tail = []
    for line in lines[starts[0] + 1:]:
        if line in ("loss = None",) or line.startswith("if labels is not None"):
            return tuple(tail)
        tail.append(line)
    return None


def tail_of(model: nn.Module, head_name: str) -> tuple[Callable | None, str | None]:
    """(the post-processing `model` applies to its head's output, or None for none; why it cannot be taken
    apart, or None)."""
    lines = _tail_lines(model, head_name)
    if lines is None:
        return None, f"{type(model).__name__}'s forward does not call its {head_name} as transformers' causal LMs do"
    known = _TAILS.get(lines)
    if known is None:
        return None, (f"{type(model).__name__} post-processes its logits ({lines[0]!r}, ...) in a way xla_shard "
                      "does not know")
    if getattr(model, "loss_type", None) not in (None, "ForCausalLM") and \
            getattr(model.loss_function, "__name__", "") != "ForCausalLMLoss":
        return None, f"{type(model).__name__}'s loss is {model.loss_function.__name__}, not the causal LM's"
    return known(model), None
