"""The sharding plan: the config's strategy and mesh, resolved once for the devices a run has.

`planner.settle` resolves it once per run and `backend.setup(plan)` receives it; a backend reads only the plan
after that (how to build its mesh, whether to reshard after forward, whether anything is sharded at all); the
manifest records it. Parameters, gradients
and optimizer state each carry their own sharding degree (AMSP-style: `fsdp.sharding`, or chosen by the cost
model in `xla_shard.planner`); the named strategies set all three alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from xla_shard.config.schema import FsdpSection, MeshSection, ShardingStrategy


@dataclass(frozen=True)
class Triple:
    """Sharding degrees (P, G, OS): devices a parameter, its gradient and its optimizer state are each split
    over (AMSP). The planner enumerates and prices these; a plan runs one."""

    params: int
    grads: int
    optimizer: int
    after_forward: int | None = None  # devices a parameter stays split over until backward (None: params)

    def __post_init__(self):
        if self.after_forward == self.params:
            object.__setattr__(self, "after_forward", None)  # the default, spelled one way

    @property
    def kept(self) -> int:
        return self.params if self.after_forward is None else self.after_forward

    def __str__(self) -> str:
        after = f"({self.kept})" if self.kept != self.params else ""
        return f"{self.params}{after}/{self.grads}/{self.optimizer}"


@dataclass(frozen=True)
class ShardingPlan:
    strategy: ShardingStrategy
    devices: int
    replicas: int  # groups that each hold a whole copy (HSDP's replicate dim, SPMD's `replica` axis)
    shard: int  # devices one copy is sharded over; replicas x shard == devices
    # After forward: back to the P-way shards (True), kept whole until backward (False), or split over a
    # smaller group of k devices that backward gathers from (k, FSDP2's int form).
    reshard_after_forward: bool | int
    params: int  # devices a parameter is split over
    grads: int  # ... a gradient
    optimizer: int  # ... an optimizer state tensor
    reason: str | None = None  # why this plan (fsdp.sharding: auto says what the cost model predicted)
    context: int = 1  # devices each sequence is split over (mesh.context), inside the P devices of a parameter
    # devices an online method's generation splits the weights over (mesh.generation; 1: whole on every device)
    generation: int = 1

    @property
    def replicate_only(self) -> bool:
        """Nothing is sharded: plain data parallelism (NO_SHARD)."""
        return self.params == self.grads == self.optimizer == 1

    @property
    def uniform(self) -> bool:
        """Parameters, gradients and optimizer state sharded alike (what FSDP wrappers do)."""
        return self.params == self.grads == self.optimizer

    @property
    def after_forward(self) -> int:
        """Devices a parameter stays split over between forward and backward."""
        if self.reshard_after_forward is True:
            return self.params
        return 1 if self.reshard_after_forward is False else self.reshard_after_forward

    @property
    def degrees(self) -> Triple:
        """The plan's sharding degrees, as the planner prices them."""
        return Triple(self.params, self.grads, self.optimizer, self.after_forward)

    @property
    def triple(self) -> str:
        """P/G/OS, with the after-forward degree in brackets where it is not P: `8(2)/8/8`."""
        return str(self.degrees)

    @property
    def hybrid(self) -> bool:
        return self.strategy.is_hybrid

    @property
    def rows_split(self) -> int:
        """Devices a batch's rows are split over: the sequence axis splits each row instead."""
        return self.devices // self.context

    def describe(self) -> dict[str, Any]:
        described = {**asdict(self), "strategy": self.strategy.value, "triple": self.triple}
        if self.context == 1:
            del described["context"]  # as manifests wrote plans before the sequence axis
        if self.generation == 1:
            del described["generation"]
        return described

    def __str__(self) -> str:
        return (f"{self.strategy.value}: {self.replicas} replica(s) x {self.shard}-way shards over {self.devices} "
                f"device(s); params/grads/optimizer split {self.params}/{self.grads}/{self.optimizer}-way, "
                f"reshard after forward: {str(self.reshard_after_forward).lower()}"
                + (f"; sequences split {self.context}-way (mesh.context)" if self.context > 1 else "")
                + (f"; generation's weights split {self.generation}-way (mesh.generation)"
                   if self.generation > 1 else "")
                + (f" ({self.reason})" if self.reason else ""))


class PlanError(ValueError):
    """A sharding the devices cannot take, with the config key to change."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def resolve(fsdp: FsdpSection, mesh: MeshSection, devices: int) -> ShardingPlan:
    """The plan for `devices` from a named strategy and the mesh, or from an explicit `fsdp.sharding` triple;
    PlanError naming the key when they do not fit the devices. (`fsdp.sharding: auto` is the backend's to
    resolve, with the cost model: see `planner.settle`.)"""
    if fsdp.sharding is not None and fsdp.sharding != "auto":
        params, grads, optimizer, after_forward = fsdp.sharding.resolve(devices)
        return from_triple(params, grads, optimizer, devices, after_forward=after_forward)
    strategy = fsdp.sharding_strategy
    try:
        replicas, shard = mesh.resolve(devices)  # validates the mesh for every strategy (replica > 1 needs hybrid)
    except ValueError as exc:
        raise PlanError("mesh", str(exc)) from None
    if strategy is ShardingStrategy.NO_SHARD:
        replicas, shard = devices, 1
    return ShardingPlan(strategy, devices, replicas, shard, strategy.reshards_after_forward,
                        params=shard, grads=shard, optimizer=shard)


def with_context(plan: ShardingPlan, context: int) -> ShardingPlan:
    """`plan` with each sequence split over `context` devices; PlanError unless they lie inside the devices a
    parameter is split over (so the sequence axis multiplies no state) and the parameter's group splits into
    them."""
    if context == 1:
        return plan
    if plan.params % context:
        raise PlanError("mesh.context", f"{context} must divide the devices each parameter is split over "
                                        f"({plan.params}, {plan.triple}): the sequence axis lies inside them, so "
                                        "parameters, gradients and optimizer state stay sharded over it")
    return replace(plan, context=context)


def from_planner(triple: Triple, devices: int, reason: str | None = None) -> ShardingPlan:
    """A planner's `Triple` as the sharding plan a backend runs."""
    return from_triple(triple.params, triple.grads, triple.optimizer, devices, reason=reason,
                       after_forward=triple.kept)


def from_triple(params: int, grads: int, optimizer: int, devices: int, reason: str | None = None,
                after_forward: int | None = None) -> ShardingPlan:
    """A (P, G, OS) triple as a plan; PlanError unless P | G | OS | devices. Which triples a backend runs is
    the backend's to say (`Capabilities.triple_refusal`): xla_spmd runs them all, the others the uniform k/k/k.

    `strategy`, `replicas` and `shard` describe the parameters: FULL_SHARD when P is every device, NO_SHARD
    when P is 1, else HYBRID_SHARD with devices/P replicas of each parameter; SHARD_GRAD_OP and
    HYBRID_SHARD_ZERO2 where parameters stay whole after forward (`after_forward` 1)."""
    triple = f"{params}/{grads}/{optimizer}"
    for name, degree in (("params", params), ("grads", grads), ("optimizer", optimizer)):
        if degree > devices or devices % degree:
            raise PlanError(f"fsdp.sharding.{name}", f"{degree} does not divide the {devices} devices")
    if grads % params or optimizer % grads:
        raise PlanError("fsdp.sharding", f"{triple}: the degrees must nest (params divides grads divides optimizer): "
                                         "each device's optimizer state must lie inside its gradient shard, and that "
                                         "inside its parameter shard, or every step would reshuffle them")
    after_forward = params if after_forward is None else after_forward
    if after_forward > params or params % after_forward:
        raise PlanError("fsdp.sharding.params_after_forward", f"{after_forward} does not divide params ({params}): "
                                                              "backward gathers from a subgroup of the P devices")
    if params == devices:  # (one device: FULL_SHARD, which every backend runs)
        strategy = ShardingStrategy.FULL_SHARD if after_forward > 1 or devices == 1 else ShardingStrategy.SHARD_GRAD_OP
    elif params == 1:
        strategy = ShardingStrategy.NO_SHARD
    else:
        strategy = ShardingStrategy.HYBRID_SHARD if after_forward > 1 else ShardingStrategy.HYBRID_SHARD_ZERO2
    reshard = True if after_forward == params else False if after_forward == 1 else after_forward
    return ShardingPlan(strategy, devices, devices // params, params, reshard, params=params, grads=grads,
                        optimizer=optimizer, reason=reason)
