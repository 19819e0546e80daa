"""Fine-tuning a model one already has: its weights load, shard by shard, exactly, on every backend.

The directories are made by `save_pretrained` in this session (tests/model_dirs.py): a Llama split over two
safetensors files with an index, a tied Llama, a bf16 Llama, a BERT classifier and a bare BERT encoder.
"""

import json
import math
import shutil

import pytest
import torch
from conftest import backend_params, run_cli, run_load_probe, runnable
from model_dirs import assemble, stored_tensors
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from xla_shard import config
from xla_shard.data import build as build_data
from xla_shard.errors import ConfigError
from xla_shard.train import preflight

pytestmark = pytest.mark.torch_version  # its subject depends on torch's version

BACKENDS = {  # the three backends at the sizes that run on a CPU
    "xla_spmd": (["backend=xla_spmd", "cpu_devices=4"], 0),
    "xla_fsdp": (["backend=xla_fsdp", "cpu_devices=1"], 0),
    "torch_fsdp": (["backend=torch_fsdp"], 2),
}
# The decoder layers kept stacked [layers, ...]: loaded from the per-layer tensors of the files.
SCANNED = {"xla_spmd scanned": (["backend=xla_spmd", "cpu_devices=4", "fsdp.scan_layers=true"], 0)}


def reference_loss(directory, overrides, auto=AutoModelForCausalLM, **fields) -> float:
    """Plain transformers: from_pretrained, unsharded, eager attention, on the run's first batch."""
    cfg = config.load(None, [f"model.name={directory}", *overrides])
    model = auto.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32, **fields).eval()
    with torch.no_grad():
        return model(**build_data(cfg, model.config, None).train.global_batch(0)).loss.item()


@pytest.fixture(scope="module")
def loaded(model_dirs, tmp_path_factory):
    """The split Llama set up (loaded, no step taken) on each backend: what every process held and read."""
    root = tmp_path_factory.mktemp("loaded")
    return {name: run_load_probe(root / name, f"model.name={model_dirs.llama}", "train.seq_len=32", *sets, nproc=nproc)
            for name, (sets, nproc) in runnable({**BACKENDS, **SCANNED}).items()}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params([*BACKENDS, *SCANNED]))
def test_pretrained_weights_load_bitwise_and_give_from_pretrained_loss(model_dirs, loaded, backend):
    stored = stored_tensors(model_dirs.llama)
    held = assemble(loaded[backend])
    assert held.keys() == stored.keys()
    different = [name for name in stored if not torch.equal(held[name], stored[name])]
    assert not different, f"{backend}: not bitwise equal to the file: {different}"
    want = reference_loss(model_dirs.llama, ["train.seq_len=32"])
    assert math.isclose(loaded[backend][0]["loss"], want, rel_tol=1e-6), (backend, loaded[backend][0]["loss"], want)


@pytest.mark.slow
@pytest.mark.xla
def test_each_process_reads_only_its_own_part(model_dirs, loaded):
    stored = sum(t.numel() * t.element_size() for t in stored_tensors(model_dirs.llama).values())
    # torch_fsdp on 2 processes: each reads the rows of each tensor it holds, together every byte exactly once.
    reports = [process["report"] for process in loaded["torch_fsdp"]]
    assert len(reports) == 2 and all(r["bytes_stored"] == stored for r in reports)
    assert sum(r["bytes_read"] for r in reports) == stored
    assert all(0.4 * stored < r["bytes_read"] < 0.6 * stored for r in reports), [r["bytes_read"] for r in reports]
    # xla_spmd: one host drives all 4 devices; it reads each byte once, not once per device.
    for backend in ("xla_spmd", "xla_spmd scanned"):
        (spmd,) = [process["report"] for process in loaded[backend]]
        assert spmd["bytes_read"] == stored, backend


@pytest.mark.e2e
@pytest.mark.slow
def test_no_process_ever_holds_a_full_copy(tmp_path):
    """A 37 MiB model over 4 gloo processes: each reads its quarter, and its host memory grows by what it
    holds (its shard: on a CPU the parameters live in host memory) plus what it read, never by the model."""
    from model_dirs import llama_dir

    directory = llama_dir(tmp_path / "larger", hidden=512, layers=4, files=3)
    stored = sum(t.numel() * t.element_size() for t in stored_tensors(directory).values())
    saved = run_load_probe(tmp_path / "probe", f"model.name={directory}", "train.seq_len=32",
                           *BACKENDS["torch_fsdp"][0], nproc=4)
    assert len(saved) == 4 and sum(p["report"]["bytes_read"] for p in saved) == stored
    for process in saved:
        report = process["report"]
        assert 0.2 * stored < report["bytes_read"] < 0.3 * stored
        assert report["peak_host_growth"] <= report["bytes_held"] + report["bytes_read"] + (4 << 20), report
        assert report["peak_host_growth"] < 0.6 * stored, (report["peak_host_growth"], stored)


@pytest.mark.e2e
@pytest.mark.xla
def test_weights_from_a_bucket_are_read_by_range(model_dirs, gcs, tmp_path):
    """The split Llama served by the GCS emulator: the same parameters as from disk, each byte read once."""
    from xla_shard.io.storage import Storage

    url = gcs.url("models/llama")
    bucket = Storage(url)
    for file in model_dirs.llama.iterdir():
        bucket.write(file.name, file.read_bytes())
    saved = run_load_probe(tmp_path / "probe", f"model.name={url}", "train.seq_len=32",
                           *BACKENDS["xla_spmd"][0], env=gcs.env())
    stored = stored_tensors(model_dirs.llama)
    held = assemble(saved)
    assert all(torch.equal(held[name], stored[name]) for name in stored)
    assert saved[0]["report"]["bytes_read"] == sum(t.numel() * t.element_size() for t in stored.values())


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.xla
def test_bf16_weights_become_fp32_master_weights_and_the_load_says_so(model_dirs, tmp_path):
    saved = run_load_probe(tmp_path / "probe", f"model.name={model_dirs.llama_bf16}", "train.seq_len=32",
                           *BACKENDS["xla_spmd"][0])
    stored = stored_tensors(model_dirs.llama_bf16)
    held = assemble(saved)
    assert all(held[n].dtype == torch.float32 and torch.equal(held[n], stored[n].float()) for n in stored)
    assert sorted(saved[0]["report"]["converted"]["BF16->F32"]) == sorted(f"model/{n}" for n in stored)


def test_init_chooses_between_the_weights_and_random(model_dirs):
    def preflight_ok(*sets):
        preflight(config.load(None, [f"model.name={model_dirs.llama}", *sets]))

    preflight_ok()
    preflight_ok("model.init=random")
    preflight_ok("model.init=pretrained")
    config_only = model_dirs.llama.parent / "config_only"
    config_only.mkdir(exist_ok=True)
    shutil.copy(model_dirs.llama / "config.json", config_only)
    preflight(config.load(None, [f"model.name={config_only}"]))  # auto: nothing to load, random init
    for name, problem in [(config_only, "holds no model.safetensors"), ("tiny-llama", "is a preset")]:
        with pytest.raises(ConfigError) as raised:
            preflight(config.load(None, [f"model.name={name}", "model.init=pretrained"]))
        assert raised.value.key == "model.init" and problem in str(raised.value)


@pytest.mark.parametrize("change, key, words", [
    (["model.overrides={num_hidden_layers: 3}"], "model.name", ["lacks 9 tensor(s)", "model.layers.2."]),
    (["model.overrides={intermediate_size: 64}"], "model.name", ["mlp.down_proj.weight is [64, 128] there"]),
    (["model.overrides={vocab_size: 300}"], "model.name", ["embed_tokens.weight is [320, 64] there, [300, 64]"]),
])
def test_weights_that_do_not_fit_are_refused_naming_the_keys(model_dirs, change, key, words):
    with pytest.raises(ConfigError) as raised:
        preflight(config.load(None, [f"model.name={model_dirs.llama}", *change]))
    assert raised.value.key == key and all(w in str(raised.value) for w in words), str(raised.value)


def test_refusals_reach_the_user_as_one_line(model_dirs, tmp_path, capsys):
    from xla_shard.cli import main

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(model_dirs.llama / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    damaged = tmp_path / "damaged"
    shutil.copytree(model_dirs.bert, damaged)
    (damaged / "model.safetensors").write_bytes(b"\xff" * 16)
    for name, words in [(pickled, "pytorch_model.bin"), (damaged, "not a safetensors file"),
                        (model_dirs.bert, "set model.task: sequence_classification")]:
        code = main(["config", "check", "--set", f"model.name={name}", "--set", "model.init=pretrained"])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, err


def test_a_causal_lm_becomes_a_classifier_with_a_new_head(model_dirs):
    """As transformers does: the LM head is not used, the score head is new; both are said."""
    from xla_shard.models import build_model, resolve_source
    from xla_shard.pretrained import PretrainedWeights

    cfg = config.load(None, [f"model.name={model_dirs.llama}", "model.task=sequence_classification",
                             "model.num_labels=2"])
    weights = PretrainedWeights.find(resolve_source(cfg.model), "pretrained")
    weights.match(build_model(cfg.model, 0, empty=True), seed=0)
    assert sorted(weights.fresh) == ["score.weight"] and weights.skipped == ["lm_head.weight"]


@pytest.mark.e2e
@pytest.mark.xla
def test_a_bare_encoder_gets_a_new_classifier_head_from_the_seed(model_dirs, tmp_path):
    from xla_shard.models import build_model, resolve_source
    from xla_shard.pretrained import PretrainedWeights

    sets = ["model.task=sequence_classification", "train.seq_len=32", *BACKENDS["xla_spmd"][0]]
    first = run_load_probe(tmp_path / "a", f"model.name={model_dirs.bert_base}", *sets)
    assert first[0]["report"]["fresh"] == ["classifier.bias", "classifier.weight"]
    cfg = config.load(None, [f"model.name={model_dirs.bert_base}", *sets])
    again = PretrainedWeights.find(resolve_source(cfg.model), "pretrained")
    again.match(build_model(cfg.model, 0, empty=True), seed=cfg.train.seed)  # another process: the same head
    held, stored = assemble(first), stored_tensors(model_dirs.bert_base)
    assert all(torch.equal(held[f"bert.{name}"], value) for name, value in stored.items())  # prefix added
    head = held["classifier.weight"]
    assert head.shape == (3, 64) and 0.005 < head.std() < 0.05  # normal(0, initializer_range=0.02)
    assert torch.equal(head, again.fresh["classifier.weight"])  # the same seed, the same head


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(BACKENDS))
def test_a_classifier_trains_checkpoints_resumes_and_exports(model_dirs, tmp_path, backend):
    sets, nproc = BACKENDS[backend]
    out = tmp_path / "run"
    no_dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}  # so losses can be compared
    common = [f"model.name={model_dirs.bert}", "model.task=sequence_classification", "train.seq_len=32",
              f"model.overrides={json.dumps(no_dropout)}",
              "train.optimizer=sgd", "train.lr=0.5", f"output_dir={out}", f"checkpoint.dir={out}/ckpt",
              "checkpoint.every_steps=2", "fsdp.state_dict_type=FULL_STATE_DICT", *sets]
    extra = ["--nproc-per-node", str(nproc)] if nproc else []

    def train(steps):
        done = run_cli("train", *[a for s in common + [f"train.steps={steps}"] for a in ("--set", s)], *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr

    log = train(2)
    assert "pretrained weights from" in log
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    want = reference_loss(model_dirs.bert, ["model.task=sequence_classification", "train.seq_len=32"],
                          AutoModelForSequenceClassification, **no_dropout)
    assert math.isclose(metrics[0]["loss"], want, rel_tol=1e-5), (metrics[0]["loss"], want)
    log = train(3)
    assert "resumed from" in log and "were not read" in log
    exported = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert type(exported).__name__ == "BertForSequenceClassification" and exported.config.id2label[2] == "contradiction"
    saved = stored_tensors(out / "model")
    assert all(torch.equal(exported.state_dict()[name], value) for name, value in saved.items())
    assert not torch.equal(saved["classifier.weight"], stored_tensors(model_dirs.bert)["classifier.weight"])  # trained
    assert (out / "model" / "tokenizer.json").read_bytes() == (model_dirs.bert / "tokenizer.json").read_bytes()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.xla
def test_export_carries_tokenizer_generation_config_and_use_cache(model_dirs, tmp_path):
    out = tmp_path / "run"
    sets = [f"model.name={model_dirs.llama_tied}", "train.seq_len=32", "train.steps=1", f"output_dir={out}",
            f"checkpoint.dir={out}/ckpt", "fsdp.state_dict_type=FULL_STATE_DICT", *BACKENDS["xla_spmd"][0]]
    done = run_cli("train", *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr[-3000:]
    exported = out / "model"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (exported / name).read_bytes() == (model_dirs.llama_tied / name).read_bytes(), name
    config_json = json.loads((exported / "config.json").read_text())
    assert config_json["use_cache"] is True and config_json["tie_word_embeddings"] is True
    assert "lm_head.weight" not in stored_tensors(exported)  # tied: stored once
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.e2e
@pytest.mark.xla
def test_load_model_gives_your_own_loop_the_pretrained_weights(model_dirs, tmp_path):
    """`xla_shard.load_model` (README, "Use from Python"): the same shard-by-shard load as the trainer's."""
    program = tmp_path / "loop.py"
    program.write_text(f"""
import torch, xla_shard
cfg = xla_shard.load_config(None, ["model.name={model_dirs.llama}", "backend=xla_spmd", "cpu_devices=2"])
backend = xla_shard.start_backend(cfg)
model = xla_shard.load_model(cfg, backend)
chunks = {{t.name[len("model/"):]: (t.shape, t.chunks()) for t in backend.state.tensors(model)}}
torch.save(chunks, "{tmp_path}/chunks.pt")
""")
    import subprocess
    import sys

    from conftest import _env

    done = subprocess.run([sys.executable, str(program)], env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    stored = stored_tensors(model_dirs.llama)
    held = assemble([{"chunks": torch.load(tmp_path / "chunks.pt")}])
    assert held.keys() == stored.keys() and all(torch.equal(held[n], stored[n]) for n in stored)
