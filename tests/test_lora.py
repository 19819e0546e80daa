"""LoRA (model.lora, through peft): the frozen base is read and sharded like any model, the adapters train as
peft + plain transformers train them, the optimizer holds state for the adapters only, checkpoints hold what is
trained and resume exactly, and the export is a directory PeftModel loads."""

import json
from pathlib import Path

import pytest
import torch
from conftest import (FIXTURES, backend_params, run_cli, run_in_process, run_probe, run_trainings, runnable,
                      sgd_losses)
from model_dirs import MOE_FAMILIES
from transformers import AutoModelForCausalLM

from xla_shard import backends, config
from xla_shard.data import build
from xla_shard.errors import ConfigError, UserError
from xla_shard.pretrained import build_for

pytestmark = pytest.mark.torch_version  # its subject depends on torch's version

BACKENDS = {
    "xla_spmd": (["backend=xla_spmd", "cpu_devices=2"], 0),
    "torch_fsdp": (["backend=torch_fsdp"], 2),
}
LORA = ["model.lora.r=4", "model.lora.alpha=8"]


def _common(model_dirs, *sets):
    return [f"model.name={model_dirs.llama}", f"data.path={FIXTURES / 'corpus.jsonl'}", "train.seq_len=32",
            "train.optimizer=sgd", "train.lr=1.0", *LORA, *sets]


def _train(args, out, nproc, steps, *sets, drop: tuple[str, ...] = ()):
    extra = ["--nproc-per-node", str(nproc)] if nproc else []
    sets = [*args, f"output_dir={out}", f"train.steps={steps}", *sets]
    done = run_cli("train", *[a for s in sets for a in ("--set", s)], *extra, drop=drop)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def peft_reference(model_dirs, args, steps: int, dtype=torch.float32) -> list[float]:
    """peft + plain transformers on one process, whole batches, SGD, from the same initial adapters (fp32 ones
    over a base of `dtype`, as peft keeps them)."""
    from peft import LoraConfig, get_peft_model

    cfg = config.load(None, args)
    _, weights, _ = build_for(cfg)  # the adapters' initial values, as the run draws them from train.seed
    base = AutoModelForCausalLM.from_pretrained(model_dirs.llama, attn_implementation="eager", use_cache=False,
                                                dtype=dtype)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                            use_dora=cfg.model.lora.use_dora))
    # DoRA's magnitudes are peft's own, computed from the base it holds: the run derives its own on the device.
    adapters = {f"base_model.model.{k}": v for k, v in weights.fresh.items() if ".lora_magnitude_vector." not in k}
    assert not model.load_state_dict(adapters, strict=False).unexpected_keys
    return sgd_losses(model, build(cfg, base.config, str(model_dirs.llama)).train, cfg.train.lr, steps)


def test_xla_fsdp_refuses_lora_naming_key_and_backend():
    cfg = config.load(None, ["backend=xla_fsdp", "cpu_devices=1", *LORA])
    with pytest.raises(ConfigError) as raised:
        backends.create(cfg)
    assert (raised.value.key, raised.value.backend) == ("model.lora", "xla_fsdp")
    assert "one requires_grad" in str(raised.value)


def test_adapters_are_all_that_trains_and_the_base_is_read_under_its_stored_names(model_dirs):
    cfg = config.load(None, [f"model.name={model_dirs.llama}", *LORA, "model.lora.target_modules=[q_proj, v_proj]"])
    model, weights, _ = build_for(cfg)
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trained == sorted(weights.fresh) and len(trained) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert weights.names["model.layers.0.self_attn.q_proj.base_layer.weight"].endswith(
        "model.layers.0.self_attn.q_proj.weight")
    assert all(torch.count_nonzero(v) == 0 for n, v in weights.fresh.items() if ".lora_B." in n)
    _, again, _ = build_for(cfg)
    assert all(torch.equal(v, again.fresh[n]) for n, v in weights.fresh.items())  # from train.seed


def test_dora_adds_a_magnitude_per_row_derived_from_the_base_after_it_is_loaded(model_dirs):
    """DoRA trains LoRA's matrices plus a magnitude per output row; until the base is in place it has no value
    (NaN, so a path that forgot to derive it cannot train quietly), then each is its row's norm in the base."""
    from xla_shard.methods import adapter_for

    sets = [f"model.name={model_dirs.llama}", *LORA, "model.lora.target_modules=[q_proj, down_proj]",
            "model.lora.use_dora=true"]
    cfg = config.load(None, sets)
    model, weights, _ = build_for(cfg)
    trained = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
    magnitudes = {n: s for n, s in trained.items() if ".lora_magnitude_vector.default." in n}
    assert set(trained) == set(weights.fresh) and len(magnitudes) == 2 * 2  # 2 layers x (q, down)
    base = dict(AutoModelForCausalLM.from_pretrained(model_dirs.llama).named_parameters())
    for name, shape in magnitudes.items():
        layer = name.split(".lora_magnitude_vector.")[0]
        assert shape == (base[f"{layer}.weight"].shape[0],) and torch.isnan(weights.fresh[name]).all()
    real, _, _ = build_for(config.load(None, [*sets, "model.init=random"]))
    adapter_for(cfg).derive(real)
    held = dict(real.named_parameters())
    for name in magnitudes:
        layer = name.split(".lora_magnitude_vector.")[0]
        torch.testing.assert_close(held[name], held[f"{layer}.base_layer.weight"].norm(dim=1), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="model.lora.use_dora with fsdp.scan_layers"):
        config.load(None, [*sets, "fsdp.scan_layers=true"])


def test_a_target_the_model_lacks_is_refused_naming_the_key(model_dirs):
    cfg = config.load(None, [f"model.name={model_dirs.llama}", *LORA, "model.lora.target_modules=[qkv_proj]"])
    with pytest.raises(ConfigError) as raised:
        build_for(cfg)
    assert raised.value.key == "model.lora.target_modules" and "qkv_proj" in str(raised.value)


METHODS = {"lora": [], "dora": ["model.lora.use_dora=true"]}  # DoRA: LoRA plus a trained magnitude per row


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(list(BACKENDS)))
def test_lora_and_dora_training_follow_peft_and_plain_transformers(model_dirs, tmp_path, backend):
    """Both in one process. DoRA's magnitudes start from the sharded base's row norms, derived on the device
    after the load; peft computes its own from the base it holds."""
    sets, nproc = runnable(BACKENDS)[backend]
    args = _common(model_dirs, *sets, "train.steps=3")
    got = run_trainings(tmp_path, args, METHODS, nproc=nproc)
    log = (tmp_path / "train_runs.log").read_text()
    assert "LoRA matrices initialised from train.seed" in log and "the rest frozen" in log
    assert "DoRA matrices initialised from train.seed, each magnitude then from its row's norm in the base" in log
    for method, sets in METHODS.items():
        want = peft_reference(model_dirs, [*args, *sets], 3)
        assert [r["loss"] for r in got[method]] == pytest.approx(want, rel=1e-5), (backend, method, got, want)
        assert want[-1] < want[0]
    assert [r["loss"] for r in got["dora"]] != [r["loss"] for r in got["lora"]]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(list(BACKENDS)))
def test_fp32_adapters_over_a_bf16_base_follow_peft(model_dirs, tmp_path, backend):
    """model.lora.base_dtype: bfloat16: the frozen weights are read into bf16 (the log says so), the adapters
    stay fp32 (torch_fsdp shards them as units of their own: FSDP2 wants one dtype per unit), and the losses
    follow peft over a bf16 `from_pretrained` base."""
    sets, nproc = runnable(BACKENDS)[backend]
    args = _common(model_dirs, *sets, "model.lora.base_dtype=bfloat16")
    # XLA's CPU code as users compile it: without LLVM's optimizations (the tests' default) bf16 rounds elsewhere
    log, records = _train(args, tmp_path / "run", nproc, 3, drop=("XLA_FLAGS",))
    assert "F32->BF16" in log
    want = peft_reference(model_dirs, args, 3, dtype=torch.bfloat16)
    # bf16 matmuls (XLA's CPU kernels, other batch splits): measured within 1.0e-5 (xla_spmd), 1e-6 (torch_fsdp)
    assert [r["loss"] for r in records] == pytest.approx(want, rel=2e-5), (backend, [r["loss"] for r in records], want)


@pytest.mark.fsdp2
@pytest.mark.e2e
@pytest.mark.slow
def test_optimizer_state_and_gradients_are_the_adapters_only(model_dirs, tmp_path):
    base = [f"model.name={model_dirs.llama}", "train.seq_len=32", "backend=torch_fsdp", "train.optimizer=adamw"]
    full, adapted = (run["memory"] for run in run_probe(tmp_path / "probe.pt", *base, nproc=2, each=[[], LORA]))
    cfg = config.load(None, [*base, *LORA])
    model, _, _ = build_for(cfg)
    trained = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert adapted["optimizer_unsharded"] == 2 * trained  # AdamW's two moments, adapters only
    assert adapted["grads_unsharded"] == trained
    assert adapted["optimizer"] < full["optimizer"] / 5 and adapted["params"] >= full["params"]


@pytest.mark.fsdp2
@pytest.mark.e2e
@pytest.mark.slow
def test_checkpoints_hold_the_adapters_resume_exactly_and_export_for_peft(model_dirs, moe_dirs, tmp_path, capsys):
    """For LoRA and DoRA, in one process: checkpoints hold only what trains (DoRA's magnitudes too, which a
    resume reads back instead of deriving them again), resume exactly, and export an adapter directory peft
    loads, or with --merge a model whose logits are the adapted model's. A LoRA run on an MoE model (all-linear:
    peft adapts its fused experts too) exports an adapter and a merge that reproduce its logged evaluation."""
    sets, nproc = BACKENDS["torch_fsdp"]
    texts = [" ".join(["the river runs south"] * (i + 1)) for i in range(5)]
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    runs = {}
    for method, extra in METHODS.items():
        ckpt = f"checkpoint.dir={tmp_path / method / 'ckpt'}"
        runs[method] = [*extra, "train.steps=4", f"checkpoint.dir={tmp_path / 'straight' / method}"]
        runs[f"{method}-stopped"] = [*extra, "train.steps=2", ckpt]
        runs[f"{method}-resumed"] = [*extra, "train.steps=4", ckpt]
    runs["moe"] = [f"model.name={moe_dirs['mixtral']}", "train.steps=2", f"data.eval_path={held_out}",
                   "data.packing=false", f"checkpoint.dir={tmp_path / 'moe' / 'ckpt'}"]
    got = run_trainings(tmp_path, _common(model_dirs, *sets, "checkpoint.every_steps=2"), runs, nproc=nproc)
    assert "resumed the trained parameters" in (tmp_path / "train_runs.log").read_text()
    for method in METHODS:
        straight = [(r["step"], r["loss"]) for r in got[method]]
        assert [(r["step"], r["loss"]) for r in got[f"{method}-stopped"] + got[f"{method}-resumed"]] == straight
        _exports_load_in_peft(model_dirs.llama, tmp_path / "straight" / method / "step-00000004",
                              tmp_path / method, capsys)
    (evaluation,) = [r for r in got["moe"] if "eval_loss" in r]
    adapter, merged = _exports_load_in_peft(moe_dirs["mixtral"], tmp_path / "moe" / "ckpt" / "step-00000002",
                                            tmp_path / "moe", capsys)
    for model in (adapter, merged):
        assert _loss(model, moe_dirs["mixtral"], texts) == pytest.approx(evaluation["eval_loss"], rel=1e-5)


def _loss(model, directory, texts: list[str]) -> float:
    """Causal-LM loss over every real token of `texts` at once, each row padded to 32 tokens, as evaluation takes
    it."""
    from transformers import AutoTokenizer

    encoded = AutoTokenizer.from_pretrained(directory)(texts, truncation=True, max_length=32,
                                                       padding="max_length", return_tensors="pt")
    labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
    with torch.no_grad():
        return model(**encoded, labels=labels).loss.item()


def _exports_load_in_peft(base_dir, checkpoint, out, capsys):
    """Export `checkpoint` as an adapter and as a merge; both checked against peft over `base_dir`, and returned
    as (the adapted PeftModel, the merged model)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    manifest = json.loads((checkpoint / "manifest.json").read_text())
    model_tensors = sorted(n for n in manifest["tensors"] if n.startswith("model/"))
    assert model_tensors and all(".lora_" in n for n in model_tensors)

    done = run_in_process(capsys, "ckpt", "export", str(checkpoint), "--to", str(out / "adapter"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in (out / "adapter").iterdir()) >= ["adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    ids = torch.randint(3, min(300, base.config.vocab_size), (2, 16))
    with torch.no_grad():
        plain = base(input_ids=ids).logits
    loaded = PeftModel.from_pretrained(base, out / "adapter").eval()
    stored = load_file(out / "adapter" / "adapter_model.safetensors")
    state = loaded.state_dict()
    assert len(stored) == len(model_tensors)
    for key, value in stored.items():
        name = key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        name = name.replace(".lora_magnitude_vector", ".lora_magnitude_vector.default.weight")
        assert torch.equal(state[name], value), key
    with torch.no_grad():
        adapted = loaded(input_ids=ids).logits
    assert not torch.allclose(adapted, plain)  # trained adapters change the outputs

    merged_dir = out / "merged"
    done = run_in_process(capsys, "ckpt", "export", str(checkpoint), "--to", str(merged_dir), "--merge")
    assert done.returncode == 0, done.stderr[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, rtol=1e-5, atol=1e-5)
    assert (merged_dir / "tokenizer.json").exists()
    return loaded, merged


def _moe_lora_checkpoint(base, directory, *sets) -> tuple[torch.nn.Module, Path]:
    """A LoRA checkpoint of the MoE model at `base` as a run writes it, its adapters random (a trained run's are
    not zero): (the adapted model it holds, the step directory)."""
    from conftest import in_process_checkpointer

    from xla_shard.methods import adapter_for

    sets = [f"model.name={base}", *LORA, *sets]
    adapter = adapter_for(config.load(None, sets))
    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    adapter.materialize(model, adapter.inject(model, "causal_lm", seed=0))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn_like(param) * 0.1)
    ckpt = in_process_checkpointer(directory, *sets)
    ckpt.trained_only = True
    ckpt.restore(model, None)
    ckpt.save(1, model, None)
    return model, directory / "step-00000001"


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_moe_lora_exports_an_adapter_peft_loads_and_merges_as_peft_merges(moe_dirs, tmp_path, family):
    """all-linear on transformers 5's fused experts: peft adapts each stacked parameter (a rank-r pair per expert
    side by side; gate and up fused, twice the rank). The adapter loads in peft to the held model's logits, and
    the merge, written one tensor per expert as the base stores them, is peft's own merge."""
    from peft import PeftModel

    from xla_shard.checkpoint.export import export

    model, step = _moe_lora_checkpoint(moe_dirs[family], tmp_path / "ckpt")
    export(str(step), str(tmp_path / "adapter"))
    export(str(step), str(tmp_path / "merged"), merge=True)
    ids = torch.randint(3, 200, (2, 12))
    with torch.no_grad():
        held = model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(moe_dirs[family], attn_implementation="eager").eval()
        plain, before = base(input_ids=ids).logits, {n: v.clone() for n, v in base.state_dict().items()}
        peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        torch.testing.assert_close(peft(input_ids=ids).logits, held, rtol=1e-5, atol=1e-5)
        peft_merged = peft.merge_and_unload().state_dict()
        stored = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert not torch.allclose(held, plain, atol=1e-3)
    assert stored.keys() == peft_merged.keys()
    for name, value in peft_merged.items():
        torch.testing.assert_close(stored[name], value, rtol=1e-6, atol=1e-6, msg=name)
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    # all-linear adapts fused experts in the families peft converts (Qwen2-MoE's from peft 0.22; before it, only
    # its attention and shared expert): where they are adapted, the merge moves them
    adapted = any(".mlp.experts." in name and ".lora_" in name for name, _ in model.named_parameters())
    assert adapted or family == "qwen2_moe"
    assert torch.equal(stored[experts], before[experts]) != adapted


@pytest.mark.parametrize("setting, key", [("model.lora.use_dora=true", "model.lora.use_dora"),
                                          ("model.lora.dropout=0.05", "model.lora.dropout")])
def test_what_peft_cannot_do_on_stacked_experts_is_refused_naming_the_key_and_the_remedy(moe_dirs, setting, key):
    with pytest.raises(ConfigError) as refused:
        build_for(config.load(None, [f"model.name={moe_dirs['mixtral']}", *LORA, setting]))
    assert refused.value.key == key and "target_modules" in str(refused.value)
    # the remedy works: the linear layers alone
    model, _, _ = build_for(config.load(None, [f"model.name={moe_dirs['mixtral']}", *LORA, setting,
                                               "model.lora.target_modules=[q_proj, v_proj]"]))
    assert not any(".experts." in n for n, p in model.named_parameters() if p.requires_grad)


def test_a_tampered_moe_adapter_rank_is_refused(moe_dirs, tmp_path):
    """The manifest's check learns peft's layouts, it is not loosened: another rank matches none of them."""
    from xla_shard.checkpoint.export import export

    _, step = _moe_lora_checkpoint(moe_dirs["mixtral"], tmp_path / "ckpt")
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["config"]["model"]["lora"]["r"] = 8  # the experts' gate_up adapter holds 2 x 4 per expert
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="rank-8"):
        export(str(step), str(tmp_path / "out"))


def test_a_classifier_head_is_trained_whole_beside_the_adapters(model_dirs):
    cfg = config.load(None, [f"model.name={model_dirs.bert}", "model.task=sequence_classification", *LORA])
    model, weights, _ = build_for(cfg)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"classifier.modules_to_save.default.weight", "classifier.modules_to_save.default.bias"} <= trained
    # both copies of the head come from the file: the frozen original and the trained one
    assert weights.names["classifier.original_module.weight"] == weights.names[
        "classifier.modules_to_save.default.weight"] == "model/classifier.weight"


@pytest.mark.fsdp2
@pytest.mark.e2e
@pytest.mark.slow
def test_a_lora_classifier_exports_an_adapter_peft_loads_with_its_head(model_dirs, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "run"
    sets = [f"model.name={model_dirs.bert}", "model.task=sequence_classification", *LORA, "backend=torch_fsdp",
            f"data.path={FIXTURES / 'nli.csv'}", "data.text_fields=[premise, hypothesis]", "train.seq_len=32",
            "train.steps=2", "train.lr=0.01", f"output_dir={out}", f"checkpoint.dir={out}/ckpt"]
    done = run_cli("train", *[a for s in sets for a in ("--set", s)], "--nproc-per-node", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "classifier trained whole" in done.stderr
    assert "OMP_NUM_THREADS" not in done.stderr  # torchrun's banner: its default is set without it
    assert "[Gloo]" not in done.stdout + done.stderr  # torch 2.9's gloo: a line per process as the group forms
    adapter = tmp_path / "adapter"
    done = run_in_process(capsys, "ckpt", "export", str(out / "ckpt"), "--to", str(adapter))
    assert done.returncode == 0, done.stderr[-2000:]
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["task_type"] == "SEQ_CLS" and saved["modules_to_save"] == ["classifier"]
    base = AutoModelForSequenceClassification.from_pretrained(model_dirs.bert)
    head = base.classifier.weight.detach().clone()
    loaded = PeftModel.from_pretrained(base, adapter)
    trained = loaded.base_model.model.classifier.modules_to_save["default"].weight
    assert not torch.equal(trained, head)  # the trained head, not the stored one
    from safetensors.torch import load_file

    assert torch.equal(trained, load_file(adapter / "adapter_model.safetensors")["base_model.model.classifier.weight"])
