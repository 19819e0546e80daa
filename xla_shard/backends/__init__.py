"""Backend registry: a name in the config (or `auto`) -> the class that runs it, and the one rule for `auto`."""

from __future__ import annotations

import importlib.util

import torch
from pydantic import ValidationError

from xla_shard.backends import fsdp2_devices
from xla_shard.backends.base import Backend
from xla_shard.backends.torch_fsdp import TorchFsdpBackend
from xla_shard.backends.torchtpu import TorchTpuBackend
from xla_shard.backends.xla_fsdp import XlaFsdpBackend
from xla_shard.backends.xla_spmd import XlaSpmdBackend
from xla_shard.capabilities import Capabilities
from xla_shard.config import revalidated
from xla_shard.config.schema import Backend as BackendName
from xla_shard.config.schema import LaunchSection, ShardConfig
from xla_shard import launch
from xla_shard.errors import ConfigError
from xla_shard.io.device import on_tpu
from xla_shard.plan import Triple
from xla_shard.planner.settle import settle

BACKENDS: dict[str, type[Backend]] = {
    cls.capabilities.name: cls for cls in (XlaSpmdBackend, XlaFsdpBackend, TorchFsdpBackend, TorchTpuBackend)}
# `backend: auto`, by the platform a run is planned for: a TPU runs SPMD FSDPv2 (what `[tpu]` installs and the
# deployments set up), GPUs run FSDP2, a plain CPU runs FSDP2 over gloo (the fastest there: below).
AUTO = {"tpu": "xla_spmd", "cuda": "torch_fsdp", "cpu": "torch_fsdp"}
# Why auto takes FSDP2 on a CPU even where torch_xla is installed: XLA's CPU client steps the same job slower
# than gloo's processes, after its compiles (2 cores: the main job at seq_len 512, 0.26 vs 0.24 s a step; a tiny
# Qwen2 on chat rows of varied lengths, 5.26 vs 2.23 s). xla_spmd stays the choice where FSDP2 does not train
# the config (scanned layers, say).
CPU_FASTEST_FIRST = ("torch_fsdp", "xla_spmd")


def _candidates(machine: str) -> list[str]:
    """`backend: auto` on this machine, fastest first, among what is installed: on a TPU VM TorchTPU where it
    is importable, else torch_xla; on a CPU FSDP2 over gloo, then torch_xla's SPMD where it is installed."""
    if machine == "tpu":
        return ["torch_tpu" if fsdp2_devices.TPU.installed() else "xla_spmd"]
    if machine == "cuda":
        return ["torch_fsdp"]
    xla = importlib.util.find_spec("torch_xla") is not None
    return [name for name in CPU_FASTEST_FIRST if xla or not capabilities(name).torch_xla]


def platform() -> str:
    """'tpu', 'cuda' or 'cpu': what this machine would run on."""
    return "tpu" if on_tpu() else "cuda" if torch.cuda.is_available() else "cpu"


def resolve_name(cfg: ShardConfig, on: str | None = None) -> str:
    """The backend `cfg` names; for `auto`, the one for platform `on`, or for this machine and what it has
    installed (`auto_choice`)."""
    if cfg.backend is not BackendName.AUTO:
        return cfg.backend.value
    return AUTO[on] if on else auto_choice(cfg, can_launch=launch.torchrun_worker())[0]


def auto_choice(cfg: ShardConfig, can_launch: bool) -> tuple[str, str]:
    """`backend: auto` on this machine: the fastest installed backend that trains `cfg` as configured, and why
    it is the one (a line for the log). Where none does, the fastest, whose check then says why not.
    `can_launch`: the caller starts the processes a backend's launcher would (the CLI), or is one of them; a
    program that builds its backend in its own single process (the Python API) cannot have torchrun's."""
    machine = platform()
    candidates = _candidates(machine)
    passed_over = []
    for name in candidates:
        if not can_launch and capabilities(name).launcher == "torchrun" and name != candidates[-1]:
            passed_over.append(f"{name} trains in processes torchrun starts, and this one was not (`xla-shard "
                               "train` starts them)")
            continue
        try:
            BACKENDS[name](revalidated(cfg, {"backend": name})).check()
        except ConfigError as refusal:
            passed_over.append(f"{name} does not train this config ({refusal.key}: {refusal.message})")
            continue
        why = (f"the backend for {machine}" if machine != "cpu" else
               "the fastest on a CPU" if name == candidates[0] else "the fastest on a CPU that trains it here")
        return name, "; ".join([*passed_over, f"{name}: {why}"])
    return candidates[0], ""
def capabilities(name: str) -> Capabilities:
    return BACKENDS[name].capabilities


def running(triple: Triple, devices: int, cfg: ShardConfig | None = None) -> list[str]:
    """The backends that run a planner `Triple` on `devices` (what `xla-shard plan` shows per row), and, given
    the config, what it trains (a backend that refuses its LoRA, scan or compile does not run it)."""
    return [name for name, cls in BACKENDS.items()
            if cls.capabilities.runs(triple, devices) and (cfg is None or cls.capabilities.trains(cfg))]


def launch_from_environment(cfg: ShardConfig) -> tuple[ShardConfig, str | None]:
    """The config with its launch section taken from the slice's environment where the backend has a launch
    contract that reads one (TorchTPU on a multi-host slice: `torchtpu.pod_launch`) and the config names no
    nodes itself; and a line saying so (None: unchanged)."""
    from xla_shard.backends import torchtpu

    launch = cfg.launch
    if capabilities(resolve_name(cfg)).tpu_setup != "torchtpu" or launch.nnodes > 1 or launch.node_rank is not None:
        return cfg, None
    pod = torchtpu.pod_launch()
    if pod is None:
        return cfg, None
    try:
        nodes = LaunchSection.model_validate({**launch.model_dump(), "nnodes": pod["NNODES"],
                                              "node_rank": pod["NODE_RANK"],
                                              "rdzv_endpoint": f"{pod['MASTER_ADDR']}:{pod['MASTER_PORT']}"})
    except ValidationError as exc:
        raise ConfigError("launch", f"TorchTPU's launch environment ({pod}) does not make a launch: "
                                    f"{exc.errors()[0]['msg']}", backend="torch_tpu") from None
    said = (f"torch_tpu: host {nodes.node_rank} of {nodes.nnodes} of this TPU slice (TorchTPU's launch environment), "
            f"meeting at {nodes.rdzv_endpoint}")
    return cfg.model_copy(update={"launch": nodes}), said


def create(cfg: ShardConfig, method=None) -> Backend:
    """The config's backend for the run's `method` (None: the config's), its options checked; nothing started."""
    backend = BACKENDS[resolve_name(cfg)](cfg, method)
    backend.check()
    return backend


def start(cfg: ShardConfig, backend: Backend | None = None) -> Backend:
    """The config's backend ready to wrap a model: runtime started, plan settled for its devices, set up."""
    backend = backend or create(cfg)
    backend.check_runtime()
    backend.start()
    backend.setup(settle(cfg, backend.num_devices, backend.capabilities, backend.device_kind, backend.method))
    return backend


def check_devices(backend: Backend, nproc_per_node: int | None = None) -> int | None:
    """Before anything starts (`train`, `config check`): the plan must fit the devices the run will have,
    where that is known already. Returns them (None: only the started runtime can tell)."""
    devices = backend.expected_devices(nproc_per_node)
    if devices is not None:
        settle(backend.cfg, devices, backend.capabilities, backend.device_kind, backend.method)
    return devices


__all__ = ["AUTO", "BACKENDS", "Backend", "auto_choice", "capabilities", "check_devices", "create", "platform",
           "resolve_name", "running", "start"]
