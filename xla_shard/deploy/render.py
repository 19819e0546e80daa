"""Render the gcloud commands and scripts that run a config on Cloud TPU VMs, queued resources or GPU VMs
(and, through `deploy.gke`, on GKE).

Every gcloud command is built here as an argv list (so tests can hand each one to the real gcloud CLI) and
written into scripts from the templates in `gcp/`. Values come from the config's `deploy`, `backend` and
`checkpoint` sections; package versions come from pyproject.toml on the machine itself (`pip install -e`),
so nothing is copied by hand into a second place.

Quoting: the schema admits only what GCP accepts for each `deploy` value, and on top of that every value is
quoted for the exact shell it reaches: `shlex.quote` for the local script, again inside the `--command`
strings the remote login shell runs, and inside the `bash -c` string startup.sh runs as the remote user.
Nothing from the config is ever placed inside double quotes, where `$(...)` would still expand.
"""

from __future__ import annotations

import shlex

from xla_shard.config import dump
from xla_shard.config.schema import ShardConfig
from xla_shard.deploy import gke, tpu
from xla_shard.deploy.scripts import (GPU_MACHINES, HERE, Rendering, check_backend, check_common, common_header,
                                     messages, shell_line, template)
from xla_shard.errors import ConfigError, UserError

TARGETS = ("tpu-vm", "queued-resource", "gpu-vm", "gke")
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"


def _remote(remote_dir: str, *commands: str) -> str:
    """A command line for the remote login shell, run in ~/remote_dir (quoted; `~/` stays unquoted so it
    expands)."""
    return " && ".join([f"cd ~/{shlex.quote(remote_dir)}", *commands])


def _launch(launch_env: dict[str, str], config_name: str, log: str, args: str = "") -> str:
    """`args`: more of `xla-shard train`'s arguments, shell words as they are (validated names only)."""
    env = " ".join(f"{key}={shlex.quote(value)}" for key, value in launch_env.items())
    return (f"{env}{' ' if env else ''}setsid nohup scripts/train_loop.sh ~/{shlex.quote(config_name)}"
            f"{' ' if args else ''}{args} {log} 2>&1 < /dev/null &")


def _startup(target: str, user: str, remote_dir: str, launch_env: dict[str, str], config_name: str,
             args: str = "") -> str:
    command = _remote(remote_dir, _launch(launch_env, config_name, ">> ~/train.log", args))
    return template("startup.sh.tmpl").substitute(
        target=target, user=shlex.quote(user), remote_dir=shlex.quote(remote_dir), command=shlex.quote(command))


def _checkout() -> str:
    """The deploy scripts' first step: archive HEAD of the xla_shard checkout for the workers."""
    return template("checkout.sh.tmpl").substitute().rstrip("\n")


def render(cfg: ShardConfig, target: str, config_name: str = "config.yaml") -> Rendering:
    if target not in TARGETS:
        raise UserError(f"--target {target!r}: choose one of {', '.join(TARGETS)}")
    if target == "gpu-vm":
        return _render_gpu(cfg, config_name)
    if target == "gke":
        return gke.render(cfg, config_name)
    return _render_tpu(cfg, target, config_name)


def _render_tpu(cfg: ShardConfig, target: str, config_name: str) -> Rendering:
    d = cfg.deploy
    if d.num_slices > 1:
        raise ConfigError("deploy.num_slices", f"{d.num_slices} slices: xla_shard renders several slices for "
                                               "--target gke only")
    tpu_slice = tpu.parse(d.accelerator_type, d.zone, d.allow_unlisted_zone)
    check_common(cfg, tpu_slice.hosts)
    where = [f"--zone={d.zone}", f"--project={d.project}"]
    node = f"{d.remote_user}@{d.name}"
    ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", node, *where, "--worker=all"]
    placement = [*( [f"--network={d.network}"] if d.network else []),
                 *( [f"--subnetwork={d.subnetwork}"] if d.subnetwork else [])]
    account = ([f"--service-account={d.service_account}"] if d.service_account else []) + [f"--scopes={CLOUD_PLATFORM}"]
    provisioning = {"spot": ["--spot"], "preemptible": ["--preemptible"], "reserved": ["--reserved"],
                    "on-demand": []}[d.provisioning]
    rendering = Rendering(target)
    if target == "tpu-vm":
        create = ["gcloud", "compute", "tpus", "tpu-vm", "create", d.name, *where,
                  f"--accelerator-type={tpu_slice.accelerator_type}", f"--version={tpu_slice.runtime_version}",
                  *provisioning, *placement, *account, f"--metadata-from-file=startup-script={HERE}/startup.sh"]
        delete = [["gcloud", "compute", "tpus", "tpu-vm", "delete", d.name, *where, "--quiet"]]
        poll = []
    else:
        if d.provisioning == "preemptible":
            raise ConfigError("deploy.provisioning", "queued resources take spot, reserved or on-demand capacity")
        create = ["gcloud", "compute", "tpus", "queued-resources", "create", d.name, f"--node-id={d.name}", *where,
                  f"--accelerator-type={tpu_slice.accelerator_type}", f"--runtime-version={tpu_slice.runtime_version}",
                  *provisioning, f"--valid-until-duration={_duration(d.valid_until)}", *placement, *account,
                  f"--metadata-from-file=startup-script={HERE}/startup.sh"]
        poll = ["gcloud", "compute", "tpus", "queued-resources", "describe", d.name, *where,
                "--format=value(state.state)"]
        delete = [["gcloud", "compute", "tpus", "queued-resources", "delete", d.name, *where, "--force", "--quiet"]]
    copy = ["gcloud", "compute", "tpus", "tpu-vm", "scp", f"{HERE}/xla_shard.tar.gz", f"{HERE}/{config_name}",
            f"{node}:~/", *where, "--worker=all"]
    # torch_xla reads PJRT_DEVICE; TorchTPU needs no variable, and its setup installs torch_tpu instead.
    kind = check_backend(cfg, "tpu").tpu_setup
    launch_env = {"PJRT_DEVICE": "TPU"} if kind == "tpu" else {}
    setup = ssh + [f"--command={_setup(d.remote_dir, kind)}"]
    launch = ssh + [f"--command={_remote(d.remote_dir, _launch(launch_env, config_name, '> ~/train.log'))}"]
    follow = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", node, *where, "--worker=0", "--command=tail -F ~/train.log"]
    rendering.commands = [create, *( [poll] if poll else []), copy, setup, launch, follow, *delete]
    common = common_header(cfg, target, config_name)
    values = dict(common=common, checkout=_checkout(), create=shell_line(create), copy=shell_line(copy),
                  setup=shell_line(setup), launch=shell_line(launch), poll=shell_line(poll)[4:] if poll else "",
                  **messages(d.name, follow))
    script = "tpu_vm.sh.tmpl" if target == "tpu-vm" else "queued_resource.sh.tmpl"
    rendering.files["deploy.sh"] = template(script).substitute(values)
    rendering.files["teardown.sh"] = template("teardown.sh.tmpl").substitute(
        common=common, delete="\n".join(shell_line(c) for c in delete))
    rendering.files["startup.sh"] = _startup(target, d.remote_user, d.remote_dir, launch_env, config_name)
    rendering.files[config_name] = dump(cfg)
    return rendering


def _render_gpu(cfg: ShardConfig, config_name: str) -> Rendering:
    d = cfg.deploy
    check_backend(cfg, "cuda")
    gpus = GPU_MACHINES.get(d.gpu_machine_type)
    if gpus is None:
        raise ConfigError("deploy.gpu_machine_type", f"{d.gpu_machine_type!r} is not a GPU machine type xla_shard "
                                                     f"knows ({', '.join(GPU_MACHINES)})")
    check_common(cfg, d.gpu_nodes)
    if d.num_slices > 1:
        raise ConfigError("deploy.num_slices", f"{d.num_slices}: slices are TPU slices; a GPU job's size is "
                                               "deploy.gpu_nodes")
    where = [f"--zone={d.zone}", f"--project={d.project}"]
    names = [d.name] if d.gpu_nodes == 1 else [f"{d.name}-{i}" for i in range(d.gpu_nodes)]
    provisioning = {"spot": ["--provisioning-model=SPOT", "--instance-termination-action=STOP"],
                    "preemptible": ["--preemptible"], "reserved": ["--reservation-affinity=any"],
                    "on-demand": []}[d.provisioning]
    account = ([f"--service-account={d.service_account}"] if d.service_account else []) + [f"--scopes={CLOUD_PLATFORM}"]
    create = ["gcloud", "compute", "instances", "create", *names, *where, f"--machine-type={d.gpu_machine_type}",
              f"--image-family={d.gpu_image_family}", f"--image-project={d.gpu_image_project}",
              "--boot-disk-size=200GB", "--maintenance-policy=TERMINATE", *provisioning,
              *([f"--network={d.network}"] if d.network else []),
              *([f"--subnet={d.subnetwork}"] if d.subnetwork else []),
              *account, f"--metadata-from-file=startup-script={HERE}/startup.sh"]
    # xla-shard's own launch on every node (torchrun's workers started as the launcher starts them anywhere);
    # several nodes: torchrun's static rendezvous, node r holding ranks r*gpus.. (not join order)
    if cfg.launch.nnodes not in (1, d.gpu_nodes):
        raise ConfigError("launch.nnodes", f"{cfg.launch.nnodes}, but deploy.gpu_nodes is {d.gpu_nodes}: one "
                                           "node per VM; set them alike")
    launch = {"nproc_per_node": gpus}
    if d.gpu_nodes > 1:
        launch.update(nnodes=d.gpu_nodes, rdzv_endpoint=f"{names[0]}:{gke.RDZV_PORT}", rdzv_id=d.name)
    cfg = cfg.model_copy(update={"launch": cfg.launch.model_copy(update=launch)})
    copies, setups, launches = [], [], []
    for rank, name in enumerate(names):
        node = f"{d.remote_user}@{name}"
        copies.append(["gcloud", "compute", "scp", f"{HERE}/xla_shard.tar.gz", f"{HERE}/{config_name}", f"{node}:~/",
                       *where])
        setups.append(["gcloud", "compute", "ssh", node, *where, f"--command={_setup(d.remote_dir, 'gpu')}"])
        args = f"--set launch.node_rank={rank}" if d.gpu_nodes > 1 else ""
        launches.append(["gcloud", "compute", "ssh", node, *where,
                         f"--command={_remote(d.remote_dir, _launch({}, config_name, '> ~/train.log', args))}"])
    follow = ["gcloud", "compute", "ssh", f"{d.remote_user}@{names[0]}", *where, "--command=tail -F ~/train.log"]
    delete = ["gcloud", "compute", "instances", "delete", *names, *where, "--quiet"]
    rendering = Rendering("gpu-vm", [create, *copies, *setups, *launches, follow, delete])
    common = common_header(cfg, "gpu-vm", config_name)
    rendering.files["deploy.sh"] = template("gpu_vm.sh.tmpl").substitute(
        common=common, checkout=_checkout(), create=shell_line(create), copy="\n".join(map(shell_line, copies)),
        setup="\n".join(map(shell_line, setups)), launch="\n".join(map(shell_line, launches)),
        **messages(d.name, follow))
    rendering.files["teardown.sh"] = template("teardown.sh.tmpl").substitute(common=common, delete=shell_line(delete))
    # A VM restarted after a preemption finds its rank in its own name (NAME-RANK), as it was launched.
    rank = '--set launch.node_rank="${HOSTNAME##*-}"' if d.gpu_nodes > 1 else ""
    rendering.files["startup.sh"] = _startup("gpu-vm", d.remote_user, d.remote_dir, {}, config_name, rank)
    rendering.files[config_name] = dump(cfg)
    return rendering


def _setup(remote_dir: str, kind: str) -> str:
    """Unpack the code into ~/remote_dir and set the machine up (a remote command line)."""
    quoted = shlex.quote(remote_dir)
    return (f"mkdir -p ~/{quoted} && tar xzf ~/xla_shard.tar.gz -C ~/{quoted} && "
            f"bash ~/{quoted}/scripts/setup_worker.sh {kind}")


def _duration(text: str) -> str:
    """gcloud reads `--valid-until-duration=30m` as thirty *months*. The config takes s, min, h or d, and
    minutes are rendered as seconds, so no ambiguous `m` ever reaches gcloud."""
    import re

    match = re.fullmatch(r"\s*(\d+)\s*(s|sec|min|h|d)\s*", text)
    if not match:
        raise ConfigError("deploy.valid_until", f"{text!r}: use a number with s, min, h or d (e.g. 6h, 90min, 2d); "
                                                "gcloud reads a bare 'm' as months")
    number, unit = int(match.group(1)), match.group(2)
    seconds = {"s": f"{number}s", "sec": f"{number}s", "min": f"{number * 60}s"}
    return {**seconds, "h": f"{number}h", "d": f"{number}d"}[unit]


def preemption_note(cfg: ShardConfig, target: str, write_mib_s: float | None = None) -> str:
    """What a preemption of the rendered job costs: its emergency save (each writer's share of the checkpoint at
    the measured rate) against the window the target's capacity gives (`checkpoint.window`)."""
    from xla_shard import backends, planner
    from xla_shard.checkpoint import window

    d = cfg.deploy
    name = backends.resolve_name(cfg, on="cuda" if target == "gpu-vm" else "tpu")
    capabilities = backends.capabilities(name)
    if "tpu" in capabilities.platforms and target != "gpu-vm":
        chips = tpu.parse_type(d.accelerator_type)[1]
        hosts = tpu.parse_gke(d.accelerator_type).hosts if target == "gke" else tpu.vm_hosts(d.accelerator_type)
        devices, hosts = chips * d.num_slices, hosts * d.num_slices
    else:
        per_node = GPU_MACHINES.get(d.gpu_machine_type, 1)
        devices, hosts = per_node * d.gpu_nodes, d.gpu_nodes
    try:
        work = planner.workload(cfg, devices, capabilities)
    except UserError as exc:  # a model this machine cannot read (a gs:// directory without credentials)
        return f"preemption: not estimated ({exc})"
    writers = hosts if capabilities.launcher == "in_process" else devices
    _, said = window.say(cfg, target, work.params, work.trained_params, work.frozen_bytes, writers, 0.0,
                         window.rate_for(cfg, write_mib_s))
    return f"preemption ({d.provisioning} {target}): {said}"
