"""`xla-shard gcp render`: every gcloud command parses in the real gcloud CLI; scripts pass shellcheck;
golden renderings; bad deployment configs fail naming the value."""

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from xla_shard import config
from xla_shard.deploy.render import render
from xla_shard.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
TPU = str(REPO / "scripts/configs/tpu_v4_spmd.yaml")
GPU = str(REPO / "scripts/configs/gpu_a3_fsdp2.yaml")
RENDERINGS = {
    "tpu-vm": (TPU, "tpu-vm", []),
    "queued-resource": (TPU, "queued-resource", []),
    "v5e-multihost": (TPU, "tpu-vm", ["deploy.accelerator_type=v5litepod-16", "deploy.zone=us-west4-a",
                                      "deploy.provisioning=reserved", "deploy.network=train-net",
                                      "deploy.subnetwork=train-subnet", "deploy.service_account=sa@p.iam.gserviceaccount.com"]),
    "gpu-1node": (GPU, "gpu-vm", ["deploy.gpu_nodes=1"]),
    "gpu-2node": (GPU, "gpu-vm", []),
}
SHELLCHECK = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
needs_gcloud = pytest.mark.skipif(shutil.which("gcloud") is None, reason="the gcloud CLI is not installed")


def _render(name):
    path, target, sets = RENDERINGS[name]
    return render(config.load(path, sets), target)


def _gcloud(argv, here: Path) -> subprocess.CompletedProcess:
    argv = [a.replace("@HERE@", str(here)) for a in argv]
    env = dict(os.environ, CLOUDSDK_CORE_DISABLE_PROMPTS="1", CLOUDSDK_CONFIG=str(here / "gcloud-config"))
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow
@needs_gcloud
@pytest.mark.parametrize("name", sorted(RENDERINGS))
def test_every_rendered_gcloud_command_parses(name, tmp_path):
    """Offline, gcloud rejects a bad flag at once ("unrecognized arguments", exit 2) and a well-formed
    command only when it needs credentials."""
    rendering = _render(name)
    for file, text in rendering.files.items():
        (tmp_path / file).write_text(text)
    (tmp_path / "xla_shard.tar.gz").write_bytes(b"")
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda argv: (argv, _gcloud(argv, tmp_path)), rendering.commands))
    for argv, done in results:
        assert done.returncode == 1, (argv, done.stderr)
        assert "unrecognized arguments" not in done.stderr and "argument" not in done.stderr.split("\n")[0]
        assert "credentials" in done.stderr or "active account" in done.stderr, (argv, done.stderr)


@needs_gcloud
def test_a_misspelt_flag_is_caught_by_the_same_check(tmp_path):
    """The check above can fail: the flag `tpu-vm create` does not have (queued resources' spelling)."""
    done = _gcloud(["gcloud", "compute", "tpus", "tpu-vm", "create", "x", "--zone=us-central2-b",
                    "--accelerator-type=v4-8", "--runtime-version=tpu-ubuntu2204-base"], tmp_path)
    assert done.returncode == 2 and "unrecognized arguments: --runtime-version" in done.stderr


@pytest.mark.parametrize("name", sorted(RENDERINGS))
def test_renderings_match_their_golden_files(name):
    rendering = _render(name)
    folder = GOLDEN / name
    if os.environ.get("XLA_SHARD_UPDATE_GOLDEN"):
        folder.mkdir(parents=True, exist_ok=True)
        for file, text in rendering.files.items():
            (folder / file).write_text(text)
    assert sorted(p.name for p in folder.iterdir()) == sorted(rendering.files)
    for file, text in rendering.files.items():
        assert text == (folder / file).read_text(), f"{name}/{file} changed; XLA_SHARD_UPDATE_GOLDEN=1 to accept"


def test_scripts_and_renderings_are_shellcheck_clean(tmp_path):
    scripts = sorted(str(p) for p in (REPO / "scripts").glob("*.sh"))
    for name in RENDERINGS:
        for file, text in _render(name).files.items():
            if file.endswith(".sh"):
                (tmp_path / f"{name}-{file}").write_text(text)
                scripts.append(str(tmp_path / f"{name}-{file}"))
    done = subprocess.run([SHELLCHECK, *scripts], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_dry_run_prints_and_runs_nothing(tmp_path):
    out = tmp_path / "qr"
    for file, text in _render("queued-resource").files.items():
        (out / file).parent.mkdir(exist_ok=True)
        (out / file).write_text(text)
    done = subprocess.run(["bash", str(out / "deploy.sh")], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, DRY_RUN="1", GCLOUD="/nonexistent/gcloud"))
    assert done.returncode == 0, done.stderr
    assert "+ /nonexistent/gcloud compute tpus queued-resources create" in done.stderr
    assert not (out / "xla_shard.tar.gz").exists()


@pytest.mark.parametrize("sets, key, value", [
    (["deploy.accelerator_type=v9-8"], "deploy.accelerator_type", "v9-8"),
    (["deploy.zone=europe-west1-b"], "deploy.zone", "europe-west1-b"),
    (["deploy.accelerator_type=v4-16", "checkpoint.dir=/home/me/ckpt"], "checkpoint.dir", "/home/me/ckpt"),
    (["deploy.valid_until=30m"], "deploy.valid_until", "30m"),
    (["backend=torch_fsdp"], "backend", "torch_fsdp"),
])
def test_bad_deployment_configs_name_the_value(sets, key, value):
    with pytest.raises(ConfigError) as raised:
        render(config.load(TPU, sets), "queued-resource")
    assert raised.value.key == key and value in str(raised.value)


def test_train_loop_restarts_after_preemption_until_training_finishes(tmp_path):
    """scripts/train_loop.sh around a launcher that is preempted once (143), then finishes (0)."""
    launcher = tmp_path / "launcher.sh"
    count = tmp_path / "count"
    launcher.write_text(f'#!/usr/bin/env bash\necho "$@" >> {count}\n[[ $(wc -l < {count}) -ge 2 ]] || exit 143\n')
    launcher.chmod(0o755)
    done = subprocess.run(["bash", str(REPO / "scripts/train_loop.sh"), "cfg.yaml", "--set", "a=1"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, XLA_SHARD_LAUNCHER=str(launcher), RESTART_DELAY_S="0"))
    assert done.returncode == 0, done.stderr
    assert count.read_text().splitlines() == ["cfg.yaml --set a=1"] * 2
    assert "exit status 143; restart 1/" in done.stderr
