"""The one table of Cloud TPU generations: accelerator-type spelling, runtime version, hosts, zones, and
what GKE schedules a slice by (node-selector accelerator and topology).

Runtime versions and zones are from the Cloud TPU documentation (2026). Zones change; a zone missing here is
refused unless `deploy.allow_unlisted_zone` is set, so a typo fails before any VM is requested. GKE's
accelerator labels and topologies are those of the GKE TPU documentation, which xpk's table follows too
(the tests compare the two).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from xla_shard.errors import ConfigError


@dataclass(frozen=True)
class Generation:
    prefix: str  # as gcloud spells the accelerator type: <prefix>-<size>
    runtime_version: str
    size_counts_cores: bool  # v4/v5p/TPU7x sizes count TensorCores (2 per chip), v5e/v6e count chips
    chips_per_host: int
    zones: tuple[str, ...]
    gke_accelerator: str  # the cloud.google.com/gke-tpu-accelerator node label
    max_chips: int  # the largest slice (a v5e or v6e pod is 256 chips)
    gke_single_chip: bool = True  # GKE has a 1-chip machine type (v4 and v5p have none)

    @property
    def topology_dims(self) -> int:
        """3-D tori (v4, v5p, TPU7x: the generations whose sizes count cores) or 2-D (v5e, v6e)."""
        return 3 if self.size_counts_cores else 2


GENERATIONS = {
    "v4": Generation("v4", "tpu-ubuntu2204-base", True, 4, ("us-central2-b",), "tpu-v4-podslice", 4096, False),
    "v5e": Generation("v5litepod", "v2-alpha-tpuv5-lite", False, 4,
                      ("us-central1-a", "us-south1-a", "us-west1-c", "us-west4-a", "us-east1-c", "us-east5-b",
                       "europe-west4-b", "asia-southeast1-b"), "tpu-v5-lite-podslice", 256),
    "v5p": Generation("v5p", "v2-alpha-tpuv5", True, 4, ("us-central1-a", "us-east5-a", "europe-west4-b"),
                      "tpu-v5p-slice", 8960, False),
    "v6e": Generation("v6e", "v2-alpha-tpuv6e", False, 4,
                      ("us-central1-b", "us-east1-d", "us-east5-a", "us-east5-b", "europe-west4-a",
                       "asia-northeast1-b", "southamerica-west1-a"), "tpu-v6e-slice", 256),
    # Ironwood: GKE only (docs.cloud.google.com/tpu/docs/tpu7x; `parse` refuses it); the cluster decides the zone.
    "tpu7x": Generation("tpu7x", "", True, 4, (), "tpu7x", 9216),
}
_TYPE = re.compile(r"^(v4|v5litepod|v5p|v6e|tpu7x)-(\d+)$")


@dataclass(frozen=True)
class Slice:
    accelerator_type: str
    generation: Generation
    chips: int
    hosts: int

    @property
    def runtime_version(self) -> str:
        return self.generation.runtime_version


@dataclass(frozen=True)
class GkeSlice(Slice):
    topology: str  # the cloud.google.com/gke-tpu-topology node label, e.g. 2x2x2 or 4x4

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts


# Generations the Cloud TPU API (tpu-vm create, queued resources) does not serve: TPU7x (Ironwood) and later
# are provisioned on GKE or as Compute Engine instances (docs.cloud.google.com/tpu/docs/tpu7x).
_NOT_ON_THE_TPU_API = re.compile(r"^(tpu)?(v?[7-9]x?|ironwood)\b", re.IGNORECASE)


def parse(accelerator_type: str, zone: str, allow_unlisted_zone: bool = False) -> Slice:
    """A slice the Cloud TPU API serves (tpu-vm and queued-resource targets)."""
    if _NOT_ON_THE_TPU_API.match(accelerator_type):
        raise ConfigError("deploy.accelerator_type", f"{accelerator_type!r}: TPU7x (Ironwood) and later are not "
                                                     "served by the Cloud TPU API that the tpu-vm and queued-resource "
                                                     "targets use; they run on GKE: use --target gke")
    generation, chips = parse_type(accelerator_type)
    check_zone(generation, zone, allow_unlisted_zone)
    return Slice(accelerator_type, generation, chips, vm_hosts(accelerator_type))


def vm_hosts(accelerator_type: str) -> int:
    """The hosts of a slice as the Cloud TPU API serves it: single-host slices hold up to one host's chips
    (v5e and v6e single hosts go up to 8 chips)."""
    generation, chips = parse_type(accelerator_type)
    single_host = 8 if not generation.size_counts_cores else generation.chips_per_host
    return 1 if chips <= single_host else chips // generation.chips_per_host


def check_zone(generation: Generation, zone: str, allow_unlisted_zone: bool = False) -> None:
    """A zone that has the generation's TPUs, by the table (a generation listing none, TPU7x on GKE, is the
    cluster's to place)."""
    if generation.zones and zone not in generation.zones and not allow_unlisted_zone:
        raise ConfigError("deploy.zone", f"{zone!r} has no {generation.prefix} TPUs in xla_shard's table "
                                         f"(zones: {', '.join(generation.zones)}); set "
                                         "deploy.allow_unlisted_zone=true if the table is out of date")


def parse_gke(accelerator_type: str) -> GkeSlice:
    """A slice as GKE schedules it: node pools of 4-chip TPU VMs (1 for a single chip) in a fixed topology."""
    generation, chips = parse_type(accelerator_type)
    shape = topology(chips, generation.topology_dims)
    if shape is None or (chips == 1 and not generation.gke_single_chip):
        raise ConfigError("deploy.accelerator_type", f"{accelerator_type!r}: {chips} chips is no GKE TPU topology "
                                                     "(1 chip, or 4, 8, 16, ... chips)")
    hosts = 1 if chips == 1 else chips // generation.chips_per_host
    return GkeSlice(accelerator_type, generation, chips, hosts, "x".join(map(str, shape)))


def parse_type(accelerator_type: str) -> tuple[Generation, int]:
    match = _TYPE.match(accelerator_type)
    if not match:
        known = ", ".join(f"{g.prefix}-N" for g in GENERATIONS.values())
        raise ConfigError("deploy.accelerator_type", f"{accelerator_type!r} is not a TPU type xla_shard knows "
                                                     f"({known}; e.g. v4-8, v5litepod-16, v6e-8)")
    generation = next(g for g in GENERATIONS.values() if g.prefix == match.group(1))
    size = int(match.group(2))
    if generation.size_counts_cores and size % 2:
        raise ConfigError("deploy.accelerator_type", f"{accelerator_type!r}: {generation.prefix} sizes count "
                                                     "TensorCores, two per chip: an even number")
    chips = size // 2 if generation.size_counts_cores else size
    if chips < 1:
        raise ConfigError("deploy.accelerator_type", f"{accelerator_type!r} has no whole chip")
    if chips > generation.max_chips:
        raise ConfigError("deploy.accelerator_type", f"{accelerator_type!r}: a {generation.prefix} slice has at most "
                                                     f"{generation.max_chips} chips")
    return generation, chips


def topology(chips: int, dims: int) -> list[int] | None:
    """The standard slice shape of `chips`: one host is 2x2 (2x2x1 in 3-D); each doubling doubles the
    smallest side (the last of equals), so 8 chips are 2x4 / 2x2x2, 16 are 4x4 / 2x2x4, 32 are 4x8 / 2x4x4."""
    if chips == 1:
        return [1] * dims
    shape = [2, 2] + [1] * (dims - 2)
    while math.prod(shape) < chips:
        smallest = min(shape)
        last = max(i for i, side in enumerate(shape) if side == smallest)
        shape[last] *= 2
    return shape if math.prod(shape) == chips else None


def slice_hosts(accelerator: str, devices: int) -> int:
    """A TPU slice's hosts: its name's, or `devices` chips at the generation's chips per host."""
    if "-" in accelerator:
        return vm_hosts(accelerator)
    generation = next(g for g in GENERATIONS.values() if accelerator.startswith(g.prefix))
    return max(1, devices // generation.chips_per_host)
