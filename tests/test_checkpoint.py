"""Checkpoints end to end through `xla-shard`: resume, portability, faults, export; gs:// against a real
GCS server (gcp-storage-emulator)."""

import json
import os
import random
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import HAS_XLA, REPO, run_in_process, start_cli
from xla_shard.checkpoint import layout

# torch_version marks the tests whose subject is a checkpoint's tensors as torch writes and loads them; the
# others (refusals, verification, lineage, storage faults) run on the oldest torch only.
pytestmark = pytest.mark.slow



def _main_job_config() -> str:
    """The main job's config (xla_spmd); where torch_xla is not installed (the newest torch's tier), a copy of
    it on torch_fsdp: what these tests hold (saves, resumes, exports) is the same on either backend."""
    main_job = "scripts/configs/tiny_llama_cpu.yaml"
    if HAS_XLA:
        return main_job
    copy = Path(tempfile.mkdtemp(prefix="xla_shard_tests_")) / "tiny_llama_cpu.yaml"
    copy.write_text((REPO / main_job).read_text().replace("backend: xla_spmd", "backend: torch_fsdp"))
    return str(copy)


CONFIG = _main_job_config()
STEPS = 6


def losses(output_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}  # a resumed run appends; the last record of a step wins


def _first_shard(step_dir):
    """The first of a checkpoint's shard files (one per writing process: 00000-of-00001 under xla_spmd)."""
    return sorted((step_dir / "shards").glob("*.safetensors"))[0]


def train(cli, output_dir, *sets, steps=STEPS):
    done = cli("train", CONFIG, "--set", f"train.steps={steps}", "--set", f"output_dir={output_dir}",
               *[arg for s in sets for arg in ("--set", s)])
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run of the main job's config (xla_spmd; torch_fsdp where torch_xla is not installed) that
    checkpoints every step: the losses every resumed run must match."""
    from tests.conftest import run_cli

    root = tmp_path_factory.mktemp("reference")
    train(run_cli, root / "run", f"checkpoint.dir={root / 'ckpt'}", "checkpoint.every_steps=1",
          "checkpoint.keep_last=2", "checkpoint.keep_every=4")
    return root / "ckpt", losses(root / "run")


@pytest.mark.e2e
def test_a_rerun_with_nothing_to_train_says_so(cli, tmp_path, reference):
    import shutil

    ref, _ = reference
    shutil.copytree(ref, tmp_path / "ckpt")
    done = train(cli, tmp_path / "run", f"checkpoint.dir={tmp_path / 'ckpt'}")
    # Said first and alone: no backend, device, model or data line before it (nothing was started or built).
    assert done.stderr.strip().splitlines() == [
        f"xla-shard: the checkpoint at step {STEPS} already reaches train.steps={STEPS} ({STEPS} steps); nothing to "
        f"train (raise train.steps to continue)"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # Another run's checkpoint is not this run's finish: refused by the key that differs, as any resume of it.
    other = cli("train", CONFIG, "--set", f"train.steps={STEPS}", "--set", f"output_dir={tmp_path / 'other'}",
                "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "train.seed=12345")
    assert other.returncode != 0 and "train.seed" in other.stderr and "nothing to train" not in other.stderr


def test_retention_keeps_the_last_k_and_every_nth(reference):
    ckpt, _ = reference
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000004", "step-00000005", "step-00000006"]


@pytest.mark.torch_version
@pytest.mark.e2e
@pytest.mark.parametrize("backend, sets", [
    ("torch_fsdp", ["backend=torch_fsdp", "cpu_devices=2"]),   # 1 SPMD host -> 2 FSDP2 ranks
    pytest.param("xla_fsdp", ["backend=xla_fsdp", "cpu_devices=1"], marks=pytest.mark.xla),  # FSDPv1 flat shards
    pytest.param("xla_spmd", ["backend=xla_spmd", "mesh.fsdp=2", "cpu_devices=2"],  # 2 SPMD devices instead of 4
                 marks=pytest.mark.xla),
])
def test_a_checkpoint_loads_on_another_backend_and_world_size(cli, tmp_path, reference, backend, sets):
    ckpt, expected = reference
    train(cli, tmp_path / "run", *sets, f"checkpoint.dir={tmp_path / 'ckpt'}",
          f"checkpoint.resume={ckpt / 'step-00000004'}")
    got = losses(tmp_path / "run")
    assert sorted(got) == [5, 6]
    for step in (5, 6):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), (backend, step)
    # ... and what that backend saved loads back into the SPMD run and continues it.
    train(cli, tmp_path / "back", f"checkpoint.dir={tmp_path / 'ckpt2'}",
          f"checkpoint.resume={tmp_path / 'ckpt' / 'step-00000006'}", steps=STEPS + 1)
    assert sorted(losses(tmp_path / "back")) == [STEPS + 1]


@pytest.mark.xla
@pytest.mark.e2e
def test_a_checkpoint_resumes_under_parameters_gradients_and_optimizer_state_sharded_apart(cli, tmp_path, reference):
    """The reference's FULL_SHARD (2/2/2) checkpoint continues on 4 devices under 1/2/4 (replicated parameters,
    gradients over 2, AdamW state over 4) with the same losses; what that layout saves loads back under
    FULL_SHARD on 2."""
    ckpt, expected = reference
    config = tmp_path / "apart.yaml"
    config.write_text((REPO / CONFIG).read_text().replace("  sharding_strategy: FULL_SHARD\n", ""))
    apart = ["--set", "backend=xla_spmd", "--set", "cpu_devices=4", "--set",
             "fsdp.sharding={params: 1, grads: 2, optimizer: 4}"]
    done = cli("train", str(config), *apart, "--set", f"train.steps={STEPS}", "--set", f"output_dir={tmp_path / 'run'}",
               "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", f"checkpoint.resume={ckpt / 'step-00000004'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1/2/4" in done.stderr
    manifest = json.loads((tmp_path / "ckpt" / "step-00000006" / "manifest.json").read_text())
    assert manifest["plan"]["triple"] == "1/2/4"
    got = losses(tmp_path / "run")
    assert sorted(got) == [5, 6] and all(got[s] == pytest.approx(expected[s], rel=1e-5) for s in (5, 6)), got
    train(cli, tmp_path / "back", f"checkpoint.dir={tmp_path / 'ckpt2'}",
          f"checkpoint.resume={tmp_path / 'ckpt' / 'step-00000006'}", steps=STEPS + 1)
    assert sorted(losses(tmp_path / "back")) == [STEPS + 1]


@pytest.mark.xla
@pytest.mark.e2e
def test_scanned_layers_train_exactly_and_share_checkpoints_with_the_unrolled_model(cli, tmp_path, reference):
    """fsdp.scan_layers (one XLA loop over the decoder layers), with activation checkpointing inside the scan:
    the same losses as the unrolled reference from step 1; its checkpoint continues unrolled, and the
    reference's continues scanned (without checkpointing), with the reference's losses."""
    ckpt, expected = reference
    scanned = ["fsdp.scan_layers=true", "fsdp.activation_checkpointing=true"]
    train(cli, tmp_path / "scan", *scanned, f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every_steps=2")
    got = losses(tmp_path / "scan")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(got[s] == pytest.approx(expected[s], rel=1e-5) for s in got), (got, expected)
    for name, sets, start in (("unrolled", [], tmp_path / "ckpt" / "step-00000004"),
                              ("scanned", [scanned[0], "fsdp.activation_checkpointing=false"],
                               ckpt / "step-00000004")):
        train(cli, tmp_path / name, *sets, f"checkpoint.dir={tmp_path / name / 'ckpt'}", f"checkpoint.resume={start}")
        resumed = losses(tmp_path / name)
        assert sorted(resumed) == [5, 6] and all(resumed[s] == pytest.approx(expected[s], rel=1e-5) for s in (5, 6))


@pytest.mark.torch_version
@pytest.mark.e2e
def test_sigkill_at_random_points_loses_nothing_and_resumes_bitwise(cli, capsys, tmp_path, gcs, reference):
    """Kill -9 while training (and, saving every step, usually while a save is in flight) to gs://;
    each restart resumes from the newest committed step and the losses equal the uninterrupted run's."""
    from xla_shard.checkpoint import Storage, committed_steps

    _, expected = reference
    url = gcs.url("killed")
    args = ["train", CONFIG, "--set", f"train.steps={STEPS}", "--set", f"output_dir={tmp_path / 'run'}",
            "--set", f"checkpoint.dir={url}", "--set", "checkpoint.every_steps=1"]
    rng = random.Random(1234)
    for attempt in range(2):
        process = start_cli(*args, log=tmp_path / f"attempt{attempt}.log")
        target = rng.randint(1, STEPS - 2)
        while process.poll() is None:
            done = losses(tmp_path / "run") if (tmp_path / "run" / "metrics.jsonl").exists() else {}
            if max(done, default=0) >= target + attempt * 2:
                time.sleep(rng.uniform(0, 0.15))  # somewhere inside the next step or its save
                process.send_signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        process.wait()
        committed = committed_steps(Storage(url))
        assert committed, (tmp_path / f"attempt{attempt}.log").read_text()[-2000:]
    last = committed[-1]
    done = train(cli, tmp_path / "run", f"checkpoint.dir={url}", "checkpoint.every_steps=1")
    assert f"resumed from {url}/step-{last:08d} at step {last}" in done.stderr
    got = losses(tmp_path / "run")
    assert set(got) == set(range(1, STEPS + 1))
    assert {s: got[s] for s in got} == expected  # bitwise: every step, before and after each kill
    verified = run_in_process(capsys, "ckpt", "verify", url)
    assert verified.returncode == 0 and f"step {STEPS}" in verified.stdout, verified.stderr


@pytest.mark.e2e
def test_an_output_dir_on_a_bucket_holds_every_steps_metrics_across_a_resume(cli, tmp_path, gcs, reference):
    """output_dir and checkpoint.dir on gs:// (as a GKE pod, whose disk goes with it, must have them): a run
    stopped after step 3 and its restart leave one metrics.jsonl in the bucket, every step's loss equal to the
    uninterrupted run's."""
    from xla_shard.io.storage import Storage

    _, expected = reference
    out, ckpt = gcs.url("out"), gcs.url("ckpt")
    train(cli, out, f"checkpoint.dir={ckpt}", "checkpoint.every_steps=1", steps=3)
    done = train(cli, out, f"checkpoint.dir={ckpt}", "checkpoint.every_steps=1")
    assert "at step 3" in done.stderr
    records = [json.loads(line) for line in Storage(out).read_bytes("metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {r["step"]: r["loss"] for r in records} == expected


@pytest.mark.torch_version
@pytest.mark.e2e
def test_sigterm_saves_and_exits_then_the_restart_resumes(cli, tmp_path, reference):
    _, expected = reference
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    args = ["train", CONFIG, "--set", f"train.steps={STEPS}", "--set", f"output_dir={run}",
            "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every_steps=1000"]
    process = start_cli(*args, log=tmp_path / "log")
    while process.poll() is None and not ((run / "metrics.jsonl").exists() and max(losses(run), default=0) >= 2):
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 143  # 128 + SIGTERM: stopped on request, checkpoint committed
    log = (tmp_path / "log").read_text()
    stopped = max(losses(run))
    assert f"SIGTERM: stopped after step {stopped}; checkpoint committed" in log
    assert stopped < STEPS and (ckpt / f"step-{stopped:08d}" / "manifest.json").exists()
    done = train(cli, run, f"checkpoint.dir={ckpt}", "checkpoint.every_steps=1000")
    assert f"at step {stopped}" in done.stderr
    assert losses(run) == expected


@pytest.mark.e2e
def test_an_emulator_outage_fails_the_save_loudly_and_keeps_the_last_good_one(capsys, tmp_path, gcs):
    url = gcs.url("outage")
    args = ["train", CONFIG, "--set", "train.steps=400", "--set", f"output_dir={tmp_path / 'run'}",
            "--set", f"checkpoint.dir={url}", "--set", "checkpoint.every_steps=2", "--set",
            "checkpoint.retry_deadline_s=2", "--set", "checkpoint.keep_last=1"]
    process = start_cli(*args, log=tmp_path / "log")
    from xla_shard.checkpoint import Storage, committed_steps

    while process.poll() is None and not committed_steps(Storage(url)):
        time.sleep(0.1)
    gcs.outage()  # mid-run: the next upload (or its commit) finds nobody listening
    cut = time.monotonic()
    assert process.wait(timeout=180) == 2
    assert time.monotonic() - cut < 30  # the 2 s deadline and the exit (gcsfs's own retries beneath took 33 s)
    log = (tmp_path / "log").read_text()
    assert "checkpoint save failed" in log and "gave up after retrying for 2s" in log, log[-2000:]
    assert "Traceback" not in log
    gcs.restore()  # what was committed before the outage is intact
    verified = run_in_process(capsys, "ckpt", "verify", url)
    assert verified.returncode == 0, verified.stderr


@pytest.mark.e2e
def test_verify_and_resume_refuse_a_corrupt_shard(cli, capsys, tmp_path, reference):
    import shutil

    ckpt, _ = reference
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt / "step-00000006", copy / "step-00000006")
    shard = _first_shard(copy / "step-00000006")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x55
    shard.write_bytes(bytes(data))
    verified = run_in_process(capsys, "ckpt", "verify", str(copy))
    assert verified.returncode == 2 and f"{shard.name} is corrupt" in verified.stderr
    resumed = cli("train", CONFIG, "--set", f"output_dir={tmp_path / 'run'}", "--set", f"checkpoint.dir={copy}",
                  "--set", "train.steps=8")
    assert resumed.returncode == 2
    assert f"{shard.name} is corrupt" in resumed.stderr and "Traceback" not in resumed.stderr


@pytest.mark.e2e
def test_a_checkpoint_of_another_model_or_config_is_refused(cli, tmp_path, reference):
    ckpt, _ = reference
    other = cli("train", CONFIG, "--set", "model.overrides.num_hidden_layers=1", "--set",
                f"output_dir={tmp_path / 'a'}", "--set", f"checkpoint.dir={ckpt}", "--set", "train.steps=8")
    assert other.returncode == 2
    assert "config key 'model.overrides'" in other.stderr and "step-00000006" in other.stderr


@pytest.mark.torch_version
@pytest.mark.e2e
def test_export_gives_a_model_transformers_loads_with_identical_weights(capsys, tmp_path, reference):
    from transformers import AutoModelForCausalLM

    from xla_shard.checkpoint import ChunkReader
    from xla_shard.checkpoint.inspect import open_checkpoint

    ckpt, _ = reference
    out = tmp_path / "hf"
    done = run_in_process(capsys, "ckpt", "export", str(ckpt), "--to", str(out), "--max-shard-size", "150KB")
    assert done.returncode == 0, done.stderr
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(out)
    storage, manifest = open_checkpoint(str(ckpt))
    assert manifest.step == STEPS
    reader = ChunkReader(storage, manifest)
    params = dict(model.named_parameters())
    stored = sorted(n for n in manifest.tensors if n.startswith("model/"))
    assert sorted(f"model/{n}" for n in params) == stored
    for name in stored:
        shape = tuple(manifest.tensors[name]["shape"])
        (value,) = reader.read([(name, ((0,) * len(shape), shape))])
        assert torch.equal(params[name[len("model/"):]].detach(), value), name


@pytest.mark.e2e
def test_list_shows_committed_and_incomplete(capsys, tmp_path, reference):
    import shutil

    ckpt, _ = reference
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    (copy / "step-00000005" / "manifest.json").unlink()  # as if that save had died before its commit
    listed = run_in_process(capsys, "ckpt", "list", str(copy))
    lines = {line.split()[0]: line.split()[1] for line in listed.stdout.splitlines()[1:]}
    assert lines == {"4": "committed", "5": "incomplete", "6": "committed"}


# ---- runs sharing a checkpoint.dir --------------------------------------------------------------------
def _manifest(step_dir):
    return json.loads((step_dir / "manifest.json").read_text())


def _committed_bytes(ckpt):
    return {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}


@pytest.mark.e2e
@pytest.mark.parametrize("resume", ["step-00000004", "never"])
def test_a_new_run_is_refused_where_it_would_overwrite_another_runs_checkpoints(cli, tmp_path, reference, resume):
    """Resuming an older step (or starting afresh) next to newer committed checkpoints would rewrite them in
    place and let retention delete them: refused before training, naming checkpoint.dir; nothing changes."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference[0], ckpt)
    before = _committed_bytes(ckpt)
    done = cli("train", CONFIG, "--set", f"output_dir={tmp_path / 'run'}", "--set", f"checkpoint.dir={ckpt}",
               "--set", f"checkpoint.resume={ckpt / resume if resume != 'never' else 'never'}",
               "--set", "checkpoint.every_steps=1", "--set", "train.steps=8")
    assert done.returncode == 2, done.stderr[-2000:]
    run = _manifest(ckpt / "step-00000006")["run"]["id"]
    assert "config key 'checkpoint.dir'" in done.stderr and f"run {run} up to step 6" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert _committed_bytes(ckpt) == before


@pytest.mark.e2e
def test_auto_resume_names_the_run_it_continues_and_a_branch_keeps_its_own_lineage(cli, tmp_path, reference):
    import shutil

    ref, expected = reference
    original = _manifest(ref / "step-00000006")["run"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ref, ckpt)
    done = train(cli, tmp_path / "run", f"checkpoint.dir={ckpt}", "checkpoint.every_steps=1", steps=STEPS + 1)
    assert f"at step {STEPS}, continuing run {original['id']}" in done.stderr
    assert _manifest(ckpt / f"step-{STEPS + 1:08d}")["run"] == original

    # A branch off step 5 into a directory holding another run's step 4: a new run, whose retention
    # (keep_last=1) deletes only its own older checkpoints, never the other run's.
    other = tmp_path / "shared"
    shutil.copytree(ref / "step-00000004", other / "step-00000004")
    done = train(cli, tmp_path / "branch", f"checkpoint.dir={other}", f"checkpoint.resume={ref / 'step-00000005'}",
                 "checkpoint.every_steps=1", "checkpoint.keep_last=1", steps=8)
    branch = _manifest(other / "step-00000008")["run"]
    assert branch["id"] != original["id"] and branch["parent"]["run"] == original["id"]
    assert branch["parent"]["step"] == 5 and f"branching off run {original['id']}" in done.stderr
    assert sorted(p.name for p in other.iterdir()) == ["step-00000004", "step-00000008"]
    assert _manifest(other / "step-00000004")["run"] == original
    assert losses(tmp_path / "branch")[6] == expected[6]


@pytest.mark.e2e
def test_auto_resume_falls_back_past_a_checkpoint_that_fails_verification(cli, tmp_path, reference):
    import shutil

    ref, expected = reference
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ref, ckpt)
    shard = _first_shard(ckpt / "step-00000006")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x55
    shard.write_bytes(bytes(data))
    # ... and a manifest that claims another step than its directory (copied there by hand).
    shutil.copytree(ckpt / "step-00000004", ckpt / "step-00000007")
    # ... and manifests that fail the schema: a key missing, a field of the wrong type.
    for step, damage in ((8, lambda m: m.pop("rng")), (9, lambda m: next(iter(m["tensors"].values())).update(
            shape="32"))):
        shutil.copytree(ckpt / "step-00000005", ckpt / f"step-0000000{step}")
        manifest = json.loads((ckpt / f"step-0000000{step}" / "manifest.json").read_text())
        manifest["step"] = step
        damage(manifest)
        (ckpt / f"step-0000000{step}" / "manifest.json").write_text(json.dumps(manifest))
    # ... and manifests that are not files: a FIFO (a read would block for ever), a link to an endless device
    for step, make in ((10, os.mkfifo), (11, lambda path: path.symlink_to("/dev/zero"))):
        shutil.copytree(ckpt / "step-00000005", ckpt / f"step-000000{step}")
        (ckpt / f"step-000000{step}" / "manifest.json").unlink()
        make(ckpt / f"step-000000{step}" / "manifest.json")
    # ... and a shards folder that is a link to itself (every open fails: ELOOP)
    shutil.copytree(ckpt / "step-00000005", ckpt / "step-00000012")
    shutil.rmtree(ckpt / "step-00000012" / "shards")
    (ckpt / "step-00000012" / "shards").symlink_to("shards")
    manifest = json.loads((ckpt / "step-00000012" / "manifest.json").read_text())
    (ckpt / "step-00000012" / "manifest.json").write_text(json.dumps({**manifest, "step": 12}))
    done = train(cli, tmp_path / "run", f"checkpoint.dir={ckpt}", "checkpoint.every_steps=100", steps=STEPS)
    log = done.stderr
    assert "step-00000012/shards/" in log and "too many levels of symbolic links" in log
    assert "step-00000010/manifest.json is a FIFO" in log
    assert "step-00000011/manifest.json is a link to /dev/zero" in log
    assert "step-00000007/manifest.json says step 4" in log and f"{shard.name} is corrupt" in log
    assert "step-00000008/manifest.json is damaged: rng: expected a JSON object, got nothing" in log
    assert "step-00000009/manifest.json is damaged: tensors[" in log and "got a string" in log
    assert "resumed from" in log and f"{ckpt / 'step-00000005'} at step 5" in log
    assert losses(tmp_path / "run") == {STEPS: expected[STEPS]}
    aside = sorted(p.name.rsplit("-", 1)[0] for p in ckpt.glob("corrupt-*"))
    assert aside == [f"corrupt-{layout.step_dir(s)}" for s in (6, 7, 8, 9, 10, 11, 12)]  # set aside, not deleted
    assert (ckpt / "step-00000006" / "manifest.json").exists()  # the new, good step 6


@pytest.mark.xla
@pytest.mark.e2e
def test_xla_spmd_resumes_many_times_on_a_busy_machine(tmp_path, reference):
    """Restoring creates sharded optimizer state on the device asynchronously; reading shard indices while
    that runs used to abort ("... while an async operation is in flight"), about one resume in six."""
    import subprocess
    import sys

    from tests.conftest import WORKERS, _env

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        done = subprocess.run([sys.executable, str(WORKERS / "resume_many.py"), str(reference[0] / "step-00000006"),
                               "12", "fsdp.activation_checkpointing=true"], env=_env(), capture_output=True,
                              text=True, timeout=600)
    finally:
        for burner in burners:
            burner.kill()
    assert done.returncode == 0 and "loaded 12 times" in done.stdout, done.stderr[-3000:]


@pytest.mark.torch_version
@pytest.mark.e2e
def test_full_state_dict_also_exports_the_final_checkpoint_for_transformers(cli, tmp_path):
    from transformers import AutoModelForCausalLM

    from xla_shard.checkpoint import ChunkReader, Storage, read_manifest

    run = tmp_path / "run"
    done = train(cli, run, f"checkpoint.dir={tmp_path / 'ckpt'}", "fsdp.state_dict_type=FULL_STATE_DICT", steps=2)
    assert f"exported step 2 to {run / 'model'}" in done.stderr
    model = AutoModelForCausalLM.from_pretrained(run / "model")
    storage = Storage(str(tmp_path / "ckpt" / "step-00000002"))
    manifest = read_manifest(storage)
    reader = ChunkReader(storage, manifest)
    for name, param in model.named_parameters():
        shape = tuple(param.shape)
        (stored,) = reader.read([(f"model/{name}", ((0,) * len(shape), shape))])
        assert torch.equal(param.detach(), stored), name
