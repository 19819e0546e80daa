"""GRPO's arithmetic (`xla_shard.methods.grpo`) held to TRL's GRPOTrainer: the advantages of a group's rewards,
and the loss and gradients of every loss type on fixed completions."""

import json
import statistics
from dataclasses import replace

import pytest
import torch
from conftest import FIXTURES, backend_params, run_in_process, run_trainings, run_worker, runnable, runs_args
from transformers import AutoModelForCausalLM

from xla_shard import backends, config
from xla_shard.errors import ConfigError
from xla_shard.methods import grpo, method_for


PROMPTS = FIXTURES / "prompts.jsonl"
EVAL_PROMPTS = FIXTURES / "prompts_eval.jsonl"


def grpo_generations(cfg):
    return method_for(cfg).generations
REWARDS_FILE = FIXTURES / "rewards.py"
RUN_BACKENDS = {"xla_spmd": (["backend=xla_spmd", "cpu_devices=2"], 0),
                "torch_fsdp": (["backend=torch_fsdp", "cpu_devices=2"], 2)}
TRL_NAMES = ("reward", "reward_std", "frac_reward_zero_std", "rewards/low_token_share/mean",
             "rewards/low_token_share/std", "rewards/mentions_topic/mean", "completions/mean_length",
             "completions/clipped_ratio", "completions/mean_terminated_length", "entropy", "clip_ratio/region_mean")


def _grpo_common(model_dir) -> list[str]:
    return [f"model.name={model_dir}", f"data.path={PROMPTS}", "method=grpo", "data.kind=prompt",
            f"grpo.reward_funcs=[{REWARDS_FILE}:low_token_share, {REWARDS_FILE}:mentions_topic]",
            "grpo.reward_weights=[1.0, 0.5]", "grpo.num_generations=4", "grpo.max_completion_length=8",
            "train.seq_len=48", "train.global_batch_size=8", "train.grad_accum_steps=2", "train.lr=1e-2",
            "train.log_every=1", "train.steps=16", "checkpoint.every_steps=100"]



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
    """Four completions of two prompts (left-padded), of 6, 3, 4 and 5 tokens, and log-probabilities for an older
    policy and a reference, off the model's by enough that some ratios fall outside the clip range."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (4, 5), generator=generator)
    prompt_mask = torch.ones(4, 5, dtype=torch.long)
    prompt_mask[1, :2] = prompt_mask[3, :2] = 0
    completion_ids = torch.randint(3, vocab, (4, 6), generator=generator)
    # as many tokens in either half (two processes' rows): bnpo's per-process mean is then the whole batch's
    completion_mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 4 + [0] * 2, [1] * 5 + [0]])
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


def _trl(model_dir, tmp_path, inputs, adapters=None, quant_type: str | None = None) -> list[dict]:
    torch.save({"inputs": inputs, "cases": CASES}, tmp_path / "inputs.pt")
    extra = []
    if adapters is not None:
        torch.save(adapters, tmp_path / "adapters.pt")
        extra = [str(tmp_path / "adapters.pt"), *([quant_type] if quant_type else [])]
    run_worker("trl_grpo.py", str(model_dir), str(tmp_path / "inputs.pt"), str(tmp_path / "trl.pt"), *extra,
               cwd=tmp_path, env={"USE_TORCH_XLA": "0"})
    return torch.load(tmp_path / "trl.pt")


@pytest.mark.e2e
def test_each_loss_type_gives_trls_loss_and_gradients_on_each_backend(model_dirs, tmp_path):
    """dapo, grpo, dr_grpo and bnpo, each on the step that generated the completions (ratio 1, no KL) and on a
    later one (old log-probabilities, two-sided clipping 0.2 / 0.28, beta 0.04 with a reference, temperature
    0.7; the last once more without the KL's ratio weighting): the loss and every trained parameter's gradient
    equal GRPOTrainer's `_compute_loss` (1e-5 relative), run in a process of its own; so do the KL and
    clip-ratio metrics. Held there: `grpo.policy_loss` in plain torch, and the objective a GRPO run trains
    (`Grpo.loss`: the completions' log-probabilities from the sharded model, the policy loss, the metrics) on
    each backend's two devices (torch_fsdp: two processes, each its half of the rows), fully fine-tuned, with
    LoRA adapters, and where the backend holds a 4-bit base with QLoRA against peft's over transformers'
    bitsandbytes base (TRL's model given the same adapters; in fp32, where GRPOTrainer would cast them to bf16)."""
    pytest.importorskip("trl")
    model_dir = model_dirs.llama
    inputs = _inputs(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager"))
    theirs = _trl(model_dir, tmp_path, inputs)
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
    trl_lora = {}
    for backend, (sets, nproc) in runnable(RUN_BACKENDS).items():
        common = [*_grpo_common(model_dir), *sets, "train.grad_accum_steps=1", "train.global_batch_size=4",
                  "grpo.num_generations=2", "fsdp.mixed_precision=no", f"output_dir={tmp_path / 'out'}"]
        # full, LoRA, and QLoRA (over peft's bitsandbytes base) where the backend holds a 4-bit base
        kinds = [None, "lora", *(["nf4"] if backends.capabilities(backend).trains(config.load(None, [
            *sets, "model.lora.r=4", "model.quantization.bnb_4bit_quant_type=nf4"])) else [])]
        for kind in kinds:
            lora = kind is not None
            quantized = ["model.quantization.bnb_4bit_quant_type=nf4"] if kind == "nf4" else []
            run_worker("grpo_loss.py", str(tmp_path / "inputs.pt"), str(tmp_path / "ours.pt"), *common,
                       *(["model.lora.r=4", "model.lora.alpha=8", *quantized] if lora else []), nproc=nproc,
                       cwd=tmp_path)
            ours = torch.load(tmp_path / "ours.pt")
            assert bool(ours["adapters"]) == lora
            if lora and kind not in trl_lora:  # the adapters start from train.seed: the same on every backend
                trl_lora[kind] = _trl(model_dir, tmp_path, inputs, ours["adapters"], None if kind == "lora" else kind)
            for case, got, trl in zip(CASES, ours["cases"], trl_lora[kind] if lora else theirs):
                what = (backend, kind, case)
                assert got["loss"] == pytest.approx(trl["loss"].item(), rel=1e-5, abs=1e-7), what
                trained = {name for name in trl["grads"] if not lora or ".lora_" in name}
                assert set(got["grads"]) == trained, what
                for name, grad in got["grads"].items():
                    torch.testing.assert_close(grad, trl["grads"][name], rtol=1e-5, atol=1e-7, msg=f"{what} {name}")
                for key in ("clip_ratio/region_mean", *(("kl",) if case["beta"] else ())):
                    assert got["metrics"][key] == pytest.approx(trl["metrics"][key], rel=1e-5), (what, key)

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

def takes_the_step(completions, log_metric, **kwargs):
    log_metric("step", 999)
    log_metric("loss", 0.0)
    return [1.0] * len(completions)

def logs_nothing_useful(completions, log_metric, **kwargs):
    log_metric("ratio", float("inf"))
    return [1.0] * len(completions)

def leaves(completions, **kwargs):
    import sys
    sys.exit(0)

def shouts(completions, **kwargs):
    raise ValueError("x" * 5_000_000)

def too_big(completions, **kwargs):
    return [1e39] * len(completions)

def far_too_big(completions, **kwargs):
    return [10**400] * len(completions)

def abstains(completions, **kwargs):
    return [None] * len(completions)

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
    assert scores[:, 2].tolist() == [7.0] * 3 and rewards.logged == {"log_metric/seen": [3]}


@pytest.mark.parametrize("spec, words", [
    ("my_rewards", "is not MODULE:FUNCTION"), ("no_such_module:f", "no module named 'no_such_module'"),
    ("my_rewards:missing", "my_rewards has no missing"), ("my_rewards:table", "is a dict, not a function"),
    ("elsewhere/r.py:f", "no file elsewhere/r.py")])
def test_a_reward_function_that_cannot_be_found_is_one_line_naming_the_key(reward_file, spec, words):
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


def test_end_of_sequence_ids_declared_only_in_generation_config_json_end_a_completion(model_dirs, tmp_path):
    """transformers reads generation_config.json only in from_pretrained; the model built from its config (as
    sharded loading builds it) is given it too, so an end-of-turn id declared there ends a completion. One that
    is not a generation config is one line naming model.name."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from xla_shard import config as cfglib
    from xla_shard.methods.grpo_rollout import _eos_ids
    from xla_shard.models import build_model

    directory = shutil.copytree(model_dirs.llama, tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    declared = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**declared, "eos_token_id": [
        tokenizer.eos_token_id, 5]}))
    section = cfglib.load(None, [f"model.name={directory}"]).model
    assert _eos_ids(tokenizer, build_model(section, seed=0)) == (tokenizer.eos_token_id, 5)
    assert _eos_ids(tokenizer, build_model(section, seed=0, empty=True)) == (tokenizer.eos_token_id, 5)
    (directory / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="model.name.*generation_config.json is not a generation config"):
        build_model(section, seed=0)


def test_what_a_reward_function_logs_is_kept_apart_from_the_runs_own_record(reward_file):
    """log_metric("step", ...) or ("loss", ...) lands under log_metric/, never on the record's own step and loss
    (a resume would have taken such records for newer than the checkpoint and deleted them); a name that is no
    name or a value that is no finite number is one line naming the function."""
    from xla_shard.methods.rewards import RewardError, Rewards

    rewards = Rewards.from_specs(["my_rewards:takes_the_step"])
    _score(rewards, ["a", "b"])
    assert rewards.logged == {"log_metric/step": [999.0], "log_metric/loss": [0.0]}
    with pytest.raises(RewardError, match="reward function logs_nothing_useful logged 'ratio' = inf"):
        _score(Rewards.from_specs(["my_rewards:logs_nothing_useful"]), ["a"])


@pytest.mark.parametrize("name, words", [
    ("leaves", "reward function leaves called sys.exit(0): a reward function returns rewards, it does not end the "
               "run"),
    ("too_big", "reward function too_big returned 1e+39 for the completion of data row 10: return a finite number "
                "within float32's range"),
    ("far_too_big", "reward function far_too_big returned 1000"),
    ("shouts", "reward function shouts raised ValueError: xxx")])
def test_a_reward_function_cannot_end_the_run_or_overflow_its_rewards_or_flood_the_log(reward_file, name, words):
    from xla_shard.methods.rewards import RewardError, Rewards

    with pytest.raises(RewardError) as caught:
        _score(Rewards.from_specs([f"my_rewards:{name}"]), ["abc", "ab"])
    said = str(caught.value)
    assert said.startswith(words) and "\n" not in said and len(said) < 1000


def test_a_step_no_reward_function_scores_is_said(reward_file, capsys):
    """Every reward None: the completions' advantages are 0 and the step learns nothing from them (TRL warns)."""
    from xla_shard.methods.rewards import Rewards

    assert _score(Rewards.from_specs(["my_rewards:abstains", "my_rewards:long_only"]), ["ab", "b"]).isnan().all()
    assert "step 7: every reward function returned None for all 2 completions" in capsys.readouterr().err
    _score(Rewards.from_specs(["my_rewards:abstains", "my_rewards:long_only"]), ["ab", "abcde"])
    assert "every reward function returned None" not in capsys.readouterr().err  # long_only scored one


def test_reward_functions_of_one_name_keep_their_own_metrics_and_columns_cannot_shadow_their_arguments(
        reward_file, tmp_path):
    from xla_shard.methods.rewards import RewardError, Rewards

    (tmp_path / "other.py").write_text("def share_of_a(completions, **kwargs):\n    return [0.5] * len(completions)\n")
    rewards = Rewards.from_specs(["my_rewards:share_of_a", "other:share_of_a"])
    assert rewards.names == ["share_of_a", "share_of_a_2"]
    scores = _score(rewards, ["aa", "b"])
    assert scores[:, 1].tolist() == [0.5, 0.5] and scores[:, 0].tolist() == [1.0, 0.0]
    with pytest.raises(RewardError, match="the data's column 'completions' has the name of an argument"):
        rewards.score(["p"], ["a"], [[1]], {"completions": ["x"]}, rows=[0])


@pytest.mark.e2e
@pytest.mark.torch_version  # the sampler's static cache and FSDP2's forward hooks change with torch
@pytest.mark.parametrize("backend", backend_params(list(RUN_BACKENDS)))
def test_grpo_learns_a_toy_task_resumes_exactly_and_exports(model_dirs, tmp_path, backend, capsys):
    """A tiny Llama rewarded for the share of low token ids in its completions (a random policy: about 1 in 8)
    learns it within 16 steps of 2 prompts x 4 completions, on the run's own devices (2 of them, in two
    micro-batches). A run stopped by SIGTERM after step 6 resumes to draw the very completions and take the very
    steps of the uninterrupted run (every record equal), its records carry TRL's metric names, and the last
    checkpoint exports as a model transformers loads. The uninterrupted run evaluates at its end as TRL does: 5
    held-out prompts' completions sampled by the trained policy (2 prompts a batch: the third batch is filled
    up, its filler neither scored nor counted), its rewards under `eval_` names, the training untouched (its
    records equal the stopped and resumed run's, which did not evaluate). With num_iterations 2 and beta 0.04
    under LoRA, a
    generation's first step is the policy that drew it (no ratio clipped) and its reference (the adapters off:
    KL 0), its second has moved (clipping counted, KL above 0); on XLA the second generation compiles nothing
    the first did not (the warm-up counts generations); its checkpoint exports as the adapter peft loads."""
    sets, nproc = runnable(RUN_BACKENDS)[backend]
    iterations = ["grpo.num_iterations=2", "grpo.beta=0.04", "model.lora.r=4", "model.lora.alpha=8", "train.lr=5e-2",
                  "train.steps=6", "train.recompile_warmup_steps=2"]
    got = run_trainings(tmp_path, [*_grpo_common(model_dirs.llama_chat), *sets], {
        "full": [f"checkpoint.dir={tmp_path / 'a'}", f"data.eval_path={EVAL_PROMPTS}", "train.eval_every=16"],
        "stopped": [f"checkpoint.dir={tmp_path / 'b'}", "sigterm_after=6"],
        "resumed": [f"checkpoint.dir={tmp_path / 'b'}"],
        "iterations": [*iterations, f"checkpoint.dir={tmp_path / 'c'}"],
        # stopped after step 3, inside the generation steps 3 and 4 train on: the resume trains on it as stored
        "iterations_stopped": [*iterations, f"checkpoint.dir={tmp_path / 'd'}", "sigterm_after=3"],
        "iterations_resumed": [*iterations, f"checkpoint.dir={tmp_path / 'd'}"]}, nproc=nproc)
    records = [r for r in got["iterations"] if "loss" in r]
    assert records[0]["kl"] == 0 and records[0]["clip_ratio/region_mean"] == 0
    assert records[1]["kl"] > 0 and records[1]["clip_ratio/region_mean"] > 0
    assert not any("recompiles" in r for r in records)
    drop = ("step_time_s", "tokens_per_s", "real_tokens_per_s", "compile_time_s", "compilations", "mfu_basis",
            "recompiles", "eta_s")

    def steps(records):
        return [{k: v for k, v in r.items() if k not in drop} for r in records if "loss" in r]

    full = steps(got["full"])
    assert steps(got["stopped"]) + steps(got["resumed"]) == full
    assert steps(got["iterations_stopped"]) + steps(got["iterations_resumed"]) == steps(got["iterations"])
    assert [r["step"] for r in steps(got["resumed"])] == list(range(7, 17))
    assert all(name in r for r in full for name in (*TRL_NAMES, "log_metric/topic_mentions"))  # (log_metric's)
    assert not any("recompiles" in r for r in got["full"])  # the sampler and the step compile once
    reward = [r["rewards/low_token_share/mean"] for r in full]
    # (a random policy scores 1/8 throughout; 16 steps of 8 completions are noisy: the last four steps' mean above
    # the first four's by 0.13, 0.33 and 0.28 at train.seed 0, 1 and 2)
    assert sum(reward[-4:]) / 4 > sum(reward[:4]) / 4 + 0.1 and max(reward[-4:]) > 0.3, reward
    (evaluation,) = [r for r in got["full"] if "eval_loss" in r]
    assert evaluation["eval_rows"] == 5 and evaluation["eval_batches"] == 3
    assert all(f"eval_{name}" in evaluation for name in TRL_NAMES)
    assert evaluation["eval_rewards/low_token_share/mean"] > sum(reward[:4]) / 4 + 0.1  # the trained policy's
    if backend == "xla_spmd":  # one process scores each batch's real completions: 8, 8, then 4 (not the filler)
        assert evaluation["eval_log_metric/scored_completions"] == pytest.approx(20 / 3)
    done = run_in_process(capsys, "ckpt", "export", str(tmp_path / "a" / "step-00000016"), "--to",
                          str(tmp_path / "export"))
    assert done.returncode == 0, done.stderr[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    start = AutoModelForCausalLM.from_pretrained(model_dirs.llama_chat).state_dict()
    assert set(exported) == set(start) and not torch.equal(exported["lm_head.weight"], start["lm_head.weight"])
    # ... and under LoRA, the adapter peft loads over the base, trained away from it
    from peft import PeftModel

    done = run_in_process(capsys, "ckpt", "export", str(tmp_path / "c" / "step-00000006"), "--to",
                          str(tmp_path / "adapter"))
    assert done.returncode == 0, done.stderr[-2000:]
    base = AutoModelForCausalLM.from_pretrained(model_dirs.llama_chat)
    ids = torch.arange(3, 19)[None]
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=ids).logits
    assert not torch.allclose(adapted, plain)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.torch_version
@pytest.mark.fsdp2  # FSDP2's parameter groups, kept gathered through a generation, change with torch
def test_fsdp2_gathers_each_unit_once_a_generation_whatever_its_length(model_dirs, tmp_path):
    """Sampling runs a forward per token; on torch_fsdp the units stay gathered through the whole generation, so a
    step's all-gathers do not grow with the completions' length (gathered per token, 8 more tokens would be 8
    more gathers of every unit), and the step after a generation gathers as a training step does."""
    import json

    out = tmp_path / "counts.json"
    sets = [*_grpo_common(model_dirs.llama_chat), "backend=torch_fsdp", "train.steps=2", "train.grad_accum_steps=1",
            "grpo.num_generations=2", "train.global_batch_size=4"]
    runs = [["grpo.max_completion_length=4"], ["grpo.max_completion_length=12"]]
    run_worker("fsdp2_collectives.py", str(out), "1", *sets, *runs_args(runs), nproc=2, cwd=tmp_path)
    gathers = [sum(v["count"] for k, v in run["collectives"].items() if k.startswith("all-gather"))
               for run in json.loads(out.read_text())]
    assert gathers[0] > 0 and gathers[1] == gathers[0], gathers


@pytest.mark.e2e
@pytest.mark.xla
def test_xla_spmd_generates_on_weights_laid_out_once_a_generation(model_dirs, tmp_path):
    """On xla_spmd over 2 devices (FULL_SHARD, bf16), a generation's token program in training's layout
    all-gathers the weights every token; in the generation layout the weights are laid out by one program of
    their own, then neither the prompt's nor the token's program gathers a weight: whole on each device (split 1)
    they run no collective but transformers' padding-mask lookup (a few hundred bytes), split 2 only the MLPs'
    all-reduces. All three draw the same completions, token for token."""
    import json

    out, dump = tmp_path / "layouts.json", tmp_path / "dump"
    sets = [*_grpo_common(model_dirs.llama_chat), "backend=xla_spmd", "cpu_devices=2", "fsdp.mixed_precision=bf16",
            f"output_dir={tmp_path / 'run'}"]
    run_worker("xla_generation.py", str(out), str(dump), *sets, cwd=tmp_path,
               env={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"})
    found = json.loads(out.read_text())
    weights = found["weights_bytes"]

    def forwards(layout):
        return [p["collectives"] for p in found[layout]["programs"] if p["forward"]]

    def laying(layout):
        return [p["collectives"] for p in found[layout]["programs"] if not p["forward"]][0]

    assert found["training"]["ids"] == found["whole"]["ids"] == found["split"]["ids"]
    assert found["training"]["mask"] == found["whole"]["mask"] == found["split"]["mask"]
    training, whole, split = forwards("training"), forwards("whole"), forwards("split")
    assert len(training) == len(whole) == len(split) == 2  # the prompt's program and the token's
    assert training[1]["all-gather"]["bytes"] > weights / 4  # (bf16: half the fp32 weights, less what is whole)
    assert laying("whole")["all-gather"]["bytes"] >= weights / 2
    assert all(p["all-gather"]["bytes"] < 1000 and p["all-reduce"]["count"] == 0 for p in whole)
    layers = 2
    assert all(p["all-gather"]["count"] == 0 and p["all-reduce"]["count"] == layers for p in split)


@pytest.mark.parametrize("sets, words", [
    (["grpo.beta=0.1"], "grpo.beta applies to method grpo; method is sft"),
    (["method=grpo", "data.kind=prompt", "grpo.reward_funcs=[]"], "set grpo.reward_funcs"),
    (["method=grpo", "data.kind=prompt", "train.global_batch_size=6"], "the batch must hold whole groups"),
    (["method=grpo", "data.kind=prompt", "grpo.max_completion_length=48"], "leaves the prompt nothing"),
    (["data.kind=prompt"], "data.kind prompt rows train method grpo, and method is sft"),
    (["method=grpo", "data.kind=prompt", "grpo.reward_weights=[1.0, 2.0]"], "2 weight(s) for 1 reward function"),
    (["method=grpo", "data.kind=prompt", "grpo.reference=/elsewhere"], "grpo.reference scores the KL term"),
    (["method=grpo", "data.kind=prompt", "fsdp.scan_layers=true"], "set fsdp.scan_layers: false")])
def test_a_grpo_config_that_cannot_train_is_one_line_naming_its_key(sets, words):
    from xla_shard import config

    base = [f"data.path={PROMPTS}", "train.seq_len=48", "train.global_batch_size=8"]
    if "method=grpo" in sets:
        base += [f"grpo.reward_funcs=[{REWARDS_FILE}:low_token_share]", "grpo.num_generations=4",
                 "grpo.max_completion_length=8"]
    with pytest.raises(ConfigError) as caught:
        config.load(None, [*base, *sets])
    assert words in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("path", [PROMPTS, FIXTURES / "prompts_chat.jsonl"])
def test_prompts_are_tokenized_as_trl_and_left_padded_longer_ones_dropped(model_dirs, path):
    """Text through the tokenizer as TRL's GRPOTrainer calls it (special tokens added), messages through the chat
    template with its generation prompt; each left-padded to what the completion leaves, masked there; a prompt
    longer than that is dropped and counted."""
    from transformers import AutoTokenizer

    from xla_shard.data import prompts
    from xla_shard.data.files import read_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dirs.llama_chat)
    rows = read_rows(str(path), None, "data.path")
    want = [tokenizer(text=r["prompt"])["input_ids"] if isinstance(r["prompt"], str) else
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for r in rows]
    length = sorted(len(w) for w in want)[4]  # a length the longer prompts exceed
    got, dropped = prompts.examples(rows, tokenizer, prompts.PromptFields("prompt"), length, 0, None, str(path),
                                    "grpo.max_completion_length")
    kept = [(i, w) for i, w in enumerate(want) if len(w) <= length]
    assert dropped == len(want) - len(kept) > 0 and len(got) == len(kept)
    for row, (index, ids) in zip(got, kept):
        fill = length - len(ids)
        assert row["row"] == index and row["input_ids"] == [0] * fill + ids
        assert row["attention_mask"] == [0] * fill + [1] * len(ids)


@pytest.mark.parametrize("prompt, words", [(None, "not missing"), (7, "not int"), ({"role": "user"}, "not dict")])
def test_a_prompt_that_is_neither_text_nor_messages_is_said_as_that(model_dirs, tmp_path, prompt, words):
    """Not as "holds messages ... the tokenizer has no chat template" (the tokenizer here has none)."""
    from transformers import AutoTokenizer

    from xla_shard.data import prompts
    from xla_shard.data.files import read_rows

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "a text"}) + "\n" + json.dumps({"prompt": prompt}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(model_dirs.llama)
    with pytest.raises(ConfigError) as refused:
        prompts.examples(read_rows(str(path), None, "data.path"), tokenizer, prompts.PromptFields("prompt"), 32, 0,
                         None, str(path), "grpo.max_completion_length")
    assert refused.value.key == "data.prompt_field"
    assert "row 1: 'prompt' must be text or a list of messages, " + words in str(refused.value)


@pytest.mark.parametrize("held_out", [f"data.eval_path={EVAL_PROMPTS}", "data.eval_fraction=0.25"])
def test_evaluation_prompts_come_in_file_order_in_groups_the_last_batch_filled_up(model_dirs, held_out):
    """An evaluation batch is global_batch_size completion rows: its prompts in file order, each num_generations
    times in a row; where the prompts run out the batch is filled up with rows marked -1 (never scored). A
    row's columns for the rewards come from the held-out rows themselves (eval_fraction's split included)."""
    from transformers import AutoConfig

    from xla_shard import config, data
    from xla_shard.data.files import read_rows

    cfg = config.load(None, [*_grpo_common(model_dirs.llama_chat), held_out, "train.global_batch_size=12",
                             "grpo.num_generations=4"])
    sources = data.build(cfg, AutoConfig.from_pretrained(model_dirs.llama_chat), str(model_dirs.llama_chat),
                         grpo_generations(cfg))
    held = sources.eval
    total = held.rows_total
    assert total == (5 if "eval_path" in held_out else 2) and held.batches == -(-total // 3)
    seen = []
    for index in range(held.batches):
        rows = held.rows(index, range(12))["row"].tolist()
        assert all(rows[g * 4:(g + 1) * 4] == [rows[g * 4]] * 4 for g in range(3))  # groups of one prompt
        seen += rows[::4]
    assert seen[:total] == list(range(total)) and seen[total:] == [-1] * (held.batches * 3 - total)
    topics, columns = held.columns(list(range(total)), "prompt")
    if "eval_path" in held_out:
        assert [r["topic"] for r in read_rows(str(EVAL_PROMPTS), None, "data.eval_path")] == columns["topic"]
    train_topics = set(sources.train.columns(list(range(6)), "prompt")[1]["topic"])
    assert "eval_path" in held_out or not train_topics & set(columns["topic"])  # held out, not read twice


def test_a_step_holds_groups_of_one_prompt_and_a_generation_trains_num_iterations_steps():
    """Rows of a step: each prompt num_generations times in a row; steps 2k and 2k+1 share their prompts
    (num_iterations 2); an epoch is every prompt's group trained num_iterations times."""
    import datasets

    from xla_shard.data.prompts import Generations, PromptSource

    rows = datasets.Dataset.from_dict({"input_ids": [[i, i] for i in range(6)], "attention_mask": [[1, 1]] * 6,
                                       "row": list(range(6))})
    source = PromptSource(rows, None, None, Generations(3, 2, 4, "k"), global_batch_size=6, seed=1)
    steps = [source.rows(step, range(6))["row"].tolist() for step in range(6)]
    assert all(s[0] == s[1] == s[2] and s[3] == s[4] == s[5] and s[0] != s[3] for s in steps)
    assert steps[0] == steps[1] and steps[2] == steps[3] and steps[1] != steps[2]
    assert sorted({*steps[0], *steps[2], *steps[4]}) == list(range(6))  # an epoch: every prompt once
    assert source.rows_per_epoch == 6 * 3 * 2 and source.rows(0, range(3, 5))["row"].tolist() == steps[0][3:5]


def test_a_checkpoint_inside_a_generation_keeps_its_examples_for_the_resume(model_dirs):
    """num_iterations 2: the checkpoint after a generation's first step holds what it made (each process its
    own), the one after its last nothing; a resume inside it trains on what was kept, or says that it draws it
    again where the checkpoint does not hold it."""
    from xla_shard.methods.grpo_rollout import GrpoRollout

    cfg = config.load(None, [*_grpo_common(model_dirs.llama_chat), "grpo.num_iterations=2"])
    rollout = GrpoRollout(cfg, method_for(cfg).adapter)
    made = [{"input_ids": torch.arange(8).view(2, 4), "advantages": torch.tensor([0.5, -0.5])},
            {"input_ids": torch.arange(8, 16).view(2, 4), "advantages": torch.tensor([1.0, -1.0])}]
    rollout._generated = (3, made)  # generation 3: steps 6 and 7
    assert rollout.state(8) == {}  # step 8 starts generation 4
    kept = rollout.state(7)
    assert int(kept["generation"]) == 3 and torch.equal(kept["1/input_ids"], made[1]["input_ids"])
    resumed = GrpoRollout(cfg, method_for(cfg).adapter)
    assert "not drawn again" in resumed.resume(7, kept)
    generation, batches = resumed._generated
    assert generation == 3 and len(batches) == 2
    assert all(torch.equal(batches[i][key], made[i][key]) for i in range(2) for key in made[i])
    assert resumed.resume(8, {}) == ""  # at a generation's start there is nothing to keep
    assert "drawn again from the resumed weights" in GrpoRollout(cfg, method_for(cfg).adapter).resume(7, {})


def test_the_plan_holds_generations_kv_cache_beside_the_step(model_dirs):
    """Generation runs between steps, its static cache holding every layer's keys and values for each of a
    device's completions at every position: 2 x layers x KV heads x head_dim x seq_len x rows x bytes. The plan
    counts it (kv_cache) and its phase (state at rest, the whole model in bf16, which both backends hold to
    generate, the cache, a token's logits) in the total where it is the larger. With the MLPs split over 2 devices
    (mesh.generation 2) a device holds half the MLP weights, for twice the rows."""
    from transformers import AutoConfig

    from xla_shard import config, planner
    from xla_shard.backends.torch_fsdp import TorchFsdpBackend
    from xla_shard.backends.xla_spmd import XlaSpmdBackend
    from xla_shard.plan import Triple
    from xla_shard.planner import cost

    model = AutoConfig.from_pretrained(model_dirs.llama_chat)
    head_dim = getattr(model, "head_dim", None) or model.hidden_size // model.num_attention_heads
    for rows, seq_len, micro in ((64, 512, 2), (4096, 2048, 256)):
        cfg = config.load(None, [*_grpo_common(model_dirs.llama_chat), f"train.global_batch_size={rows}",
                                 f"train.seq_len={seq_len}", "fsdp.mixed_precision=bf16",
                                 f"train.grad_accum_steps={micro}"])
        work = planner.workload(cfg, 4, XlaSpmdBackend.capabilities)
        found = cost.memory(work, Triple(4, 4, 4), 4)
        want = 2 * model.num_hidden_layers * model.num_key_value_heads * head_dim * seq_len * (rows / 4) * 2
        assert found["kv_cache"] == want
        phase = found["params"] + found["optimizer"] + work.params * 2 + want + 4 * rows / 4 * model.vocab_size
        assert found["total"] == max(phase, cost.memory(replace(work, generated_rows=0), Triple(4, 4, 4), 4)["total"])
    assert found["total"] == phase  # 1024 completions a device at once, 4 a micro-batch: generation is the larger
    assert work.mlp_params == model.num_hidden_layers * 3 * model.hidden_size * model.intermediate_size
    split = cost.memory(replace(work, generation_split=2), Triple(4, 4, 4), 4)
    assert split["total"] == (found["params"] + found["optimizer"] + (work.params - work.mlp_params / 2) * 2
                              + 2 * want + 2 * 4 * rows / 4 * model.vocab_size)
    fsdp = planner.workload(cfg, 4, TorchFsdpBackend.capabilities)
    assert fsdp.generation_gathers_model and cost.memory(fsdp, Triple(4, 4, 4), 4)["total"] == found["total"]


def _llama_70b_widths(path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=16,
                num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192).save_pretrained(path)
    return path


@pytest.mark.e2e  # (the first case pays for building a model on the meta device and the planner's imports: 19 s)
@pytest.mark.parametrize("kind, devices, batch, want", [
    ("TPU v6e", 16, 64, 2),  # whole, the bf16 weights (8.5 GiB) and the state do not fit 32 GiB; MLPs halved do
    ("TPU v6e", 16, 160, 4),  # 10 rows a device: halved is 32.5 GiB (twice the cache), a quarter 29.7
    ("TPU v6e", 16, 256, "refused"),  # at best 32.7 GiB (4 devices): the cache grows as the split does
    ("cpu", 16, 64, 1)])  # no memory known: whole
def test_auto_splits_generation_over_the_fewest_devices_that_fit(tmp_path, kind, devices, batch, want):
    """mesh.generation auto, for Llama-70B's widths (16 layers) on 16 v6e chips: the fewest devices whose split of
    the MLPs fits the generation phase in the chip's memory (by the plan's formula, held to each split's phase), or
    one line naming the batch when none does; set, it is taken as it is; torch_fsdp refuses a split."""
    from xla_shard import config, planner
    from xla_shard.backends.torch_fsdp import TorchFsdpBackend
    from xla_shard.backends.xla_spmd import XlaSpmdBackend
    from xla_shard.planner import settle

    sets = [f"model.name={_llama_70b_widths(tmp_path / 'llama70b')}", f"data.path={PROMPTS}", "method=grpo",
            "data.kind=prompt", f"grpo.reward_funcs=[{REWARDS_FILE}:low_token_share]", "grpo.num_generations=8",
            "grpo.max_completion_length=1024", "train.seq_len=2048", f"train.global_batch_size={batch}",
            "fsdp.mixed_precision=bf16"]
    capabilities = XlaSpmdBackend.capabilities
    cfg = config.load(None, sets)
    resolved = planlib_resolve(cfg, devices)
    if want == "refused":
        with pytest.raises(ConfigError, match="train.global_batch_size.*generation needs"):
            settle.with_generation(cfg, resolved, capabilities, kind)
        return
    got = settle.with_generation(cfg, resolved, capabilities, kind)
    assert got.generation == want
    if want > 1:
        hardware = planner.for_device_kind(kind)
        work = planner.workload(cfg, devices, capabilities, hardware)

        def phase(split):
            split_work = replace(work, generation_split=split)
            return split_work.generation_bytes(planner.memory(split_work, resolved.degrees, devices))[1]
        assert phase(want) <= hardware.hbm_bytes < phase(want // 2)
    fixed = config.load(None, [*sets, "mesh.generation=2"])
    assert settle.with_generation(fixed, resolved, capabilities, kind).generation == 2
    with pytest.raises(ConfigError, match="mesh.generation.*torch_fsdp"):
        TorchFsdpBackend.capabilities.check(fixed)


def planlib_resolve(cfg, devices):
    from xla_shard import plan

    return plan.resolve(cfg.fsdp, cfg.mesh, devices)


@pytest.mark.e2e
@pytest.mark.parametrize("split", [1, 2])
def test_xla_shard_compile_compiles_grpos_step_and_its_generation(model_dirs, split):
    """`xla-shard compile` of a GRPO config compiles its training step (prompt + completion rows, the policy
    loss) for a v5p-8 with libtpu, and beside it the generation's three programs as the sampler runs them: the
    weights laid out once (an all-gather of every weight), the prompts' forward, and a token's, which gathers no
    weight (split 1: a device holds them whole; split 2: the MLPs split, their outputs all-reduced) and reads
    every weight a device holds. The phase's memory holds training's state at rest beside them."""
    pytest.importorskip("jax")
    from tpu_compiles import compile_json

    report = compile_json(
        "--tpu", "v5p-8", *(f"--set={s}" for s in [*_grpo_common(model_dirs.llama_chat), "train.seq_len=256",
                                                     "grpo.max_completion_length=64", "backend=xla_spmd",
                                                     f"mesh.generation={split}"]))
    assert report["fits"] and report["planned_generation"]["kv_cache_bytes"] > 0
    assert report["collectives"]["all-gather"]["count"] > 0  # the sharded policy's forward and backward
    generation = report["generation"]
    assert generation["split"] == split and generation["rows"] == 8 and generation["max_new_tokens"] == 64
    programs, weights = generation["programs"], report["consumers"]["parameters"] * report["devices"]  # fp32
    assert programs["layout"]["collectives"]["all-gather"]["bytes"] >= weights / split / 2
    per_token = programs["token"]["collectives"]
    assert sum(v["bytes"] for v in per_token.values()) < weights / 50, per_token
    assert ("all-reduce" in per_token) == (split > 1)
    assert programs["token"]["bytes_accessed_per_device"] >= weights / split / 2
    resting = report["consumers"]["parameters"] + report["consumers"]["optimizer state"]
    assert generation["resting_bytes_per_device"] == resting
    assert generation["fits"] and generation["needed_bytes_per_device"] > resting + weights / split / 2
    assert generation["decode_roofline"]["tokens_per_s"] > 0

