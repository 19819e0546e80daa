"""`xla-shard gcp render --target gke`: the JobSet passes Kubernetes' own schemas for every built-in kind it holds
(its ConfigMap, and each replicated job's template as a batch/v1 Job) and our reading of the JobSet v1alpha2 API;
the xpk command is accepted by xpk's own parser (in its own environment: xpk pins its dependencies exactly)
and xpk's table agrees with ours on each slice's topology and hosts; values never execute."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from xla_shard import config
from xla_shard.deploy import gke, tpu
from xla_shard.deploy.render import render
from xla_shard.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
TPU = str(REPO / "scripts/configs/tpu_v4_spmd.yaml")
GPU = str(REPO / "scripts/configs/gpu_a3_fsdp2.yaml")
OWN = ["deploy.project=acme-train-1", "checkpoint.dir=gs://acme-ckpts/run", "output_dir=gs://acme-ckpts/out",
       "deploy.cluster=train-cluster",
       "deploy.image=us-docker.pkg.dev/acme-train-1/train/xla-shard:1.0"]
# What a shared cluster's platform team asks of a job: who it runs as, where, under which queue, what it requests.
SHARED_CLUSTER = ["deploy.service_account=trainer@acme-train-1.iam.gserviceaccount.com", "deploy.region=us-east5",
                  "deploy.queue=team-a", "deploy.priority_class=high", "deploy.cpu=200", "deploy.memory=700Gi"]
# name -> (config, sets): single- and multi-host slices of every generation GKE runs, several slices, GPUs.
GKE = {
    "gke-v6e-single": (TPU, ["deploy.accelerator_type=v6e-4", "deploy.provisioning=on-demand",
                             "deploy.zone=us-east5-b"]),
    "gke-v5p-multislice": (TPU, ["deploy.accelerator_type=v5p-32", "deploy.num_slices=2", "deploy.zone=us-east5-a"]),
    "gke-v5e-multihost": (TPU, ["deploy.accelerator_type=v5litepod-16", "deploy.zone=us-west4-a"]),
    "gke-v6e-multihost": (TPU, ["deploy.accelerator_type=v6e-16", "deploy.namespace=research",
                                "deploy.zone=us-east5-b", *SHARED_CLUSTER]),
    "gke-tpu7x": (TPU, ["deploy.accelerator_type=tpu7x-16"]),
    "gke-gpu-2node": (GPU, []),
}
K8S_VERSION = "1.33"  # GKE's oldest minor still in its release channels (late 2026)
XPK_PYTHON = Path(os.environ.get("XLA_SHARD_XPK_PYTHON", REPO / ".venv-xpk/bin/python"))
needs_xpk = pytest.mark.skipif(not XPK_PYTHON.exists(), reason="xpk's environment is missing (tests/run.sh makes "
                                                              ".venv-xpk)")


def _render(name, *extra):
    path, sets = GKE[name]
    return render(config.load(path, [*OWN, *sets, *extra]), "gke")


def _documents(rendering) -> dict:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(rendering.files["jobset.yaml"])}


@pytest.mark.parametrize("name", sorted(GKE))
def test_every_built_in_kind_passes_kubernetes_schema_validation(name):
    import kubernetes_validate

    docs = _documents(_render(name))
    assert set(docs) == {"ConfigMap", "JobSet"} | ({"ServiceAccount"} if name == "gke-v6e-multihost" else set())
    for kind in set(docs) - {"JobSet"}:
        kubernetes_validate.validate(docs[kind], K8S_VERSION, strict=True)
    for replicated in docs["JobSet"]["spec"]["replicatedJobs"]:
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": replicated["name"]},
               **replicated["template"]}
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_the_schema_check_above_can_fail():
    import kubernetes_validate

    docs = _documents(_render("gke-gpu-2node"))
    job = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]
    job["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, **job},
                                     K8S_VERSION, strict=True)


# The JobSet v1alpha2 API as its Go types define it (kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go).
JOBSET_SPEC = {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
               "coordinator", "managedBy", "ttlSecondsAfterFinished", "volumeClaimPolicies"}
REPLICATED_JOB = {"name", "groupName", "template", "replicas", "dependsOn"}
FAILURE_POLICY = {"maxRestarts", "restartStrategy", "rules"}
FAILURE_RULE = {"name", "action", "onJobFailureReasons", "onJobFailureMessagePatterns", "targetReplicatedJobs"}
ACTIONS = {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts", "RestartJob",
           "RestartJobAndIgnoreMaxRestarts"}
NETWORK = {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"}
COORDINATOR = {"replicatedJob", "jobIndex", "podIndex"}
JOB_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "PodFailurePolicy", "MaxFailedIndexesExceeded"}
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def jobset_problems(jobset: dict) -> list[str]:
    """What in `jobset` the JobSet API would reject or ignore, or what makes its pods unreachable."""
    problems = []

    def fields(where: str, found: dict, allowed: set, required: set = frozenset()):
        problems.extend(f"{where}.{key}: no such field" for key in set(found) - allowed)
        problems.extend(f"{where}.{key}: required" for key in required - set(found))

    fields("", jobset, {"apiVersion", "kind", "metadata", "spec"}, {"apiVersion", "kind", "metadata", "spec"})
    if (jobset.get("apiVersion"), jobset.get("kind")) != ("jobset.x-k8s.io/v1alpha2", "JobSet"):
        problems.append("not a jobset.x-k8s.io/v1alpha2 JobSet")
    name, spec = jobset["metadata"].get("name", ""), jobset.get("spec", {})
    fields("spec", spec, JOBSET_SPEC, {"replicatedJobs"})
    jobs = {job.get("name"): job for job in spec.get("replicatedJobs", [])}
    if len(jobs) != len(spec.get("replicatedJobs", [])):
        problems.append("spec.replicatedJobs: names repeat")
    for job_name, job in jobs.items():
        fields(f"replicatedJobs[{job_name}]", job, REPLICATED_JOB, {"name", "template"})
        replicas, pods = job.get("replicas", 1), job["template"]["spec"].get("parallelism", 1)
        # Pods are <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain>: each part a DNS label.
        hostname = f"{name}-{job_name}-{replicas - 1}-{pods - 1}"
        if not DNS_LABEL.fullmatch(hostname) or len(hostname) > 63:
            problems.append(f"pod hostname {hostname!r} is no DNS label")
        pod = job["template"]["spec"]["template"]["spec"]
        if "podFailurePolicy" in job["template"]["spec"] and pod.get("restartPolicy") != "Never":
            problems.append(f"replicatedJobs[{job_name}]: a podFailurePolicy needs restartPolicy Never")
    policy = spec.get("failurePolicy", {})
    fields("spec.failurePolicy", policy, FAILURE_POLICY)
    for rule in policy.get("rules", []):
        fields("spec.failurePolicy.rules[]", rule, FAILURE_RULE, {"name", "action"})
        if not re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule.get("name", "")):
            problems.append(f"failure rule name {rule.get('name')!r}")
        if rule.get("action") not in ACTIONS:
            problems.append(f"failure rule action {rule.get('action')!r}")
        problems.extend(f"failure reason {r!r}" for r in set(rule.get("onJobFailureReasons", [])) - JOB_FAILURE_REASONS)
        problems.extend(f"rule targets {t!r}" for t in set(rule.get("targetReplicatedJobs", [])) - set(jobs))
    fields("spec.network", spec.get("network", {}), NETWORK)
    coordinator = spec.get("coordinator")
    if coordinator is not None:
        fields("spec.coordinator", coordinator, COORDINATOR, {"replicatedJob"})
        job = jobs.get(coordinator["replicatedJob"])
        if job is None:
            problems.append(f"coordinator names no replicated job {coordinator['replicatedJob']!r}")
        elif not (coordinator.get("jobIndex", 0) < job.get("replicas", 1) and
                  coordinator.get("podIndex", 0) < job["template"]["spec"].get("parallelism", 1)):
            problems.append("coordinator points past its replicated job's pods")
    return problems


@pytest.mark.parametrize("name", sorted(GKE))
def test_the_jobset_keeps_to_the_jobset_api(name):
    assert jobset_problems(_documents(_render(name))["JobSet"]) == []


def test_the_jobset_check_can_fail():
    jobset = _documents(_render("gke-v5p-multislice"))["JobSet"]
    jobset["spec"]["failurePolicy"]["maxRestart"] = 1
    jobset["spec"]["coordinator"]["podIndex"] = 9
    jobset["spec"]["replicatedJobs"][0]["replica"] = 2
    assert len(jobset_problems(jobset)) == 3


@pytest.mark.parametrize("name", sorted(GKE))
def test_slices_and_node_pools_are_scheduled_as_declared(name):
    """What each pod asks for: the slice's accelerator, topology and chips per VM; a pod per VM (GPU: per
    node); a restart budget; a user error (exit 2) that fails the JobSet rather than restarting it."""
    cfg = config.load(GKE[name][0], [*OWN, *GKE[name][1]])
    jobset = _documents(render(cfg, "gke"))["JobSet"]
    (job,) = jobset["spec"]["replicatedJobs"]
    pod = job["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == cfg.deploy.max_restarts
    assert job["template"]["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2]
    assert pod["terminationGracePeriodSeconds"] > cfg.checkpoint.preemption_grace_s
    assert (pod["nodeSelector"].get("cloud.google.com/gke-spot") == "true") == (cfg.deploy.provisioning == "spot")
    if name.startswith("gke-gpu"):
        assert job["replicas"] == 1 and job["template"]["spec"]["parallelism"] == cfg.deploy.gpu_nodes == 2
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
        assert pod["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-h100-80gb"
        command = container["command"]
        assert "--set=launch.node_rank=$(NODE_RANK)" in command and "--set=launch.nnodes=2" in command
        assert "--set=launch.rdzv_endpoint=$(COORDINATOR):29500" in command
        assert {e["name"] for e in container["env"]} == {"NODE_RANK", "COORDINATOR"}
        return
    tpu_slice = tpu.parse_gke(cfg.deploy.accelerator_type)
    assert job["replicas"] == cfg.deploy.num_slices
    assert job["template"]["spec"]["parallelism"] == tpu_slice.hosts
    assert container["resources"]["limits"] == {"google.com/tpu": tpu_slice.chips // tpu_slice.hosts}
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == tpu_slice.topology
    assert {"name": "PJRT_DEVICE", "value": "TPU"} in container["env"]
    assert container["command"] == ["xla-shard", "train", "/etc/xla-shard/config.yaml"]


def _xpk_pod_runs(rendering, tmp_path) -> str:
    """What an xpk pod does with the rendered command: its environment as xpk's --env sets it, its bash running
    --command with an `xla-shard` that prints the config file it was given."""
    env = dict(a.removeprefix("--env=").split("=", 1) for a in rendering.xpk[0] if a.startswith("--env="))
    command = next(a for a in rendering.xpk[0] if a.startswith("--command=")).removeprefix("--command=")
    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "xla-shard").write_text('#!/bin/bash\ncat "$2"\n')
    (shim / "xla-shard").chmod(0o755)
    done = subprocess.run(["/bin/bash", "-c", command], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env, "PATH": f"{shim}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_config_travels_whole_in_the_configmap_and_in_the_xpk_command(tmp_path):
    rendering = _render("gke-v5p-multislice")
    cfg_text = rendering.files["config.yaml"]
    assert _documents(rendering)["ConfigMap"]["data"]["config.yaml"] == cfg_text
    assert _xpk_pod_runs(rendering, tmp_path) == cfg_text
    assert config.validate(yaml.safe_load(cfg_text)).deploy.num_slices == 2


@pytest.mark.e2e  # YAML of 300 KiB, read and written several times
def test_a_large_config_reaches_xpk_pods_with_every_word_under_linuxs_argument_limit(tmp_path):
    """A 300 KiB config (a classifier's 12,000 label names): no word of xpk.sh's command line, and no variable of
    the pods' environment, reaches Linux's 128 KiB per-argument limit, and the pod still gets the config whole."""
    labels = {i: f"category-{i:05d}-of-the-taxonomy" for i in range(12000)}
    rendering = _render("gke-v5p-multislice", f"model.overrides={json.dumps({'id2label': labels})}")
    cfg_text = rendering.files["config.yaml"]
    assert len(cfg_text) > 300 * 2**10
    assert max(len(word.encode()) for word in rendering.xpk[0]) < 128 * 2**10
    assert _xpk_pod_runs(rendering, tmp_path) == cfg_text


def test_what_each_pod_runs_is_a_valid_run_of_the_rendered_config(tmp_path):
    """The GPU pods' --set overrides, with the values Kubernetes (or xpk's bash) puts in, load as the config of
    node 1 of 2, rendezvousing at pod 0; so do those of the xpk command."""
    rendering = _render("gke-gpu-2node")
    path = tmp_path / "config.yaml"
    path.write_text(rendering.files["config.yaml"])
    (container,) = _documents(rendering)["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
        "spec"]["containers"]
    command = next(a for a in rendering.xpk[0] if a.startswith("--command="))
    xpk_words = shlex.split(command.split(" && ", 1)[1])
    for words, env in ((container["command"], {"$(NODE_RANK)": "1", "$(COORDINATOR)": "pod-0.job"}),
                       (xpk_words, {"$NODE_RANK": "1"})):
        assert words[:3] == ["xla-shard", "train", words[2]] and words[2].endswith("config.yaml")
        sets = [word.removeprefix("--set=") for word in words[3:]]
        for name, value in env.items():
            sets = [s.replace(name, value) for s in sets]
        cfg = config.load(path, sets)
        assert (cfg.launch.nnodes, cfg.launch.node_rank) == (2, 1)
        assert cfg.launch.rdzv_endpoint.endswith(":29500") and cfg.launch.rdzv_id == cfg.deploy.name


@pytest.mark.parametrize("sets, key, words", [
    (["deploy.image=null"], "deploy.image", "container image"),
    (["deploy.cluster=null"], "deploy.cluster", "GKE cluster"),
    (["checkpoint.dir=/home/me/ckpt"], "checkpoint.dir", "restarted pod"),
    (["output_dir=runs/mine"], "output_dir", "vanish with it"),
    (["deploy.provisioning=reserved"], "deploy.provisioning", "node pool"),
    (["deploy.accelerator_type=v5p-24"], "deploy.accelerator_type", "topology"),
    (["deploy.name=a-workload-name-longer-than-forty-characters"], "deploy.name", "40"),
    (["backend=xla_fsdp", "deploy.num_slices=2"], "deploy.num_slices", "xla_spmd"),
    (["deploy.zone=us-central2-b"], "deploy.zone", "no v5p TPUs"),  # the default zone: v4 only
])
def test_bad_gke_configs_name_the_key(sets, key, words):
    with pytest.raises(ConfigError) as raised:
        _render("gke-v5p-multislice", *sets)
    assert raised.value.key == key and words in str(raised.value) and "\n" not in str(raised.value)


def _xpk(script: str) -> dict:
    done = subprocess.run([str(XPK_PYTHON), "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


XPK_PARSE = """
import argparse, json, sys
from xpk.parser.core import set_parser
from xpk.core.system_characteristics import get_system_characteristics_by_device_type
parser = argparse.ArgumentParser(prog="xpk")
set_parser(parser)
found = {}
for argv in json.loads(sys.argv[1]):
    args = parser.parse_args(argv[1:])
    kind = args.tpu_type or args.device_type
    system, error = get_system_characteristics_by_device_type(kind)
    found[args.workload + "/" + str(len(found))] = dict(
        vars(args), func=None, system=error or dict(topology=system.topology, vms=system.vms_per_slice,
                                                  chips=system.chips_per_vm, accelerator=system.gke_accelerator))
print(json.dumps(found, default=str))
"""


@pytest.mark.e2e
@needs_xpk
def test_every_xpk_command_is_accepted_by_xpks_parser_and_agrees_with_its_tables():
    renderings = {name: _render(name) for name in GKE}
    argvs = [r.xpk[0] for r in renderings.values()]
    parsed = list(_xpk(XPK_PARSE.replace("sys.argv[1]", repr(json.dumps(argvs)))).values())
    for (name, rendering), args in zip(renderings.items(), parsed):
        cfg = config.validate(yaml.safe_load(rendering.files["config.yaml"]))
        d = cfg.deploy
        assert (args["workload"], args["cluster"], args["docker_image"]) == (d.name, d.cluster, d.image)
        assert args["max_restarts"] == str(d.max_restarts) or args["max_restarts"] == d.max_restarts
        assert "xla-shard train /tmp/config.yaml" in args["command"] and args["namespace"] == d.namespace
        assert all(e.startswith(gke.CONFIG_VARIABLE) for e in args["env"])
        system = args["system"]
        assert isinstance(system, dict), (name, system)  # xpk knows the device type
        if name.startswith("gke-gpu"):
            assert args["device_type"] == "h100-80gb-8" and int(args["num_nodes"]) == d.gpu_nodes
            assert system["accelerator"] == "nvidia-h100-80gb"
            continue
        ours = tpu.parse_gke(d.accelerator_type)
        assert args["tpu_type"] == d.accelerator_type and int(args["num_slices"]) == d.num_slices
        assert (system["topology"], system["vms"], system["chips"], system["accelerator"]) == (
            ours.topology, ours.hosts, ours.chips // ours.hosts, ours.generation.gke_accelerator), name


@pytest.mark.e2e
@needs_xpk
def test_our_slice_table_is_xpks_for_every_size_both_know():
    kinds = [f"{g.prefix}-{(2 if g.size_counts_cores else 1) * chips}" for g in tpu.GENERATIONS.values()
             for chips in (1, 4, 8, 16, 32, 64, 128, 256, 512)]
    script = ("import json\nfrom xpk.core.system_characteristics import UserFacingNameToSystemCharacteristics as T\n"
              f"print(json.dumps({{k: [T[k].topology, T[k].vms_per_slice, T[k].gke_accelerator] for k in {kinds!r} "
              "if k in T}))")
    known = _xpk(script)
    assert len(known) >= 30  # most sizes of every generation
    for kind, (topology, vms, accelerator) in known.items():
        ours = tpu.parse_gke(kind)
        assert (ours.topology, ours.hosts, ours.generation.gke_accelerator) == (topology, vms, accelerator), kind
    for kind in set(kinds) - set(known):  # what xpk lacks we refuse, or render without an xpk command
        try:
            assert not gke.xpk_knows(tpu.parse_gke(kind)), kind
        except ConfigError:
            pass


@pytest.mark.e2e
@needs_xpk
def test_the_xpk_parser_check_can_fail():
    done = subprocess.run([str(XPK_PYTHON), "-c", "import argparse\nfrom xpk.parser.core import set_parser\n"
                           "p = argparse.ArgumentParser(prog='xpk'); set_parser(p)\n"
                           "p.parse_args(['workload', 'create', '--workload=x', '--cluster=c', '--tpu-type=v5p-8', "
                           "'--command=true', '--slices=2'])"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "unrecognized arguments: --slices=2" in done.stderr


PAYLOADS = ["a$(xcanary)b", "a`xcanary`b", "a;xcanary;b", "a'xcanary'b", "a\"$(xcanary)\"b", "a\nxcanary\nb"]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_values_forced_past_validation_never_execute(tmp_path, payload):
    """deploy.sh, teardown.sh and xpk.sh run for real against shims of gcloud, kubectl and xpk, and the
    command xpk would hand the pod's bash runs too: nothing executes, and the manifest carries each value
    exactly."""
    cfg = config.load(GPU, OWN)
    for key in ("name", "project", "zone", "cluster", "image", "namespace", "service_account", "queue",
                "priority_class", "cpu", "memory"):
        cfg.deploy.__dict__[key] = payload  # bypasses the schema on purpose
    rendering = render(cfg, "gke")
    out, bin_dir, canary, calls = tmp_path / "out", tmp_path / "bin", tmp_path / "canary", tmp_path / "calls"
    out.mkdir()
    bin_dir.mkdir()
    for file, text in rendering.files.items():
        (out / file).write_text(text)
    record = f'printf "%s\\0" "$0" "$@" >> {calls}'
    for name, body in {"xcanary": f'echo "$0 $*" >> {canary}', "gcloud": record, "kubectl": record,
                       "xla-shard": record,
                       "xpk": record + '; for a in "$@"; do case "$a" in --command=*) /bin/bash -c "${a#--command=}";; '
                                       "esac; done"}.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", GCLOUD=str(bin_dir / "gcloud"))
    for script in ("deploy.sh", "xpk.sh", "teardown.sh", "bind_service_account.sh"):
        done = subprocess.run(["/bin/bash", str(out / script)], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=60)
        assert done.returncode == 0, (script, done.stderr)
    assert not canary.exists(), canary.read_text()
    words = calls.read_text().split("\0")
    assert f"--cluster={payload}" in words and "get-credentials" in words
    assert f"--set=launch.rdzv_id={payload}" in words  # xla-shard got the value whole from xpk's command
    docs = _documents(rendering)
    assert docs["JobSet"]["metadata"]["name"] == payload == docs["ConfigMap"]["metadata"]["namespace"]
    assert docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "image"] == payload


@pytest.mark.parametrize("path, target", [(TPU, "tpu-vm"), (TPU, "queued-resource"), (GPU, "gpu-vm"), (GPU, "gke")])
def test_several_slices_are_refused_where_they_would_do_nothing(path, target):
    """Only a TPU workload on GKE renders slices; elsewhere the key would be accepted and ignored."""
    with pytest.raises(ConfigError) as raised:
        render(config.load(path, [*OWN, "deploy.num_slices=2"]), target)
    assert raised.value.key == "deploy.num_slices" and "\n" not in str(raised.value)


def test_a_slice_xpk_lacks_gets_an_xpk_script_that_says_so():
    rendering = _render("gke-v6e-single", "deploy.accelerator_type=v5litepod-4")
    assert rendering.xpk == [] and _documents(rendering)["JobSet"]
    done = subprocess.run(["bash", "-c", rendering.files["xpk.sh"]], capture_output=True, text=True,
                          env=dict(os.environ, XPK="/nonexistent/xpk"))
    assert done.returncode == 2 and "xpk has no v5litepod-4 device type" in done.stderr


@pytest.mark.e2e  # a fresh process
def test_the_cli_renders_gke_and_says_which_scripts_to_run(tmp_path):
    sets = [f"--set={s}" for s in OWN]
    done = subprocess.run([sys.executable, "-m", "xla_shard.cli", "gcp", "render", TPU, "--target", "gke", *sets,
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "deploy.sh", "jobset.yaml", "teardown.sh",
                                                          "xpk.sh"]
    assert "xpk.sh" in done.stdout


LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")  # Kubernetes' label values, up to 63


def test_a_shared_cluster_gets_what_its_platform_team_asks_for():
    """Workload Identity (a Kubernetes service account bound to the Google one, and the one-time binding to
    run), a regional cluster's credentials, Kueue's queue and priority labels on the JobSet, CPU and memory
    requests beside the chips; and the rendering says where the pods may run and as whom."""
    rendering = _render("gke-v6e-multihost")
    docs = _documents(rendering)
    d = config.validate(yaml.safe_load(rendering.files["config.yaml"])).deploy
    account = docs["ServiceAccount"]["metadata"]
    assert account["annotations"] == {"iam.gke.io/gcp-service-account": d.service_account}
    assert (account["name"], account["namespace"]) == (d.name, "research")
    pod = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == d.name
    labels = docs["JobSet"]["metadata"]["labels"]
    assert (labels["kueue.x-k8s.io/queue-name"], labels["kueue.x-k8s.io/priority-class"]) == ("team-a", "high")
    assert all(LABEL_VALUE.fullmatch(v) and len(v) <= 63 for v in labels.values())
    requests = pod["containers"][0]["resources"]["requests"]
    assert requests == {"google.com/tpu": 4, "cpu": "200", "memory": "700Gi"}
    assert "get-credentials train-cluster --region=us-east5 --project=acme-train-1" in rendering.files["deploy.sh"]
    assert rendering.commands[-1][:5] == ["gcloud", "iam", "service-accounts", "add-iam-policy-binding",
                                          d.service_account]
    assert f"--member=serviceAccount:acme-train-1.svc.id.goog[research/{d.name}]" in rendering.commands[-1]
    assert "add-iam-policy-binding" in rendering.files["bind_service_account.sh"]
    for said in (rendering.files["deploy.sh"], rendering.files["jobset.yaml"]):
        assert "wait for a spot node pool" in said and f"run as Kubernetes service account {d.name}" in said
    assert "xpk runs the pods as namespace research" in rendering.files["xpk.sh"]
    assert "--priority=high" in rendering.xpk[0]


def test_default_names_let_runs_share_a_namespace_and_a_rerun_replace_its_own():
    """deploy.name left at its default: each run (its checkpoint directory) gets a name of its own, the same
    on every render; deploy.sh deletes that run's JobSet (its spec is immutable) before applying the new one."""
    names = [_render("gke-v6e-single", "deploy.name=xla-shard", f"checkpoint.dir=gs://acme-ckpts/{run}")
             .files["config.yaml"]
             for run in ("a", "b", "a")]
    a, b, again = (config.validate(yaml.safe_load(text)).deploy.name for text in names)
    assert a == again != b and a.startswith("xla-shard-") and len(a) <= 40
    script = _render("gke-v6e-single", "deploy.name=my-run").files["deploy.sh"]
    delete = script.index('"$KUBECTL" delete jobset my-run --namespace=default --ignore-not-found --wait=true')
    assert delete < script.index('"$KUBECTL" apply')


def test_every_problem_of_a_config_is_reported_at_once_each_in_one_line(capsys):
    from conftest import run_in_process

    bad = ["deploy.image=null", "deploy.cluster=null", "checkpoint.dir=/home/me/ckpt", "deploy.region=us-west1",
           "deploy.provisioning=reserved", "deploy.project=null", "model.name=/home/me/model"]
    with pytest.raises(Exception) as raised:
        _render("gke-v6e-single", *bad)
    assert sorted(e.key for e in raised.value.errors) == sorted(  # every target's checks too (deploy.project ...)
        ["deploy.image", "deploy.cluster", "checkpoint.dir", "deploy.zone", "deploy.provisioning", "deploy.project",
         "model.name"])
    path, sets = GKE["gke-v6e-single"]
    done = run_in_process(capsys, "gcp", "render", path, "--target", "gke",
                          *[f"--set={s}" for s in [*OWN, *sets, *bad]])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 7 and all(line.startswith("xla-shard: error: ") for line in lines)


def test_torch_tpu_runs_on_a_multi_host_slice_as_torchtpus_launch_contract_has_it(monkeypatch):
    """GKE gives each TPU pod the hosts' names and its index (TPU_WORKER_HOSTNAMES, JOB_COMPLETION_INDEX): a
    4-host v5p-32 renders for torch_tpu, each pod running `xla-shard train` with no torch_xla variable, and what
    a pod does with its environment is rank = its index, world = the hosts, rendezvous at pod 0 (the
    coordinator the JobSet names)."""
    from xla_shard import backends
    from xla_shard.backends import torchtpu

    rendering = _render("gke-v5p-multislice", "backend=torch_tpu", "deploy.num_slices=1")
    pod = _documents(rendering)["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert pod["parallelism"] == 4
    container = pod["template"]["spec"]["containers"][0]
    assert container["command"] == ["xla-shard", "train", "/etc/xla-shard/config.yaml"]
    assert not any(e["name"] == "PJRT_DEVICE" for e in container["env"])
    cfg = config.validate(yaml.safe_load(rendering.files["config.yaml"]))
    hosts = [f"{cfg.deploy.name}-slice-0-{i}.{cfg.deploy.name}" for i in range(4)]
    for key in ("TPU_WORKER_ID", "MASTER_PORT", "NNODES", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"TPU_WORKER_HOSTNAMES": ",".join(hosts), "JOB_COMPLETION_INDEX": "1",
                       "MASTER_ADDR": hosts[0]}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torchtpu, "_set_tpu_launch_env", lambda: None)
    launch = backends.launch_from_environment(cfg)[0].launch
    assert (launch.nnodes, launch.node_rank, launch.rdzv_endpoint) == (4, 1, f"{hosts[0]}:29500")
