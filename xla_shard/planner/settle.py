"""The sharding plan of a run, settled once: from the config, the devices the run has, and what its backend can
run (`Capabilities`). The CLI settles it before launch (where the device count is known then) and the trainer
once the runtime is up; `backend.setup(plan)` receives it."""

from __future__ import annotations

from dataclasses import replace

from xla_shard import plan as planlib
from xla_shard import planner
from xla_shard.capabilities import Capabilities
from xla_shard.config.schema import ShardConfig
from xla_shard.plan import PlanError, ShardingPlan


def settle(cfg: ShardConfig, devices: int, capabilities: Capabilities, device_kind: str,
           method=None) -> ShardingPlan:
    """The plan for `devices` (for the run's `method`; None: the config's); one ConfigError naming the key and
    the backend when the strategy, mesh, triple or batch does not fit them or the backend cannot run it."""
    refuse, unit = capabilities.refuse, capabilities.unit
    try:
        if cfg.fsdp.sharding == "auto":
            resolved = auto(cfg, devices, capabilities, device_kind, method)
        else:
            resolved = planlib.resolve(cfg.fsdp, cfg.mesh, devices)
        resolved = planlib.with_context(resolved, cfg.mesh.context)
    except PlanError as exc:
        refuse(exc.key, f"{exc}" + ("" if unit == "devices" else f" ({unit})"))
    refusal = capabilities.triple_refusal(resolved)
    if refusal and cfg.fsdp.sharding is not None:
        refuse("fsdp.sharding", refusal)
    train, rows = cfg.train, resolved.rows_split
    over = f"{rows} {unit}" + (f" ({devices} over mesh.context={resolved.context})" if resolved.context > 1 else "")
    if train.global_batch_size % rows:
        refuse("train.global_batch_size", f"{train.global_batch_size} does not split evenly over {over}")
    micro = train.global_batch_size // train.grad_accum_steps
    if micro % rows:
        # Each micro-batch is split over the devices like a whole batch: uneven, a process would drop rows
        # (FSDP2) or XLA would replicate the batch (SPMD).
        refuse("train.grad_accum_steps", f"{train.grad_accum_steps} micro-batches of {micro} rows: each must split "
                                         f"evenly over {over} (global_batch_size {train.global_batch_size})")
    return with_generation(cfg, resolved, capabilities, device_kind, method)


def with_generation(cfg: ShardConfig, resolved: ShardingPlan, capabilities: Capabilities, device_kind: str,
                    method=None) -> ShardingPlan:
    """`resolved` with the devices an online method's generation splits the weights over (mesh.generation): auto
    takes 1 (the weights whole on every device, no collective per token) where they fit beside the KV cache on
    the device's memory, else the fewest devices that fit (tensor parallelism's all-reduces per token); nothing
    fits: one line naming what to make smaller. Where no memory is known (a CPU), 1."""
    from xla_shard.methods import GENERATION, method_for

    requested, devices = cfg.mesh.generation, resolved.devices
    hardware = planner.for_device_kind(device_kind)
    if requested == "auto" and hardware is None:
        return resolved  # (before building a method: nothing to choose)
    method = method or method_for(cfg)
    if GENERATION not in method.needs:
        if requested != "auto":
            capabilities.refuse("mesh.generation", f"{requested}: method {cfg.method} does not generate; remove it")
        return resolved
    if capabilities.generation_split:  # (a split it cannot take is refused by its check)
        return resolved
    if requested != "auto":
        if devices % requested:
            capabilities.refuse("mesh.generation", f"{requested} does not divide the {devices} devices")
        return replace(resolved, generation=requested)
    work = planner.workload(cfg, devices, capabilities, hardware, method)
    for split in planner.divisors(devices):
        split_work = replace(work, generation_split=split)
        phase = split_work.generation_bytes(planner.memory(split_work, resolved.degrees, devices))[1]
        if phase <= hardware.hbm_bytes:
            return replace(resolved, generation=split)
    capabilities.refuse("train.global_batch_size", f"generation needs {phase / 2**30:.1f} GiB per device with the "
                        f"weights split over all {devices} devices, over {hardware.name}'s "
                        f"{hardware.hbm_bytes / 2**30:.0f} GiB (the KV cache of every completion a step): fewer "
                        "completions a step, or shorter ones (grpo.max_completion_length)")


def auto(cfg: ShardConfig, devices: int, capabilities: Capabilities, device_kind: str, method=None) -> ShardingPlan:
    """fsdp.sharding: auto. The cost model's fastest triple that fits and that the backend runs."""
    hardware = planner.for_device_kind(device_kind)
    if hardware is None:
        return planlib.from_triple(devices, devices, devices, devices, reason=f"fsdp.sharding=auto: no hardware "
                                   f"model for {device_kind!r}, so FULL_SHARD")
    ranked = planner.plan(planner.workload(cfg, devices, capabilities, hardware, method), devices, hardware)
    pick = ranked.best_where(lambda triple: capabilities.runs(triple, devices))
    if pick is None:
        raise PlanError("fsdp.sharding", f"auto: no sharding of this model fits {devices} x {hardware.name} by "
                                         "the cost model (see `xla-shard plan`)")
    base, best = ranked.baseline, ranked.best
    why = (f"fsdp.sharding=auto: {pick.triple} predicted {pick.step_s * 1e3:.0f} ms/step, MFU {pick.mfu:.2f}, "
           f"{pick.memory['total'] / 2**30:.1f} GiB/device, vs FULL_SHARD {base.step_s * 1e3:.0f} ms"
           + (f"; the model's best, {best.triple}, is not run by {capabilities.name}"
              if best and best.triple != pick.triple else ""))
    return planlib.from_planner(pick.triple, devices, reason=why)
