"""The trainer's knobs do what they say on every backend: learning-rate schedules, gradient clipping over the
global norm, gradient accumulation, evaluation, and one metrics series per run."""

import json
import math
import subprocess
import sys
import types

import pytest
import torch
from conftest import FIXTURES, WORKERS, _env, backend_params, run_cli, run_trainings, run_worker, runnable, runs_args

from xla_shard import config
from xla_shard.data import SyntheticSource
from xla_shard.errors import ConfigError
from xla_shard.planner.settle import settle
from xla_shard.models import build_model
from xla_shard.schedule import EARLIER_WARMUP_RULE, lr_factor

pytestmark = pytest.mark.torch_version  # its subject depends on torch's version

BACKENDS = {
    "xla_spmd": (["backend=xla_spmd", "cpu_devices=4"], []),
    "xla_fsdp": (["backend=xla_fsdp", "cpu_devices=1"], []),
    "torch_fsdp": (["backend=torch_fsdp"], ["--nproc-per-node", "2"]),
}
TINY = ["model=tiny-llama", "train.seq_len=32", "train.global_batch_size=8", "train.seed=3", "train.optimizer=sgd",
        "train.lr=0.5"]


def train(out, sets, extra=()):
    done = run_cli("train", *[a for s in [*sets, f"output_dir={out}"] for a in ("--set", s)], *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("schedule, min_ratio, reference", [
    ("constant", 0.0, "get_constant_schedule_with_warmup"),
    ("linear", 0.0, "get_linear_schedule_with_warmup"),
    ("cosine", 0.0, "get_cosine_schedule_with_warmup"),
    ("cosine", 0.1, "get_cosine_with_min_lr_schedule_with_warmup"),
])
@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_each_schedule_is_the_transformers_scheduler_of_its_name(schedule, min_ratio, reference, warmup):
    """The Trainer and TRL step their scheduler after each optimizer step: step k (0-based) runs at lr x lambda(k),
    0 at the first step of a warm-up."""
    import transformers

    total = 20
    cfg = config.load(None, [f"train.lr_schedule={schedule}", f"train.lr_warmup_steps={warmup}",
                             f"train.lr_min_ratio={min_ratio}", "train.lr=1.0"])
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    kwargs = {} if schedule == "constant" else {"num_training_steps": total}
    if min_ratio:
        kwargs["min_lr_rate"] = min_ratio
    scheduler = getattr(transformers, reference)(optimizer, num_warmup_steps=warmup, **kwargs)
    want = []
    for _ in range(total):
        want.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert [lr_factor(s, cfg.train, total) for s in range(total)] == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_mfu_is_taken_against_the_planners_peak_and_stops_once_above_one():
    """`metrics.Mfu`, the step record's: the configured peak, else the hardware table's for the device kind (the
    planner's own), else none; a rate that would put it above 1 stops it with one warning."""
    from xla_shard.metrics import Mfu
    from xla_shard.planner import accelerator

    mfu = Mfu(1e9, "tpu v5p-8", 4)
    assert mfu.peak == accelerator("v5p").peak_flops and "dense bf16 peak" in mfu.basis
    assert mfu.of(1e3, print) == pytest.approx(1e12 / (mfu.peak * 4))
    warned = []
    assert mfu.of(1e9, warned.append) is None and len(warned) == 1 and "MFU" in warned[0]
    assert mfu.of(1e3, warned.append) is None and len(warned) == 1  # stopped, said once
    assert Mfu(1e9, "tpu v5p-8", 4, configured=5e14).peak == 5e14
    cpu = Mfu(1e9, "cpu", 1)
    assert cpu.of(1e3, print) is None and cpu.basis.startswith("no MFU: cpu")


def test_the_steps_graphs_are_counted_apart_from_evaluations_and_recompiles_are_said():
    from xla_shard.metrics import GraphCount

    compiled = types.SimpleNamespace(graphs=3, seconds=1.0)  # what setup compiled: not the steps'
    count, warned = GraphCount(lambda: types.SimpleNamespace(**vars(compiled)), warmed_up_at=2), []
    compiled.graphs = 5
    record = {}
    count.count_step(record, 1, warned.append)
    assert record == {"compilations": 2}
    compiled.graphs = 6
    count.count_step(record := {}, 2, warned.append)  # the end of the warm-up
    assert record == {"compilations": 3} and not warned
    with count.evaluation(2, warned.append) as found:
        compiled.graphs, compiled.seconds = 8, 3.0
    assert found == {"eval_compilations": 2, "eval_compile_time_s": 2.0} and not warned
    count.count_step(record := {}, 3, warned.append)
    assert record == {"compilations": 3} and not warned  # evaluation's graphs are not the steps'
    compiled.graphs = 9
    count.count_step(record := {}, 4, warned.append)
    assert record == {"compilations": 4, "recompiles": 1} and "after warm-up" in warned[0]
    assert GraphCount(lambda: None, 1).count_step(record := {}, 1, print) is None and record == {}


def test_a_checkpoint_from_before_the_rule_keeps_its_warm_up():
    """Written one step ahead (lr x (k + 1) / warm-up); the rules agree once the warm-up is over."""
    cfg = config.load(None, ["train.lr_schedule=linear", "train.lr_warmup_steps=4", "train.lr=1.0"])
    earlier = [lr_factor(s, cfg.train, 10, EARLIER_WARMUP_RULE) for s in range(10)]
    assert earlier[:4] == [0.25, 0.5, 0.75, 1.0] and earlier[4:] == [lr_factor(s, cfg.train, 10) for s in range(4, 10)]


def _eager_steps(steps: int, micro: int, max_norm: float):
    """The reference: unsharded eager PyTorch with torch's own clip_grad_norm_, `micro` micro-batches a step."""
    cfg = config.load(None, TINY)
    model = build_model(cfg.model, cfg.train.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
    source = SyntheticSource(8, 32, cfg.train.seed, model.config.vocab_size)
    losses, norms = [], []
    for step in range(steps):
        batch = source.global_batch(step)
        total = 0.0
        for j in range(micro):
            part = {k: v[j * 8 // micro:(j + 1) * 8 // micro] for k, v in batch.items()}
            loss = model(**part).loss
            (loss / micro).backward()
            total += loss.item() / micro
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, norms


@pytest.mark.parametrize("sets", [["backend=xla_spmd", "cpu_devices=8"], ["backend=torch_fsdp"]])
def test_micro_batches_that_do_not_split_over_the_devices_are_refused(sets):
    """8 rows in 2 micro-batches of 4 over 8 devices: FSDP2 ranks would feed no rows, SPMD would replicate."""
    from xla_shard import backends

    cfg = config.load(None, [*sets, "train.global_batch_size=8", "train.grad_accum_steps=2"])
    with pytest.raises(ConfigError) as raised:
        settle(cfg, 8, backends.create(cfg).capabilities, "cpu")
    assert raised.value.key == "train.grad_accum_steps" and "4 rows" in str(raised.value), str(raised.value)
    cfg = config.load(None, [*sets, "train.global_batch_size=16", "train.grad_accum_steps=2"])
    settle(cfg, 8, backends.create(cfg).capabilities, "cpu")


@pytest.fixture(scope="module")
def clipped_runs(tmp_path_factory):
    """Each backend, 3 SGD steps with the gradient norm clipped to 0.5, in one batch and in 2 micro-batches (the
    two in one process)."""
    root = tmp_path_factory.mktemp("clipped")
    runs = {}
    for name, (sets, extra) in runnable(BACKENDS).items():
        found = run_trainings(root / name, [*TINY, *sets, "train.steps=3", "train.max_grad_norm=0.5"],
                              {str(micro): [f"train.grad_accum_steps={micro}"] for micro in (1, 2)},
                              nproc=int(extra[1]) if extra else 0)
        runs |= {(name, micro): found[str(micro)] for micro in (1, 2)}
    return runs


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(BACKENDS))
def test_the_clipped_norm_is_the_global_norm_on_every_backend(clipped_runs, backend):
    losses, norms = _eager_steps(3, 1, 0.5)
    records = clipped_runs[(backend, 1)]
    assert norms[0] > 0.5  # clipping is active
    assert [r["grad_norm"] for r in records] == pytest.approx(norms, rel=1e-5)
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(BACKENDS))
def test_two_micro_batches_make_the_same_update_as_one_batch(clipped_runs, backend):
    whole, split = clipped_runs[(backend, 1)], clipped_runs[(backend, 2)]
    assert [r["loss"] for r in split] == pytest.approx([r["loss"] for r in whole], rel=1e-5)
    assert [r["grad_norm"] for r in split] == pytest.approx([r["grad_norm"] for r in whole], rel=1e-5)
    assert [r["loss"] for r in split] == pytest.approx(_eager_steps(3, 2, 0.5)[0], rel=1e-5)


@pytest.mark.fsdp2
@pytest.mark.e2e
@pytest.mark.slow
def test_fsdp2_reduces_gradients_once_per_step_whatever_the_micro_batches(tmp_path):
    out = tmp_path / "counts.json"
    run_worker("fsdp2_collectives.py", str(out), "1", *TINY, "backend=torch_fsdp",
               *runs_args([["train.grad_accum_steps=1"], ["train.grad_accum_steps=4"]]), nproc=2, cwd=tmp_path)
    counts = [sum(v["count"] for k, v in run["collectives"].items() if k.startswith("reduce-scatter"))
              for run in json.loads(out.read_text())]
    assert counts[0] > 0 and counts[1] == counts[0], counts


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.xla
def test_lr_is_logged_each_step_and_a_schedule_compiles_nothing_new(tmp_path):
    records = train(tmp_path / "run", [*TINY, *BACKENDS["xla_spmd"][0], "train.steps=6", "train.lr_schedule=cosine",
                                       "train.lr_warmup_steps=2", "train.recompile_warmup_steps=3"])
    cfg = config.load(None, [*TINY, "train.lr_schedule=cosine", "train.lr_warmup_steps=2"])
    assert [r["lr"] for r in records] == pytest.approx([0.5 * lr_factor(s, cfg.train, 6) for s in range(6)])
    assert not any("recompiles" in r for r in records)
    assert records[-1]["compilations"] == records[2]["compilations"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(BACKENDS))
def test_the_tutorial_job_bert_on_premise_hypothesis_pairs(model_dirs, tmp_path, backend):
    """The data-parallelism tutorial's job: fine-tune a BERT classifier on an NLI file with its tokenizer, with
    eval accuracy reported; under XLA the second evaluation compiles nothing new."""
    sets, extra = BACKENDS[backend]
    records = train(tmp_path / "run", [f"model.name={model_dirs.bert}", "model.task=sequence_classification",
                                       f"data.path={FIXTURES / 'nli.csv'}", "data.text_fields=[premise, hypothesis]",
                                       "data.eval_fraction=0.25", "train.seq_len=48", "train.steps=4",
                                       "train.eval_every=2", "train.lr=1e-3", "train.max_grad_norm=1.0", *sets], extra)
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    # All 9 held-out rows (a batch of 8 and one of 1 plus filler): whole rows of 9.
    assert all(r["eval_rows"] == 9 and r["eval_batches"] == 2 for r in evals)
    assert all(0.0 <= r["eval_accuracy"] <= 1.0
               and r["eval_accuracy"] * 9 == pytest.approx(round(r["eval_accuracy"] * 9))
               for r in evals)
    assert all(math.isfinite(r["eval_loss"]) for r in evals)
    if backend.startswith("xla"):
        assert evals[0]["eval_compilations"] > 0 and evals[1]["eval_compilations"] == 0


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("reading", [["data.eval_fraction=0.2"],
                                     ["data.streaming=true", f"data.eval_path={FIXTURES / 'corpus.jsonl'}"]])
@pytest.mark.xla
def test_a_causal_lm_fine_tune_on_jsonl_with_packing_and_eval_resumes_exactly(model_dirs, tmp_path, reading):
    sets = [f"model.name={model_dirs.llama}", f"data.path={FIXTURES / 'corpus.jsonl'}", *reading,
            "train.seq_len=32", "train.eval_every=2", "train.optimizer=adamw", "train.lr_schedule=linear",
            *BACKENDS["xla_spmd"][0]]
    whole = train(tmp_path / "whole", [*sets, "train.steps=4", f"checkpoint.dir={tmp_path}/whole/ckpt",
                                       "checkpoint.every_steps=2"])
    # Continue the same run (same schedule, same data order) from its step-2 checkpoint, in another directory.
    resumed = train(tmp_path / "resumed", [*sets, "train.steps=4", f"checkpoint.dir={tmp_path}/resumed/ckpt",
                                           f"checkpoint.resume={tmp_path}/whole/ckpt/step-00000002"])
    timing = ("step_time_s", "tokens_per_s", "real_tokens_per_s", "mfu", "mfu_basis", "compilations", "compile_time_s",
              "eval_compilations", "eval_time_s", "eval_compile_time_s")
    same = [{k: v for k, v in r.items() if k not in timing} for r in whole if r["step"] > 2]
    assert [{k: v for k, v in r.items() if k not in timing} for r in resumed] == same
    # The resumed run's steps compile what the whole run's did (restoring the checkpoint is counted apart),
    # and evaluation's graphs are in neither count.
    steps = [[r["compilations"] for r in run if "loss" in r] for run in (whole, resumed)]
    assert steps[1][-1] == steps[0][-1] == steps[0][1], steps
    assert [r["eval_perplexity"] for r in whole if "eval_loss" in r] == pytest.approx(
        [math.exp(r["eval_loss"]) for r in whole if "eval_loss" in r])


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(["xla_spmd", "torch_fsdp"]))
def test_evaluation_covers_every_row_and_counts_only_real_labels(model_dirs, tmp_path, backend):
    """11 held-out documents of different lengths, one padded row each, in batches of 8: the second batch is 3
    rows and 5 of filler (under torch_fsdp one process gets only filler). With lr 1e-30 the weights stay the
    pretrained ones, so eval_loss must be plain transformers' loss over all 11 rows at once (the mean over every
    real token): not a mean of batch means, not 8 rows; likewise its mean token accuracy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = [" ".join(["the river runs south"] * (i + 1)) for i in range(11)]
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    sets, extra = BACKENDS[backend]
    records = train(tmp_path / "run", [f"model.name={model_dirs.llama}", f"data.path={FIXTURES / 'corpus.jsonl'}",
                                       f"data.eval_path={held_out}", "data.packing=false", "train.seq_len=32",
                                       "train.global_batch_size=8", "train.optimizer=sgd", "train.lr=1e-30",
                                       "train.steps=1", "train.eval_every=1", *sets], extra)
    (evaluation,) = [r for r in records if "eval_loss" in r]
    assert evaluation["eval_rows"] == 11 and evaluation["eval_batches"] == 2
    tokenizer = AutoTokenizer.from_pretrained(model_dirs.llama)
    encoded = tokenizer(texts, truncation=True, max_length=32, padding="max_length", return_tensors="pt")
    labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
    with torch.no_grad():
        out = AutoModelForCausalLM.from_pretrained(model_dirs.llama)(**encoded, labels=labels)
    assert evaluation["eval_loss"] == pytest.approx(out.loss.item(), rel=1e-5)
    # TRL's mean_token_accuracy, over every labelled token at once: position t predicts the label at t + 1
    scored = labels[:, 1:] != -100
    hits = (out.logits[:, :-1].argmax(-1) == labels[:, 1:]) & scored
    assert evaluation["eval_mean_token_accuracy"] == pytest.approx(hits.sum().item() / scored.sum().item())


def test_more_virtual_xla_devices_than_cores_is_warned_about():
    from xla_shard.backends.xla_common import oversubscribed

    assert oversubscribed(2, 2) is None and oversubscribed(1, 4) is None
    warning = oversubscribed(4, 2)
    assert "cpu_devices=4" in warning and "2 CPU core(s)" in warning and "set cpu_devices to 2 or fewer" in warning


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.xla
def test_mfu_is_never_above_one(tmp_path):
    """Against a stated peak the run beats (1 kFLOP/s), MFU stops with one warning naming the basis, instead of
    logging a utilisation above 100%; against a peak it cannot reach, it is reported and below 1."""
    sets = [*TINY, "backend=xla_spmd", "cpu_devices=2", "train.steps=3"]
    done = run_cli("train", *[a for s in [*sets, "train.peak_flops_per_device=1000", f"output_dir={tmp_path / 'low'}"]
                              for a in ("--set", s)])
    assert done.returncode == 0, done.stderr[-3000:]
    low = [json.loads(line) for line in (tmp_path / "low" / "metrics.jsonl").read_text().splitlines()]
    assert len(low) == 3 and not any("mfu" in r for r in low)
    assert done.stderr.count("> 1 against train.peak_flops_per_device=1e+03") == 1, done.stderr[-2000:]
    assert "GSPMD sharding propagation is going to be deprecated" not in done.stderr  # XLA's per-compile warning
    import os

    assert ("more than the" in done.stderr) == (len(os.sched_getaffinity(0)) < 2)  # cpu_devices=2
    high = train(tmp_path / "high", [*sets, "train.peak_flops_per_device=1e18"])
    assert all(0 < r["mfu"] < 1e-3 for r in high)
    assert "PaLM's count" in high[0]["mfu_basis"]  # which convention the MFU is in


def test_without_a_terminal_each_record_is_one_line_with_the_time_left(tmp_path, capsys):
    from xla_shard.metrics import StepLogger

    logger = StepLogger(str(tmp_path), total_steps=1000, enabled=True)
    logger.log({"step": 1, "loss": 2.6, "step_time_s": 0.5, "compile_time_s": 30.0})  # no steady pace yet
    logger.log({"step": 40, "loss": 2.5, "step_time_s": 4.0, "tokens_per_s": 100.0}, eta_s=3840.4)
    logger.log({"step": 40, "eval_loss": 2.0})
    logger.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["step=1 loss=2.6 step_time_s=0.5 compile_time_s=30",
                     "step=40 loss=2.5 step_time_s=4 tokens_per_s=100 eta=1:04:00", "step=40 eval_loss=2"]


def test_step_times_leave_out_evaluation_and_compiling_and_the_eta_counts_steady_steps(monkeypatch):
    """A step that compiled reports its compiling apart and what the step itself took; evaluation (paused) and
    its compiling are in no step; the ETA waits for a lap past the warm-up that compiled nothing, then is
    the mean pace of such laps (a checkpoint's save, which recurs, stays in)."""
    from xla_shard import metrics

    now, compiled = [100.0], [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])

    def steps(n, seconds, compiling=0.0):
        for _ in range(n):
            now[0] += seconds + compiling
            compiled[0] += compiling
            clock.tick()

    clock = metrics.StepClock(lambda: compiled[0], start_step=10, warmup_steps=2)
    steps(1, 0.5, compiling=20.0)
    assert clock.lap(11) == metrics.Lap(0.5, 20.0, steady=False) and clock.eta_s(11, 20) is None
    steps(1, 0.5, compiling=4.0)
    assert clock.lap(12) == metrics.Lap(0.5, 4.0, steady=False) and clock.eta_s(12, 20) is None
    steps(2, 0.25)
    with clock.paused():  # an evaluation that compiles its graph
        now[0] += 9.0
        compiled[0] += 7.0
    assert clock.lap(14) == metrics.Lap(0.25, 0.0, steady=True) and clock.eta_s(14, 20) == 6 * 0.25
    steps(2, 0.75)
    assert clock.lap(16).steady and clock.eta_s(16, 20) == 4 * 0.5
    steps(1, 0.5, compiling=3.0)  # a recompile: reported, and no sample of the pace
    assert clock.lap(17) == metrics.Lap(0.5, 3.0, steady=False) and clock.eta_s(17, 20) == 3 * 0.5
    eager = metrics.StepClock(lambda: None, start_step=0, warmup_steps=0)  # a backend that compiles nothing
    now[0] += 2.0
    eager.tick()
    assert eager.lap(1) == metrics.Lap(2.0, 0.0, steady=True) and eager.eta_s(1, 3) == 4.0


def test_one_metrics_series_per_run(tmp_path):
    """A new run moves an earlier run's metrics aside (and says so); a resume drops the records past its step."""
    from xla_shard.metrics import StepLogger

    said = []

    def run(start, steps):
        logger = StepLogger(str(tmp_path), steps, enabled=True, start_step=start, log=said.append)
        for step in range(start + 1, steps + 1):
            logger.log({"step": step, "loss": 1.0 / step})
            if step % 2 == 0:
                logger.log({"step": step, "eval_loss": 0.5})
        logger.close()
        return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    run(0, 4)
    assert run(2, 4) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}, {"step": 2, "eval_loss": 0.5},
                         {"step": 3, "loss": 1 / 3}, {"step": 4, "loss": 0.25}, {"step": 4, "eval_loss": 0.5}]
    assert not said
    assert [r["step"] for r in run(0, 1)] == [1]
    (earlier,) = tmp_path.glob("metrics-*.jsonl")
    assert len(earlier.read_text().splitlines()) == 6 and earlier.name in said[0]


@pytest.mark.e2e
@pytest.mark.xla
def test_hooks_see_every_step_and_evaluation_and_the_trainer_grows_no_attributes(model_dirs, tmp_path):
    """`on_step_end` runs after every optimizer step (with the record on logged steps, None between them),
    `on_evaluate` after each evaluation with its record; every attribute exists from `__init__` on; without
    checkpoint.dir the trainer checkpoints through NoCheckpoints (no branch on whether there is one)."""
    out = tmp_path / "hooks.pt"
    done = subprocess.run([sys.executable, str(WORKERS / "hooks.py"), str(out), f"model.name={model_dirs.llama}",
                           f"data.path={FIXTURES / 'corpus.jsonl'}", "data.eval_fraction=0.2", "train.seq_len=32",
                           "train.steps=4", "train.log_every=2", "train.eval_every=2", "backend=xla_spmd",
                           "cpu_devices=1", f"output_dir={tmp_path}/run"],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = torch.load(out)
    assert [step for step, _, _ in seen["steps"]] == [1, 2, 3, 4]
    logged = [r for r in seen["records"] if "loss" in r]
    assert [record for _, record, _ in seen["steps"]] == [None, logged[0], None, logged[1]]
    assert [lr for _, _, lr in seen["steps"]][1] == logged[0]["lr"]
    evaluations = [r for r in seen["records"] if "eval_loss" in r]
    assert [step for step, _ in seen["evaluations"]] == [2, 4]
    assert [record for _, record in seen["evaluations"]] == evaluations
    assert seen["grown"] == [] and seen["checkpointer"] == "NoCheckpoints"


def test_a_resume_drops_the_records_it_redoes_and_the_lines_that_are_not_records(tmp_path):
    """metrics.jsonl is the run's own record, but a line of it that is not UTF-8 JSON with a numeric step (a
    disk fault, a hand edit) is dropped with a word, never the end of every later resume."""
    from xla_shard.metrics import StepLogger

    good = [b'{"step": 1, "loss": 2.0}', b'{"step": 2, "loss": 1.5}', b'{"step": 3, "loss": 1.2}']
    damaged = [b'\xff\xfe{"step": 1}', b'{"step": "2"}', b'{"step": null}', b'{"step": [1]}', b'[1, 2]',
               b'{"step": true}', b"not json"]
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join([good[0], *damaged, *good[1:]]) + b"\n")
    said = []
    logger = StepLogger(str(tmp_path), total_steps=5, enabled=True, start_step=2, log=said.append)
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_bytes().splitlines() == good[:2]
    assert len(said) == 1 and f"{len(damaged)} line(s) that are not a record" in said[0]
