"""The device profiles of the FSDP2 path: what differs between running `fully_shard` on GPUs (NCCL), on CPUs
(gloo, how CI tests it) and on TPUs through TorchTPU (`tpu_dist`). Everything else is the same code.

Device calls go through `torch.accelerator` (torch >= 2.6), which every out-of-tree device registers with:
TorchTPU refuses its own `torch.tpu.set_device`/`device_count` outside torch where that API exists.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass

import torch

from xla_shard.io.device import on_tpu


@dataclass(frozen=True)
class DeviceProfile:
    device_type: str  # torch's device type
    process_group: str  # torch.distributed backend
    accelerator: str  # what chooses the attention kernel and optimizer kernels ('cuda', 'cpu', 'torchtpu')
    # Whether parameters can live in host memory apart from the device's (FSDP2's CPUOffloadPolicy).
    offload: bool
    # torch.compile's backend for this device (train.compile).
    compile_backend: str = "inductor"
    # The runtime package that registers the device, if not torch itself.
    package: str | None = None

    def installed(self) -> bool:
        return self.package is None or importlib.util.find_spec(self.package) is not None

    def loaded(self) -> bool:
        """Whether the runtime package is imported in this process (torch may autoload it)."""
        return self.package is not None and self.package in sys.modules

    def present(self) -> bool:
        """Whether this machine has the device, asked without starting its runtime (a launcher must leave
        the chips to the processes it starts)."""
        if self.device_type == "cpu":
            return True
        if self.device_type == "cuda":
            return torch.cuda.is_available()
        return on_tpu()

    def import_runtime(self) -> None:
        if self.package:
            importlib.import_module(self.package)  # registers the device type and its process group

    def select(self, local_rank: int) -> tuple[torch.device, str]:
        """This process's device (one per process, by torchrun's LOCAL_RANK) and its name for the logs."""
        if self.device_type == "cpu":
            return torch.device("cpu"), "cpu"
        module = torch.get_device_module(self.device_type)
        if torch.accelerator.current_accelerator().type == self.device_type:
            torch.accelerator.set_device_index(local_rank)
        else:  # torch's accelerator is the one it was built for (a CUDA build on a TPU VM names cuda)
            module.set_device(local_rank)
        device = torch.device(self.device_type, local_rank)
        name = module.get_device_name(local_rank) if hasattr(module, "get_device_name") else self.device_type
        return device, name

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...]):
        """The device mesh of `shape`: on TPUs laid out over the slice's torus (TorchTPU's
        `topology_aware_mesh`, where it has it), elsewhere in rank order."""
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        layout = getattr(torch.get_device_module(self.device_type), "topology_aware_mesh", None) \
            if self.package else None
        if layout is None:
            return init_device_mesh(self.device_type, shape, mesh_dim_names=names)
        return DeviceMesh(self.device_type, layout(self.device_type, shape), mesh_dim_names=names)

    def get_rng_state(self, device: torch.device) -> torch.Tensor | None:
        if self.device_type == "cpu":
            return None
        return self._random().get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        self._random().set_rng_state(state, device)

    def _random(self):
        """torch.accelerator.random (torch >= 2.13) where it serves this device, else the device's module."""
        random = getattr(torch.accelerator, "random", None)
        if random is not None and torch.accelerator.current_accelerator().type == self.device_type:
            return random
        return torch.get_device_module(self.device_type)


CUDA = DeviceProfile("cuda", "nccl", "cuda", offload=True)
CPU = DeviceProfile("cpu", "gloo", "cpu", offload=False)
# TorchTPU registers "tpu" and its "tpu_dist" process group on import. Offload: TorchTPU documents no pinned
# host memory for FSDP2's CPUOffloadPolicy, so the backend refuses fsdp.offload_params there.
TPU = DeviceProfile("tpu", "tpu_dist", "torchtpu", offload=False, compile_backend="tpu", package="torch_tpu")
