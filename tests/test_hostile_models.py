"""What passes `config check` runs, and nothing stored or configured is silently ignored: stored experts beyond
the model's or spelled twice, LoRA modules to save that name nothing, ranks above a layer's side, a tied head
adapted, scanned layers that run dropout; and `plan` sees LoRA."""

import pytest
import torch
from model_dirs import moe_dir

from xla_shard import backends, config, planner
from xla_shard.errors import ConfigError
from xla_shard.pretrained import build_for
from xla_shard.train import preflight


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory):
    return moe_dir(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


def _edited(source, target, edit):
    from safetensors.torch import load_file, save_file

    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def _copy(source: str, target: str):
    """An edit that stores tensor `source` again as `target`."""
    return lambda tensors: tensors.update({target: tensors[source].clone()})


@pytest.mark.parametrize("edit, problem", [
    (_copy("model.layers.1.mlp.experts.0.up_proj.weight", "model.layers.1.mlp.experts.4.up_proj.weight"),
     "stores expert 4"),
    (_copy("model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.99999999999.gate_proj.weight"),
     "stores expert 99999999999"),
    (_copy("model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.0.mlp.experts.03.down_proj.weight"),
     "are both expert 3"),
], ids=["expert-4-of-4", "absurd-expert", "duplicate-spelling"])
def test_stored_experts_the_model_has_no_place_for_are_refused(qwen_moe, tmp_path, edit, problem):
    broken = _edited(qwen_moe, tmp_path / "broken", edit)
    with pytest.raises(ConfigError, match=problem) as refused:
        build_for(config.load(None, [f"model.name={broken}"]))
    assert refused.value.key == "model.name"


def _check(*sets):
    """What `config check` runs on a config: its preflight, against the backend's capabilities (the backend's
    runtime is not started: on xla_spmd that alone took seconds of a unit test)."""
    cfg = config.load(None, list(sets))
    preflight(cfg, backends.capabilities(cfg.backend))


@pytest.mark.parametrize("sets, key, problem", [
    (["model.lora.modules_to_save=[scorer]"], "model.lora.modules_to_save", "'scorer' names no module"),
    (["model.lora.r=100000"], "model.lora.r", "at most"),
    (["model=tiny-gpt2", "model.lora.target_modules=[lm_head]"], "model.lora.target_modules", "tie_word_embeddings"),
    (["model=tiny-gpt2", "model.lora.modules_to_save=[lm_head]"], "model.lora.modules_to_save", "input embedding"),
])
def test_lora_settings_that_would_do_nothing_or_crash_are_refused_by_config_check(sets, key, problem):
    with pytest.raises(ConfigError, match=problem) as refused:
        _check("backend=torch_fsdp", *sets)
    assert refused.value.key == key


def test_an_absurd_rank_is_refused_before_anything_is_allocated():
    from xla_shard.hostmem import peak_growth

    with peak_growth() as growth, pytest.raises(ConfigError, match="model.lora.r"):
        _check("backend=torch_fsdp", "model.lora.r=1000000000")
    assert growth.bytes < 512 * 2**20


@pytest.mark.parametrize("sets", [
    ["model=tiny-gpt2"],
    ["model=tiny-bert", "model.task=sequence_classification", "model.num_labels=3", "data.path=tests/fixtures/nli.csv"],
])
def test_scanning_layers_that_run_dropout_is_refused_naming_the_settings(sets):
    pytest.importorskip("torch_xla")
    with pytest.raises(ConfigError, match="dropout") as refused:
        _check("backend=xla_spmd", "fsdp.scan_layers=true", *sets)
    assert refused.value.key == "fsdp.scan_layers" and "model.overrides" in str(refused.value)


def test_plan_counts_what_lora_trains_and_lists_only_backends_that_train_it():
    big = ["model=small-llama", "model.overrides={hidden_size: 1024, intermediate_size: 2816, num_hidden_layers: 8, "
           "num_attention_heads: 16, num_key_value_heads: 4}"]
    full, adapted = (config.load(None, big + extra) for extra in ([], ["model.lora.r=8"]))
    caps = backends.capabilities("xla_spmd")
    whole, lora = planner.workload(full, 8, caps), planner.workload(adapted, 8, caps)
    assert lora.params >= whole.params and 0 < lora.trained < whole.params / 50
    triple = planner.Triple(8, 8, 8)
    tpu = planner.accelerator("v5p")
    e_full, e_lora = (planner.estimate(w, triple, 8, tpu, 8) for w in (whole, lora))
    assert e_lora.memory["optimizer"] < e_full.memory["optimizer"] / 50
    assert e_lora.memory["grads"] < e_full.memory["grads"] / 50
    assert "xla_fsdp" in backends.running(triple, 8, full) and "xla_fsdp" not in backends.running(triple, 8, adapted)
    with torch.device("meta"):  # counting allocates nothing: the model stays on meta
        assert lora.flops_per_token < whole.flops_per_token
