"""Importers, proven with the real writers: accelerate's own config class writes the YAML (every FSDP version,
strategy, wrap policy, offload and precision it offers, and the TPU form), transformers' TrainingArguments
writes the training-args JSON and reads the fsdp_config file; each is imported and checked key by key."""

import itertools
import json
import warnings
from pathlib import Path

import pytest

from tests.conftest import run_cli
from xla_shard import config
from xla_shard.cli import main

accelerate = pytest.importorskip("accelerate")
from accelerate.commands.config.config_args import ClusterConfig  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from accelerate.utils.constants import FSDP_AUTO_WRAP_POLICY, FSDP_SHARDING_STRATEGY  # noqa: E402

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]


def _accelerate_yaml(path: Path, *, version, strategy, wrap, offload, precision, distributed=DistributedType.FSDP,
                     processes=2, machines=1) -> Path:
    """What `accelerate config` writes for these answers (its questionnaire, in accelerate's own order)."""
    fsdp = {"fsdp_version": version,
            "fsdp_reshard_after_forward": strategy if version == 1 else strategy == "FULL_SHARD",
            "fsdp_offload_params": offload, "fsdp_auto_wrap_policy": wrap}
    if wrap == FSDP_AUTO_WRAP_POLICY[0]:
        fsdp["fsdp_transformer_layer_cls_to_wrap"] = "LlamaDecoderLayer"
    elif wrap == FSDP_AUTO_WRAP_POLICY[1]:
        fsdp["fsdp_min_num_params"] = 100000
    if version == 1:
        fsdp.update(fsdp_backward_prefetch="BACKWARD_PRE", fsdp_forward_prefetch=False, fsdp_use_orig_params=True)
    fsdp.update(fsdp_state_dict_type="SHARDED_STATE_DICT", fsdp_cpu_ram_efficient_loading=True,
                fsdp_sync_module_states=True, fsdp_activation_checkpointing=True)
    ClusterConfig(compute_environment="LOCAL_MACHINE", distributed_type=distributed, mixed_precision=precision,
                  use_cpu=False, debug=False, num_processes=processes, num_machines=machines, machine_rank=0,
                  main_training_function="main", rdzv_backend="static", same_network=True, downcast_bf16="no",
                  tpu_env=[], tpu_use_cluster=False, tpu_use_sudo=False,
                  fsdp_config=fsdp if distributed == DistributedType.FSDP else {}).to_yaml_file(path)
    return path


ACCELERATE_CASES = [dict(version=v, strategy=s, wrap=w, offload=o, precision=p)
                    for v, s, w, o, p in itertools.product([1, 2], FSDP_SHARDING_STRATEGY, FSDP_AUTO_WRAP_POLICY,
                                                           [False, True], ["no", "bf16", "fp16"])
                    if v == 1 or s in ("FULL_SHARD", "SHARD_GRAD_OP")]  # FSDP2 asks only reshard yes/no


@pytest.mark.parametrize("case", ACCELERATE_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_every_accelerate_fsdp_answer_imports_key_by_key(tmp_path, case):
    path = _accelerate_yaml(tmp_path / "accelerate.yaml", **case)
    cfg, kind, notes = config.load_with_notes(path)
    assert kind == "accelerate" and cfg.backend.value == "torch_fsdp"
    assert cfg.fsdp.sharding_strategy.value == case["strategy"]
    assert cfg.fsdp.offload_params == case["offload"]
    assert cfg.fsdp.auto_wrap_policy.value == case["wrap"]
    if case["wrap"] == "TRANSFORMER_BASED_WRAP":
        assert cfg.fsdp.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    if case["wrap"] == "SIZE_BASED_WRAP":
        assert cfg.fsdp.min_num_params == 100000
    assert cfg.fsdp.mixed_precision == case["precision"]
    assert cfg.fsdp.activation_checkpointing is True
    assert (cfg.launch.nproc_per_node, cfg.launch.nnodes) == (2, 1)
    written = set(json.loads(json.dumps(__import__("yaml").safe_load(path.read_text()))))
    written |= set(__import__("yaml").safe_load(path.read_text())["fsdp_config"])
    mapped = {"distributed_type", "mixed_precision", "num_processes", "num_machines", "fsdp_config",
              "fsdp_reshard_after_forward", "fsdp_offload_params", "fsdp_auto_wrap_policy", "fsdp_min_num_params",
              "fsdp_transformer_layer_cls_to_wrap", "fsdp_state_dict_type", "fsdp_activation_checkpointing"}
    for key in written - mapped:  # every other key the writer produced is accounted for in a note
        assert any(note.startswith(f"{key}:") or note.startswith(f"{key} ") for note in notes), (key, notes)


def test_accelerate_multi_machine_counts_become_the_launch(tmp_path):
    path = _accelerate_yaml(tmp_path / "a.yaml", version=2, strategy="FULL_SHARD", wrap="NO_WRAP", offload=False,
                            precision="no", processes=16, machines=2)
    cfg = config.load(path)
    assert (cfg.launch.nproc_per_node, cfg.launch.nnodes) == (8, 2)


def test_accelerate_tpu_config_imports_as_an_xla_backend(tmp_path, capsys):
    path = tmp_path / "tpu.yaml"
    ClusterConfig(compute_environment="LOCAL_MACHINE", distributed_type=DistributedType.XLA, mixed_precision="bf16",
                  use_cpu=False, debug=False, num_processes=8, downcast_bf16=False, tpu_env=[], tpu_use_cluster=False,
                  tpu_use_sudo=False, tpu_name="my-tpu", tpu_zone="us-central2-b").to_yaml_file(path)
    cfg, kind, notes = config.load_with_notes(path)
    assert cfg.backend.value == "xla_spmd" and cfg.fsdp.mixed_precision == "bf16"
    assert cfg.launch.nproc_per_node is None  # one process per host drives every device
    assert any(n.startswith("num_processes=8: xla_spmd") for n in notes)
    assert any(n.startswith("tpu_name:") for n in notes) and any(n.startswith("tpu_zone:") for n in notes)
    # `config import` prints each note and the resulting config
    assert main(["config", "import", str(path)]) == 0
    out = capsys.readouterr()
    assert "# imported from accelerate" in out.err and "# note: num_processes=8" in out.err
    assert config.validate(__import__("yaml").safe_load(out.out)).backend.value == "xla_spmd"


def test_accelerate_keys_for_other_engines_are_refused(tmp_path, capsys):
    path = _accelerate_yaml(tmp_path / "a.yaml", version=2, strategy="FULL_SHARD", wrap="NO_WRAP", offload=False,
                            precision="no")
    raw = __import__("yaml").safe_load(path.read_text())
    raw["deepspeed_config"] = {"zero_stage": 3}
    path.write_text(__import__("yaml").safe_dump(raw))
    assert main(["config", "check", str(path)]) == 2
    assert "config key 'deepspeed_config'" in capsys.readouterr().err


# ---- transformers ----------------------------------------------------------------------------------------
def _training_arguments(tmp_path, fsdp, fsdp_config, **extra) -> dict:
    from transformers import TrainingArguments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = TrainingArguments(output_dir=str(tmp_path / "out"), fsdp=fsdp, fsdp_config=fsdp_config, use_cpu=True,
                                 report_to=[], **extra)
    return json.loads(args.to_json_string())


TRANSFORMERS_CASES = [
    ("full_shard auto_wrap", {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
     dict(strategy="FULL_SHARD", wrap="TRANSFORMER_BASED_WRAP", classes=["LlamaDecoderLayer"], backend="torch_fsdp")),
    (["shard_grad_op", "offload"], {"min_num_params": 1000},
     dict(strategy="SHARD_GRAD_OP", wrap="SIZE_BASED_WRAP", offload=True, backend="torch_fsdp")),
    ("hybrid_shard", {"version": 1}, dict(strategy="HYBRID_SHARD", backend="torch_fsdp")),
    (True, {"xla": True, "xla_fsdp_v2": True, "xla_fsdp_grad_ckpt": True},
     dict(strategy="FULL_SHARD", ckpt=True, backend="xla_spmd")),
    (True, {"xla": True, "xla_fsdp_settings": {"flatten_parameters": False}},
     dict(strategy="FULL_SHARD", backend="xla_fsdp", settings={"flatten_parameters": False})),
    (True, {"fsdp_activation_checkpointing": True, "fsdp_reshard_after_forward": False},
     dict(strategy="SHARD_GRAD_OP", ckpt=True, backend="torch_fsdp")),
]


@pytest.mark.parametrize("fsdp, fsdp_config, expect", TRANSFORMERS_CASES)
def test_saved_training_arguments_import_key_by_key(tmp_path, fsdp, fsdp_config, expect):
    saved = _training_arguments(tmp_path, fsdp, fsdp_config, learning_rate=3e-4, seed=7, max_steps=12, bf16=True)
    path = tmp_path / "training_args.json"
    path.write_text(json.dumps(saved))
    cfg, kind, notes = config.load_with_notes(path)
    assert kind == "transformers TrainingArguments"
    assert cfg.backend.value == expect["backend"]
    assert cfg.fsdp.sharding_strategy.value == expect["strategy"]
    assert cfg.fsdp.offload_params == expect.get("offload", False)
    assert cfg.fsdp.activation_checkpointing == expect.get("ckpt", False)
    assert cfg.fsdp.xla_settings == expect.get("settings", {})
    if "wrap" in expect:
        assert cfg.fsdp.auto_wrap_policy.value == expect["wrap"]
    if "classes" in expect:
        assert cfg.fsdp.transformer_layer_cls_to_wrap == expect["classes"]
    assert (cfg.train.lr, cfg.train.seed, cfg.train.steps, cfg.fsdp.mixed_precision) == (3e-4, 7, 12, "bf16")
    assert cfg.output_dir == saved["output_dir"]
    ignored = next(n for n in notes if "TrainingArguments that are not FSDP settings" in n)
    assert "per_device_train_batch_size" in ignored and "learning_rate" not in ignored


def test_the_trainer_settings_of_training_arguments_come_along(tmp_path):
    saved = _training_arguments(tmp_path, "full_shard", {}, max_steps=20, lr_scheduler_type="cosine",
                                warmup_steps=0.1, max_grad_norm=0.5, gradient_accumulation_steps=2,
                                eval_strategy="steps", eval_steps=5)
    path = tmp_path / "training_args.json"
    path.write_text(json.dumps(saved))
    cfg, _, notes = config.load_with_notes(path)
    train = cfg.train
    assert (train.lr_schedule, train.lr_warmup_steps, train.max_grad_norm, train.grad_accum_steps) == \
        ("cosine", 2, 0.5, 2)
    assert any("warmup_steps 0.1 x max_steps 20" in n for n in notes)
    assert any("train.eval_every=5" in n for n in notes) and train.eval_every is None
    for kwargs in ({"min_lr_rate": 0.1}, {"min_lr": 1e-5}):  # transformers' cosine to a floor, either way given
        floored = _training_arguments(tmp_path, "full_shard", {}, max_steps=20, learning_rate=1e-4,
                                      lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs=kwargs)
        path.write_text(json.dumps(floored))
        train = config.load(path).train
        assert (train.lr_schedule, train.lr_min_ratio) == ("cosine", pytest.approx(0.1))
    epochs = _training_arguments(tmp_path, "full_shard", {}, num_train_epochs=2.5, warmup_steps=0.1)
    path.write_text(json.dumps(epochs))
    cfg, _, notes = config.load_with_notes(path)
    assert cfg.train.epochs == 2.5 and cfg.train.lr_warmup_steps == 0
    assert any("warmup_steps 0.1: not imported" in n for n in notes)


def test_the_fsdp_config_file_transformers_reads_imports_the_same(tmp_path):
    """The file given to --fsdp_config: transformers reads it (proving it is valid), and so do we."""
    path = tmp_path / "fsdp_config.json"
    path.write_text(json.dumps({"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "fsdp_xla": True,
                                "fsdp_xla_fsdp_v2": True, "fsdp_xla_fsdp_grad_ckpt": True}))
    saved = _training_arguments(tmp_path, True, str(path))
    assert saved["fsdp_config"]["xla_fsdp_v2"] is True  # transformers read our file
    cfg = config.load(path)
    assert cfg.backend.value == "xla_spmd" and cfg.fsdp.activation_checkpointing
    assert cfg.fsdp.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]


# ---- each family trains -----------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("family", ["accelerate-fsdp2", pytest.param("accelerate-xla", marks=pytest.mark.xla),
                                    "training-args", pytest.param("fsdp-config", marks=pytest.mark.xla)])
def test_an_imported_config_trains(tmp_path, family):
    if family == "accelerate-fsdp2":
        path = _accelerate_yaml(tmp_path / "c.yaml", version=2, strategy="FULL_SHARD", wrap="TRANSFORMER_BASED_WRAP",
                                offload=False, precision="no", processes=2)
        backend = "torch_fsdp"
    elif family == "accelerate-xla":
        path = tmp_path / "c.yaml"
        ClusterConfig(compute_environment="LOCAL_MACHINE", distributed_type=DistributedType.XLA, mixed_precision="no",
                      use_cpu=False, debug=False, num_processes=8, downcast_bf16=False).to_yaml_file(path)
        backend = "xla_spmd"
    elif family == "training-args":
        path = tmp_path / "c.json"
        arguments = _training_arguments(tmp_path, "full_shard auto_wrap", {}, max_steps=2, logging_steps=1)
        path.write_text(json.dumps(arguments))
        backend = "torch_fsdp"
    else:
        path = tmp_path / "c.json"
        path.write_text(json.dumps({"xla_fsdp_v2": True, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}))
        backend = "xla_spmd"
    run = tmp_path / "run"
    done = run_cli("train", str(path), "--set", "train.steps=2", "--set", f"output_dir={run}", "--set", "cpu_devices=2",
                   "--set", "train.global_batch_size=4", "--set", "train.seq_len=32")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "imported from" in done.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[-1]["backend"] == backend
    assert records[-1]["devices"] == 2
