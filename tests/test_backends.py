"""Every backend, really run on CPU: xla_spmd on 4 XLA virtual devices, xla_fsdp on 1, torch_fsdp on 2 gloo
processes, each backend's runs in one fresh process (the CLI's own path is the subject of test_launch and
test_checkpoint)."""

import json
import math

import pytest
import torch

from tests.conftest import backend_params, runnable
from xla_shard import config
from xla_shard.data import SyntheticSource
from xla_shard.models import build_model

pytestmark = [pytest.mark.slow, pytest.mark.torch_version]

TINY = ["model=tiny-llama", "train.seq_len=32", "train.global_batch_size=8", "train.seed=3"]
BACKENDS = {
    "xla_spmd": (["backend=xla_spmd", "cpu_devices=4"], 0),
    "xla_fsdp": (["backend=xla_fsdp", "cpu_devices=1"], 0),
    "torch_fsdp": (["backend=torch_fsdp"], 2),
}
SGD_STEPS = 4


def _eager_losses(overrides):
    """The reference: plain unsharded eager PyTorch, written here without xla_shard's loop."""
    cfg = config.load(None, overrides)
    model = build_model(cfg.model, cfg.train.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
    source = SyntheticSource(cfg.train.global_batch_size, cfg.train.seq_len, cfg.train.seed, model.config.vocab_size)
    losses = []
    for step in range(cfg.train.steps):
        batch = source.global_batch(step)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


SGD = TINY + ["train.optimizer=sgd", "train.lr=0.5", f"train.steps={SGD_STEPS}"]


@pytest.fixture(scope="module")
def backend_runs(tmp_path_factory):
    """Each backend's SGD run of tiny-llama and its run of the tied tiny-gpt2 (which checkpoints), the two in one
    fresh process: {backend: (directory, {run: metrics records})}."""
    from conftest import run_trainings

    runs = {}
    for name, (sets, nproc) in runnable(BACKENDS).items():
        root = tmp_path_factory.mktemp(name)
        tied = [*TIED, "train.steps=3", f"checkpoint.dir={root / 'tied' / 'ck'}"]
        runs[name] = root, run_trainings(root, sets, {"sgd": SGD, "tied": tied, **PRECISIONS}, nproc)
    return runs


# bf16 mixed precision, its residual stream in bf16 (the default) and in fp32 (autocast's own rule)
PRECISIONS = {f"bf16_{dtype}": [*SGD, "fsdp.mixed_precision=bf16", f"fsdp.activation_dtype={dtype}"]
              for dtype in ("bfloat16", "float32")}


@pytest.fixture(scope="module")
def sgd_runs(backend_runs):
    """The SGD runs' metrics records per backend, and the eager reference's losses."""
    return {"eager": _eager_losses(SGD)} | {name: records["sgd"] for name, (_, records) in backend_runs.items()}


@pytest.mark.e2e
@pytest.mark.parametrize("backend", backend_params(BACKENDS))
def test_loss_curve_matches_unsharded_eager(sgd_runs, backend):
    reference = sgd_runs["eager"]
    losses = [r["loss"] for r in sgd_runs[backend]]
    assert len(losses) == SGD_STEPS
    assert reference[-1] < reference[0] - 0.05, "the reference must actually train for parity to mean anything"
    for step, (got, want) in enumerate(zip(losses, reference)):
        assert math.isclose(got, want, rel_tol=1e-4), f"{backend} step {step + 1}: {got} vs eager {want}"


@pytest.mark.parametrize("backend", backend_params(BACKENDS))
def test_metrics_lines(sgd_runs, backend):
    records = sgd_runs[backend]
    assert [r["step"] for r in records] == list(range(1, SGD_STEPS + 1))
    # A CPU has no peak FLOP/s to measure against: no MFU (a matmul timed at start-up once gave 19), tokens/s kept.
    assert records[0]["mfu_basis"] == ("no MFU: cpu has no known peak FLOP/s (set train.peak_flops_per_device to "
                                       "report one)")
    tokens = 8 * 32
    for r in records:
        assert r["backend"] == backend and "mfu" not in r
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_s"])
    if backend.startswith("xla"):
        # The steady state compiles nothing new: the step graph is static after warm-up.
        after_warmup = [r["compilations"] for r in records[1:]]
        assert len(set(after_warmup)) == 1, after_warmup
        assert not any("recompiles" in r for r in records)


@pytest.mark.e2e
@pytest.mark.parametrize("backend", backend_params(BACKENDS))
def test_bf16_activations_stay_within_bf16_tolerance_of_autocasts_fp32_stream(backend_runs, backend):
    """`fsdp.activation_dtype`: the stream between layers in bf16 (the default) and in fp32 give losses within bf16
    tolerance of each other and of fp32 training, step after step, and not the same ones: the mode changes what
    is computed, on every backend."""
    records = backend_runs[backend][1]
    bf16, fp32_stream, fp32 = ([r["loss"] for r in records[run]] for run in ("bf16_bfloat16", "bf16_float32", "sgd"))
    assert bf16 == pytest.approx(fp32_stream, rel=2e-2) and bf16 == pytest.approx(fp32, rel=2e-2), (bf16, fp32)
    assert bf16 != fp32_stream


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """One step of each backend, with and without activation checkpointing (AdamW, so optimizer state exists)."""
    from conftest import run_probe

    results = {}
    for name, (sets, nproc) in runnable(BACKENDS).items():
        out = tmp_path_factory.mktemp(name) / "probe.pt"
        plain, checkpointed = run_probe(out, *TINY, *sets, "train.optimizer=adamw", nproc=nproc, each=[
            ["fsdp.activation_checkpointing=false"], ["fsdp.activation_checkpointing=true"]])
        results[name, False], results[name, True] = plain, checkpointed
    return results


@pytest.mark.e2e
@pytest.mark.parametrize("backend", backend_params(BACKENDS))
def test_activation_checkpointing_gradients_are_exact(probes, backend):
    plain, checkpointed = probes[backend, False], probes[backend, True]
    assert plain["loss"] == pytest.approx(checkpointed["loss"], rel=1e-6)
    assert plain["grads"].keys() == checkpointed["grads"].keys() and len(plain["grads"]) > 10
    for name, grad in plain["grads"].items():
        assert grad.abs().max() > 0, f"{name} has no gradient: the comparison would prove nothing"
        torch.testing.assert_close(checkpointed["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", backend_params(BACKENDS))
def test_auto_wrap_units(probes, backend):
    layers = config.load(None, TINY).model
    expected = [""] + [f"model.layers.{i}" for i in range(build_model(layers, 0).config.num_hidden_layers)]
    assert sorted(probes[backend, False]["units"]) == sorted(expected)


@pytest.mark.parametrize("backend", backend_params(["xla_spmd", "torch_fsdp"]))
def test_full_shard_holds_one_nth_per_device(probes, backend):
    result = probes[backend, False]
    n = result["devices"]
    assert n > 1
    memory = result["memory"]
    # Padding: a shard holds at most ceil(dim / n) slices of the sharded dimension, whichever dim that is.
    padded = sum(4 * max(math.ceil(g.shape[d] / n) * g.numel() // g.shape[d] for d in range(g.dim()))
                 for g in result["grads"].values())
    for kind in ("params", "grads"):
        assert memory[f"{kind}_unsharded"] > 0
        assert memory[kind] <= padded, (kind, memory)
        assert memory[kind] <= memory[f"{kind}_unsharded"] / n * 1.1, (kind, memory)
    assert memory["optimizer"] <= 2 * padded  # AdamW: exp_avg and exp_avg_sq, sharded like the params


# ---- tied embeddings (lm_head shares the input embedding) ------------------------------------------------
TIED = ["model=tiny-gpt2", "model.overrides={resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0}",  # no dropout
        "train.seq_len=32", "train.global_batch_size=8", "train.seed=3", "train.optimizer=sgd", "train.lr=0.5"]


@pytest.fixture(scope="module")
def tied_runs(backend_runs):
    """The tied runs' directories per backend, and the eager reference's losses."""
    return {"eager": _eager_losses(TIED + ["train.steps=3"])} | {name: root / "tied"
                                                                   for name, (root, _) in backend_runs.items()}


@pytest.mark.e2e
@pytest.mark.parametrize("backend", backend_params(BACKENDS))
def test_tied_weights_stay_tied_on_every_backend(tied_runs, backend):
    """Moving a model to an XLA device unties lm_head from the embedding; every backend re-ties, so a tied
    model trains the same on all of them and its checkpoints hold the shared matrix once."""
    out = tied_runs[backend]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    for step, (got, want) in enumerate(zip(losses, tied_runs["eager"])):
        assert math.isclose(got, want, rel_tol=1e-4), f"{backend} step {step + 1}: {got} vs eager {want}"
    tensors = json.loads((out / "ck/step-00000003/manifest.json").read_text())["tensors"]
    assert "model/transformer.wte.weight" in tensors and "model/lm_head.weight" not in tensors


@pytest.mark.e2e
@pytest.mark.xla
def test_a_tied_checkpoint_resumes_on_another_backend_and_exports_tied(tied_runs, tmp_path, capsys):
    from conftest import run_cli, run_in_process
    from transformers import AutoModelForCausalLM

    source = tied_runs["xla_spmd"] / "ck" / "step-00000003"
    sets = TIED + ["backend=torch_fsdp", "train.steps=4", f"output_dir={tmp_path / 'run'}",
                   f"checkpoint.dir={tmp_path / 'ck'}", f"checkpoint.resume={source}"]
    done = run_cli("train", *[a for s in sets for a in ("--set", s)], "--nproc-per-node", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    exported = run_in_process(capsys, "ckpt", "export", str(source), "--to", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.transformer.wte.weight
