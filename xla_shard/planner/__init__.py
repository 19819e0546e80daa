"""AMSP-style planning: which (parameters, gradients, optimizer state) sharding degrees a run should use.

`candidates` enumerates every nested triple for the device count, `estimate` (cost.py) predicts each one's
memory, traffic per link class and step time, and `plan` ranks those that fit, fastest first. Which triples a
backend can run today is its own business (`realisable`): the named strategies' uniform triples k/k/k.
"""

from __future__ import annotations

from dataclasses import dataclass

from xla_shard.planner.cost import Estimate, Triple, Workload, estimate
from xla_shard.planner.hardware import ACCELERATORS, Accelerator, accelerator, for_device_kind

__all__ = ["ACCELERATORS", "Accelerator", "Estimate", "Plan", "Triple", "Workload", "accelerator", "candidates",
           "estimate", "for_device_kind", "plan", "realisable", "workload"]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(devices: int) -> list[Triple]:
    """Every (P, G, OS) with P | G | OS | devices."""
    return [Triple(p, g, o) for o in divisors(devices) for g in divisors(o) for p in divisors(g)]


def realisable(triple: Triple) -> bool:
    """What the backends run today: uniform triples (FULL_SHARD, HYBRID_SHARD k/k/k with N/k replicas,
    NO_SHARD). Parameters, gradients and optimizer state sharded to different degrees are predicted, not run."""
    return triple.params == triple.grads == triple.optimizer


@dataclass
class Plan:
    devices: int
    domain: int
    accelerator: Accelerator
    ranked: list[Estimate]  # fitting ones first, fastest first
    baseline: Estimate  # FULL_SHARD (ZeRO-3)

    @property
    def best(self) -> Estimate | None:
        return next((e for e in self.ranked if e.fits), None)

    def best_realisable(self) -> Estimate | None:
        return next((e for e in self.ranked if e.fits and realisable(e.triple)), None)


def plan(work: Workload, devices: int, acc: Accelerator, hosts: int = 1, slices: int = 1,
         hbm_bytes: float | None = None, efficiency: float = 0.7) -> Plan:
    """Rank every triple for `devices` of `acc`. The fast domain is a GPU node (devices / hosts, at most the
    accelerator's node size) or a TPU slice (devices / slices)."""
    if acc.domain_max is None:
        domain = devices // slices
    else:
        domain = min(acc.domain_max, devices // hosts if hosts else devices)
    if hbm_bytes:
        acc = Accelerator(**{**acc.__dict__, "hbm_bytes": hbm_bytes})
    estimates = [estimate(work, t, devices, acc, domain, efficiency=efficiency) for t in candidates(devices)]
    ranked = sorted(estimates, key=lambda e: (not e.fits, e.step_s, e.memory["total"]))
    baseline = next(e for e in estimates if e.triple == Triple(devices, devices, devices))
    return Plan(devices, domain, acc, ranked, baseline)


def workload(cfg, devices: int) -> Workload:
    """The step of a config, from its model built on the meta device (no memory, nothing downloaded)."""
    import torch

    from xla_shard.metrics import train_flops_per_token
    from xla_shard.models import build_model
    from xla_shard.wrap import wrap_targets

    with torch.device("meta"):
        model = build_model(cfg.model, cfg.train.seed)
    config = model.config
    tokens = cfg.train.global_batch_size * cfg.train.seq_len // devices
    return Workload(params=sum(p.numel() for p in model.parameters()), units=len(wrap_targets(model, cfg.fsdp)) + 1,
                    flops_per_token=train_flops_per_token(model, cfg.train.seq_len), tokens_per_device=max(1, tokens),
                    layers=getattr(config, "num_hidden_layers", 1), hidden=getattr(config, "hidden_size", 1),
                    seq_len=cfg.train.seq_len, compute_bytes=2 if cfg.fsdp.mixed_precision == "bf16" else 4,
                    optimizer=cfg.train.optimizer, activation_checkpointing=cfg.fsdp.activation_checkpointing,
                    micro_batches=cfg.train.grad_accum_steps)
