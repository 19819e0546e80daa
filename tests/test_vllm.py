"""GRPO's completions drawn by vLLM (`grpo.use_vllm`, `xla_shard.methods.vllm_engine`): the config's refusals
(every tier), and runs on vLLM's CPU build (the `vllm` tier of tests/run.sh, .venv-vllm; skipped elsewhere).

The engine's CPU attention refuses head sizes under 64, so the runs' Llama has 2 heads of 64."""

import json
import math

import pytest
import torch
from conftest import FIXTURES, run_cli, run_trainings, run_worker
from model_dirs import llama_dir

from xla_shard import config
from xla_shard.errors import ConfigError
from xla_shard.methods.vllm_engine import SHM, importance_sampling, remove_segments

PROMPTS = FIXTURES / "prompts.jsonl"
REWARDS = FIXTURES / "rewards.py"


def _grpo(model_dir, *more: str) -> list[str]:
    return [f"model.name={model_dir}", f"data.path={PROMPTS}", "method=grpo", "data.kind=prompt",
            "backend=torch_fsdp", "cpu_devices=1", f"grpo.reward_funcs=[{REWARDS}:low_token_share]",
            "grpo.num_generations=4", "grpo.max_completion_length=8", "train.seq_len=48",
            "train.global_batch_size=8", "train.lr=1e-2", "train.log_every=1", "grpo.use_vllm=true", *more]


@pytest.mark.parametrize("sets, key", [
    (["grpo.vllm_mode=server"], "vllm_mode server"),
    (["grpo.vllm_max_model_length=32"], "vllm_max_model_length=32"),
    (["model.lora.r=4", "model.lora.use_dora=true"], "use_dora"),
    (["model.lora.r=4", "model.lora.modules_to_save=[lm_head]"], "modules_to_save"),
    (["grpo.vllm_importance_sampling_clip_min=4"], "clip_min=4.0 is above clip_max=3.0"),
    (["grpo.vllm_gpu_memory_utilization=1.5"], "vllm_gpu_memory_utilization"),
])
def test_what_the_engine_cannot_do_is_refused_in_one_line_naming_the_key(tmp_path, sets, key):
    cfg = [*_grpo(tmp_path, "backend=torch_fsdp"), *sets]
    with pytest.raises(ConfigError, match=key) as refused:
        config.load(None, cfg)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("backend", ["xla_spmd", "xla_fsdp", "torch_tpu"])
def test_a_backend_without_an_engine_refuses_it_naming_the_key(tmp_path, backend):
    from xla_shard.backends import create

    cfg = config.load(None, [*_grpo(tmp_path), f"backend={backend}"])
    with pytest.raises(ConfigError, match=r"grpo\.use_vllm.*use backend torch_fsdp") as refused:
        create(cfg).check()
    assert "\n" not in str(refused.value)


def test_the_importance_ratio_is_the_trainers_probability_over_the_engines_clipped_or_masked():
    """Two completions of 3 tokens (the second's last is padding). Per token: exp(trainer - engine), clipped
    into [0.5, 2] (token_truncate) or zeroed outside (token_mask); per sequence: exp of the summed differences,
    one value a row. The metrics are the masked mean and max of |trainer - engine|, padding left out."""
    from types import SimpleNamespace

    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]])
    engine = torch.tensor([[-1.0, -1.0, -0.4], [-2.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    gap = trainer - engine

    def section(mode, low=0.5, high=2.0):
        return SimpleNamespace(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                               vllm_importance_sampling_clip_min=low, vllm_importance_sampling_clip_max=high)

    ratio, metrics = importance_sampling(trainer, engine, mask, section("token_truncate"))
    for row, col in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
        assert ratio[row, col].item() == pytest.approx(min(2.0, max(0.5, math.exp(gap[row, col].item()))))
    assert metrics["sampling/sampling_logp_difference/max"].item() == pytest.approx(1.0)
    assert metrics["sampling/sampling_logp_difference/mean"].item() == pytest.approx((0 + 1 + 0.1 + 1 + 0) / 5)
    masked, _ = importance_sampling(trainer, engine, mask, section("token_mask"))
    assert masked[0, 1].item() == 0.0 and masked[1, 0].item() == 0.0  # e^-1 < 0.5, e^1 > 2
    assert masked[0, 2].item() == pytest.approx(math.exp(-0.1))
    sequence, metrics = importance_sampling(trainer, engine, mask, section("sequence_truncate", None, 3.0))
    assert sequence.shape == (2, 1)
    assert sequence[0, 0].item() == pytest.approx(math.exp(-1.1))
    assert sequence[1, 0].item() == pytest.approx(math.exp(1.0))  # the padded token's -9 left out
    assert metrics["sampling/importance_sampling_ratio/max"].item() == pytest.approx(math.exp(1.0))
    off, _ = importance_sampling(trainer, engine, mask, SimpleNamespace(vllm_importance_sampling_correction=False))
    assert off is None


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    pytest.importorskip("vllm")
    return llama_dir(tmp_path_factory.mktemp("vllm") / "llama", hidden=128, heads=2)


SAMPLED = ("reward", "completions/mean_length", "sampling/sampling_logp_difference/mean", "loss", "entropy")


@pytest.mark.e2e
@pytest.mark.vllm
@pytest.mark.slow
def test_grpo_on_the_engine_learns_its_logprobs_are_the_trainers_and_a_stopped_run_resumes_exactly(
        engine_model, tmp_path):
    """Full fine-tuning on the engine, in one process: a tiny Llama rewarded for the share of low token ids
    learns (the last steps' reward over the first steps'); after every weight push the engine's log-probabilities
    of the tokens it sampled equal the trainer's to fp32 rounding (TRL's sampling/sampling_logp_difference
    metrics, every step); a run stopped by SIGTERM after step 4 resumes (the engine given the checkpoint's
    weights) to draw the same completions and take the same steps as the uninterrupted run. Under LoRA (the
    adapters pushed through vLLM's LoRA loading) the engine's log-probabilities equal the trainer's too."""
    got = run_trainings(tmp_path, _grpo(engine_model, "train.steps=12", "checkpoint.every_steps=100"), {
        "full": [f"checkpoint.dir={tmp_path / 'a'}"],
        "stopped": [f"checkpoint.dir={tmp_path / 'b'}", "sigterm_after=4"],
        "resumed": [f"checkpoint.dir={tmp_path / 'b'}"],
        "lora": ["model.lora.r=4", "model.lora.alpha=8", "train.lr=5e-2", "train.steps=4",
                 f"checkpoint.dir={tmp_path / 'c'}"]}, nproc=1)
    full = [r for r in got["full"] if "loss" in r]
    assert len(full) == 12
    rewards = [r["reward"] for r in full]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.1, rewards
    for name in ("full", "lora"):
        for record in (r for r in got[name] if "loss" in r):
            assert record["sampling/sampling_logp_difference/max"] < 1e-4, (name, record)
            assert 0.99 < record["sampling/importance_sampling_ratio/mean"] < 1.01
    lora = [r for r in got["lora"] if "loss" in r]
    assert lora[-1]["entropy"] != lora[0]["entropy"]  # the adapters trained (and were pushed: the check held)

    def sampled(records):
        return [{key: r[key] for key in SAMPLED} for r in records if "loss" in r]

    assert [r["step"] for r in got["resumed"] if "loss" in r] == list(range(5, 13))
    assert sampled(got["stopped"]) + sampled(got["resumed"]) == sampled(got["full"])


@pytest.mark.e2e
@pytest.mark.vllm
def test_an_engine_left_with_stale_weights_stops_the_run(engine_model, tmp_path):
    """The weight pushes after the first skipped: the engine samples from the starting weights while the policy
    trains, its log-probabilities drift from the trainer's, and the run stops at the next generation with an
    error naming the limit, rather than training on."""
    done = run_worker("vllm_stale_sync.py", *_grpo(engine_model, "train.steps=6", f"output_dir={tmp_path}"),
                      cwd=tmp_path, nproc=1)
    assert "STOPPED at push 2:" in done.stdout, done.stdout[-2000:]
    assert "grpo.vllm_logp_difference_limit" in done.stdout and "weight sync" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1]  # the first step trained on its own weights


@pytest.mark.e2e
@pytest.mark.vllm
def test_a_model_the_engine_cannot_serve_is_refused_in_one_line_before_training(model_dirs, tmp_path):
    """The test Llama's heads are of 16, which vLLM's CPU attention refuses: said in one line naming the key,
    no traceback, no step taken."""
    pytest.importorskip("vllm")
    done = run_cli("train", *[a for s in _grpo(model_dirs.llama, "train.steps=2", f"output_dir={tmp_path}")
                              for a in ("--set", s)], "--nproc-per-node", "1")
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "grpo.use_vllm" in line]
    assert errors and "vLLM cannot serve" in errors[-1], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "metrics.jsonl").exists() or "loss" not in (tmp_path / "metrics.jsonl").read_text()


@pytest.mark.e2e
@pytest.mark.vllm
def test_an_engine_split_over_two_processes_draws_what_an_engine_each_draws(engine_model, tmp_path):
    """Two training processes over gloo: an engine each (vllm_tensor_parallel_size 1), then one engine split over
    both (2: each process asks it for the group's rows and takes its own back). A row's draw is seeded by its key,
    so the first step (the same starting weights) draws the same completions either way, and the split engine's
    log-probabilities match the trainer's at every step."""
    common = [*_grpo(engine_model, "train.steps=3", "cpu_devices=2"), "checkpoint.every_steps=100"]
    dead = [SHM / f"-tp:0-[0-1]-cpushm_{rank}" for rank in (0, 1)]  # what a killed split engine leaves (AVX-512)
    for path in dead:
        path.write_bytes(b"\0" * 4096)
    got = {size: run_trainings(tmp_path / str(size), common, {"run": [f"grpo.vllm_tensor_parallel_size={size}"]},
                               nproc=2)["run"] for size in (1, 2)}
    one, split = ([r for r in got[size] if "loss" in r] for size in (1, 2))
    assert len(split) == 3
    for key in ("reward", "completions/mean_length"):
        assert split[0][key] == one[0][key], key
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in split), split
    assert not [path for path in SHM.glob("*-[[]0-1]-cpushm_*")]  # none left for the next run


def test_a_split_engines_segment_is_removed_when_its_run_died_and_kept_while_a_process_maps_it(tmp_path):
    """vLLM's CPU build creates a split engine's shared memory exclusively and unlinks it only in a teardown a
    killed (or unfinalized) worker skips. Before a build, this process's segment is removed if no live process
    maps it; one mapped (a run alive on the machine) stays, as do other processes' and other groups'."""
    import mmap

    names = ["-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1", "-tp:0-[2-3]-cpushm_0", "other_0"]
    for name in names:
        (tmp_path / name).write_bytes(b"\0" * 4096)
    remove_segments("[0-1]-cpushm_0", tmp_path, unmapped_only=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
    (tmp_path / names[0]).write_bytes(b"\0" * 4096)
    with open(tmp_path / names[0], "r+b") as file, mmap.mmap(file.fileno(), 4096):
        remove_segments("[0-1]-cpushm_0", tmp_path, unmapped_only=True)
        assert (tmp_path / names[0]).exists()
        remove_segments("[0-1]-cpushm_0", tmp_path)  # after the build: every process of the group maps it
        assert not (tmp_path / names[0]).exists()
