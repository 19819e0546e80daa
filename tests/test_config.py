"""The config schema, `--set` overrides, importers, and the one-line errors users see."""

import enum
import json
import subprocess
import typing

import pytest
import yaml
from conftest import FIXTURES, run_in_process
from pydantic_core import PydanticUndefined

from xla_shard import config
from xla_shard.cli import main
from xla_shard.config.schema import ShardingStrategy
from xla_shard.errors import ConfigError


def test_defaults_and_overrides_keep_their_types():
    cfg = config.load(None, ["train.steps=3", "fsdp.activation_checkpointing=true", "model=tiny-gpt2",
                             "fsdp.transformer_layer_cls_to_wrap=[GPT2Block]", "train.lr=0.5"])
    assert cfg.train.steps == 3 and cfg.train.lr == 0.5
    assert cfg.fsdp.activation_checkpointing is True
    assert cfg.model.name == "tiny-gpt2"
    assert cfg.fsdp.transformer_layer_cls_to_wrap == ["GPT2Block"]


@pytest.mark.parametrize("spelling, expected", [
    (1, "FULL_SHARD"), ("2", "SHARD_GRAD_OP"), (3, "NO_SHARD"), ("hybrid_shard", "HYBRID_SHARD"),
    (5, "HYBRID_SHARD_ZERO2"), ("full shard", "FULL_SHARD")])
def test_strategy_spellings(spelling, expected):
    cfg = config.validate({"fsdp": {"sharding_strategy": spelling}})
    assert cfg.fsdp.sharding_strategy is ShardingStrategy[expected]


def test_comma_separated_layer_classes_like_accelerate():
    cfg = config.validate({"fsdp": {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer, LlamaMLP"}})
    assert cfg.fsdp.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer", "LlamaMLP"]


@pytest.mark.parametrize("raw, key, words", [
    ({"fsdp": {"sharding_stratgy": 1}}, "fsdp.sharding_stratgy", "did you mean 'fsdp.sharding_strategy'"),
    ({"trian": {}}, "trian", "did you mean 'train'"),
    ({"train": {"steps": "many"}}, "train.steps", "valid integer"),
    ({"fsdp": {"sharding_strategy": 9}}, "fsdp.sharding_strategy", "1-5"),
    ({"fsdp": {"sharding_strategy": "SHARD_EVERYTHING"}}, "fsdp.sharding_strategy", "FULL_SHARD"),
    ({"backend": "tpu_magic"}, "backend", "xla_spmd"),
    ({"mesh": {"fsdp": 0}}, "mesh.fsdp", "positive"),
    ({"train": {"optimizer": "lamb"}}, "train.optimizer", "sgd"),
])
def test_bad_values_name_the_key(raw, key, words):
    with pytest.raises(ConfigError) as err:
        config.validate(raw)
    assert err.value.key == key
    assert words in str(err.value)


@pytest.mark.parametrize("raw, key, words", [
    # The Trainer's, TRL's and peft's names for a key of ours get that key, not the nearest spelling.
    ({"train": {"max_steps": 3}}, "train.max_steps", "the Trainer's max_steps is 'train.steps'"),
    ({"train": {"learning_rate": 1e-4}}, "train.learning_rate", "'train.lr'"),
    ({"train": {"per_device_train_batch_size": 4}}, "train.per_device_train_batch_size",
     "'train.global_batch_size' here, which counts all rows of a step"),
    ({"max_seq_length": 512}, "max_seq_length", "TRL's max_seq_length is 'train.seq_len'"),
    ({"model": {"lora": {"lora_alpha": 16}}}, "model.lora.lora_alpha", "peft's lora_alpha is 'model.lora.alpha'"),
    ({"model": {"lora": {"lora_dropout": 0.1}}}, "model.lora.lora_dropout", "'model.lora.dropout'"),
    # A keyword in another case would be read as a directory of that name.
    ({"checkpoint": {"resume": "Auto"}}, "checkpoint.resume", "the keywords are auto and never, in lower case"),
])
def test_names_from_the_trainer_trl_and_peft_point_at_ours(raw, key, words):
    with pytest.raises(ConfigError) as err:
        config.validate(raw)
    assert err.value.key == key and words in str(err.value), str(err.value)
    assert "did you mean" not in str(err.value)


def test_a_resume_that_is_no_checkpoint_names_the_key(tmp_path):
    from xla_shard.checkpoint import Checkpointer

    cfg = config.load(None, [f"checkpoint.dir={tmp_path / 'ckpt'}", f"checkpoint.resume={tmp_path / 'nothing'}",
                             f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        Checkpointer(cfg.checkpoint, None).restore(None, None)
    assert err.value.key == "checkpoint.resume" and "is not a committed checkpoint" in str(err.value)


def test_replica_axis_needs_a_hybrid_strategy():
    with pytest.raises(ConfigError, match="mesh.replica=2 needs fsdp.sharding_strategy HYBRID_SHARD"):
        config.validate({"mesh": {"replica": 2}})


def test_mesh_must_divide_devices():
    assert config.validate({"mesh": {"replica": 2}, "fsdp": {"sharding_strategy": 4}}).mesh.resolve(8) == (2, 4)
    with pytest.raises(ValueError, match="does not divide the 6 devices"):
        config.validate({"mesh": {"replica": 4}, "fsdp": {"sharding_strategy": 4}}).mesh.resolve(6)
    with pytest.raises(ValueError, match="3 x 3 = 9"):
        config.validate({"mesh": {"replica": 3, "fsdp": 3}, "fsdp": {"sharding_strategy": 4}}).mesh.resolve(6)


def _seed_guide(tmp_path, extra: str = ""):
    path = tmp_path / "accelerate.yaml"
    path.write_text((FIXTURES / "accelerate_fsdp_guide.yaml").read_text() + extra)
    return path


def test_accelerate_yaml_from_the_guide_as_printed(tmp_path):
    raw = config.read_raw(_seed_guide(tmp_path))
    native, kind, notes = config.to_native(raw)
    cfg = config.validate(native)
    assert kind == "accelerate"
    assert cfg.backend.value == "torch_fsdp"
    assert cfg.fsdp.sharding_strategy is ShardingStrategy.FULL_SHARD
    assert cfg.fsdp.auto_wrap_policy.value == "TRANSFORMER_BASED_WRAP"
    assert cfg.fsdp.transformer_layer_cls_to_wrap == ["BertLayer"]
    assert cfg.fsdp.offload_params is True
    assert cfg.fsdp.state_dict_type == "SHARDED_STATE_DICT"
    assert cfg.fsdp.mixed_precision == "bf16"
    # FSDP1 knobs with no key here are reported, not dropped.
    assert any(n.startswith("fsdp_backward_prefetch_policy") for n in notes)
    assert any(n.startswith("fsdp_use_orig_params") for n in notes)


def test_accelerate_yaml_with_the_guides_tpu_lines(tmp_path):
    extra = (FIXTURES / "accelerate_tpu_lines.yaml").read_text()
    cfg = config.validate(config.to_native(config.read_raw(_seed_guide(tmp_path, extra)))[0])
    assert cfg.backend.value == "xla_fsdp"
    assert cfg.fsdp.activation_checkpointing is True
    assert cfg.fsdp.xla_settings == {}


def test_accelerate_yaml_nested_as_accelerate_writes_it(tmp_path):
    flat = yaml.safe_load(_seed_guide(tmp_path).read_text())
    nested = {k: v for k, v in flat.items() if not k.startswith("fsdp_")}
    nested["fsdp_config"] = {k: v for k, v in flat.items() if k.startswith("fsdp_") and k != "fsdp_config"}
    nested["fsdp_config"]["fsdp_sharding_strategy"] = 2
    cfg = config.validate(config.to_native(nested)[0])
    assert cfg.fsdp.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert cfg.fsdp.transformer_layer_cls_to_wrap == ["BertLayer"]


def test_accelerate_yaml_that_is_not_fsdp_is_refused():
    with pytest.raises(ConfigError, match="distributed_type.*MULTI_GPU"):
        config.to_native({"distributed_type": "MULTI_GPU", "fsdp_config": {}})


def test_transformers_fsdp_config_v2():
    raw = json.loads((FIXTURES / "transformers_fsdp_config.json").read_text())
    native, kind, _ = config.to_native(raw)
    cfg = config.validate(native)
    assert kind == "transformers fsdp_config"
    assert cfg.backend.value == "xla_spmd"
    assert cfg.fsdp.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    assert cfg.fsdp.activation_checkpointing is True


def test_transformers_fsdp_config_v1_size_based():
    raw = json.loads((FIXTURES / "transformers_fsdp_config_v1.json").read_text())
    cfg = config.validate(config.to_native(raw)[0])
    assert cfg.backend.value == "xla_fsdp"
    assert cfg.fsdp.auto_wrap_policy.value == "SIZE_BASED_WRAP"
    assert cfg.fsdp.min_num_params == 20000
    assert cfg.fsdp.xla_settings == {"flatten_parameters": False}


def test_transformers_fsdp_config_unknown_key():
    with pytest.raises(ConfigError) as err:
        config.to_native({"xla": True, "xla_fsdp_grad_ckpt": True, "shard_everything": 1})
    assert err.value.key == "shard_everything"


# ---- the CLI, as users meet it ----------------------------------------------------------------------

def _one_line_error(done, *words):
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_cli_config_import_round_trips(capsys, tmp_path):
    out = tmp_path / "native.yaml"
    done = run_in_process(capsys, "config", "import", str(FIXTURES / "transformers_fsdp_config.json"), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "imported from transformers fsdp_config" in done.stderr
    assert config.load(out).backend.value == "xla_spmd"


@pytest.mark.e2e
def test_cli_config_check_prints_every_default(cli, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: tiny-llama\nbackend: torch_fsdp\n")
    done = cli("config", "check", str(path), "--set", "train.steps=2")
    assert done.returncode == 0 and done.stdout == "", done.stderr
    assert done.stderr.strip().splitlines()[-1] == (f"xla-shard: {path} with --set: valid, for backend torch_fsdp "
                                                    "on 4 cpu device(s) (--print shows it with every default "
                                                    "filled in)")
    done = cli("config", "check", str(path), "--set", "train.steps=2", "--print")
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)
    assert printed["train"]["steps"] == 2
    assert printed["fsdp"]["sharding_strategy"] == "FULL_SHARD"


@pytest.mark.parametrize("sets, words", [
    (["fsdp.sharding_stratgy=1"], ["fsdp.sharding_stratgy", "did you mean"]),
    (["train.steps=abc"], ["train.steps"]),
    (["backend=xla_spmd", "fsdp.sharding_strategy=SHARD_GRAD_OP"], ["fsdp.sharding_strategy", "backend xla_spmd"]),
    (["backend=xla_fsdp", "fsdp.offload_params=true"], ["fsdp.offload_params", "backend xla_fsdp"]),
    (["backend=torch_fsdp", "fsdp.mixed_precision=fp16"], ["fsdp.mixed_precision", "backend torch_fsdp"]),
    (["backend=torch_fsdp", "fsdp.xla_settings={flatten_parameters: false}"], ["fsdp.xla_settings"]),
    pytest.param(["backend=xla_fsdp", "cpu_devices=1", "fsdp.xla_settings={no_such_arg: 1}"],
                 ["fsdp.xla_settings.no_such_arg"], marks=pytest.mark.xla),  # read from torch_xla's signature
    (["backend=torch_fsdp", "fsdp.scan_layers=true"], ["fsdp.scan_layers", "backend torch_fsdp", "xla_spmd"]),
    (["backend=xla_fsdp", "fsdp.scan_layers=true"], ["fsdp.scan_layers", "backend xla_fsdp", "hooks"]),
    (["fsdp.transformer_layer_cls_to_wrap=[BertLayer]"], ["fsdp.transformer_layer_cls_to_wrap", "BertLayer",
                                                           "LlamaDecoderLayer"]),
    (["model=no-such-model"], ["model.name", "no-such-model"]),
    (["data.path=/nonexistent/corpus.txt"], ["data.path", "/nonexistent/corpus.txt"]),
    (["train.data=corpus.txt"], ["train", "data.path"]),
    (["train.warmup_steps=3"], ["train", "recompile_warmup_steps", "lr_warmup_steps"]),
    (["output_dir=gs://"], ["output_dir", "names no bucket"]),  # else a local folder called `gs:`
    (["checkpoint.dir=gs:///run"], ["checkpoint.dir", "names no bucket"]),
    (["output_dir=gs:/bucket/run"], ["output_dir", "two slashes: gs://bucket/run"]),  # one slash: a folder too
    # a union's value: the key as written, and what each member takes (not `train.loss_chunks.literal['auto']`)
    (["train.loss_chunks=2.5"], ["config key 'train.loss_chunks':", "'auto' or a valid integer", "got 2.5"]),
    (["checkpoint.dir=s3:bucket"], ["checkpoint.dir", "two slashes: s3://bucket"]),
])
def test_cli_bad_config_is_one_line_exit_2(capsys, sets, words):
    args = ["config", "check", str(FIXTURES / "transformers_fsdp_config.json")]
    for item in sets:
        args += ["--set", item]
    code = main(args)  # in-process for speed; the subprocess tests below cover the real entry point
    _one_line_error(subprocess.CompletedProcess(args, code, "", capsys.readouterr().err), *words)


@pytest.mark.e2e
def test_cli_missing_file(cli):
    _one_line_error(cli("train", "/nonexistent/config.yaml"), "/nonexistent/config.yaml")


@pytest.mark.e2e
def test_cli_guide_yaml_on_xla_refuses_offload(cli, tmp_path):
    path = _seed_guide(tmp_path, (FIXTURES / "accelerate_tpu_lines.yaml").read_text())
    _one_line_error(cli("config", "check", str(path)), "fsdp.offload_params", "xla_fsdp")


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_train_mesh_that_does_not_divide_the_devices(cli):
    done = cli("train", "--set", "backend=xla_spmd", "--set", "cpu_devices=4", "--set", "fsdp.sharding_strategy=4",
               "--set", "mesh.replica=3")
    _one_line_error(done, "'mesh'", "xla_spmd", "does not divide the 4 devices")


@pytest.mark.e2e
@pytest.mark.parametrize("args, words", [
    # Checked by the launcher, before torchrun prints anything: 8 rows over 3 processes, a 2 x 2 mesh over 3.
    (["--nproc-per-node", "3", "--set", "backend=torch_fsdp"], ["train.global_batch_size", "3 torchrun processes"]),
    (["--nproc-per-node", "3", "--set", "backend=torch_fsdp", "--set", "train.global_batch_size=6", "--set",
      "fsdp.sharding_strategy=HYBRID_SHARD", "--set", "mesh.replica=2"], ["'mesh'", "torch_fsdp", "3 devices"]),
    # Not torchrun's backend: refused, not ignored.
    (["--nproc-per-node", "2", "--set", "backend=xla_spmd"], ["--nproc-per-node", "xla_spmd"]),
])
def test_cli_train_launcher_checks_the_process_count_before_anything_starts(cli, args, words):
    done = cli("train", *args)
    _one_line_error(done, *words)
    assert "torch.distributed" not in done.stderr and "W1122" not in done.stderr


def _leaf_keys(section: type, prefix: str = ""):
    """(dotted key, pydantic field) of every leaf of the schema, sections that may be null included."""
    from pydantic import BaseModel

    for name, field in section.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        kinds = typing.get_args(field.annotation) or (field.annotation,)
        inner = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if inner is not None:
            yield from _leaf_keys(inner, key + ".")
        yield key, field


def _other_values(field) -> list:
    """Values of a field's type other than its default, as a user would write them."""
    default = None if field.default is PydanticUndefined else field.default
    annotation = field.annotation
    found = []
    kinds = [annotation] if typing.get_origin(annotation) is typing.Literal else \
        typing.get_args(annotation) or (annotation,)
    for kind in kinds:
        if typing.get_origin(kind) is typing.Literal:
            found += list(typing.get_args(kind))
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            found += [member.value for member in kind]
        elif kind is bool:
            found += [True, False]
        elif kind is int:
            found += [1, 2, 4] + ([default + 1, default * 2] if isinstance(default, int) else [])
        elif kind is float:
            found += [0.5, 2.0] + ([default * 2] if isinstance(default, float) and default else [])
        elif kind is str:
            found += ["my-run-1", "gs://my-bucket/run"]
    return [v for v in dict.fromkeys(found) if v != getattr(default, "value", default)]


def test_a_settled_config_validates_again_as_itself_for_every_key():
    """What a launcher settles and hands its workers (`config.load.dump`), and what `config check` prints, is a
    config: for every key of the schema set to each other value it takes (where that config is valid), the
    dump validates again to the same config. (train.epochs used to fail here on torch_fsdp's workers: the dump
    set train.steps too.)"""
    from xla_shard.config.load import dump, validate
    from xla_shard.config.schema import ShardConfig

    bases = [[], ["model.lora.r=4"], ["fsdp.sharding_strategy=HYBRID_SHARD"],
             ["method=dpo", "data.kind=preference", f"data.path={FIXTURES / 'preference.jsonl'}"],
             ["method=grpo", "data.kind=prompt", f"data.path={FIXTURES / 'prompts.jsonl'}", "train.seq_len=512",
              f"grpo.reward_funcs=[{FIXTURES / 'rewards.py'}:short]", "grpo.num_generations=4"]]
    tried, keys = 0, set()
    for key, field in _leaf_keys(ShardConfig):
        for value in _other_values(field):
            for base in bases:  # the first context in which the value is valid
                try:
                    cfg = config.load(None, ["model.name=tiny-llama", *base, f"{key}={json.dumps(value)}"])
                except ConfigError:
                    continue
                again = validate(yaml.load(dump(cfg), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
                assert again.model_dump() == cfg.model_dump(), (key, value)
                tried, keys = tried + 1, keys | {key}
                break
    assert len(keys) > 100 and tried > 200, (len(keys), tried)
    assert {"dpo.beta", "grpo.beta", "grpo.top_k"} <= keys


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_a_dumped_config_holds_the_runs_method_section_alone_after_the_data(method):
    from xla_shard.config.load import dump

    kind, data = {"sft": ("text", "synthetic"), "dpo": ("preference", FIXTURES / "preference.jsonl")}[method]
    keys = list(yaml.safe_load(dump(config.load(None, [f"method={method}", f"data.kind={kind}", f"data.path={data}"]))))
    sections = [name for name in keys if name in ("dpo", "grpo")]
    assert sections == ([] if method == "sft" else [method])
    assert method == "sft" or keys[keys.index("data") + 1] == method
