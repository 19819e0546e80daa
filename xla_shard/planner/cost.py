"""The cost model: per-device memory and per-step communication of a sharding triple, and the step time.

A triple (P, G, OS) shards parameters over P devices, gradients over G and optimizer state over OS, nested
(P divides G divides OS divides N): each device's parameter shard contains its gradient shard, which contains
its optimizer-state shard. FULL_SHARD is N/N/N, NO_SHARD 1/1/1, HYBRID_SHARD k/k/k. Per step and device, ring
collectives send (g-1)/g of the bytes involved:

  parameters:  all-gather over P, in forward and again in backward if resharded,    2 (P-1)/P * Psi * c
               for each micro-batch                                                  (x micro-batches)
  gradients:   reduce-scatter over G (fp32)                                          (G-1)/G * Psi * 4
               all-reduce of the shard across the N/G replicas                       2 (R-1)/R * Psi/G * 4
  update:      all-gather of the updated shard from OS back to P's layout (if OS>P)  (k-1)/k * Psi/P * 4

A group of devices that lies inside one fast domain uses the fast links; one that spans domains runs
hierarchically, sending 1/d of its bytes across domains per device (d: its devices per domain); placement nests
the inner axes on the closest devices. Step time: compute at `efficiency` of
peak, overlapped with communication (FSDP prefetches the next unit), plus one unit's collectives that nothing
hides; each collective also pays one latency per ring hop, once per FSDP unit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from xla_shard.planner.hardware import Accelerator

OPTIMIZER_BYTES = {"adamw": 8, "sgd": 0}  # fp32 exp_avg + exp_avg_sq per parameter


@dataclass(frozen=True)
class Workload:
    """What one step does, independent of sharding."""

    params: int  # all parameters (Psi)
    units: int  # FSDP units (wrapped layers + the root): collectives per step per kind
    flops_per_token: float
    tokens_per_device: int
    layers: int
    hidden: int
    seq_len: int
    compute_bytes: int = 4  # 2 with bf16 mixed precision: what parameters are gathered in
    optimizer: str = "adamw"
    activation_checkpointing: bool = False
    micro_batches: int = 1  # gradient accumulation: parameters are gathered again for each micro-batch

    def activation_bytes(self) -> float:
        """Per device, for one micro-batch: Korthikanti et al.'s 34 * s * b * h bytes per layer for 16-bit
        activations (scaled for fp32), or 2 * s * b * h (each layer's input) with activation checkpointing."""
        tokens = self.tokens_per_device / self.micro_batches
        per_layer = (2 if self.activation_checkpointing else 34) * tokens * self.hidden
        return per_layer * self.layers * self.compute_bytes / 2


@dataclass(frozen=True)
class Triple:
    params: int
    grads: int
    optimizer: int

    def __str__(self) -> str:
        return f"{self.params}/{self.grads}/{self.optimizer}"


@dataclass
class Estimate:
    triple: Triple
    memory: dict[str, float]  # bytes per device: params, grads, optimizer, activations, gathered, total
    traffic: dict[str, float]  # bytes per device per step, by link class
    compute_s: float
    comm_s: float
    step_s: float
    mfu: float
    fits: bool
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {**asdict(self), "triple": str(self.triple)}


def estimate(work: Workload, triple: Triple, devices: int, acc: Accelerator, domain: int,
             reshard_after_forward: bool = True, efficiency: float = 0.7) -> Estimate:
    psi, c = work.params, work.compute_bytes
    p, g, os_ = triple.params, triple.grads, triple.optimizer
    memory = {"params": 4 * psi / p, "grads": 4 * psi / g, "optimizer": OPTIMIZER_BYTES[work.optimizer] * psi / os_,
              "activations": work.activation_bytes(),
              "gathered": 2 * c * psi / max(1, work.units - 1) if p > 1 else 0.0}  # a unit in use + one prefetched
    memory["total"] = sum(memory.values())
    traffic = {acc.fast_name: 0.0, acc.slow_name: 0.0}
    seconds = 0.0

    def collective(size: int, stride: int, nbytes: float, calls: int, ring_factor: int = 1) -> None:
        """`calls` collectives over groups of `size` devices `stride` apart, moving `nbytes` per device (ring
        accounting). A group inside one domain uses the fast links; one spanning several runs hierarchically
        (as NCCL's multi-ring / XLA's DCN collectives do): inside each domain first, then only 1/d of the bytes
        per device across domains, d being the group's devices per domain."""
        nonlocal seconds
        if size <= 1 or nbytes <= 0:
            return
        local = max(1, min(size, domain // stride)) if stride < domain else 1
        across = size // local
        whole = nbytes * size / (size - 1)  # the bytes a device's share of the collective covers
        fast_bytes = whole * (local - 1) / local
        slow_bytes = whole * (across - 1) / across / local
        traffic[acc.fast_name] += fast_bytes
        traffic[acc.slow_name] += slow_bytes
        seconds += fast_bytes / acc.fast_bw + slow_bytes / acc.slow_bw
        seconds += calls * ring_factor * ((local - 1) * acc.fast_latency_s + (across - 1) * acc.slow_latency_s)

    gathers = (2 if reshard_after_forward else 1) * work.micro_batches
    collective(p, 1, gathers * (p - 1) / p * psi * c, gathers * work.units)
    collective(g, 1, (g - 1) / g * psi * 4, work.units)
    replicas = devices // g
    collective(replicas, g, 2 * (replicas - 1) / replicas * psi / g * 4, work.units, ring_factor=2)
    k = os_ // p
    collective(k, p, (k - 1) / k * psi / p * 4, work.units)
    compute = work.flops_per_token * work.tokens_per_device / (acc.peak_flops * efficiency)
    exposed = seconds / max(1, work.units)  # the first gather and the last reduction of a step
    step = max(compute, seconds) + exposed
    mfu = work.flops_per_token * work.tokens_per_device / (step * acc.peak_flops)
    return Estimate(triple, memory, traffic, compute, seconds, step, mfu, memory["total"] <= acc.hbm_bytes)
