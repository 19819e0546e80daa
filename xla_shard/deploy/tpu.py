"""The one table of Cloud TPU generations: accelerator-type spelling, runtime version, hosts, zones.

Runtime versions and zones are from the Cloud TPU documentation (2026). Zones change; a zone missing here is
refused unless `deploy.allow_unlisted_zone` is set, so a typo fails before any VM is requested.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from xla_shard.errors import ConfigError


@dataclass(frozen=True)
class Generation:
    prefix: str  # as gcloud spells the accelerator type: <prefix>-<size>
    runtime_version: str
    size_counts_cores: bool  # v4/v5p sizes count TensorCores (2 per chip), v5e/v6e count chips
    chips_per_host: int
    zones: tuple[str, ...]


GENERATIONS = {
    "v4": Generation("v4", "tpu-ubuntu2204-base", True, 4, ("us-central2-b",)),
    "v5e": Generation("v5litepod", "v2-alpha-tpuv5-lite", False, 4,
                      ("us-central1-a", "us-south1-a", "us-west1-c", "us-west4-a", "us-east1-c", "us-east5-b",
                       "europe-west4-b", "asia-southeast1-b")),
    "v5p": Generation("v5p", "v2-alpha-tpuv5", True, 4, ("us-central1-a", "us-east5-a", "europe-west4-b")),
    "v6e": Generation("v6e", "v2-alpha-tpuv6e", False, 4,
                      ("us-central1-b", "us-east1-d", "us-east5-a", "us-east5-b", "europe-west4-a",
                       "asia-northeast1-b", "southamerica-west1-a")),
}
_TYPE = re.compile(r"^(v4|v5litepod|v5p|v6e)-(\d+)$")


@dataclass(frozen=True)
class Slice:
    accelerator_type: str
    generation: Generation
    chips: int
    hosts: int

    @property
    def runtime_version(self) -> str:
        return self.generation.runtime_version


# Generations the Cloud TPU API (tpu-vm create, queued resources) does not serve: TPU7x (Ironwood) and later
# are provisioned on GKE or as Compute Engine instances (docs.cloud.google.com/tpu/docs/tpu7x).
_NOT_ON_THE_TPU_API = re.compile(r"^(tpu)?(v?[7-9]x?|ironwood)\b", re.IGNORECASE)


def parse(accelerator_type: str, zone: str, allow_unlisted_zone: bool = False) -> Slice:
    if _NOT_ON_THE_TPU_API.match(accelerator_type):
        raise ConfigError("deploy.accelerator_type", f"{accelerator_type!r}: TPU7x (Ironwood) and later are not "
                                                     "served by the Cloud TPU API that the tpu-vm and queued-resource "
                                                     "targets use; they run on GKE (a gke target is still to come: "
                                                     "xla-shard plan knows tpu7x already)")
    match = _TYPE.match(accelerator_type)
    if not match:
        known = ", ".join(f"{g.prefix}-N" for g in GENERATIONS.values())
        raise ConfigError("deploy.accelerator_type", f"{accelerator_type!r} is not a TPU type xla_shard knows "
                                                     f"({known}; e.g. v4-8, v5litepod-16, v6e-8)")
    generation = next(g for g in GENERATIONS.values() if g.prefix == match.group(1))
    size = int(match.group(2))
    chips = size // 2 if generation.size_counts_cores else size
    if chips < 1:
        raise ConfigError("deploy.accelerator_type", f"{accelerator_type!r} has no whole chip")
    # Single-host slices: up to one host's chips (v5e/v6e single hosts go up to 8 chips).
    single_host = 8 if not generation.size_counts_cores else generation.chips_per_host
    hosts = 1 if chips <= single_host else chips // generation.chips_per_host
    if zone not in generation.zones and not allow_unlisted_zone:
        raise ConfigError("deploy.zone", f"{zone!r} has no {generation.prefix} TPUs in xla_shard's table "
                                         f"(zones: {', '.join(generation.zones)}); set "
                                         "deploy.allow_unlisted_zone=true if the table is out of date")
    return Slice(accelerator_type, generation, chips, hosts)
