"""The sharding plan: the config's strategy and mesh, resolved once for the devices a run has.

A backend resolves it in `setup` and reads only the plan after that (how to build its mesh, whether to
reshard after forward, whether anything is sharded at all); the manifest records it. Parameters, gradients
and optimizer state each carry their own sharding degree, so that a planner can later choose them
independently (AMSP-style); the named strategies set all three alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from xla_shard.config.schema import FsdpSection, MeshSection, ShardingStrategy


@dataclass(frozen=True)
class ShardingPlan:
    strategy: ShardingStrategy
    devices: int
    replicas: int  # groups that each hold a whole copy (HSDP's replicate dim, SPMD's `replica` axis)
    shard: int  # devices one copy is sharded over; replicas x shard == devices
    reshard_after_forward: bool  # free gathered parameters after forward (else keep them until backward)
    params: int  # devices a parameter is split over
    grads: int  # ... a gradient
    optimizer: int  # ... an optimizer state tensor

    @property
    def replicate_only(self) -> bool:
        """Nothing is sharded: plain data parallelism (NO_SHARD)."""
        return self.params == self.grads == self.optimizer == 1

    @property
    def hybrid(self) -> bool:
        return self.strategy.is_hybrid

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "strategy": self.strategy.value}

    def __str__(self) -> str:
        return (f"{self.strategy.value}: {self.replicas} replica(s) x {self.shard}-way shards over {self.devices} "
                f"device(s); params/grads/optimizer split {self.params}/{self.grads}/{self.optimizer}-way, "
                f"reshard after forward: {str(self.reshard_after_forward).lower()}")


def resolve(fsdp: FsdpSection, mesh: MeshSection, devices: int) -> ShardingPlan:
    """The plan for `devices`; ValueError (naming `mesh.*`) when the mesh does not fit them."""
    strategy = fsdp.sharding_strategy
    replicas, shard = mesh.resolve(devices)  # validates the mesh for every strategy (replica > 1 needs hybrid)
    if strategy is ShardingStrategy.NO_SHARD:
        replicas, shard = devices, 1
    return ShardingPlan(strategy, devices, replicas, shard, strategy.reshards_after_forward,
                        params=shard, grads=shard, optimizer=shard)
