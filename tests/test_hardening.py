"""User mistakes end in one line and exit 2 naming what to change, and nothing silently wrong is trained or
saved: malformed configs, impossible model settings, diverging runs, damaged manifests, leaky messages."""

import json
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from xla_shard.checkpoint import layout
from xla_shard.cli import main
from xla_shard.errors import redact

CONFIG = "scripts/configs/tiny_llama_cpu.yaml"
REPO = Path(__file__).resolve().parent.parent


def _one_line_exit_2(args, capsys, *words) -> str:
    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def _bomb() -> bytes:
    rows = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        rows.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    return "\n".join(rows).encode()


@pytest.mark.parametrize("suffix, content, words", [
    (".yaml", b"train:\n  steps: 2\ntrain:\n  steps: 3\n", ["'train' is given twice"]),
    (".yaml", b"train:\n  steps: 2\n  steps: 3\n", ["'steps' is given twice"]),
    (".json", b'{"train": {"steps": 2}, "train": {"steps": 3}}', ["'train' is given twice"]),
    (".yaml", b"train:\n  steps: \xff\xfe\n", ["not UTF-8", "0xff"]),
    (".yaml", b"1: x\n", ["key 1", "config keys are names"]),
    (".yaml", b"train:\n  true: 3\n", ["key True at train"]),
    (".yaml", b"train: {steps: true}\n", ["train.steps", "expected a number, got true"]),
    (".yaml", b"train: {lr: .inf}\n", ["train.lr", "finite"]),
    (".yaml", b"train: {steps: 2", ["not valid YAML"]),
    (".yaml", b"x: !!python/object/apply:os.system [echo hi]\n", ["not valid YAML"]),
    (".yaml", _bomb(), ["aliases", "refusing"]),
    (".yaml", b"# " + b"x" * (2 << 20) + b"\n", ["bytes; a config is at most"]),
    (".yaml", b"cpu_devices: 100000\n", ["cpu_devices", "64"]),
])
def test_malformed_config_files(tmp_path, capsys, suffix, content, words):
    path = tmp_path / f"config{suffix}"
    path.write_bytes(content)
    _one_line_exit_2(["config", "check", str(path)], capsys, *words)


@pytest.mark.parametrize("sets, words", [
    (["train.steps=[1"], ["train.steps", "not valid YAML"]),
    (["train.steps=!!python/name:os.system"], ["train.steps", "not valid YAML"]),
    (["train.lr=.nan"], ["train.lr", "finite"]),
    (["train.peak_flops_per_device=true"], ["train.peak_flops_per_device", "expected a number"]),
    (["model.overrides={hidden_sise: 32}"], ["model.overrides.hidden_sise", "did you mean 'hidden_size'"]),
    (["model.overrides={num_attention_heads: 3}"], ["model.overrides", "not a multiple"]),
    (["model.overrides={num_hidden_layers: two}"], ["model.overrides", "num_hidden_layers"]),
    (["train.seq_len=4096"], ["train.seq_len", "512 positions"]),
    (["backend=torch_fsdp", "fsdp.offload_params=true"], ["fsdp.offload_params", "torch_fsdp", "no CUDA"]),
    (["fsdp.state_dict_type=FULL_STATE_DICT", "checkpoint.dir=null"], ["fsdp.state_dict_type", "checkpoint.dir"]),
    (["backend=xla_spmd", "launch.nproc_per_node=2"], ["'launch'", "xla_spmd", "torchrun"]),
    # what `train` would refuse at start-up, `config check` refuses too
    (["backend=xla_spmd", "mesh.fsdp=3"], ["'mesh'", "xla_spmd", "2 devices"]),
    (["backend=torch_fsdp", "cpu_devices=3"], ["train.global_batch_size", "3 torchrun processes"]),
    (["backend=torch_fsdp", "launch.nproc_per_node=3"], ["train.global_batch_size", "3 torchrun processes"]),
])
def test_bad_values_are_refused_by_config_check(capsys, sets, words):
    _one_line_exit_2(["config", "check", CONFIG, *[a for s in sets for a in ("--set", s)]], capsys, *words)


def test_a_model_config_json_with_bad_field_types(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "wide"}))
    _one_line_exit_2(["config", "check", CONFIG, "--set", f"model={tmp_path}"], capsys, "model.name", "hidden_size")


def test_a_jsonl_data_file_that_is_not_utf8(tmp_path, capsys, model_dirs):
    data = tmp_path / "corpus.jsonl"
    data.write_bytes(b'{"text": "caf\xe9"}\n' * 100)
    _one_line_exit_2(["config", "check", CONFIG, "--set", f"data.path={data}", "--set", f"model={model_dirs.llama}"],
                     capsys, "data.path", str(data))


def test_output_dir_or_export_target_that_is_a_file(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _one_line_exit_2(["config", "check", CONFIG, "--set", f"output_dir={blocker}/run"], capsys, "output_dir",
                     "is a file")
    _one_line_exit_2(["ckpt", "export", str(tmp_path / "nothing"), "--to", str(blocker)], capsys, "--to", "is a file")


# ---- manifests that were damaged or edited -----------------------------------------------------------
def _checkpoint(folder: Path) -> Path:
    """A real one-writer checkpoint of two tensors, written with the format's own encoder."""
    from xla_shard.checkpoint import Storage

    step = folder / layout.step_dir(3)
    storage = Storage(str(step))
    entries = [layout.Entry("model/w", (4, 4), torch.float32, [((0, 0), torch.randn(4, 4))]),
               layout.Entry("model/b", (4,), torch.float32, [((0,), torch.randn(4))])]
    parts, index = layout.encode_shard(entries)
    layout.add_checksums(parts, index)
    index.update(file=layout.shard_file(0, 1), writer=0, writers=1, rng={})
    storage.write(index["file"], parts)
    files, tensors = layout.merge_indexes([index])
    manifest = {"format": layout.FORMAT, "step": 3, "writers": 1, "created": 0.0, "config": {}, "files": files,
                "rng": {"0": {}}, "tensors": tensors}
    storage.write(layout.MANIFEST, json.dumps(manifest).encode())
    return step


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.pop("tensors"), ["tensors: expected a JSON object, got nothing (the field is missing)"]),
    (lambda m: m.update(step="3"), ["step: expected an integer, got a string"]),
    (lambda m: m.update(step=4), ["says step 4", "step-00000003"]),
    (lambda m: m["tensors"]["model/w"].update(dtype="F16"), ["tensors['model/w'].chunks[0]", "F16 chunk of [4, 4]"]),
    (lambda m: m["tensors"]["model/w"].update(dtype="Q7"), ["tensors['model/w'].dtype", "'Q7' is not a dtype"]),
    (lambda m: m.clear() or m.update(format=layout.FORMAT, step=[]), ["step: expected an integer, got a list"]),
])
def test_a_damaged_manifest_is_one_line(tmp_path, capsys, edit, words):
    step = _checkpoint(tmp_path)
    assert main(["ckpt", "verify", str(step)]) == 0
    capsys.readouterr()
    manifest = json.loads((step / "manifest.json").read_text())
    edit(manifest)
    if "tensors" in manifest:  # an edited dtype applies to the chunks, as the reader sees them
        for meta in manifest["tensors"].values():
            for chunk in meta.get("chunks", []):
                chunk["dtype"] = meta["dtype"]
    (step / "manifest.json").write_text(json.dumps(manifest))
    _one_line_exit_2(["ckpt", "verify", str(step)], capsys, *words)


def test_manifest_json_that_is_not_an_object(tmp_path, capsys):
    step = _checkpoint(tmp_path)
    (step / "manifest.json").write_text("[1, 2]")
    _one_line_exit_2(["ckpt", "verify", str(step)], capsys, "expected a JSON object, got a list")


# ---- storage and messages ------------------------------------------------------------------------------
def test_credentials_in_urls_are_redacted_and_errors_are_one_line():
    from xla_shard.checkpoint import Storage, StorageError

    assert redact("gs://user:s3cret@bucket/x and https://tok@h/p?X-Goog-Signature=abc&a=1&token=zz") == \
        "gs://***@bucket/x and https://***@h/p?X-Goog-Signature=***&a=1&token=***"
    storage = Storage("memory://redact-test", retry_deadline_s=0.1)

    def fail():
        raise PermissionError("denied for\nhttps://admin:hunter2@example.com/b?access_token=ya29.x\nsee logs")

    with pytest.raises(StorageError) as raised:
        storage.retry("reading it", fail)
    message = str(raised.value)
    assert "hunter2" not in message and "ya29" not in message and "\n" not in message
    assert "https://***@example.com/b?access_token=***" in message


def test_a_failed_local_write_leaves_no_temporary_file(tmp_path):
    from xla_shard.checkpoint import Storage, StorageError

    storage = Storage(str(tmp_path))
    storage.write("a/ok.bin", b"previous")
    with pytest.raises(StorageError):
        storage.write("a/ok.bin", [b"partial", object()])  # fails half-way, as a full disk would
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["ok.bin"]
    assert (tmp_path / "a" / "ok.bin").read_bytes() == b"previous"


def test_non_finite_state_is_never_saved():
    from xla_shard.checkpoint import CheckpointError
    from xla_shard.checkpoint.manager import _refuse_non_finite

    good = layout.Entry("model/w", (2,), torch.float32, [((0,), torch.ones(2))])
    steps = layout.Entry("optim/w/step", (), torch.int64, [((), torch.tensor(3))])
    _refuse_non_finite(5, [good, steps], 4)
    bad = layout.Entry("optim/w/exp_avg", (2,), torch.float32, [((0,), torch.tensor([1.0, math.inf]))])
    with pytest.raises(CheckpointError, match=r"step 5: optim/w/exp_avg holds NaN or inf.*step 4, stays"):
        _refuse_non_finite(5, [good, bad], 4)


@pytest.mark.parametrize("sets, key", [
    (["model=/home/me/llama"], "model.name"),
    (["data.path=/home/me/corpus.txt"], "data.path"),
])
def test_a_deployment_refuses_files_the_workers_do_not_have(tmp_path, sets, key):
    from xla_shard import config
    from xla_shard.deploy.render import render
    from xla_shard.errors import ConfigError

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text " * 100)
    sets = [s.replace("/home/me/corpus.txt", str(corpus)) for s in sets]
    with pytest.raises(ConfigError) as raised:
        render(config.load(REPO / "scripts/configs/tpu_v4_spmd.yaml", sets), "tpu-vm")
    assert raised.value.key == key


# ---- end to end ----------------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.slow
def test_a_diverging_run_stops_with_one_line_and_commits_nothing_non_finite(tmp_path):
    from xla_shard.checkpoint import ChunkReader, Storage, committed_steps, read_manifest

    ckpt = tmp_path / "ckpt"
    done = run_cli("train", CONFIG, "--set", "train.optimizer=sgd", "--set", "train.lr=1e30", "--set", "train.steps=6",
                   "--set", f"output_dir={tmp_path / 'run'}", "--set", f"checkpoint.dir={ckpt}",
                   "--set", "checkpoint.every_steps=1")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "the loss is nan" in done.stderr or "holds NaN or inf" in done.stderr
    for step in committed_steps(Storage(str(ckpt))):
        storage = Storage(str(ckpt / layout.step_dir(step)))
        manifest = read_manifest(storage)
        for name, meta in manifest.tensors.items():
            shape = tuple(meta["shape"])
            (value,) = ChunkReader(storage, manifest).read([(name, ((0,) * len(shape), shape))])
            assert not value.is_floating_point() or bool(value.isfinite().all()), (step, name)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_model_config_edited_between_runs_is_not_resumed(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    fields = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "rope_theta": 10000.0}
    (model / "config.json").write_text(json.dumps(fields))
    args = ["train", CONFIG, "--set", f"model={model}", "--set", "train.steps=2", "--set", "cpu_devices=1",
            "--set", f"output_dir={tmp_path / 'run'}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    (model / "config.json").write_text(json.dumps({**fields, "rope_theta": 500000.0}))  # same shapes
    second = run_cli(*args[:-6], "--set", "train.steps=3", *args[-6:])
    assert second.returncode == 2, second.stderr[-3000:]
    error = second.stderr  # transformers 5 keeps rope_theta inside rope_parameters
    assert "config key 'model.name'" in error and "differs" in error and "500000.0" in error and "10000.0" in error
