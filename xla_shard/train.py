"""The training loop: data -> step -> metrics, identical for every backend.

`Trainer` runs the whole job from a config; users with their own loop use the same pieces directly (a backend's
`wrap`, `local_batch` and `after_step`, and a `Checkpointer`), see the README's "Use from Python".
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from xla_shard import backends
from xla_shard.backends.base import Backend
from xla_shard.checkpoint import CheckpointError, Checkpointer, layout
from xla_shard.config.schema import ShardConfig, TrainSection
from xla_shard.data import TokenSource
from xla_shard.metrics import StepLogger, measure_cpu_matmul_flops, peak_for, train_flops_per_token
from xla_shard.errors import ConfigError, UserError, file_in_the_way, redact
from xla_shard.models import build_model, check_sequence_length
from xla_shard.preemption import PreemptionGuard
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
    check_sequence_length(model.config, cfg.train.seq_len)
    check_output_dir(cfg.output_dir)
    wrap_targets(model, cfg.fsdp)
    if cfg.fsdp.activation_checkpointing:
        checkpoint_targets(model, cfg.fsdp)
    if cfg.fsdp.state_dict_type == "FULL_STATE_DICT" and not cfg.checkpoint.dir:
        raise ConfigError("fsdp.state_dict_type", "FULL_STATE_DICT also exports the final checkpoint as one Hugging "
                                                  "Face model directory (output_dir/model); set checkpoint.dir")
    TokenSource(cfg.train, model.config.vocab_size)


def check_output_dir(path: str) -> None:
    blocker = file_in_the_way(Path(path))
    if blocker:
        raise ConfigError("output_dir", f"{path!r}: {blocker} is a file, not a directory")


class TrainingDiverged(UserError):
    """The loss became NaN or infinite: nothing after this step is worth training or saving."""


@dataclass
class MemoryReport:
    """Bytes on one device, and what the same tensors take unsharded."""

    params: int
    grads: int
    optimizer: int
    params_unsharded: int
    grads_unsharded: int
    optimizer_unsharded: int


LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def causal_lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, as transformers computes it from `labels`."""
    return model(input_ids=batch, labels=batch).loss


class Trainer:
    """The whole training job for one config. `loss_fn(model, batch) -> loss` replaces the causal-LM loss."""

    def __init__(self, cfg: ShardConfig, backend: Backend | None = None, loss_fn: LossFn = causal_lm_loss):
        self.cfg = cfg
        self.backend = backend or backends.create(cfg)
        self.loss_fn = loss_fn
        self.records: list[dict[str, Any]] = []

    def setup(self) -> "Trainer":
        cfg, backend = self.cfg, self.backend
        backend.setup()
        self._log(f"{backend.name} on {backend.num_devices} {backend.device_kind} device(s): {backend.plan}")
        model = build_model(cfg.model, cfg.train.seed)
        check_sequence_length(model.config, cfg.train.seq_len)
        check_output_dir(cfg.output_dir)
        self.flops_per_token = train_flops_per_token(model, cfg.train.seq_len)
        self.source = TokenSource(cfg.train, model.config.vocab_size)
        self.model = backend.wrap(model)
        self.model.train()
        self.optimizer = make_optimizer(self.model.parameters(), cfg.train)
        self.peak_per_device, self.mfu_basis = self._mfu_basis()
        self.start_step, self.checkpointer, self.preempted = 0, None, False
        if cfg.checkpoint.dir:
            self.checkpointer = Checkpointer(cfg.checkpoint, backend, log=self._log)
            self.start_step = self.checkpointer.restore(self.model, self.optimizer)
            if self.start_step > cfg.train.steps:
                raise ConfigError("train.steps", f"{cfg.train.steps} is behind the checkpoint's step {self.start_step} "
                                                 f"(under {cfg.checkpoint.dir})")
        return self

    def _log(self, message: str) -> None:
        if self.backend.is_main:
            print(f"xla-shard: {redact(message)}", file=sys.stderr, flush=True)

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
            loss = self.loss_fn(self.model, batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.backend.after_step()
        return loss

    def run(self) -> list[dict[str, Any]]:
        cfg, ckpt = self.cfg, self.checkpointer
        logger = StepLogger(cfg.output_dir, cfg.train.steps, enabled=self.backend.is_main, start_step=self.start_step)
        self._compiled_after_warmup = None
        self._interval = (time.perf_counter(), 0)
        try:
            with PreemptionGuard(cfg.checkpoint.preemption_grace_s) as preemption:
                for step in range(self.start_step, cfg.train.steps):
                    loss = self.step(step)
                    done = step + 1
                    record = self._record(done, loss, logger)
                    logger.advance(record)
                    if ckpt and (done % cfg.checkpoint.every_steps == 0 or done == cfg.train.steps):
                        ckpt.save(done, self.model, self.optimizer)
                    if self.backend.any_rank(preemption.requested):
                        self._stop_for_preemption(done, preemption)
                        self.preempted = True
                        break
                if ckpt:
                    ckpt.wait()  # the last save commits before the run counts as finished
                    if cfg.fsdp.state_dict_type == "FULL_STATE_DICT" and not self.preempted:
                        self._export_final()
        finally:
            logger.close()
        return self.records

    def _export_final(self) -> None:
        """FULL_STATE_DICT: the final checkpoint also becomes one Hugging Face model directory."""
        ckpt = self.checkpointer
        if not self.backend.is_main or ckpt.last_committed is None:
            return
        from xla_shard.checkpoint.export import export

        target = Path(self.cfg.output_dir) / "model"
        report = export(ckpt.storage.url_of(layout.step_dir(ckpt.last_committed)), str(target))
        self._log(f"fsdp.state_dict_type=FULL_STATE_DICT: exported step {report.step} to {target} "
                  f"({report.tensors} tensors, {report.bytes} bytes)")

    def _stop_for_preemption(self, done: int, preemption: PreemptionGuard) -> None:
        ckpt = self.checkpointer
        if ckpt is None:
            self._log(f"SIGTERM: stopping after step {done} (no checkpoint.dir: nothing saved)")
            return
        ckpt.save(done, self.model, self.optimizer)  # a no-op if this step's save is already done or in flight
        if ckpt.wait(timeout=preemption.remaining_s()):
            self._log(f"SIGTERM: stopped after step {done}; checkpoint committed, rerun the same command to resume")
        else:
            raise CheckpointError(f"SIGTERM: the step {done} checkpoint did not commit within "
                                  f"checkpoint.preemption_grace_s={preemption.grace_s:g}; the last committed one "
                                  f"({ckpt.last_committed}) stays the resume point")

    def _record(self, done: int, loss: torch.Tensor, logger: StepLogger) -> dict[str, Any] | None:
        cfg, backend = self.cfg, self.backend
        start, steps = self._interval
        steps += 1
        self._interval = (start, steps)
        if done % cfg.train.log_every and done != cfg.train.steps:
            return None
        elapsed = (time.perf_counter() - start) / steps
        tokens_per_s = cfg.train.global_batch_size * cfg.train.seq_len / elapsed
        record = {
            "step": done, "loss": backend.mean_loss(loss), "step_time_s": elapsed, "tokens_per_s": tokens_per_s,
            "mfu": self.flops_per_token * tokens_per_s / (self.peak_per_device * backend.num_devices),
            "backend": backend.name, "devices": backend.num_devices,
        }
        if not math.isfinite(record["loss"]):
            if self.checkpointer:
                self.checkpointer.wait()  # a save of an earlier step may still be committing: let it
            kept = self.checkpointer.last_committed if self.checkpointer else None
            raise TrainingDiverged(f"step {done}: the loss is {record['loss']}; stopping. "
                                   + (f"The last committed checkpoint (step {kept}) is intact. " if kept else "")
                                   + f"Lower train.lr (now {cfg.train.lr:g}) or check the data")
        if not self.records:
            record["mfu_basis"] = self.mfu_basis
        compiles = backend.compilations()
        if compiles is not None:
            record["compilations"] = compiles
            if done == self.start_step + cfg.train.warmup_steps:
                self._compiled_after_warmup = compiles
            elif self._compiled_after_warmup is not None and compiles > self._compiled_after_warmup:
                record["recompiles"] = compiles - self._compiled_after_warmup
                logger.warn(f"step {done}: XLA compiled {record['recompiles']} new graph(s) after warm-up; the "
                            "step is not static (changing shapes or Python-side control flow). Set "
                            "PT_XLA_DEBUG_LEVEL=2 to see why.")
        self.records.append(record)
        logger.log(record)
        self._interval = (time.perf_counter(), 0)
        return record

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
