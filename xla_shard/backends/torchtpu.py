"""TorchTPU (`torch_tpu`, the successor of torch_xla): native FSDP2 on device "tpu" over its `tpu_dist` process
group, one torchrun process per chip. It is the torch_fsdp code under the TPU device profile; what differs is
only where it may run and what TorchTPU does not offer."""

from __future__ import annotations

import os
import re
import urllib.request
from collections.abc import Callable, Mapping

import yaml

from xla_shard.backends import fsdp2_devices
from xla_shard.backends.fsdp2_devices import DeviceProfile
from xla_shard.backends.torch_fsdp import TorchFsdpBackend
from xla_shard.capabilities import Capabilities
from xla_shard.errors import ConfigError, one_line
from xla_shard.io.device import on_tpu, tpu_chips

MASTER_PORT = "29500"  # TorchTPU's default, as its set_tpu_launch_env sets it
# A Cloud TPU VM's own description of its slice (what torch_xla reads there too).
METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"


class TorchTpuBackend(TorchFsdpBackend):
    capabilities = Capabilities(
        "torch_tpu", launcher="torchrun", platforms=("tpu",), unit="torchrun processes",
        offload_params="TorchTPU has no pinned host memory for FSDP2's CPUOffloadPolicy",
        nonuniform_triple=TorchFsdpBackend.capabilities.nonuniform_triple,
        group_after_forward=None, compile=None, tpu_setup="torchtpu", varying_shapes=False,  # one program a shape
        context="the split sequence's attention (SDPA with a boolean mask over keys all-gathered along a process "
                "group) has not run on TorchTPU; use backend xla_spmd (splash attention, compiled for the slice by "
                "xla-shard compile), or set it to 1")

    @property
    def profile(self) -> DeviceProfile:
        return fsdp2_devices.TPU

    def check_runtime(self) -> None:
        if not self.profile.present():
            self.capabilities.refuse("backend", "runs on a Cloud TPU VM and this machine has no TPU; use torch_fsdp "
                                     "(GPUs, or CPUs over gloo) or xla_spmd")
        if not self.profile.installed():
            self.capabilities.refuse("backend", "needs TorchTPU: pip install 'xla_shard[torchtpu]' (torch >= 2.11; "
                                     "torch_xla's backends are xla_spmd and xla_fsdp)")

    def local_device_count(self) -> int | None:
        return tpu_chips() or None  # no TPU here: only a run on one can tell


def pod_launch(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """TorchTPU's launch contract on a multi-host slice: NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT, as
    `torch.tpu.distributed.set_tpu_launch_env` sets them from what the slice's hosts are given (called where
    TorchTPU is importable and `environ` is this process's), else derived here the same way: the hosts from
    TPU_WORKER_HOSTNAMES (a TPU VM worker's and a GKE TPU pod's), this host's rank from JOB_COMPLETION_INDEX
    (an indexed Job's pod) or TPU_WORKER_ID, the rendezvous at the first host. A variable already set wins.
    None on one host."""
    if environ is None:
        environ = os.environ
        if on_tpu():  # TorchTPU's own function asks the TPU; off one, the variables alone say it
            if "TPU_WORKER_HOSTNAMES" not in environ:  # a TPU VM: its metadata names the workers
                for key, value in tpu_vm_workers().items():
                    os.environ.setdefault(key, value)
            set_env = _set_tpu_launch_env()
            if set_env is not None:
                try:
                    set_env()
                except ValueError as exc:  # what it cannot derive, said as TorchTPU says it
                    raise ConfigError("launch", one_line(exc), backend="torch_tpu") from None
    hosts = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    bad = next((h for h in hosts if not _HOST.fullmatch(h)), None)
    if bad is not None:  # shown cut: it reaches every rendezvous message otherwise
        raise ConfigError("launch", f"TPU_WORKER_HOSTNAMES holds {bad[:60]!r}{' ...' if len(bad) > 60 else ''} "
                                    f"({len(bad)} characters), not {_HOST_IS}", backend="torch_tpu")
    index = environ.get("JOB_COMPLETION_INDEX")
    if len(hosts) < 2 and index is None and "NNODES" not in environ:
        return None
    if not hosts and not {"NNODES", "MASTER_ADDR"} <= set(environ):
        raise ConfigError("launch", "this is one host of a multi-host TPU slice (JOB_COMPLETION_INDEX is set), but "
                                    "TPU_WORKER_HOSTNAMES, which names the hosts, is not", backend="torch_tpu")
    rank = environ.get("NODE_RANK", index if index is not None else environ.get("TPU_WORKER_ID"))
    if rank is None:
        raise ConfigError("launch", f"this host is one of {len(hosts)} (TPU_WORKER_HOSTNAMES), but neither "
                                    "NODE_RANK, JOB_COMPLETION_INDEX nor TPU_WORKER_ID says which; set "
                                    "launch.node_rank", backend="torch_tpu")
    return {"NNODES": environ.get("NNODES", str(len(hosts))), "NODE_RANK": rank,
            "MASTER_ADDR": environ.get("MASTER_ADDR", hosts[0] if hosts else ""),
            "MASTER_PORT": environ.get("MASTER_PORT", MASTER_PORT)}


def tpu_vm_workers(read: Callable[[str], str] | None = None) -> dict[str, str]:
    """A Cloud TPU VM worker's place in its slice, as TorchTPU's launch contract reads it (TPU_WORKER_HOSTNAMES,
    TPU_WORKER_ID), from the VM's metadata as torch_xla reads it there: the workers' addresses from
    `worker-network-endpoints` ("hostname:uid:ip,..."), this worker's index from `tpu-env` (WORKER_ID). `read`:
    a metadata attribute's text (default: the metadata server). Empty off a multi-host TPU VM."""
    read = read or _metadata
    try:
        endpoints = [e for e in read("worker-network-endpoints").split(",") if e]
        env_text = read("tpu-env")
    except OSError:
        return {}
    try:
        env = yaml.safe_load(env_text)
    except yaml.YAMLError as exc:
        raise _bad_metadata(f"tpu-env is not YAML ({one_line(exc)[:120]})") from None
    if env is not None and not isinstance(env, dict):
        raise _bad_metadata(f"tpu-env is a YAML {type(env).__name__}, not a mapping of its variables")
    worker = (env or {}).get("WORKER_ID")
    if len(endpoints) < 2 or worker is None:
        return {}
    if not isinstance(worker, (int, str)) or not str(worker).isdigit():
        raise _bad_metadata(f"tpu-env's WORKER_ID is {str(worker)[:40]!r}, not a worker index")
    addresses = []
    for endpoint in endpoints:
        parts = endpoint.split(":")
        if len(parts) < 3 or not _HOST.fullmatch(parts[2]):
            raise _bad_metadata(f"worker-network-endpoints holds {endpoint[:60]!r}, not hostname:uid:address with "
                                f"an address of {_HOST_IS}")
        addresses.append(parts[2])
    return {"TPU_WORKER_HOSTNAMES": ",".join(addresses), "TPU_WORKER_ID": str(worker)}


_HOST = re.compile(r"[A-Za-z0-9][-A-Za-z0-9.:]{0,252}")  # a hostname, IPv4 or IPv6 address
_HOST_IS = "at most 253 letters, digits, '.', '-' or ':'"


def _bad_metadata(problem: str) -> ConfigError:
    return ConfigError("launch", f"this TPU VM's metadata cannot say where its workers are: {problem}",
                       backend="torch_tpu")


def _metadata(attribute: str) -> str:
    request = urllib.request.Request(METADATA + attribute, headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.read().decode()


def _set_tpu_launch_env():
    """TorchTPU's own `set_tpu_launch_env`, where this TorchTPU has it."""
    if not fsdp2_devices.TPU.installed():
        return None
    try:
        fsdp2_devices.TPU.import_runtime()
        import torch

        return torch.tpu.distributed.set_tpu_launch_env
    except (ImportError, AttributeError):
        return None
