"""GRPO's arithmetic (`xla_shard.methods.grpo`) held to TRL's GRPOTrainer: the advantages of a group's rewards,
and the loss and gradients of every loss type on fixed completions."""

import statistics

import pytest
import torch
from conftest import run_worker
from transformers import AutoModelForCausalLM

from xla_shard.methods import grpo


def _expected_advantages(rewards: list[float], size: int, scale: str) -> list[float]:
    """The advantage TRL's docs define, written out with the statistics module: a reward less its group's mean,
    over the group's (or the batch's) sample standard deviation + 1e-4, unscored completions (None) left out and
    given none."""
    scored = [r for r in rewards if r is not None]
    found = []
    for start in range(0, len(rewards), size):
        group = rewards[start:start + size]
        kept = [r for r in group if r is not None]
        mean = statistics.fmean(kept)
        spread = statistics.stdev(scored if scale == "batch" else kept)
        for r in group:
            found.append(0.0 if r is None else (r - mean) / ((spread + 1e-4) if scale != "none" else 1.0))
    return found


@pytest.mark.parametrize("scale", grpo.REWARD_SCALES)
def test_advantages_are_each_rewards_distance_from_its_groups_mean(scale):
    """Two reward functions weighted 1 and 0.5, groups of 3: one function skips a completion (its NaN adds
    nothing), and one completion no function scored is left out of its group's mean and gets no advantage."""
    nan = float("nan")
    scores = torch.tensor([[1.0, 2.0], [0.0, nan], [3.0, 1.0], [nan, nan], [2.0, 2.0], [0.5, 0.0]])
    weights = torch.tensor([1.0, 0.5])
    found, rewards, zero_spread = grpo.advantages(scores, weights, 3, scale)
    summed = [2.0, 0.0, 3.5, None, 3.0, 0.5]
    assert rewards[3].isnan() and rewards[[0, 1, 2, 4, 5]].tolist() == [r for r in summed if r is not None]
    assert found.tolist() == pytest.approx(_expected_advantages(summed, 3, scale), rel=1e-6)
    assert not zero_spread.any()


def test_a_group_whose_rewards_agree_has_no_advantage_and_is_counted():
    found, _, zero_spread = grpo.advantages(torch.tensor([[1.0], [1.0], [0.0], [2.0]]), torch.ones(1), 2)
    assert found.tolist()[:2] == [0.0, 0.0] and zero_spread.tolist() == [True, True, False, False]


def test_a_setting_that_is_not_trls_is_refused_naming_its_key():
    with pytest.raises(ValueError, match="grpo.scale_rewards"):
        grpo.advantages(torch.ones(2, 1), torch.ones(1), 2, "groups")
    with pytest.raises(ValueError, match="grpo.loss_type"):
        grpo.policy_loss(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1), loss_type="ppo")


CASES = [{"loss_type": loss_type, "beta": beta, "epsilon": 0.2, "epsilon_high": high, "max_completion_length": 8,
          "temperature": temperature, "old": old, "kl_correction": True}
         for loss_type in grpo.LOSS_TYPES
         for beta, high, temperature, old in ((0.0, 0.2, 1.0, False), (0.04, 0.28, 0.7, True))]
CASES.append({**CASES[-1], "kl_correction": False})


def _inputs(model) -> dict[str, torch.Tensor]:
    """Four completions of two prompts (left-padded), of 6, 4, 6 and 2 tokens, and log-probabilities for an older
    policy and a reference, off the model's by enough that some ratios fall outside the clip range."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (4, 5), generator=generator)
    prompt_mask = torch.ones(4, 5, dtype=torch.long)
    prompt_mask[1, :2] = prompt_mask[3, :2] = 0
    completion_ids = torch.randint(3, vocab, (4, 6), generator=generator)
    completion_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 6, [1] * 2 + [0] * 4])
    with torch.no_grad():
        logps = _log_probs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": torch.tensor([0.9, -0.9, -0.4, 0.4]),
            "old_per_token_logps": logps + 0.4 * torch.randn(logps.shape, generator=generator),
            "ref_per_token_logps": logps + 0.3 * torch.randn(logps.shape, generator=generator),
            "num_items_in_batch": completion_mask.sum()}


def _log_probs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    ids = torch.cat([prompt_ids, completion_ids], 1)
    logits = model(input_ids=ids, attention_mask=torch.cat([prompt_mask, completion_mask], 1)).logits
    return grpo.token_log_probs(logits[:, prompt_ids.shape[1] - 1:-1], completion_ids, temperature)[0]


@pytest.mark.e2e
def test_each_loss_type_gives_trls_loss_and_gradients(model_dirs, tmp_path):
    """dapo, grpo, dr_grpo and bnpo, each on the step that generated the completions (ratio 1, no KL) and on a
    later one (old log-probabilities, two-sided clipping 0.2 / 0.28, beta 0.04 with a reference, temperature
    0.7; the last once more without the KL's ratio weighting): the loss and every parameter's gradient equal
    GRPOTrainer's `_compute_loss` (1e-5 relative), run in a process of its own; so do the KL and clip-ratio
    metrics."""
    pytest.importorskip("trl")
    model_dir = model_dirs.llama
    inputs = _inputs(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager"))
    torch.save({"inputs": inputs, "cases": CASES}, tmp_path / "inputs.pt")
    run_worker("trl_grpo.py", str(model_dir), str(tmp_path / "inputs.pt"), str(tmp_path / "trl.pt"), cwd=tmp_path,
               env={"USE_TORCH_XLA": "0"})
    theirs = torch.load(tmp_path / "trl.pt")
    mask = inputs["completion_mask"]
    for case, trl in zip(CASES, theirs):
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
        logps = _log_probs(model, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], mask,
                           case["temperature"])
        loss, terms = grpo.policy_loss(
            logps, mask, inputs["advantages"], old_logps=inputs["old_per_token_logps"] if case["old"] else None,
            ref_logps=inputs["ref_per_token_logps"], loss_type=case["loss_type"], epsilon_low=case["epsilon"],
            epsilon_high=case["epsilon_high"], beta=case["beta"], kl_correction=case["kl_correction"],
            max_completion_length=case["max_completion_length"], tokens_in_step=inputs["num_items_in_batch"])
        loss.backward()
        assert loss.item() == pytest.approx(trl["loss"].item(), rel=1e-5), case
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, trl["grads"][name], rtol=1e-5, atol=1e-7, msg=f"{case} {name}")
        if case["beta"]:
            assert grpo.masked_mean(terms["kl"], mask).item() == pytest.approx(trl["metrics"]["kl"], rel=1e-5)
        for flag in ("low", "high", "region"):
            assert grpo.masked_mean(terms[f"clip_ratio/{flag}"], mask).item() == pytest.approx(
                trl["metrics"][f"clip_ratio/{flag}_mean"], rel=1e-6), (case, flag)
    assert any(trl["metrics"]["clip_ratio/region_mean"] > 0 for trl in theirs)  # the clipping was exercised


REWARDS = '''
def share_of_a(prompts, completions, completion_ids, target, **kwargs):
    return [c.count(t) / max(1, len(c)) for c, t in zip(completions, target)]

def long_only(completions, **kwargs):
    return [len(c) if len(c) > 3 else None for c in completions]

def picky(completions, **kwargs):
    return [1 / (len(c) - 2) for c in completions]

def one_short(completions, **kwargs):
    return [0.0] * (len(completions) - 1)

def not_a_number(completions, **kwargs):
    return [float("nan") if c == "bbb" else 1.0 for c in completions]

def logs(completions, trainer_state, log_metric, **kwargs):
    log_metric("seen", len(completions))
    return [float(trainer_state.global_step)] * len(completions)

table = {}
'''


@pytest.fixture
def reward_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "my_rewards.py"


def _score(rewards, completions):
    prompts = ["p"] * len(completions)
    return rewards.score(prompts, completions, [[1] * len(c) for c in completions],
                         {"target": ["a"] * len(completions)}, rows=list(range(10, 10 + len(completions))), step=7)


def test_reward_functions_are_the_users_python_called_as_trl_calls_them(reward_file):
    """By module (from the working directory) and by file; a row's other columns arrive under their names, None
    is not scored (NaN), the weights are the config's, and log_metric and trainer_state reach the function."""
    from xla_shard.methods.rewards import Rewards

    rewards = Rewards.from_specs(["my_rewards:share_of_a", f"{reward_file}:long_only", "my_rewards:logs"],
                                 [1.0, 0.5, 2.0])
    scores = _score(rewards, ["aab", "abcd", "b"])
    assert rewards.names == ["share_of_a", "long_only", "logs"] and rewards.weights == [1.0, 0.5, 2.0]
    assert scores[:, 0].tolist() == pytest.approx([2 / 3, 1 / 4, 0.0])
    assert scores[[0, 2], 1].isnan().all() and scores[1, 1].item() == 4.0
    assert scores[:, 2].tolist() == [7.0] * 3 and rewards.logged == {"seen": [3]}


@pytest.mark.parametrize("spec, words", [
    ("my_rewards", "is not MODULE:FUNCTION"), ("no_such_module:f", "no module named 'no_such_module'"),
    ("my_rewards:missing", "my_rewards has no missing"), ("my_rewards:table", "is a dict, not a function"),
    ("elsewhere/r.py:f", "no file elsewhere/r.py")])
def test_a_reward_function_that_cannot_be_found_is_one_line_naming_the_key(reward_file, spec, words):
    from xla_shard.errors import ConfigError
    from xla_shard.methods.rewards import Rewards

    with pytest.raises(ConfigError, match="grpo.reward_funcs") as caught:
        Rewards.from_specs([spec])
    assert words in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("name, words", [
    ("picky", "reward function picky raised ZeroDivisionError: division by zero on the completion of data row 11"),
    ("one_short", "reward function one_short returned 2 rewards for 3 completions"),
    ("not_a_number", "reward function not_a_number returned nan for the completion of data row 12")])
def test_a_reward_function_that_fails_is_one_line_naming_it_and_the_row(reward_file, name, words):
    from xla_shard.methods.rewards import RewardError, Rewards

    with pytest.raises(RewardError) as caught:
        _score(Rewards.from_specs([f"my_rewards:{name}"]), ["abc", "ab", "bbb"])
    assert str(caught.value).startswith(words) and "\n" not in str(caught.value)
