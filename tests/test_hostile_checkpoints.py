"""Checkpoints and exports against what a user (or an attacker) may hand them, in process: destinations that
would delete what an export reads, extra state the reader would not give back, manifests whose LoRA section was
edited, and checkpoint directories whose names look like glob patterns."""

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import in_process_checkpointer
from transformers import LlamaConfig, LlamaForCausalLM

from xla_shard import config
from xla_shard.checkpoint import Checkpointer, layout
from xla_shard.checkpoint.manager import NoCheckpoints
from xla_shard.checkpoint.export import export
from xla_shard.checkpoint.extra_state import MAX_EXTRA_DEPTH
from xla_shard.checkpoint.manifest import committed_steps, read_manifest
from xla_shard.errors import UserError
from xla_shard.io.storage import Storage


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))


def _checkpointer(directory, *sets) -> Checkpointer:
    return in_process_checkpointer(directory, *sets)


def _run(root: Path, steps=(1, 2), **saves) -> Path:
    """A run directory as `xla-shard train` leaves it: checkpoints under RUN/ckpt, metrics beside them."""
    run = root / "run"
    (run / "ckpt").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    ckpt = _checkpointer(run / "ckpt", f"output_dir={run}")
    ckpt.restore(_model(), None)
    for step in steps:
        ckpt.save(step, _model(step), None, **saves)
    return run


def _listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# ---- exports never delete what they read, or where you stand -----------------------------------------------
@pytest.mark.parametrize("where", ["run", "run/ckpt", "run/ckpt/step-00000002", "run/ckpt/step-00000002/x", ".",
                                   "", "/", "..", "run/ckpt/../ckpt"])
def test_an_export_that_would_replace_what_it_reads_is_refused_and_deletes_nothing(tmp_path, monkeypatch, where):
    run = _run(tmp_path)
    monkeypatch.chdir(tmp_path / "run" if where in (".", "..") else tmp_path)
    before = _listing(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(UserError) as refused:
            export(str(tmp_path / "run/ckpt/step-00000002"), str(tmp_path / where) if where not in ("", ".", "..")
                   else where, overwrite=overwrite)
        assert "\n" not in str(refused.value) and "--to" in str(refused.value)
    assert _listing(tmp_path) == before
    assert (run / "metrics.jsonl").exists() and committed_steps(Storage(str(run / "ckpt"))) == [1, 2]


@pytest.mark.e2e
def test_on_gcs_an_export_over_its_run_is_refused_before_anything_is_deleted(gcs):
    """On an object store there is no staging rename: the prefix used to be emptied before the source was read."""
    run = f"gs://{gcs.bucket}/run"
    Storage(run).write("metrics.jsonl", b'{"step": 1}\n')
    ckpt = _checkpointer(f"{run}/ckpt", f"output_dir={run}")
    ckpt.restore(_model(), None)
    ckpt.save(1, _model(1), None)
    before = Storage(run).glob("**")
    for to in (run, f"{run}/ckpt", f"{run}/ckpt/step-00000001", f"gs://{gcs.bucket}"):
        with pytest.raises(UserError, match="--to"):
            export(f"{run}/ckpt/step-00000001", to, overwrite=True)
    assert Storage(run).glob("**") == before and committed_steps(Storage(f"{run}/ckpt")) == [1]
    assert export(f"{run}/ckpt", f"gs://{gcs.bucket}/exported").step == 1


def test_an_export_through_a_link_to_the_run_is_refused(tmp_path):
    run = _run(tmp_path)
    os.symlink(run, tmp_path / "alias")
    with pytest.raises(UserError, match="contains the checkpoint"):
        export(str(run / "ckpt"), str(tmp_path / "alias"), overwrite=True)
    assert committed_steps(Storage(str(run / "ckpt"))) == [1, 2]


def test_an_export_beside_the_run_works_and_an_overwrite_replaces_only_it(tmp_path):
    run = _run(tmp_path)
    (run / "export").mkdir()
    (run / "export" / "stale.txt").write_text("old")
    report = export(str(run / "ckpt"), str(run / "export"), overwrite=True)
    assert report.step == 2 and (run / "export" / "config.json").exists()
    assert not (run / "export" / "stale.txt").exists() and committed_steps(Storage(str(run / "ckpt"))) == [1, 2]


def test_the_run_recorded_in_the_manifest_is_protected_even_when_read_elsewhere(tmp_path):
    """A checkpoint copied away still names its run's output_dir: an export there is refused."""
    run = _run(tmp_path)
    copy = tmp_path / "copy"
    Storage(str(run / "ckpt")).fs.copy(str(run / "ckpt" / "step-00000002"), str(copy), recursive=True)
    with pytest.raises(UserError, match="the run's"):
        export(str(copy), str(run), overwrite=True)
    assert committed_steps(Storage(str(run / "ckpt"))) == [1, 2]


def test_an_export_whose_checkpoint_retention_deleted_says_so(tmp_path, monkeypatch):
    run = _run(tmp_path)
    from xla_shard.checkpoint import export as export_module

    real = export_module._write_weights

    def deleted_meanwhile(reader, *args, **kwargs):
        Storage(str(run / "ckpt")).remove_tree("step-00000002")  # a run's keep_last, mid-export
        return real(reader, *args, **kwargs)

    monkeypatch.setattr(export_module, "_write_weights", deleted_meanwhile)
    with pytest.raises(UserError, match="was deleted while it was being exported") as refused:
        export(str(run / "ckpt" / "step-00000002"), str(tmp_path / "out"))
    assert "shard file" not in str(refused.value) and not (tmp_path / "out").exists()


# ---- what the writer accepts, the reader accepts ------------------------------------------------------------
def _nested(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth - 1):
        value = {"d": value}
    return value


def test_extra_state_at_the_deepest_the_reader_takes_round_trips(tmp_path):
    deepest = {"loader": _nested(MAX_EXTRA_DEPTH), "ints": {"epoch": 3, "seen": [1, 2, {"x": None}]}}
    run = _run(tmp_path, steps=(1,), extra=deepest)
    read_manifest(Storage(str(run / "ckpt")), layout.step_dir(1))  # the reader's own check
    back = {"loader": {}, "ints": {}}
    assert _checkpointer(run / "ckpt").restore(_model(), None, extra=back) == 1
    assert back == deepest


@pytest.mark.parametrize("state, problem", [
    (_nested(MAX_EXTRA_DEPTH + 1), "nested deeper"),
    ({"epoch": {1: "a"}}, "key 1"),
    ({"betas": (0.9, 0.99)}, "tuple"),
    ({"when": object()}, "not JSON data"),
])
def test_extra_state_the_reader_would_not_return_as_saved_is_refused_at_save(tmp_path, state, problem):
    run = _run(tmp_path, steps=(1,))
    ckpt = _checkpointer(run / "ckpt")
    ckpt.restore(_model(), None)
    with pytest.raises(UserError, match=problem) as refused:
        ckpt.save(2, _model(), None, extra={"sampler": state})
    assert "'sampler'" in str(refused.value) and "\n" not in str(refused.value)
    assert committed_steps(Storage(str(run / "ckpt"))) == [1]  # the last good checkpoint stays the newest
    assert _checkpointer(run / "ckpt").restore(_model(), None) == 1


@pytest.mark.parametrize("extra", [[{"seen": 3}], ["sampler"], {"sampler": [1, 2]}, {"sampler": "state"},
                                   {3: {"seen": 0}}])
def test_restore_given_extra_state_it_cannot_fill_refuses_in_one_line_and_changes_nothing(tmp_path, extra):
    import copy

    run = _run(tmp_path, steps=(1,), extra={"sampler": {"seen": 3}})
    before = copy.deepcopy(extra)
    for directory in (run / "ckpt", None):  # with a checkpoint to restore from, and without one
        ckpt = _checkpointer(directory) if directory else NoCheckpoints()
        with pytest.raises(UserError, match="extra state") as refused:
            ckpt.restore(_model(), None, extra=extra)
        assert "\n" not in str(refused.value)
        assert extra == before  # the caller's object is checked, never emptied first


# ---- legal paths ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["run[1]", "a*b", "what?", "[!x]"])
def test_a_checkpoint_dir_named_like_a_glob_saves_resumes_and_exports(tmp_path, name):
    directory = tmp_path / name
    (tmp_path / "run1").mkdir()  # what `run[1]` would match as a pattern
    ckpt = _checkpointer(directory)
    assert ckpt.restore(_model(), None) == 0
    ckpt.save(1, _model(1), None)
    ckpt.save(2, _model(2), None)
    assert committed_steps(Storage(str(directory))) == [1, 2]
    again = _checkpointer(directory)
    assert again.restore(_model(), None) == 2  # resumes: no false "another run is writing here"
    again.save(3, _model(3), None)
    assert export(str(directory), str(tmp_path / "export")).step == 3


# ---- the manifest's LoRA section is untrusted ----------------------------------------------------------
def _lora_checkpoint(tmp_path: Path, *sets: str, derived: bool = True) -> Path:
    from xla_shard.methods import adapter_for

    sets = ("model.lora.r=2", "model.lora.target_modules=[q_proj]", *sets)
    adapter = adapter_for(config.load(None, list(sets)))
    model = _model()
    adapter.materialize(model, adapter.inject(model, "causal_lm", seed=0))
    if derived:
        adapter.derive(model)
    ckpt = _checkpointer(tmp_path / "ckpt", *sets)
    ckpt.trained_only = True
    ckpt.restore(model, None)
    ckpt.save(1, model, None)
    return tmp_path / "ckpt" / layout.step_dir(1)


def _tamper(step_dir: Path, change) -> None:
    path = step_dir / layout.MANIFEST
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("change, problem", [
    (lambda m: m["config"]["model"]["lora"].update(r=0), "model.lora.r"),
    (lambda m: m["config"]["model"]["lora"].update(r="8"), "model.lora.r"),
    (lambda m: m["config"]["model"]["lora"].pop("alpha"), "lacks 'alpha'"),
    (lambda m: m["config"]["model"]["lora"].update(r=3), "rank-3"),
    (lambda m: m["config"]["model"]["lora"].update(target_modules=5), "target_modules"),
    (lambda m: m["config"]["model"].update(lora="yes"), "model.lora"),
    (lambda m: m["config"]["model"].update(lora=None), "LoRA tensors"),
])
@pytest.mark.parametrize("merge", [False, True])
def test_a_tampered_lora_section_is_refused_in_one_line(tmp_path, change, problem, merge):
    step = _lora_checkpoint(tmp_path)
    _tamper(step, change)
    with pytest.raises(UserError) as refused:
        export(str(step), str(tmp_path / "out"), merge=merge)
    assert problem in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


DORA = "model.lora.use_dora=true"
MAGNITUDE = "model/model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight"


def _first_rows(tensor: dict, rows: int) -> None:
    """A one-chunk float32 vector's manifest entry cut to its first `rows` entries, consistently."""
    (chunk,) = tensor["chunks"]
    tensor.update(shape=[rows], chunks=[{**chunk, "sizes": [rows], "end": chunk["start"] + 4 * rows}])


@pytest.mark.parametrize("sets, change, problem", [
    ([DORA], lambda m: m["config"]["model"]["lora"].update(use_dora=False), "holds DoRA magnitudes"),
    ([], lambda m: m["config"]["model"]["lora"].update(use_dora=True), "has no magnitude"),
    ([DORA], lambda m: _first_rows(m["tensors"][MAGNITUDE], 8), "not one magnitude per row of its lora_B"),
])
def test_dora_magnitudes_where_the_manifest_does_not_say_are_refused(tmp_path, sets, change, problem):
    step = _lora_checkpoint(tmp_path, *sets)
    _tamper(step, change)
    for merge in (False, True):
        with pytest.raises(UserError) as refused:
            export(str(step), str(tmp_path / "out"), merge=merge)
        assert problem in str(refused.value) and "\n" not in str(refused.value)
        assert not (tmp_path / "out").exists()


def test_dora_magnitudes_never_derived_are_refused_not_exported_as_nan(tmp_path, monkeypatch):
    """NaN is what a magnitude holds until it is derived from its base: a checkpoint holding it (written by
    another tool, or by a saver that let NaN through) would export NaN logits."""
    from xla_shard.checkpoint import manager

    monkeypatch.setattr(manager, "_refuse_non_finite", lambda *args: None)
    step = _lora_checkpoint(tmp_path, DORA, derived=False)
    with pytest.raises(UserError, match="holds NaN, DoRA's value for a magnitude not yet derived") as refused:
        export(str(step), str(tmp_path / "out"))  # (a merge reads them through the same check)
    assert "q_proj.lora_magnitude_vector" in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_a_full_fine_tune_relabelled_as_lora_is_refused(tmp_path):
    run = _run(tmp_path, steps=(1,))
    _tamper(run / "ckpt" / layout.step_dir(1), lambda m: m["config"]["model"].update(
        lora={"r": 2, "alpha": 4, "dropout": 0, "target_modules": ["q_proj"]}))
    with pytest.raises(UserError, match="full model weights"):
        export(str(run / "ckpt"), str(tmp_path / "out"))


def test_an_adapter_export_names_its_base_by_an_absolute_path(tmp_path):
    step = _lora_checkpoint(tmp_path)
    base = tmp_path / "base"
    _model().save_pretrained(base)
    _tamper(step, lambda m: m["config"]["model"].update(name=os.path.relpath(base)))
    export(str(step), str(tmp_path / "out"))
    adapter = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(base) and adapter["r"] == 2


# ---- the frozen base is the one the adapters were trained on --------------------------------------------
def _train(sets: list[str], steps: int):
    """`xla-shard train` of `sets` for `steps` steps, one process."""
    from conftest import run_cli

    return run_cli("train", *[a for s in [*sets, f"train.steps={steps}"] for a in ("--set", s)],
                   "--nproc-per-node", "1")


@pytest.mark.e2e
@pytest.mark.slow
def test_a_lora_resume_or_merge_over_another_base_of_the_same_shapes_is_refused(model_dirs, tmp_path, capsys):
    """A base replaced by another model of the same shapes (another seed): the resume and `--merge` both refuse,
    naming the weights file; the true base resumes and merges."""
    import shutil

    from conftest import FIXTURES, run_in_process
    from model_dirs import llama_dir

    base = tmp_path / "base"
    shutil.copytree(model_dirs.llama, base)
    out = tmp_path / "run"
    sets = [f"model.name={base}", f"data.path={FIXTURES / 'corpus.jsonl'}", "train.seq_len=32", "backend=torch_fsdp",
            "model.lora.r=4", f"output_dir={out}", f"checkpoint.dir={out}/ckpt", "checkpoint.every_steps=1"]

    assert _train(sets, 1).returncode == 0
    recorded = read_manifest(Storage(str(out / "ckpt")), layout.step_dir(1)).data["base"]
    assert set(recorded["files"]) == {p.name for p in base.glob("*.safetensors")}
    original = tmp_path / "original"
    base.rename(original)
    llama_dir(base, files=2, seed=99)  # same config and shapes, other weights
    resumed = _train(sets, 2)
    assert resumed.returncode == 2 and ".safetensors" in resumed.stderr and "another base" in resumed.stderr
    merged = run_in_process(capsys, "ckpt", "export", str(out / "ckpt"), "--to", str(tmp_path / "merged"), "--merge")
    assert merged.returncode == 2 and "other bytes" in merged.stderr and not (tmp_path / "merged").exists()
    shutil.rmtree(base)
    original.rename(base)
    assert _train(sets, 2).returncode == 0
    merged = run_in_process(capsys, "ckpt", "export", str(out / "ckpt"), "--to", str(tmp_path / "merged"), "--merge")
    assert merged.returncode == 0, merged.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_a_dpo_resume_against_a_replaced_reference_is_refused(model_dirs, tmp_path):
    """Full fine-tuning DPO reads its reference (here dpo.reference) again at each resume: weights replaced
    between the runs would change the objective with exit 0. Its identity is recorded as a LoRA base's is."""
    import shutil

    from conftest import FIXTURES
    from model_dirs import CHAT_TEMPLATE, llama_dir

    reference = tmp_path / "reference"
    shutil.copytree(model_dirs.llama_chat, reference)
    out = tmp_path / "run"
    sets = [f"model.name={model_dirs.llama_chat}", f"dpo.reference={reference}", "method=dpo", "data.kind=preference",
            f"data.path={FIXTURES / 'preference.jsonl'}", "train.seq_len=64", "backend=torch_fsdp",
            "train.global_batch_size=2", f"output_dir={out}", f"checkpoint.dir={out}/ckpt", "checkpoint.every_steps=1"]

    assert _train(sets, 1).returncode == 0
    recorded = read_manifest(Storage(str(out / "ckpt")), layout.step_dir(1)).data["reference"]
    assert recorded["directory"] == str(reference) and set(recorded["files"]) == {"model.safetensors"}
    shutil.rmtree(reference)
    llama_dir(reference, chat_template=CHAT_TEMPLATE, seed=99)  # the same shapes and tokenizer, other weights
    resumed = _train(sets, 2)
    assert resumed.returncode == 2 and "config key 'dpo.reference'" in resumed.stderr
    assert "trained against another reference" in resumed.stderr and "Traceback" not in resumed.stderr


@pytest.mark.parametrize("name", ["d[1]", "a*b", "q?"])
def test_data_files_in_directories_named_like_globs_are_read_as_named(tmp_path, name):
    from xla_shard.data.files import read_rows

    for folder, text in ((name, "the file named"), ("d1", "a decoy"), ("axb", "a decoy"), ("qx", "a decoy")):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "rows.jsonl").write_text(json.dumps({"text": text}) + "\n")
    rows = read_rows(str(tmp_path / name / "rows.jsonl"), None, "data.path")
    assert rows["text"] == ["the file named"]


# ---- the learning-rate warm-up rule a run resumes on ------------------------------------------------------------
def test_the_warm_up_rule_is_recorded_restored_and_checked(tmp_path):
    from xla_shard.checkpoint.manifest import CorruptCheckpointError
    from xla_shard.errors import ConfigError
    from xla_shard.schedule import EARLIER_WARMUP_RULE, WARMUP_RULE
    from xla_shard.checkpoint import RunRecord

    ckpt = _checkpointer(tmp_path / "ckpt", f"output_dir={tmp_path}")
    ckpt.restore(_model(), None)
    ckpt.record.lr_warmup_rule = WARMUP_RULE
    ckpt.save(1, _model(1), None)
    again = _checkpointer(tmp_path / "ckpt", f"output_dir={tmp_path}")
    assert again.restore(_model(), None) == 1 and again.restored.lr_warmup_rule == WARMUP_RULE

    said = []

    def resumed(step, recorded, warmup=4):
        record = RunRecord()
        rule = record.go_on_with_warmup_rule(RunRecord(lr_warmup_rule=recorded) if step else None, step, warmup,
                                             said.append)
        assert record.lr_warmup_rule == rule  # what the run's checkpoints record from here on
        return rule

    assert resumed(0, None) == WARMUP_RULE and resumed(2, WARMUP_RULE) == WARMUP_RULE and not said
    assert resumed(2, None) == EARLIER_WARMUP_RULE and "earlier learning-rate warm-up rule" in said[0]
    assert resumed(6, None) == EARLIER_WARMUP_RULE and len(said) == 1  # past the warm-up the rules agree: no word
    with pytest.raises(ConfigError, match="checkpoint.resume.*'k/2' is not one this xla_shard knows"):
        resumed(2, "k/2")

    path = tmp_path / "ckpt" / "step-00000001" / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "lr_warmup_rule": 3}))
    with pytest.raises(CorruptCheckpointError, match="lr_warmup_rule: expected a string"):
        read_manifest(Storage(str(tmp_path / "ckpt")), "step-00000001")
