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
import hashlib
import shlex
from collections.abc import Callable

import yaml

from xla_shard.config import dump
from xla_shard.config.schema import DeploySection, ShardConfig
from xla_shard.deploy import tpu
from xla_shard.deploy.scripts import (GPU_MACHINES, HERE, Rendering, check_backend, check_common, common_header,
                                     messages, shell_line, template)
from xla_shard.errors import ConfigError, Problems, one_line
from xla_shard.io.staged import is_url

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
CONTAINER = "train"
CONFIG_DIR = "/etc/xla-shard"
RDZV_PORT = 29500
USER_ERROR = 2  # xla-shard's exit status for a user error: no restart mends it
CONFIGMAP_BYTES = 2**20  # what one ConfigMap holds
# Kueue's labels on a workload it admits (kueue.x-k8s.io/queue-name, kueue.x-k8s.io/priority-class).
KUEUE_QUEUE, KUEUE_PRIORITY = "kueue.x-k8s.io/queue-name", "kueue.x-k8s.io/priority-class"
XPK_PRIORITIES = ("very-low", "low", "medium", "high", "very-high")  # xpk workload create --priority
# A per-argument limit of Linux (MAX_ARG_STRLEN, 128 KiB) bounds each word of the xpk command, and each variable
# of its pods' environment: the config travels in variables of at most this many base64 characters.
XPK_CHUNK = 96 * 2**10
CONFIG_VARIABLE = "XLA_SHARD_CONFIG_"
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


def _requirements(cfg: ShardConfig) -> list[Callable[[], None]]:
    """The checks of a config's GKE facts that do not depend on one another: each raises one ConfigError."""
    d = cfg.deploy

    def needs(key: str, what: str) -> Callable[[], None]:
        def check() -> None:
            if getattr(d, key) is None:
                raise ConfigError(f"deploy.{key}", f"--target gke needs deploy.{key}: {what}")
        return check

    def name() -> None:
        if len(d.name) > 40:
            raise ConfigError("deploy.name", f"{d.name!r}: a GKE workload name is at most 40 characters (its pods "
                                             "are named after it, and xpk allows no more)")

    def provisioning() -> None:
        if d.provisioning in ("preemptible", "reserved"):
            raise ConfigError("deploy.provisioning", f"{d.provisioning}: on GKE the node pool decides reserved "
                                                     "capacity; use spot (spot node pools only) or on-demand (any "
                                                     "node pool)")

    def storage() -> None:
        if cfg.checkpoint.dir and not is_url(cfg.checkpoint.dir):
            raise ConfigError("checkpoint.dir", f"{cfg.checkpoint.dir!r} is a local path, which a restarted pod "
                                                "does not have: use a gs:// URL, so that resume: auto continues "
                                                "there")

    def outputs() -> None:
        if not is_url(cfg.output_dir):
            raise ConfigError("output_dir", f"{cfg.output_dir!r} is a local path: a pod's metrics (and a "
                                            "FULL_STATE_DICT export) vanish with it at every restart; use a gs:// "
                                            "URL")

    def region() -> None:
        if d.region and not d.zone.startswith(f"{d.region}-"):
            raise ConfigError("deploy.zone", f"{d.zone} is not in deploy.region {d.region}: the node pools of a "
                                             "regional cluster are in its zones")

    def size() -> None:
        size = len(dump(cfg).encode())
        if size > CONFIGMAP_BYTES:
            raise ConfigError("config", f"{size / 2**10:.0f} KiB of config is more than a ConfigMap holds "
                                        f"({CONFIGMAP_BYTES // 2**10} KiB): move large values (a chat template) "
                                        "to files beside the model")

    return [needs("cluster", "the GKE cluster to run in"),
            needs("image", "a container image holding xla_shard and its runtime"), name, provisioning, storage,
            outputs, region, size]


def default_name(cfg: ShardConfig) -> str:
    """A workload name for a config that left deploy.name at its default: the default and 8 hex digits of the
    run's checkpoint directory (else its output_dir). Two runs sharing a namespace get names of their own,
    and re-deploying a run (changed or not) replaces its own JobSet."""
    if cfg.deploy.name != DeploySection.model_fields["name"].default:
        return cfg.deploy.name
    run = cfg.checkpoint.dir or cfg.output_dir
    return f"{cfg.deploy.name}-{hashlib.sha256(run.encode()).hexdigest()[:8]}"


def render(cfg: ShardConfig, config_name: str) -> Rendering:
    """The rendering, or every problem of the config at once (one ConfigError, or `Problems` of several)."""
    cfg = cfg.model_copy(update={"deploy": cfg.deploy.model_copy(update={"name": default_name(cfg)})})
    d = cfg.deploy
    problems: list[ConfigError] = []
    for check in _requirements(cfg):
        try:
            check()
        except ConfigError as exc:
            problems.append(exc)
    from xla_shard import backends

    # A backend that runs on TPUs (auto: xla_spmd) gets a TPU slice; torch_fsdp gets GPU node pools.
    on_tpu = "tpu" in backends.capabilities(backends.resolve_name(cfg, on="tpu")).platforms
    try:
        manifest, xpk = _tpu(cfg, config_name) if on_tpu else _gpu(cfg, config_name)
    except ConfigError as exc:
        problems.append(exc)
    except Problems as several:  # every target's own checks (`check_common`)
        problems.extend(several.errors)
    problems = _first_per_key(problems)
    if problems:
        raise problems[0] if len(problems) == 1 else Problems(problems)
    rendering = Rendering("gke")
    where = [f"--region={d.region}" if d.region else f"--zone={d.zone}", f"--project={d.project}"]
    credentials = ["gcloud", "container", "clusters", "get-credentials", d.cluster, *where]
    # A JobSet's spec cannot change in place: a re-deploy deletes the old one first (its pods take their
    # preemption grace to checkpoint), then applies the new.
    replace = ["kubectl", "delete", "jobset", d.name, f"--namespace={d.namespace}", "--ignore-not-found",
               "--wait=true"]
    apply = ["kubectl", "apply", f"--filename={HERE}/jobset.yaml"]
    delete = ["kubectl", "delete", "--ignore-not-found", f"--filename={HERE}/jobset.yaml"]
    follow = ["kubectl", "logs", "--follow", f"--namespace={d.namespace}", "--max-log-requests=64",
              f"--selector=jobset.sigs.k8s.io/jobset-name={d.name}"]
    rendering.commands = [credentials]
    rendering.xpk = [xpk] if xpk else []
    common = common_header(cfg, "gke", config_name)
    notes = _notes(cfg)
    rendering.files["deploy.sh"] = template("gke.sh.tmpl").substitute(
        common=common, credentials=shell_line(credentials), replace=shell_line(replace, "KUBECTL"),
        apply=shell_line(apply, "KUBECTL"), notes=_said(notes),
        **messages(d.name, follow))
    rendering.files["teardown.sh"] = template("gke_teardown.sh.tmpl").substitute(
        common=common, delete=shell_line(delete, "KUBECTL"))
    create = shell_line(xpk, "XPK") if xpk else (
        f"echo {shlex.quote(f'xpk.sh: xpk has no {d.accelerator_type} device type; run deploy.sh instead')} >&2\n"
        "exit 2")
    rendering.files["xpk.sh"] = template("xpk.sh.tmpl").substitute(
        common=common, create=create, notes=_said([f"xpk.sh: {note}" for note in _xpk_notes(cfg)]))
    if d.service_account:
        bind = _binding(cfg)
        rendering.commands.append(bind)
        rendering.files["bind_service_account.sh"] = template("gke_bind.sh.tmpl").substitute(
            common=common, bind=shell_line(bind))
    rendering.files["jobset.yaml"] = "".join(f"# {one_line(n)}\n" for n in notes) + yaml.dump_all(
        manifest, Dumper=_ManifestDumper, sort_keys=False)
    rendering.files[config_name] = dump(cfg)
    return rendering


def _said(notes: list[str]) -> str:
    """Shell lines printing each note to stderr, each a single quoted word."""
    return "\n".join(f"echo {shlex.quote(note)} >&2" for note in notes)


def _first_per_key(problems: list[ConfigError]) -> list[ConfigError]:
    """A key's first problem only: a later check of the same key (check_common's, say) would repeat it."""
    keys: set[str | None] = set()
    kept = []
    for problem in problems:
        if problem.key not in keys:
            keys.add(problem.key)
            kept.append(problem)
    return kept


def _notes(cfg: ShardConfig) -> list[str]:
    """What the rendering chose that a platform team would want said: where the pods may run, as whom, and
    under which queue."""
    d = cfg.deploy
    notes = [f"{d.name}: deploy.provisioning {d.provisioning}: "
             + ("the pods wait for a spot node pool (cloud.google.com/gke-spot=true); set on-demand for others"
                if d.provisioning == "spot" else "the pods run on any node pool with the accelerators")]
    notes.append(f"{d.name}: pods run as Kubernetes service account {d.name}, bound to {d.service_account} "
                 "through Workload Identity (bind_service_account.sh, once)" if d.service_account else
                 f"{d.name}: pods run as namespace {d.namespace}'s default Kubernetes service account: on a "
                 "Workload Identity cluster set deploy.service_account for gs:// access")
    if d.queue:
        notes.append(f"{d.name}: submitted to Kueue queue {d.queue}"
                     + (f" at priority {d.priority_class}" if d.priority_class else ""))
    return notes


def _xpk_notes(cfg: ShardConfig) -> list[str]:
    """What xpk's workload does not carry of the config (xpk has no flags for them)."""
    d = cfg.deploy
    notes = []
    if d.service_account:
        notes.append(f"xpk runs the pods as namespace {d.namespace}'s default Kubernetes service account, not "
                     f"{d.name}: bind that one to {d.service_account}, or use deploy.sh")
    if d.queue:
        notes.append(f"xpk submits to its own Kueue queue, not {d.queue}")
    if d.priority_class and d.priority_class not in XPK_PRIORITIES:
        notes.append(f"xpk takes only the priorities {', '.join(XPK_PRIORITIES)}; {d.priority_class} is not passed")
    if d.cpu or d.memory:
        notes.append("xpk sets the pods' CPU and memory requests itself; deploy.cpu and deploy.memory are not passed")
    return notes


def _binding(cfg: ShardConfig) -> list[str]:
    """The one-time Workload Identity binding: the job's Kubernetes service account may act as the Google one."""
    d = cfg.deploy
    return ["gcloud", "iam", "service-accounts", "add-iam-policy-binding", d.service_account,
            "--role=roles/iam.workloadIdentityUser",
            f"--member=serviceAccount:{d.project}.svc.id.goog[{d.namespace}/{d.name}]", f"--project={d.project}"]


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
    capabilities = check_backend(cfg, "tpu")
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
            "resources": {"limits": chips, "requests": chips | {key: value for key, value in (
                ("cpu", cfg.deploy.cpu), ("memory", cfg.deploy.memory)) if value}},
            "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]}


def _pod(cfg: ShardConfig, container: dict, selector: dict) -> dict:
    if cfg.deploy.provisioning == "spot":
        selector = selector | {"cloud.google.com/gke-spot": "true"}
    account = {"serviceAccountName": cfg.deploy.name} if cfg.deploy.service_account else {}
    return {"restartPolicy": "Never", "nodeSelector": selector, "terminationGracePeriodSeconds": _grace(cfg),
            **account, "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": f"{cfg.deploy.name}-config"}}]}


def _manifest(cfg: ShardConfig, config_name: str, job: str, replicas: int, pods: int, pod: dict,
              annotations: dict | None = None) -> list[dict]:
    """The ConfigMap holding the config, the Kubernetes service account Workload Identity binds (with
    deploy.service_account), and the JobSet."""
    d = cfg.deploy
    labels = {"app.kubernetes.io/name": "xla-shard", "app.kubernetes.io/instance": d.name}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": f"{d.name}-config", "namespace": d.namespace, "labels": labels},
                  "data": {config_name: dump(cfg)}}
    accounts = [{"apiVersion": "v1", "kind": "ServiceAccount",
                 "metadata": {"name": d.name, "namespace": d.namespace, "labels": labels,
                              "annotations": {"iam.gke.io/gcp-service-account": d.service_account}}}
                ] if d.service_account else []
    admission = {key: value for key, value in ((KUEUE_QUEUE, d.queue), (KUEUE_PRIORITY, d.priority_class)) if value}
    job_spec = {"parallelism": pods, "completions": pods, "completionMode": "Indexed", "backoffLimit": 0,
                "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                    "containerName": CONTAINER, "operator": "In", "values": [USER_ERROR]}}]},
                "template": {"metadata": {"labels": labels}, "spec": pod}}
    jobset = {"apiVersion": JOBSET_API, "kind": "JobSet",
              "metadata": {"name": d.name, "namespace": d.namespace, "labels": labels | admission,
                           **({"annotations": annotations} if annotations else {})},
              "spec": {"failurePolicy": {"maxRestarts": d.max_restarts, "rules": [
                           # the podFailurePolicy above fails a Job only for a user error
                           {"name": "UserError", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]},
                       "network": {"enableDNSHostnames": True},
                       "coordinator": {"replicatedJob": job, "jobIndex": 0, "podIndex": 0},
                       "replicatedJobs": [{"name": job, "replicas": replicas, "template": {"spec": job_spec}}]}}
    return [config_map, *accounts, jobset]


def _xpk(cfg: ShardConfig, config_name: str, accelerator: list[str], env: dict[str, str], sets: list[str],
         expanded: str = "") -> list[str]:
    """`xpk workload create`: xpk runs --command with bash in the image on every VM of the workload. Every
    word of it is quoted for that bash; `expanded` is the one fixed text it expands. The config travels
    base64-encoded in the pods' environment, split over variables (`XPK_CHUNK` characters each) that the
    command joins with bash's own printf: no word of any command line grows with the config."""
    d = cfg.deploy
    encoded = base64.b64encode(dump(cfg).encode()).decode()
    chunks = [encoded[i:i + XPK_CHUNK] for i in range(0, len(encoded), XPK_CHUNK)]
    parts = " ".join(f'"${CONFIG_VARIABLE}{i}"' for i in range(len(chunks)))
    path = shlex.quote(f"/tmp/{config_name}")
    words = [f"{key}={shlex.quote(value)}" for key, value in env.items()]
    words += ["xla-shard", "train", path, *map(shlex.quote, sets), *([expanded] if expanded else [])]
    command = f"printf %s {parts} | base64 -d > {path} && {' '.join(words)}"
    capacity = ["--spot"] if d.provisioning == "spot" else ["--on-demand"]  # the others are refused
    priority = [f"--priority={d.priority_class}"] if d.priority_class in XPK_PRIORITIES else []
    return ["xpk", "workload", "create", f"--workload={d.name}", f"--cluster={d.cluster}", f"--project={d.project}",
            f"--zone={d.zone}", f"--namespace={d.namespace}", *accelerator, f"--docker-image={d.image}",
            f"--max-restarts={d.max_restarts}", *priority,
            *[f"--env={CONFIG_VARIABLE}{i}={chunk}" for i, chunk in enumerate(chunks)],
            # xpk restarts on 42 and 127-255 only; 1 is a lost peer or a crash, which a restart may mend
            "--restart-on-exit-codes=1",
            f"--termination-grace-period-seconds={_grace(cfg)}", *capacity,
            f"--command={command}"]
