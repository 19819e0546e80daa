"""`xla-shard gcp render`: every gcloud command parses in the real gcloud CLI; scripts pass shellcheck;
golden renderings; bad deployment configs fail naming the value."""

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import run_in_process

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
                                      "deploy.subnetwork=train-subnet",
                                      "deploy.service_account=sa@p.iam.gserviceaccount.com"]),
    "gpu-1node": (GPU, "gpu-vm", ["deploy.gpu_nodes=1"]),
    "gpu-2node": (GPU, "gpu-vm", []),
    # GKE (tests/test_gke.py validates the manifests and xpk commands): several slices, and GPU node pools.
    "gke-v5p-2slices": (TPU, "gke", ["output_dir=gs://my-bucket/out", "deploy.cluster=train-cluster",
                                     "deploy.image=us-docker.pkg.dev/p1/xla-shard:1",
                                     "deploy.accelerator_type=v5p-32", "deploy.num_slices=2",
                                     "deploy.zone=us-east5-a"]),
    "gke-gpu-2node": (GPU, "gke", ["output_dir=gs://my-bucket/out", "deploy.cluster=gpu-cluster",
                                   "deploy.image=us-docker.pkg.dev/p1/xla-shard:1"]),
    # A shared regional cluster: Workload Identity, a Kueue queue and priority, CPU and memory requests.
    "gke-v6e-shared": (TPU, "gke", ["output_dir=gs://my-bucket/out", "deploy.cluster=shared",
                                    "deploy.image=us-docker.pkg.dev/p1/xla-shard:1",
                                    "deploy.accelerator_type=v6e-16", "deploy.zone=us-east5-b",
                                    "deploy.region=us-east5", "deploy.namespace=team-a",
                                    "deploy.service_account=trainer@acme-train-1.iam.gserviceaccount.com",
                                    "deploy.queue=team-a-tpu", "deploy.priority_class=high", "deploy.cpu=200",
                                    "deploy.memory=700Gi"]),
}
OWN = ["deploy.project=acme-train-1", "checkpoint.dir=gs://acme-ckpts/run"]  # a user's own, not the placeholders
SHELLCHECK = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
needs_gcloud = pytest.mark.skipif(shutil.which("gcloud") is None, reason="the gcloud CLI is not installed")


def _render(name):
    path, target, sets = RENDERINGS[name]
    return render(config.load(path, sets), target)


def _gcloud(argv, here: Path) -> subprocess.CompletedProcess:
    argv = [a.replace("@HERE@", str(here)) for a in argv]
    env = dict(os.environ, CLOUDSDK_CORE_DISABLE_PROMPTS="1", CLOUDSDK_CONFIG=str(here / "gcloud-config"))
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.e2e
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


def test_gpu_vms_start_with_fixed_ranks_each_node_its_own(tmp_path):
    """Several GPU VMs meet at node 0 by torchrun's static rendezvous (xla-shard's launch), node r taking ranks
    r*gpus..: each launch line names its VM's rank, and a VM restarted after a preemption reads the same rank
    from its own name. Not c10d's join order, which numbered the nodes as they came."""
    import shlex

    from xla_shard.launch import Nodes

    rendering = _render("gpu-2node")
    shipped = tmp_path / "config.yaml"
    shipped.write_text(rendering.files["config.yaml"])
    names = [f"{config.load(GPU, []).deploy.name}-{i}" for i in range(2)]
    launches = [c for c in rendering.commands if c[:3] == ["gcloud", "compute", "ssh"] and "train_loop.sh" in c[-1]]
    assert [c[3].split("@")[1] for c in launches] == names
    startup = rendering.files["startup.sh"]
    restart = shlex.split(startup[startup.index("bash -c ") + len("bash -c "):].splitlines()[0])[0]
    for rank, (name, command) in enumerate(zip(names, launches)):
        args = command[-1].split("train_loop.sh ~/config.yaml ")[1].split(" >")[0]
        on_restart = restart.split("train_loop.sh ~/config.yaml ")[1].split(" >")[0]
        for words in (args, on_restart):  # as bash expands them on that VM
            done = subprocess.run(["bash", "-c", f"HOSTNAME={name}; printf '%s\\n' {words}"], capture_output=True,
                                  text=True)
            assert done.stdout.split() == ["--set", f"launch.node_rank={rank}"], (words, done)
        launch = config.load(str(shipped), [f"launch.node_rank={rank}"]).launch
        torchrun = Nodes(launch.nnodes, launch.node_rank, launch.rdzv_endpoint, launch.rdzv_id).torchrun_args()
        assert {"--nnodes=2", f"--node-rank={rank}", "--rdzv-backend=static",
                f"--rdzv-endpoint={names[0]}:29500"} <= set(torchrun), torchrun
        assert launch.nproc_per_node == 8  # an a3-highgpu-8g's GPUs


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
    assert "nothing was created or started" in done.stderr and "training started" not in done.stderr


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


@pytest.mark.parametrize("target", ["tpu-vm", "queued-resource"])
@pytest.mark.parametrize("kind", ["tpu7x-8", "tpu7x-256", "v7x-8"])
def test_tpu7x_is_refused_by_the_cloud_tpu_api_targets_pointing_at_gke(target, kind):
    with pytest.raises(ConfigError) as raised:
        render(config.load(TPU, [f"deploy.accelerator_type={kind}"]), target)
    assert raised.value.key == "deploy.accelerator_type" and kind in str(raised.value)
    assert "GKE" in str(raised.value) and "\n" not in str(raised.value)


def test_a_torch_tpu_slice_sets_up_torchtpu_and_no_torch_xla_variables():
    """The runtime a TPU VM installs follows the backend: TorchTPU for torch_tpu, torch_xla[tpu] otherwise; on
    a multi-host slice too (each worker learns its place from the VM's metadata: test_torchtpu.py)."""
    for backend, kind in (("torch_tpu", "torchtpu"), ("xla_spmd", "tpu")):
        rendering = render(config.load(TPU, [f"backend={backend}", "deploy.accelerator_type=v4-16"]), "tpu-vm")
        script = rendering.files["deploy.sh"] + rendering.files["startup.sh"]
        assert f"scripts/setup_worker.sh {kind}'" in script, backend
        assert ("PJRT_DEVICE" in script) == (backend != "torch_tpu"), backend


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


def test_train_loop_stops_where_the_user_pressed_ctrl_c(tmp_path):
    """A run stopped by Ctrl-C exits 130 (its checkpoint committed): the loop ends there, not restarting it."""
    launcher = tmp_path / "launcher.sh"
    count = tmp_path / "count"
    launcher.write_text(f'#!/usr/bin/env bash\necho "$@" >> {count}\nexit 130\n')
    launcher.chmod(0o755)
    done = subprocess.run(["bash", str(REPO / "scripts/train_loop.sh"), "cfg.yaml"], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, XLA_SHARD_LAUNCHER=str(launcher),
                                                          RESTART_DELAY_S="0"))
    assert done.returncode == 130 and len(count.read_text().splitlines()) == 1, done.stderr


# ---- injection: hostile deploy values never execute -------------------------------------------------------
# Each payload runs `xcanary` (a script on PATH that leaves a file) if any shell ever evaluates it.
PAYLOADS = ["a$(xcanary)b", "a`xcanary`b", "a';xcanary;'b", 'a";xcanary;"b', "a;xcanary;b", "a&&xcanary",
            "a|xcanary", "a\nxcanary", "a$IFS$(xcanary)"]
DEPLOY_KEYS = ["name", "project", "zone", "accelerator_type", "network", "subnetwork", "service_account",
               "gpu_machine_type", "gpu_image_family", "gpu_image_project", "remote_user", "remote_dir", "cluster",
               "image", "namespace", "region", "queue", "priority_class", "cpu", "memory"]


@pytest.mark.parametrize("key", DEPLOY_KEYS)
def test_every_deploy_value_outside_what_gcp_accepts_is_refused_naming_the_key(key):
    for payload in PAYLOADS + ["", "../../etc" if key == "remote_dir" else "UPPER CASE", "a" * 300 + "@b.c"]:
        with pytest.raises(ConfigError) as raised:
            config.validate({"deploy": {key: payload, "allow_unlisted_zone": True}})
        assert raised.value.key == f"deploy.{key}", (payload, raised.value)


@pytest.mark.parametrize("key", ["queue", "priority_class"])
def test_kueue_names_are_kubernetes_object_names_not_only_label_values(key):
    """A label value may hold 'a..b' or 'a.-b'; a LocalQueue (or WorkloadPriorityClass) name may not."""
    for name in ("a..b", "a.-b", "team-.q", "q" * 64):
        with pytest.raises(ConfigError) as raised:
            config.validate({"deploy": {key: name}})
        assert raised.value.key == f"deploy.{key}", name
    assert getattr(config.validate({"deploy": {key: "team-a.tpu-1"}}).deploy, key) == "team-a.tpu-1"


@pytest.mark.e2e
def test_config_check_refuses_a_deploy_payload_before_anything_is_rendered():
    """`config check` goes through the validation above (once is enough: it is one code path for every key)."""
    done = subprocess.run([sys.executable, "-m", "xla_shard.cli", "config", "check", TPU, "--set",
                           "deploy.cluster=a$(xcanary)b"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2 and "config key 'deploy.cluster'" in done.stderr and "Traceback" not in done.stderr


def _fake_bin(folder: Path, canary: Path, calls: Path) -> dict:
    """PATH shims: `xcanary` marks an injection; gcloud runs ssh --command strings in a shell, as the remote
    login shell would; bash/tar/setsid/getent/sudo stand in for the remote machine and record what they got."""
    folder.mkdir()
    shims = {
        "xcanary": f'echo "$0 $*" >> {canary}',
        "gcloud": 'for a in "$@"; do case "$a" in --format=*) echo ACTIVE;; --command=*) '
                  '/bin/bash -c "${a#--command=}";; esac; done; true',
        "bash": f'printf "bash %s\\n" "$*" >> {calls}',
        "tar": f'printf "tar %s\\n" "$*" >> {calls}',
        "setsid": f'printf "setsid %s\\n" "$*" >> {calls}',
        "getent": 'echo "$2:x:1000:1000::$FAKE_HOME:/bin/bash"',
        "sudo": 'while [[ "$1" != bash ]]; do shift; done; shift; /bin/bash "$@"',
    }
    for name, body in shims.items():
        (folder / name).write_text(f"#!/bin/bash\n{body}\n")
        (folder / name).chmod(0o755)
    return dict(os.environ, PATH=f"{folder}:{os.environ['PATH']}", GCLOUD=str(folder / "gcloud"), REPO=str(REPO))


@pytest.mark.parametrize("target", ["tpu-vm", "queued-resource", "gpu-vm"])
@pytest.mark.parametrize("payload", PAYLOADS)
def test_rendered_scripts_never_execute_a_value_even_unvalidated(tmp_path, target, payload):
    """Quoting holds on its own: values forced past validation are rendered, deploy.sh runs (dry and for real,
    with the remote --command strings run by a shell) and startup.sh runs as root would; nothing executes and
    each value arrives intact."""
    gpu = target == "gpu-vm"
    cfg = config.load(GPU if gpu else TPU, [*OWN, *(["deploy.gpu_nodes=2"] if gpu else [])])
    for key in ("name", "project", "zone", "remote_user", "remote_dir", "network", "service_account"):
        cfg.deploy.__dict__[key] = payload  # bypasses the schema on purpose
    cfg.deploy.__dict__["allow_unlisted_zone"] = True
    rendering = render(cfg, target)
    out, home = tmp_path / "out", tmp_path / "home"
    out.mkdir()
    for file, text in rendering.files.items():
        (out / file).write_text(text)
    canary, calls = tmp_path / "canary", tmp_path / "calls"
    env = _fake_bin(tmp_path / "bin", canary, calls)
    env.update(HOME=str(home), FAKE_HOME=str(home))
    (home / payload / "scripts").mkdir(parents=True)
    loop = home / payload / "scripts" / "train_loop.sh"
    loop.write_text(f'#!/bin/sh\necho "train_loop $*" >> {calls}\n')
    loop.chmod(0o755)
    for dry in ("1", "0"):
        done = subprocess.run(["/bin/bash", str(out / "deploy.sh")], capture_output=True, text=True,
                              env=dict(env, DRY_RUN=dry), cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stderr
        assert not canary.exists(), (dry, canary.read_text(), done.stderr)
    setup = f"bash {home}/{payload}/scripts/setup_worker.sh"
    assert setup in calls.read_text()  # the remote commands ran, with the directory exactly as given
    done = subprocess.run(["/bin/bash", str(out / "startup.sh")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not canary.exists(), canary.read_text()
    assert f"setsid nohup scripts/train_loop.sh {home}/config.yaml" in calls.read_text()


def _run_deploy(rendering, tmp_path, **env):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    for file, text in rendering.files.items():
        (out / file).write_text(text)
    clean = {k: v for k, v in os.environ.items() if k not in ("REPO", "DRY_RUN")}
    return subprocess.run(["bash", str(out / "deploy.sh")], capture_output=True, text=True, cwd=tmp_path,
                          env=dict(clean, GCLOUD="/nonexistent/gcloud", **env))


def test_dry_run_works_outside_a_git_checkout_and_says_the_real_run_needs_repo(tmp_path):
    rendering = render(config.load(TPU, OWN), "tpu-vm")
    done = _run_deploy(rendering, tmp_path, DRY_RUN="1")
    assert done.returncode == 0, done.stderr
    assert "not inside an xla_shard checkout; the real run will need REPO=" in done.stderr
    real = _run_deploy(rendering, tmp_path)
    assert real.returncode == 2 and "set REPO=" in real.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("target", ["tpu-vm", "gpu-vm"])
def test_the_examples_placeholders_are_flagged_in_a_dry_run_and_refused_for_real(tmp_path, capsys, target):
    """The example configs name project my-project and bucket gs://my-bucket: render warns, a dry run flags
    each key, the real deploy.sh stops before any gcloud command; with the user's own values neither."""
    path = TPU if target == "tpu-vm" else GPU
    rendered = run_in_process(capsys, "gcp", "render", path, "--target", target, "--out", str(tmp_path / "out"))
    assert rendered.returncode == 0, rendered.stderr
    assert "deploy.project=my-project" in rendered.stderr and "checkpoint.dir=gs://my-bucket/" in rendered.stderr
    cfg = config.load(path)
    assert f"preemption ({cfg.deploy.provisioning} {target}): an emergency save writes" in rendered.stderr
    rendering = render(cfg, target)
    dry = _run_deploy(rendering, tmp_path, DRY_RUN="1", REPO=str(REPO))
    assert dry.returncode == 0 and "WARNING: deploy.project=my-project, checkpoint.dir=gs://my-bucket/" in dry.stderr
    real = _run_deploy(rendering, tmp_path, REPO=str(REPO))
    assert real.returncode == 2 and "still hold the example's placeholders: set your own" in real.stderr
    assert "+ /nonexistent/gcloud" not in real.stderr  # refused before any command
    own = run_in_process(capsys, "gcp", "render", path, "--target", target, *[a for s in OWN for a in ("--set", s)])
    assert own.returncode == 0 and "placeholder" not in own.stderr and "\nPLACEHOLDERS=''\n" in own.stdout


def test_train_loop_does_not_restart_after_a_user_error(tmp_path):
    launcher = tmp_path / "launcher.sh"
    count = tmp_path / "count"
    launcher.write_text(f'#!/usr/bin/env bash\necho x >> {count}\nexit 2\n')
    launcher.chmod(0o755)
    done = subprocess.run(["bash", str(REPO / "scripts/train_loop.sh"), "cfg.yaml"], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, XLA_SHARD_LAUNCHER=str(launcher), RESTART_DELAY_S="0"))
    assert done.returncode == 2 and count.read_text() == "x\n" and "not restarting" in done.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_an_installed_wheel_renders_without_the_checkout(tmp_path):
    """The templates ship inside the wheel: installed (not editable) and run away from the repository, `gcp
    render` writes the same scripts as the checkout does."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(REPO), "-w", str(wheels)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = wheels.glob("xla_shard-*.whl")
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                                str(wheel)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-2000:]
    config_file = tmp_path / "tpu.yaml"
    shutil.copy(TPU, config_file)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    program = "import sys, xla_shard.cli; print(xla_shard.__file__, file=sys.stderr); sys.exit(xla_shard.cli.main())"
    done = subprocess.run([sys.executable, "-c", program, "gcp", "render", str(config_file), "--target", "tpu-vm",
                           "--out", str(tmp_path / "out"), *[a for s in OWN for a in ("--set", s)]],
                          cwd=tmp_path, env=dict(env, PYTHONPATH=str(site)), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.startswith(str(site / "xla_shard")), done.stderr  # the wheel's copy, not the checkout
    checkout = render(config.load(TPU, OWN), "tpu-vm")
    for name, text in checkout.files.items():
        assert (tmp_path / "out" / name).read_text() == text, name
