"""Render a config as a GKE workload: a JobSet (`jobset.yaml`, which deploy.sh applies) and the
`xpk workload create` command that makes the same workload (`xpk.sh`), for TPU slices and GPU node pools.

TPU: one replicated job of `deploy.num_slices` replicas (a slice each), each an indexed Job of one pod per TPU
VM, scheduled by GKE's accelerator and topology node selectors and holding the VM's `google.com/tpu` chips.
GKE gives each pod its TPU worker variables; every host runs one xla_spmd process, and the hosts agree over
gloo with pod 0 of slice 0 (the JobSet coordinator) as MASTER_ADDR. GPU: `deploy.gpu_nodes` pods of one
indexed Job; each runs `xla-shard train` as launch.node_rank = its completion index, with the coordinator
as torchrun's rendezvous endpoint.

Restarts: a pod that fails (preempted, its node lost) fails its Job, and the JobSet recreates them all, up to
`deploy.max_restarts` times; `checkpoint.resume: auto` continues from the newest committed checkpoint in gs://.
A user error (xla-shard exits 2) fails the JobSet at once: restarting cannot mend a config.

Values reach the manifest through the YAML emitter, never pasted into text, after the schema validated them;
in xpk.sh and deploy.sh they are shell-quoted like every gcloud argument, and the config inside xpk's command
is base64 (letters, digits, + / =).
"""

from __future__ import annotations

import base64
import shlex

import yaml

from xla_shard.config import dump
from xla_shard.config.schema import ShardConfig
from xla_shard.deploy import tpu
from xla_shard.deploy.scripts import (GPU_MACHINES, HERE, Rendering, check_backend, check_common, common_header,
                                     messages, shell_line, template)
from xla_shard.errors import ConfigError

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
CONTAINER = "train"
CONFIG_DIR = "/etc/xla-shard"
RDZV_PORT = 29500
USER_ERROR = 2  # xla-shard's exit status for a user error: no restart mends it
COORDINATOR = "metadata.annotations['jobset.sigs.k8s.io/coordinator']"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# GPU machine types GKE node pools run: their accelerator node label and xpk's device type.
GKE_GPUS = {"a3-highgpu-8g": ("nvidia-h100-80gb", "h100-80gb-8"),
            "a3-megagpu-8g": ("nvidia-h100-mega-80gb", "h100-mega-80gb-8"),
            "a3-ultragpu-8g": ("nvidia-h200-141gb", "h200-141gb-8"),
            "a2-highgpu-1g": ("nvidia-tesla-a100", "a100-40gb-1"),
            "a2-highgpu-8g": ("nvidia-tesla-a100", "a100-40gb-8"),
            "g2-standard-4": ("nvidia-l4", "l4-1"), "g2-standard-48": ("nvidia-l4", "l4-4")}


def _xpk_pod0(name: str) -> str:
    """Pod 0 of an xpk workload: xpk names its JobSet after the workload and its replicated job `slice-job`."""
    return f"{name}-slice-job-0-0.{name}"


def _grace(cfg: ShardConfig) -> int:
    """Seconds a SIGTERM (preemption, deletion) leaves the run to take its final checkpoint."""
    return int(cfg.checkpoint.preemption_grace_s) + 30


def render(cfg: ShardConfig, config_name: str) -> Rendering:
    d = cfg.deploy
    for key in ("cluster", "image"):
        if getattr(d, key) is None:
            raise ConfigError(f"deploy.{key}", f"--target gke needs deploy.{key}: "
                                               + ("the GKE cluster to run in" if key == "cluster" else
                                                  "a container image holding xla_shard and its runtime"))
    if len(d.name) > 40:
        raise ConfigError("deploy.name", f"{d.name!r}: a GKE workload name is at most 40 characters (its pods "
                                         "are named after it, and xpk allows no more)")
    if d.provisioning in ("preemptible", "reserved"):
        raise ConfigError("deploy.provisioning", f"{d.provisioning}: on GKE the node pool decides reserved capacity; "
                                                 "use spot (spot node pools only) or on-demand (any node pool)")
    if cfg.checkpoint.dir and "://" not in cfg.checkpoint.dir:
        raise ConfigError("checkpoint.dir", f"{cfg.checkpoint.dir!r} is a local path, which a restarted pod does "
                                            "not have: use a gs:// URL, so that resume: auto continues there")
    from xla_shard import backends

    # A backend that runs on TPUs (auto: xla_spmd) gets a TPU slice; torch_fsdp gets GPU node pools.
    on_tpu = "tpu" in backends.capabilities(backends.resolve_name(cfg, on="tpu")).platforms
    manifest, xpk = _tpu(cfg, config_name) if on_tpu else _gpu(cfg, config_name)
    rendering = Rendering("gke")
    where = [f"--zone={d.zone}", f"--project={d.project}"]
    credentials = ["gcloud", "container", "clusters", "get-credentials", d.cluster, *where]
    apply = ["kubectl", "apply", f"--filename={HERE}/jobset.yaml"]
    delete = ["kubectl", "delete", "--ignore-not-found", f"--filename={HERE}/jobset.yaml"]
    follow = ["kubectl", "logs", "--follow", f"--namespace={d.namespace}", "--max-log-requests=64",
              f"--selector=jobset.sigs.k8s.io/jobset-name={d.name}"]
    rendering.commands = [credentials]
    rendering.xpk = [xpk] if xpk else []
    common = common_header(cfg, "gke", config_name)
    rendering.files["deploy.sh"] = template("gke.sh.tmpl").substitute(
        common=common, credentials=shell_line(credentials), apply=shell_line(apply, "KUBECTL"),
        **messages(d.name, follow))
    rendering.files["teardown.sh"] = template("gke_teardown.sh.tmpl").substitute(
        common=common, delete=shell_line(delete, "KUBECTL"))
    create = shell_line(xpk, "XPK") if xpk else (
        f"echo {shlex.quote(f'xpk.sh: xpk has no {d.accelerator_type} device type; run deploy.sh instead')} >&2\n"
        "exit 2")
    rendering.files["xpk.sh"] = template("xpk.sh.tmpl").substitute(common=common, create=create)
    rendering.files["jobset.yaml"] = yaml.dump_all(manifest, Dumper=_ManifestDumper, sort_keys=False)
    rendering.files[config_name] = dump(cfg)
    return rendering


class _ManifestDumper(yaml.SafeDumper):
    """Plain YAML a reader (and kubectl) takes as written: no anchors for repeated values, and the config as
    a literal block."""

    def ignore_aliases(self, data) -> bool:
        return True


_ManifestDumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def _tpu(cfg: ShardConfig, config_name: str) -> tuple[list[dict], list[str] | None]:
    d = cfg.deploy
    tpu_slice = tpu.parse_gke(d.accelerator_type)
    tpu.check_zone(tpu_slice.generation, d.zone, d.allow_unlisted_zone)  # the cluster's zone holds its node pools
    hosts = tpu_slice.hosts * d.num_slices
    check_common(cfg, hosts)
    capabilities = check_backend(cfg, "tpu", hosts)
    kind = capabilities.tpu_setup
    if d.num_slices > 1 and capabilities.launcher != "in_process":
        raise ConfigError("deploy.num_slices", f"{d.num_slices} slices run as one SPMD program over DCN, one "
                                               f"process per host: backend {capabilities.name} cannot; use xla_spmd")
    env = [{"name": "PJRT_DEVICE", "value": "TPU"}] if kind == "tpu" else []
    env.append({"name": "MASTER_ADDR", "valueFrom": {"fieldRef": {"fieldPath": COORDINATOR}}})
    selector = {"cloud.google.com/gke-tpu-accelerator": tpu_slice.generation.gke_accelerator,
                "cloud.google.com/gke-tpu-topology": tpu_slice.topology}
    container = _container(cfg, config_name, [], env, {"google.com/tpu": tpu_slice.chips_per_host},
                           ports=[8471, 8080])  # the TPU runtime's ports, as xpk's JobSets declare them
    # Multi-slice traffic crosses hosts over DCN at the host's own bandwidth (as xpk runs TPU pods).
    pod = _pod(cfg, container, selector) | {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}
    manifest = _manifest(cfg, config_name, "slice", d.num_slices, tpu_slice.hosts, pod,
                         annotations={"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"})
    run = ({"PJRT_DEVICE": "TPU"} if kind == "tpu" else {}) | {"MASTER_ADDR": _xpk_pod0(d.name)}
    xpk = _xpk(cfg, config_name, [f"--tpu-type={d.accelerator_type}", f"--num-slices={d.num_slices}"], run, []) \
        if xpk_knows(tpu_slice) else None
    return manifest, xpk


def xpk_knows(tpu_slice: tpu.GkeSlice) -> bool:
    """Whether `xpk workload create --tpu-type` takes the slice: its table starts v5e at 8 chips, where GKE
    also runs 1 and 4 (the tests compare with xpk's table)."""
    return not (tpu_slice.generation.prefix == "v5litepod" and tpu_slice.chips < 8)


def _gpu(cfg: ShardConfig, config_name: str) -> tuple[list[dict], list[str]]:
    d = cfg.deploy
    if d.num_slices > 1:
        raise ConfigError("deploy.num_slices", f"{d.num_slices}: slices are TPU slices; a GPU workload's size is "
                                               "deploy.gpu_nodes")
    if d.gpu_machine_type not in GKE_GPUS:
        raise ConfigError("deploy.gpu_machine_type", f"{d.gpu_machine_type!r} is not a GPU machine type xla_shard "
                                                     f"runs on GKE ({', '.join(GKE_GPUS)})")
    if cfg.launch.nnodes not in (1, d.gpu_nodes):
        raise ConfigError("launch.nnodes", f"{cfg.launch.nnodes}, but deploy.gpu_nodes is {d.gpu_nodes}: the GKE "
                                           "workload starts one node per pod; set them alike")
    check_common(cfg, d.gpu_nodes)
    accelerator, device_type = GKE_GPUS[d.gpu_machine_type]
    gpus = GPU_MACHINES[d.gpu_machine_type]
    nodes = [f"--set=launch.nnodes={d.gpu_nodes}", f"--set=launch.rdzv_id={d.name}"]
    sets = nodes + ["--set=launch.node_rank=$(NODE_RANK)", f"--set=launch.rdzv_endpoint=$(COORDINATOR):{RDZV_PORT}"]
    env = [{"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
           {"name": "COORDINATOR", "valueFrom": {"fieldRef": {"fieldPath": COORDINATOR}}}]
    container = _container(cfg, config_name, sets, env, {"nvidia.com/gpu": gpus}, ports=[RDZV_PORT])
    pod = _pod(cfg, container, {"cloud.google.com/gke-accelerator": accelerator})
    pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    manifest = _manifest(cfg, config_name, "node", 1, d.gpu_nodes, pod)
    # xpk's GPU pods carry NODE_RANK themselves (expanded by the pod's bash); its pod 0 is the rendezvous.
    xpk_sets = nodes + [f"--set=launch.rdzv_endpoint={_xpk_pod0(d.name)}:{RDZV_PORT}"]
    xpk = _xpk(cfg, config_name, [f"--device-type={device_type}", f"--num-nodes={d.gpu_nodes}"], {}, xpk_sets,
               expanded='--set=launch.node_rank="$NODE_RANK"')
    return manifest, xpk


def _container(cfg: ShardConfig, config_name: str, sets: list[str], env: list[dict], chips: dict,
               ports: list[int]) -> dict:
    return {"name": CONTAINER, "image": cfg.deploy.image,
            "command": ["xla-shard", "train", f"{CONFIG_DIR}/{config_name}", *sets],
            "env": env, "ports": [{"containerPort": port} for port in ports],
            "resources": {"limits": chips, "requests": chips},
            "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]}


def _pod(cfg: ShardConfig, container: dict, selector: dict) -> dict:
    if cfg.deploy.provisioning == "spot":
        selector = selector | {"cloud.google.com/gke-spot": "true"}
    return {"restartPolicy": "Never", "nodeSelector": selector, "terminationGracePeriodSeconds": _grace(cfg),
            "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": f"{cfg.deploy.name}-config"}}]}


def _manifest(cfg: ShardConfig, config_name: str, job: str, replicas: int, pods: int, pod: dict,
              annotations: dict | None = None) -> list[dict]:
    """The ConfigMap holding the config, and the JobSet."""
    d = cfg.deploy
    labels = {"app.kubernetes.io/name": "xla-shard", "app.kubernetes.io/instance": d.name}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": f"{d.name}-config", "namespace": d.namespace, "labels": labels},
                  "data": {config_name: dump(cfg)}}
    job_spec = {"parallelism": pods, "completions": pods, "completionMode": "Indexed", "backoffLimit": 0,
                "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                    "containerName": CONTAINER, "operator": "In", "values": [USER_ERROR]}}]},
                "template": {"metadata": {"labels": labels}, "spec": pod}}
    jobset = {"apiVersion": JOBSET_API, "kind": "JobSet",
              "metadata": {"name": d.name, "namespace": d.namespace, "labels": labels,
                           **({"annotations": annotations} if annotations else {})},
              "spec": {"failurePolicy": {"maxRestarts": d.max_restarts, "rules": [
                           # the podFailurePolicy above fails a Job only for a user error
                           {"name": "UserError", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]},
                       "network": {"enableDNSHostnames": True},
                       "coordinator": {"replicatedJob": job, "jobIndex": 0, "podIndex": 0},
                       "replicatedJobs": [{"name": job, "replicas": replicas, "template": {"spec": job_spec}}]}}
    return [config_map, jobset]


def _xpk(cfg: ShardConfig, config_name: str, accelerator: list[str], env: dict[str, str], sets: list[str],
         expanded: str = "") -> list[str]:
    """`xpk workload create`: xpk runs --command with bash in the image on every VM of the workload. Every
    word of it is quoted for that bash; `expanded` is the one fixed text it expands."""
    d = cfg.deploy
    encoded = base64.b64encode(dump(cfg).encode()).decode()
    path = shlex.quote(f"/tmp/{config_name}")
    words = [f"{key}={shlex.quote(value)}" for key, value in env.items()]
    words += ["xla-shard", "train", path, *map(shlex.quote, sets), *([expanded] if expanded else [])]
    command = f"echo {encoded} | base64 -d > {path} && {' '.join(words)}"
    capacity = {"spot": ["--spot"], "on-demand": ["--on-demand"]}[d.provisioning]
    return ["xpk", "workload", "create", f"--workload={d.name}", f"--cluster={d.cluster}", f"--project={d.project}",
            f"--zone={d.zone}", *accelerator, f"--docker-image={d.image}", f"--max-restarts={d.max_restarts}",
            # xpk restarts on 42 and 127-255 only; 1 is a lost peer or a crash, which a restart may mend
            "--restart-on-exit-codes=1",
            f"--termination-grace-period-seconds={_grace(cfg)}", *capacity,
            f"--command={command}"]
