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
    reason: str | None = None  # why this plan (fsdp.sharding: auto says what the cost model predicted)

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
                f"reshard after forward: {str(self.reshard_after_forward).lower()}"
                + (f" ({self.reason})" if self.reason else ""))


class PlanError(ValueError):
    """A sharding the devices cannot take, with the config key to change."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def resolve(fsdp: FsdpSection, mesh: MeshSection, devices: int) -> ShardingPlan:
    """The plan for `devices` from a named strategy and the mesh, or from an explicit `fsdp.sharding` triple;
    PlanError naming the key when they do not fit the devices. (`fsdp.sharding: auto` is the backend's to
    resolve, with the cost model: see `from_triple`.)"""
    if fsdp.sharding is not None and fsdp.sharding != "auto":
        return from_triple(*fsdp.sharding.resolve(devices), devices)
    strategy = fsdp.sharding_strategy
    try:
        replicas, shard = mesh.resolve(devices)  # validates the mesh for every strategy (replica > 1 needs hybrid)
    except ValueError as exc:
        raise PlanError("mesh", str(exc)) from None
    if strategy is ShardingStrategy.NO_SHARD:
        replicas, shard = devices, 1
    return ShardingPlan(strategy, devices, replicas, shard, strategy.reshards_after_forward,
                        params=shard, grads=shard, optimizer=shard)


def from_triple(params: int, grads: int, optimizer: int, devices: int, reason: str | None = None) -> ShardingPlan:
    """A (P, G, OS) triple as a plan. Nested degrees only (P | G | OS | devices); the backends run the uniform
    ones (k/k/k: FULL_SHARD, HYBRID_SHARD with devices/k replicas, NO_SHARD) and refuse the rest here."""
    triple = f"{params}/{grads}/{optimizer}"
    for name, degree in (("params", params), ("grads", grads), ("optimizer", optimizer)):
        if degree > devices or devices % degree:
            raise PlanError(f"fsdp.sharding.{name}", f"{degree} does not divide the {devices} devices")
    if grads % params or optimizer % grads:
        raise PlanError("fsdp.sharding", f"{triple}: the degrees must nest (params divides grads divides optimizer): "
                                         "each device's optimizer state must lie inside its gradient shard, and that "
                                         "inside its parameter shard, or every step would reshuffle them")
    if not params == grads == optimizer:
        raise PlanError("fsdp.sharding", f"{triple}: parameters, gradients and optimizer state sharded to different "
                                         "degrees are predicted by `xla-shard plan` but not run by any backend yet; "
                                         "use a uniform triple (k/k/k)")
    strategy = (ShardingStrategy.FULL_SHARD if params == devices else ShardingStrategy.NO_SHARD if params == 1
                else ShardingStrategy.HYBRID_SHARD)
    replicas = devices // params
    return ShardingPlan(strategy, devices, replicas, params, True, params=params, grads=grads, optimizer=optimizer,
                        reason=reason)
