"""The loss in chunks (`train.loss_chunks`, xla_shard/lm_head.py): on every causal LM family, the chunked
computation gives the model's own loss, gradients, evaluation metrics and DPO log-probabilities (fp32, CPU,
1e-6), its logits never whole; a model whose post-processing it does not know keeps its own loss, and says so."""

import copy

import pytest
import torch
from model_dirs import FAMILIES, MOE_FAMILIES, family_model, moe_model

from xla_shard import lm_head
from xla_shard.methods.adapter import Adapter
from xla_shard.methods.dpo import Dpo
from xla_shard.methods.objective import ModelLoss

CAUSAL = [f for f, (_, task, _) in FAMILIES.items() if task == "causal_lm"]
# Families whose head is followed by post-processing the chunks must apply too (a soft cap, a scale).
TAILED = {"gemma2": {"final_logit_softcapping": 3.0}, "gemma3": {"final_logit_softcapping": 3.0},
          "cohere": {"logit_scale": 0.25}, "granite": {"logits_scaling": 4.0}}


def _model(family: str):
    model = moe_model(family) if family in MOE_FAMILIES else family_model(family)
    for key, value in TAILED.get(family, {}).items():
        setattr(model.config, key, value)
        if key == "logit_scale":
            model.logit_scale = value
    return model.float().eval()


def _batch(model, rows=3, tokens=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (rows, tokens), generator=generator)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt
    labels[1, -7:] = -100  # padding
    return {"input_ids": ids, "labels": labels}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", CAUSAL + list(MOE_FAMILIES))
def test_the_loss_in_chunks_is_the_models_own_loss_and_gradients(family):
    whole = _model(family)
    batch = _batch(whole)
    objective = ModelLoss(causal=True)
    want = objective.loss(whole, batch)
    want.backward()
    for chunks in (1, 4, 24, "auto"):
        chunked = copy.deepcopy(whole)
        chunked.zero_grad()
        assert lm_head.install(chunked, chunks, 24) is None
        got = objective.loss(chunked, batch)
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        wanted = _grads(whole)
        # fp32, in another order (the head's gradient taken per position in the forward, then scaled): within a
        # few rounding steps of the model's largest gradient (a key bias's, zero in exact arithmetic, is noise)
        largest = max(float(grad.abs().max()) for grad in wanted.values())
        for name, grad in wanted.items():
            torch.testing.assert_close(_grads(chunked)[name], grad, rtol=1e-5, atol=1e-6 * largest,
                                       msg=f"{name} ({chunks})")
    assert lm_head.scorer(chunked).chunks == lm_head.chunks_for("auto", whole.config, 24) == 1  # rows of 24


def test_a_token_mean_loss_computes_the_heads_logits_once_a_step_a_preference_loss_twice(monkeypatch):
    """SFT's loss (the labelled tokens' mean) takes the head's gradients in the forward chunks: 4 chunks, 4 head
    matmuls a step, backward none. DPO's (a function of whole rows' sums) computes each chunk again in backward,
    8; both give the whole model's gradients of the head (the first test holds all of them)."""
    whole = _model("llama")
    chunked = copy.deepcopy(whole)
    lm_head.install(chunked, 4, 24)
    head = chunked.lm_head.weight
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w, *a, **k: calls.append(w is head) or linear(x, w, *a, **k))
    batch = _batch(whole, rows=4)
    ModelLoss(causal=True).loss(chunked, batch).backward()
    assert sum(calls) == 4
    calls.clear()
    chunked.zero_grad()
    pairs = {key: value.view(2, 2, -1) for key, value in batch.items()}
    dpo = Dpo(type("Section", (), {"beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0,
                                   "reference": None})(), adapter=Adapter(), policy="p")
    sum(logps.sum() for logps in dpo.log_probs(chunked, pairs)).backward()
    assert sum(calls) == 8


@pytest.mark.parametrize("family", ["llama", "gemma2", "mixtral"])
def test_evaluation_and_dpo_log_probabilities_in_chunks_are_the_whole_logits(family):
    whole = _model(family)
    chunked = copy.deepcopy(whole)
    lm_head.install(chunked, 5, 24)
    batch = _batch(whole, rows=4)
    objective = ModelLoss(causal=True)
    with torch.no_grad():
        want, got = objective.eval_batch(whole, batch), objective.eval_batch(chunked, batch)
    assert got["count"] == want["count"] and got["correct"] == want["correct"]
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-6, atol=0)
    pairs = {key: value.view(2, 2, -1) for key, value in batch.items()}  # [rows, chosen/rejected, tokens]
    dpo = Dpo(type("Section", (), {"beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0,
                                   "reference": None})(), adapter=Adapter(), policy="p")
    for got, want in zip(dpo.log_probs(chunked, pairs), dpo.log_probs(whole, pairs)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_the_router_loss_of_an_moe_model_is_added_back():
    whole = _model("mixtral")
    whole.config.output_router_logits = True
    chunked = copy.deepcopy(whole)
    lm_head.install(chunked, 3, 24)
    batch = _batch(whole)
    objective = ModelLoss(causal=True)
    plain = copy.deepcopy(whole)
    plain.config.output_router_logits = False
    assert objective.loss(whole, batch) > objective.loss(plain, batch)  # the router loss is in the model's own
    torch.testing.assert_close(objective.loss(chunked, batch), objective.loss(whole, batch), rtol=1e-6, atol=0)


def test_an_unknown_post_processing_keeps_the_models_own_loss_and_says_so():
    model = _model("llama")
    original = type(model).forward

    class Scaled(type(model)):
        def forward(self, input_ids=None, labels=None, **kwargs):  # a tail this module does not know
            outputs = self.model(input_ids=input_ids, **kwargs)
            hidden_states = outputs.last_hidden_state
            logits = self.lm_head(hidden_states)
            logits = logits.clamp(-5, 5)
            loss = None
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
            return type(original(self, input_ids=input_ids[:, :1]))(loss=loss, logits=logits)

    model.__class__ = Scaled
    why = lm_head.install(model, 4, 24)
    assert why and "clamp" in why and lm_head.scorer(model) is None
    assert "the model's own, over its whole logits" in lm_head.describe(model)


def test_auto_chunks_hold_about_the_hidden_states_and_a_tiles_positions():
    from transformers import LlamaConfig

    llama3 = LlamaConfig(vocab_size=128256, hidden_size=4096)
    assert lm_head.chunks_for("auto", llama3, 8192) == 32  # vocabulary / width
    assert lm_head.chunks_for("auto", llama3, 1024) == 8  # 128 positions each at least
    assert lm_head.chunks_for("auto", llama3, 100) == 1 and lm_head.chunks_for(7, llama3, 4) == 4
