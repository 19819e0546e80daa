"""TorchTPU (`torch_tpu`, the successor of torch_xla): native FSDP2 on device "tpu" over its `tpu_dist` process
group, one torchrun process per chip. It is the torch_fsdp code under the TPU device profile; what differs is
only where it may run and what TorchTPU does not offer."""

from __future__ import annotations

from xla_shard.backends import fsdp2_devices
from xla_shard.backends.fsdp2_devices import DeviceProfile
from xla_shard.backends.torch_fsdp import TorchFsdpBackend
from xla_shard.capabilities import Capabilities
from xla_shard.io.device import tpu_chips


class TorchTpuBackend(TorchFsdpBackend):
    capabilities = Capabilities(
        "torch_tpu", launcher="torchrun", platforms=("tpu",), unit="torchrun processes",
        offload_params="TorchTPU has no pinned host memory for FSDP2's CPUOffloadPolicy",
        nonuniform_triple=TorchFsdpBackend.capabilities.nonuniform_triple,
        group_after_forward=None, compile=None, tpu_setup="torchtpu")

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
