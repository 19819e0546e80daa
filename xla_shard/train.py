"""The training loop: data -> step -> metrics, identical for every backend."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from xla_shard import backends
from xla_shard.backends.base import Backend
from xla_shard.config.schema import ShardConfig, TrainSection
from xla_shard.data import TokenSource
from xla_shard.metrics import StepLogger, measure_cpu_matmul_flops, peak_for, train_flops_per_token
from xla_shard.models import build_model
from xla_shard.wrap import checkpoint_targets, wrap_targets


def make_optimizer(params, train: TrainSection) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if train.optimizer == "sgd":
        return torch.optim.SGD(params, lr=train.lr, weight_decay=train.weight_decay)
    # foreach=False: the same kernels on every backend (XLA and DTensor take different foreach paths).
    return torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay, foreach=False)


def preflight(cfg: ShardConfig) -> None:
    """Everything about the model that can be wrong, found on the meta device before any process starts."""
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.train.seed)
    wrap_targets(model, cfg.fsdp)
    if cfg.fsdp.activation_checkpointing:
        checkpoint_targets(model, cfg.fsdp)
    TokenSource(cfg.train, model.config.vocab_size)


@dataclass
class MemoryReport:
    """Bytes on one device, and what the same tensors take unsharded."""

    params: int
    grads: int
    optimizer: int
    params_unsharded: int
    grads_unsharded: int
    optimizer_unsharded: int


class Trainer:
    def __init__(self, cfg: ShardConfig, backend: Backend | None = None):
        self.cfg = cfg
        self.backend = backend or backends.create(cfg)
        self.records: list[dict[str, Any]] = []

    def setup(self) -> "Trainer":
        cfg, backend = self.cfg, self.backend
        backend.setup()
        model = build_model(cfg.model, cfg.train.seed)
        self.flops_per_token = train_flops_per_token(model, cfg.train.seq_len)
        self.source = TokenSource(cfg.train, model.config.vocab_size)
        self.model = backend.wrap(model)
        self.model.train()
        self.optimizer = make_optimizer(self.model.parameters(), cfg.train)
        self.peak_per_device, self.mfu_basis = self._mfu_basis()
        return self

    def _mfu_basis(self) -> tuple[float, str]:
        configured = self.cfg.train.peak_flops_per_device
        if configured:
            return configured, f"train.peak_flops_per_device={configured:.3g}"
        peak = peak_for(self.backend.device_kind)
        if peak:
            return peak, f"{self.backend.device_kind} dense bf16 peak {peak:.3g} FLOP/s"
        # CPU: no spec sheet applies; use what this process's threads measurably do, split over its devices.
        measured = measure_cpu_matmul_flops()
        per_device = measured / self.backend.local_devices
        return per_device, (f"cpu: measured fp32 matmul {measured:.3g} FLOP/s in this process, "
                            f"over {self.backend.local_devices} device(s)")

    def step(self, step: int) -> torch.Tensor:
        batch = self.backend.local_batch(self.source.global_batch(step))
        with self.backend.forward_context():
            loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.backend.after_step()
        return loss

    def run(self, start_step: int = 0) -> list[dict[str, Any]]:
        cfg, backend = self.cfg, self.backend
        logger = StepLogger(cfg.output_dir, cfg.train.steps, enabled=backend.is_main, start_step=start_step)
        tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
        compiled_after_warmup = None
        try:
            interval_start, interval_steps = time.perf_counter(), 0
            for step in range(start_step, cfg.train.steps):
                loss = self.step(step)
                interval_steps += 1
                record = None
                if (step + 1) % cfg.train.log_every == 0 or step + 1 == cfg.train.steps:
                    loss_value = backend.mean_loss(loss)
                    elapsed = (time.perf_counter() - interval_start) / interval_steps
                    tokens_per_s = tokens_per_step / elapsed
                    record = {
                        "step": step + 1, "loss": loss_value, "step_time_s": elapsed, "tokens_per_s": tokens_per_s,
                        "mfu": self.flops_per_token * tokens_per_s / (self.peak_per_device * backend.num_devices),
                        "backend": backend.name, "devices": backend.num_devices,
                    }
                    if not self.records:
                        record["mfu_basis"] = self.mfu_basis
                    compiles = backend.compilations()
                    if compiles is not None:
                        record["compilations"] = compiles
                        if step + 1 == cfg.train.warmup_steps:
                            compiled_after_warmup = compiles
                        elif compiled_after_warmup is not None and compiles > compiled_after_warmup:
                            record["recompiles"] = compiles - compiled_after_warmup
                            logger.warn(f"step {step + 1}: XLA compiled {compiles - compiled_after_warmup} new graph(s) "
                                        "after warm-up; the step is not static (changing shapes or Python-side "
                                        "control flow). Set PT_XLA_DEBUG_LEVEL=2 to see why.")
                    self.records.append(record)
                    logger.log(record)
                    interval_start, interval_steps = time.perf_counter(), 0
                logger.advance(record)
        finally:
            logger.close()
        return self.records

    def memory_report(self) -> MemoryReport:
        params = [p for p in self.model.parameters()]
        grads = [p.grad for p in params if p.grad is not None]
        states = [v for s in self.optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
        local = self.backend.local_bytes

        def full(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)

        return MemoryReport(sum(local(params)), sum(local(grads)), sum(local(states)),
                            full(params), full(grads), full(states))
