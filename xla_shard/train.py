"""The training loop: data -> step -> metrics, identical for every backend.

`Trainer` runs the whole job from a config, with seams for what users change (`loss_fn`, `on_step_end`,
`on_evaluate`); users with their own loop use the same pieces directly (a backend's `wrap`, `local_batch` and
`after_step`, and a `Checkpointer`), see the README's "Use from Python". `run(cfg)` is the CLI's entry point.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from xla_shard import backends, launch, lm_head, metrics
from xla_shard import data as datalib
from xla_shard.backends.base import Backend
from xla_shard.checkpoint import Checkpointer, CheckpointError, NoCheckpoints, RunRecord, finished_message
from xla_shard.checkpoint.export import check_final_export, export, final_export_dir
from xla_shard.config.schema import ShardConfig
from xla_shard.data import Batch, process_rows
from xla_shard.data.batches import trimmed
from xla_shard.data.source import check_eval_labels
from xla_shard.errors import ConfigError, UserError, redact
from xla_shard.hostmem import mib
from xla_shard.io.staged import check_output_dir
from xla_shard.methods import Method, evaluate, method_for
from xla_shard.metrics import (GraphCount, MemoryReport, Mfu, StepClock, StepLogger, memory_report,
                               train_flops_per_token)
from xla_shard.models import model_config, resolve_source
from xla_shard.preemption import PreemptionGuard
from xla_shard.pretrained import PretrainedWeights, build_for, check_model, reference_model
from xla_shard.schedule import WARMUP_RULE, lr_factor, make_optimizer
from xla_shard.wrap import inferred_layers


def preflight(cfg: ShardConfig, capabilities=None, method: Method | None = None) -> None:
    """Everything about the model that can be wrong, found on the meta device before any process starts
    (pretrained weights included: their names and shapes, from the safetensors headers; with the backend's
    `capabilities`, what it cannot run of the model; `method`: the run's, None: the config's)."""
    method = method or method_for(cfg)
    with torch.device("meta"):
        model, _, source = build_for(cfg, capabilities=capabilities, adapter=method.adapter)
    check_model(cfg, model)
    check_output_dir(cfg.output_dir)
    if cfg.fsdp.state_dict_type == "FULL_STATE_DICT":
        check_final_export(cfg, source.directory)
    if cfg.train.tensorboard:
        metrics.require_tensorboard()
    objective = method.objective
    if objective.reference_directory not in (None, cfg.model.name):  # the policy's own directory was just built
        with torch.device("meta"):
            reference_model(cfg, objective, model.config, capabilities=capabilities)
    # Reads and tokenizes the files (cached by `datasets`: the training processes then read the cache).
    datalib.build(cfg, model.config, source.directory, method.generations)


def build_data(cfg: ShardConfig) -> datalib.DataSources:
    """The config's data for your own loop, read as the trainer reads it: through the tokenizer of the config's
    model directory (or `data.tokenizer`), checked against the model's vocabulary and labels."""
    source = resolve_source(cfg.model, cfg.checkpoint.retry_deadline_s)
    return datalib.build(cfg, model_config(cfg.model, source), source.directory, method_for(cfg).generations)


class TrainingDiverged(UserError):
    """The loss became NaN or infinite: nothing after this step is worth training or saving."""


LossFn = Callable[[nn.Module, Batch], torch.Tensor]
# Called on every process after each optimizer step with (trainer, step done, the logged record or None on
# steps that log nothing), and after each evaluation with (trainer, step done, the evaluation's record).
StepHook = Callable[["Trainer", int, "dict[str, Any] | None"], None]
EvalHook = Callable[["Trainer", int, "dict[str, Any]"], None]


class Trainer:
    """The whole training job for one config.

    Seams: the objective (`xla_shard.methods`) says what a step computes and evaluation reports;
    `loss_fn(model, batch) -> loss` replaces the model's own loss (`batch` holds `input_ids` and `labels`:
    this process's rows, on its device; its values are averaged over micro-batches and processes as they are,
    while the model's own loss is weighted by each micro-batch's labelled tokens, see `Objective.weights`);
    `on_step_end` and `on_evaluate` hooks (see `StepHook`, `EvalHook`) see every step and evaluation. `setup()`
    builds everything below; `run()` trains."""

    def __init__(self, cfg: ShardConfig, backend: Backend | None = None, loss_fn: LossFn | None = None,
                 on_step_end: list[StepHook] | None = None, on_evaluate: list[EvalHook] | None = None):
        self.cfg = cfg
        # The run's method, resolved once: a backend handed in was created with the config's (its reward
        # functions imported, its adapter built); a loss of yours makes another objective.
        self.method = backend.method if backend is not None and loss_fn is None else method_for(cfg, loss_fn)
        self.backend = backend or backends.create(cfg, self.method)
        self.objective, self.adapter = self.method.objective, self.method.adapter
        self.on_step_end = list(on_step_end or [])
        self.on_evaluate = list(on_evaluate or [])
        self.records: list[dict[str, Any]] = []  # every logged and evaluation record, in order
        # Built by setup():
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.source = self.eval_source = None  # training rows (any step, any process) and evaluation rows
        self.uneven_labels = False  # whether micro-batches can hold different numbers of labelled tokens
        self.total_steps = 0
        self.start_step = 0  # where this run starts: 0, or the step of the checkpoint it resumed
        self.warmup_rule = WARMUP_RULE  # a resumed run's is its checkpoint's (`RunRecord.go_on_with_warmup_rule`)
        # What every checkpoint records of the run beside its tensors (filled in as setup learns it).
        self.record = RunRecord()
        self.checkpointer: Checkpointer | NoCheckpoints = NoCheckpoints(self.record)
        self.load_report = None  # what the pretrained load read, on this process (None: nothing loaded)
        self.flops_per_token = 0.0
        self.mfu: Mfu | None = None  # the steps' MFU, against the device's peak
        # State of run():
        self.lr, self.grad_norm = cfg.train.lr, None
        self.stopped_by = 0  # the exit status of a run a stop signal ended (preemption.PreemptionGuard)
        self.clock: StepClock | None = None  # run()'s
        self.graphs: GraphCount | None = None  # run()'s: the steps' compilations, apart from the rest
        # Real tokens (not packing's filler or padding) of the steps since the last record, and where they began.
        self._real_tokens, self._real_since = 0, 0

    def setup(self) -> Trainer:
        cfg = self.cfg
        backend = backends.start(cfg, self.backend)
        self._log(f"{backend.name} on {backend.num_devices} {backend.device_kind} device(s): {backend.plan}")
        model, weights, source = build_for(cfg, backend.accelerator, backend.capabilities,
                                           empty=backend.placeholders, adapter=self.adapter)
        check_model(cfg, model)
        check_output_dir(cfg.output_dir)
        self.flops_per_token = self.objective.step_flops_per_token(train_flops_per_token(model, cfg.train.seq_len))
        with backend.processes.main_first():
            sources = datalib.build(cfg, model.config, source.directory, self.method.generations)
        self.source, self.eval_source = sources.train, sources.eval
        if self.eval_source is not None:
            check_eval_labels(self.eval_source, cfg)
        self.uneven_labels = sources.uneven_labels
        self.total_steps = self._total_steps()
        self._log(f"data: {sources.description}; {self.total_steps} step{'' if self.total_steps == 1 else 's'}"
                  + (f" ({cfg.train.epochs:g} epoch(s))" if cfg.train.epochs else ""))
        if self.method.describe() != self.method.name:
            self._log(f"method: {self.method.describe()}")
        if cfg.train.lr_warmup_steps >= self.total_steps:
            self._log(f"WARNING: train.lr_warmup_steps={cfg.train.lr_warmup_steps} is not shorter than the run's "
                      f"{self.total_steps} steps: the learning rate never reaches train.lr={cfg.train.lr:g}")
        model_class = type(model).__name__  # before wrapping (FSDP2 renames the class)
        trained = self.adapter.describe(model)
        if trained:
            self._log(trained)
        inferred = inferred_layers(model, cfg.fsdp)
        if inferred:
            self._log(f"wrap: {inferred}")
        self.model = backend.wrap(model)
        self.model.train()
        scoring = lm_head.describe(self.model)
        if scoring:
            self._log(scoring)
        self.optimizer = backend.prepare_optimizer(make_optimizer(self.model.parameters(), cfg.train,
                                                                  backend.accelerator))
        self.mfu = Mfu(self.flops_per_token, backend.device_kind, backend.num_devices,
                       cfg.train.peak_flops_per_device)
        if cfg.checkpoint.dir:
            self._restore()
        self._log(f"model: attention {model.config._attn_implementation}"
                  + (" (model.attn_implementation=auto)" if cfg.model.attn_implementation == "auto" else ""))
        self._fill_model(weights, source, model_class)
        if self.objective.reference_directory:
            self.objective.use_reference(self._reference_model(model.config))
        prepared = self.method.rollout.prepare(self.model, backend)
        if prepared:
            self._log(prepared)
        return self

    def _restore(self) -> None:
        """The checkpointer, and what a resume restores: the model's and optimizer's state, the rollout's, the
        warm-up rule the run goes on with; a run already past its steps is refused, one at its end said."""
        cfg = self.cfg
        self.checkpointer = Checkpointer(cfg.checkpoint, self.backend.state, log=self._log,
                                         trained_only=self.adapter.freezes_base, record=self.record)
        own: dict = {}
        self.start_step = self.checkpointer.restore(self.model, self.optimizer, own=own)
        resumed = self.method.rollout.resume(self.start_step, own)
        if resumed:
            self._log(resumed)
        self.warmup_rule = self.record.go_on_with_warmup_rule(self._restored(), self.start_step,
                                                              cfg.train.lr_warmup_steps, self._log)
        key = "train.epochs" if cfg.train.epochs else "train.steps"
        if self.start_step > self.total_steps:
            raise ConfigError(key, f"{self.total_steps} steps are behind the checkpoint's step {self.start_step} "
                                   f"(under {cfg.checkpoint.dir})")
        if self.start_step == self.total_steps:  # a rerun of a finished run: exit 0, but not silently
            self._log(finished_message(self.start_step, key, getattr(cfg.train, key.split(".")[1]),
                                       self.total_steps))

    def _fill_model(self, weights: PretrainedWeights | None, source, model_class: str) -> None:
        """What the wrapped model's values come from, past what a resume restored: nothing more (no weights
        file: random init or a trace's placeholders), the frozen base of a resumed LoRA run (its checkpoint holds
        what trains), the stored buffers of a resumed full run, or the pretrained weights of a fresh run."""
        cfg, backend, resumed = self.cfg, self.backend, self.start_step
        if weights is None:
            origin = (f"weights from the step-{resumed} checkpoint" if resumed
                      else "placeholders for its parameters (traced, never run)" if backend.placeholders
                      else f"random init from train.seed={cfg.train.seed}")
            self._log(f"model: {model_class}, " + origin
                      + ("" if source.directory is None else f" (model.init={cfg.model.init})"))
        elif resumed and self.adapter.freezes_base:
            self.record.go_on_with_base(self.checkpointer.restored, resumed, weights, backend.processes.is_main,
                                        self._log)
            report = weights.load(backend, self.model, frozen_only=True)
            self._log(f"model: resumed the trained parameters; the frozen weights read from {source.directory} "
                      f"({report.describe()})")
        elif resumed:
            weights.load_buffers(backend, self.model)  # checkpoints hold parameters; stored buffers come from here
            self._log(f"model: resumed, so the pretrained weights of {source.directory} were not read")
        else:
            if self.adapter.freezes_base and backend.processes.is_main:  # the base the adapters will be trained on
                self.record.base = weights.identity()
            self._load_pretrained(weights, model_class)
        if not resumed and not backend.placeholders:  # a resume read them from its checkpoint
            self.adapter.derive(self.model)

    def _reference_model(self, policy_config) -> nn.Module:
        """The objective's reference model, sharded as the policy is and in eval mode. Never checkpointed: the
        checkpointer holds the policy only."""
        backend = self.backend
        model, weights = reference_model(self.cfg, self.objective, policy_config, accelerator=backend.accelerator,
                                         capabilities=backend.capabilities, empty=backend.placeholders)
        wrapped = backend.wrap(model)
        if weights is not None and not backend.placeholders:  # a trace reads no value: nothing to load
            self.record.go_on_with_reference(self._restored(), self.start_step, self.objective.reference_key, weights,
                                             backend.processes.is_main, self._log)
            report = weights.load(backend, wrapped)
            self._log(f"reference model: {self.objective.reference_directory}, frozen, sharded as the policy "
                      f"({report.describe()})")
        return wrapped.eval()

    def _restored(self) -> RunRecord | None:
        """What the resumed checkpoint recorded of the run (None: a fresh run)."""
        return self.checkpointer.restored if self.start_step else None

    def _total_steps(self) -> int:
        train = self.cfg.train
        if train.epochs is None:
            return train.steps
        rows = self.source.rows_per_epoch
        if rows is None:
            raise ConfigError("train.epochs", "the training rows are endless or streamed (no epoch length known up "
                                              "front): set train.steps instead")
        return max(1, math.ceil(train.epochs * rows / train.global_batch_size))

    def _load_pretrained(self, weights: PretrainedWeights, model_class: str) -> None:
        report = weights.load(self.backend, self.model)
        head = [name for name in report.fresh if not self.adapter.is_added(name)]
        adapters = len(report.fresh) - len(head)
        self._log(f"model: {model_class}, pretrained weights from {weights.source.directory}"
                  + (f"; new head {', '.join(head)} initialised from train.seed" if head else "")
                  + (f"; {adapters} {self.adapter.added}" if adapters else "")
                  + (f"; {len(report.skipped)} stored tensor(s) not used ({', '.join(report.skipped[:4])}"
                     f"{', ...' if len(report.skipped) > 4 else ''})" if report.skipped else ""))
        # Every process reports its own reads: the point is that each reads only its part.
        index, count = self.backend.processes.writer
        print(f"xla-shard: [process {index}/{count}] pretrained load: "
              f"{report.describe()}", file=sys.stderr, flush=True)
        self.load_report = report

    def _log(self, message: str) -> None:
        if self.backend.processes.is_main:
            print(f"xla-shard: {redact(message)}", file=sys.stderr, flush=True)

    def micro_batches(self, step: int) -> list[Batch]:
        """This process's rows of each micro-batch of `step`, read from the source (not yet on the device)."""
        return [self.source.rows(step, rows) for rows in process_rows(self.cfg.train, self.backend.processes)]

    def _read(self, step: int) -> tuple[list[Batch], int]:
        """`step`'s micro-batches and its global batch's real tokens, read together in the prefetch thread: a
        stream's rows are read once, in order (asked for an earlier step, a stream starts again from the top)."""
        return self.micro_batches(step), self.source.real_tokens(step)

    def trained_batches(self, step: int, micro_batches: list[Batch] | None = None) -> list[Batch]:
        """What `step` trains on: its micro-batches (read, or given), as the objective makes them (an online
        method's rollout: generated and scored)."""
        backend = self.backend
        return self.method.rollout.make(self.model, backend, self.source, step,
                                        micro_batches or self.micro_batches(step),
                                        process_rows(self.cfg.train, backend.processes))

    def step(self, step: int, micro_batches: list[Batch] | None = None) -> torch.Tensor:
        """One optimizer step over `grad_accum_steps` micro-batches; the mean loss (a device tensor)."""
        backend, train = self.backend, self.cfg.train
        micro_batches = self.trained_batches(step, micro_batches)
        k = len(micro_batches)
        weights = self.objective.weights(micro_batches, backend.processes, backend.world, self.uneven_labels)
        equal = all(w == 1.0 / k for w in weights)  # the plain mean (a process's own shares can be equal, not 1/k)
        total = None
        # one length a graph under torch.compile
        trim = backend.capabilities.varying_shapes and not train.compile and self.method.rollout.trims_padding
        for j, rows in enumerate(micro_batches):
            batch = backend.place(trimmed(rows) if trim else rows)
            with backend.grad_sync(self.model, enabled=j == k - 1):
                with backend.forward_context():
                    loss = self.objective.loss(self.model, batch)
                # Unequal shares as a device scalar, not a Python one: XLA would compile each value apart.
                if not equal:
                    loss = loss * torch.tensor(weights[j], dtype=loss.dtype, device=loss.device)
                elif k > 1:
                    loss = loss / k
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        self.grad_norm = (backend.clip_grad_norm(self.model, train.max_grad_norm)
                          if train.max_grad_norm is not None else None)
        self.lr = train.lr * lr_factor(step, train, self.total_steps, self.warmup_rule)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        backend.after_step()
        return total

    def evaluate(self) -> dict[str, float]:
        return evaluate(self.model, self.backend, self.eval_source, self.cfg, self.objective)

    def run(self) -> list[dict[str, Any]]:
        cfg, ckpt, train = self.cfg, self.checkpointer, self.cfg.train
        logger = StepLogger(cfg.output_dir, self.total_steps, enabled=self.backend.processes.is_main,
                            start_step=self.start_step, tensorboard=train.tensorboard, log=self._log,
                            retry_deadline_s=cfg.checkpoint.retry_deadline_s)
        for advisory in self.backend.advisories():
            logger.warn(advisory)
        self._start_clock()
        prefetch = datalib.Prefetcher(self._read, range(self.start_step, self.total_steps))
        try:
            with PreemptionGuard(cfg.checkpoint.preemption_grace_s) as preemption:
                for step in range(self.start_step, self.total_steps):
                    micro_batches, real_tokens = prefetch.get(step)
                    loss = self.step(step, micro_batches)
                    self._real_tokens += real_tokens
                    done = step + 1
                    record = self._record(done, loss, logger)
                    logger.advance(record)
                    for hook in self.on_step_end:
                        hook(self, done, record)
                    if self.eval_source and (done == self.total_steps or
                                             (train.eval_every and done % train.eval_every == 0)):
                        with self.clock.paused():
                            self._evaluate(done, logger)
                    if done % cfg.checkpoint.every_steps == 0 or done == self.total_steps:
                        self._save(done)
                    stop = self._agreed_stop(preemption)
                    if stop:
                        self._stop_for_preemption(done, stop, preemption)
                        self.stopped_by = 128 + stop  # as a shell reports a process the signal ended
                        break
                ckpt.wait()  # the last save commits before the run counts as finished
                if cfg.fsdp.state_dict_type == "FULL_STATE_DICT" and not self.stopped_by:  # needs checkpoint.dir
                    self._export_final()
        finally:
            logger.close()
        return self.records

    def _start_clock(self) -> None:
        """Training's clock and graph count start here: what setup compiled (the weights put on the devices;
        on a resume, said once) is counted apart from the steps' graphs, so a resumed run counts as a fresh one."""
        compiled = self.backend.compilations()
        self.clock = StepClock(lambda: None if compiled is None else self.backend.compilations().seconds,
                               self.start_step, self._warmup_steps())
        self._real_tokens, self._real_since = 0, self.start_step
        self.graphs = GraphCount(self.backend.compilations, self.start_step + self._warmup_steps())
        if compiled is not None and compiled.graphs and self.start_step:
            self._log(f"restoring the step-{self.start_step} checkpoint compiled {compiled.graphs} graph(s) "
                      f"({compiled.seconds:.1f} s), not counted in the steps' compilations")

    def _warmup_steps(self) -> int:
        """Steps whose compilations are the warm-up's: train.recompile_warmup_steps rounds of the method's programs
        (an online method compiles its sampler again once the weights it samples from are a step's outputs)."""
        return self.cfg.train.recompile_warmup_steps * self.method.rollout.steps_per_round

    def _evaluate(self, done: int, logger: StepLogger) -> None:
        start = time.perf_counter()
        with self.graphs.evaluation(done, logger.warn) as compiled:
            result = {"step": done, **self.evaluate()}
            result["eval_time_s"] = time.perf_counter() - start
        result.update(compiled)
        self.records.append(result)
        logger.log(result)
        for hook in self.on_evaluate:
            hook(self, done, result)

    def _export_final(self) -> None:
        """FULL_STATE_DICT: the final checkpoint also becomes one Hugging Face model directory."""
        if not self.backend.processes.is_main:
            return
        target = final_export_dir(self.cfg)
        # The run's own output: a rerun that trains further replaces its earlier export (whole, never mixed).
        committed = self.checkpointer.last_committed_url()
        if committed is None:
            return
        report = export(committed, target, overwrite=True)
        self._log(f"fsdp.state_dict_type=FULL_STATE_DICT: exported step {report.step} to {target} "
                  f"({report.tensors} tensors, {mib(report.bytes)}"
                  + (f"; with {', '.join(report.companions)})" if report.companions else ")")
                  + (f"; {report.note}" if report.note else ""))

    def _agreed_stop(self, preemption: PreemptionGuard) -> signal.Signals | None:
        """Every process stops after the same step, for the same signal: SIGTERM if any process had one (exit
        143: scripts/train_loop.sh restarts, and the restart resumes), else Ctrl-C's SIGINT (130: it does not)."""
        asked, terminated = self.backend.processes.total(
            [int(preemption.requested), int(preemption.signal == signal.SIGTERM)])
        if not asked:
            return None
        return signal.SIGTERM if terminated else signal.SIGINT

    def _save(self, done: int) -> None:
        """The checkpoint after `done` steps, with what this process's rollout made that later steps still use."""
        self.checkpointer.save(done, self.model, self.optimizer, own=self.method.rollout.state(done))

    def _stop_for_preemption(self, done: int, stop: signal.Signals, preemption: PreemptionGuard) -> None:
        ckpt, said = self.checkpointer, stop.name
        if not self.cfg.checkpoint.dir:
            self._log(f"{said}: stopping after step {done} (no checkpoint.dir: nothing saved)")
            return
        self._save(done)  # a no-op if this step's save is already done or in flight
        if ckpt.wait(timeout=preemption.remaining_s()):
            self._log(f"{said}: stopped after step {done}; checkpoint committed, rerun the same command to resume")
        else:
            raise CheckpointError(f"{said}: the step {done} checkpoint did not commit within "
                                  f"checkpoint.preemption_grace_s={preemption.grace_s:g}; the last committed one "
                                  f"({ckpt.last_committed}) stays the resume point")

    def _record(self, done: int, loss: torch.Tensor, logger: StepLogger) -> dict[str, Any] | None:
        cfg, backend = self.cfg, self.backend
        self.clock.tick()
        if done % cfg.train.log_every and done != self.total_steps:
            return None
        mean_loss = backend.mean_loss(loss)  # waits for the device: the lap ends after the steps ran
        lap = self.clock.lap(done)
        tokens = self.objective.tokens_per_step(cfg.train)
        tokens_per_s = tokens / lap.step_time_s
        steps = done - self._real_since
        real = self._real_tokens / steps / lap.step_time_s if steps else tokens_per_s
        self._real_tokens, self._real_since = 0, done
        record = {"step": done, "loss": mean_loss, "step_time_s": lap.step_time_s, "tokens_per_s": tokens_per_s,
                  "real_tokens_per_s": real}
        record.update(self.method.step_metrics(backend.mean_loss))
        if lap.compile_time_s:
            record["compile_time_s"] = lap.compile_time_s
        mfu = self.mfu.of(tokens_per_s, logger.warn)
        if mfu is not None:
            record["mfu"] = mfu
        record.update(backend=backend.name, devices=backend.num_devices, lr=self.lr)
        if self.grad_norm is not None:
            record["grad_norm"] = float(self.grad_norm)
        if self.source.rows_per_epoch:
            record["epoch"] = round(done * cfg.train.global_batch_size / self.source.rows_per_epoch, 4)
        if not math.isfinite(record["loss"]):
            self.checkpointer.wait()  # a save of an earlier step may still be committing: let it
            kept = self.checkpointer.last_committed
            raise TrainingDiverged(f"step {done}: the loss is {record['loss']}; stopping. "
                                   + (f"The last committed checkpoint (step {kept}) is intact. " if kept else "")
                                   + f"Lower train.lr (now {cfg.train.lr:g}) or check the data")
        if not self.records:
            record["mfu_basis"] = self.mfu.basis
        self.graphs.count_step(record, done, logger.warn)
        self.records.append(record)
        logger.log(record, eta_s=self.clock.eta_s(done, self.total_steps))
        return record

    def memory_report(self) -> MemoryReport:
        """What the parameters, gradients and optimizer state take on one device of this process."""
        return memory_report(self.model, self.optimizer, self.backend.local_bytes)


def run(cfg: ShardConfig, backend: Backend | None = None) -> int:
    """Train `cfg` in this process (the entry point a launcher runs), on `backend` if given (created, not
    started); the exit status for the CLI."""
    trainer = Trainer(cfg, backend)
    try:
        trainer.setup().run()
        trainer.backend.processes.barrier()  # every process done (the writer's last commit too) before teardown
    except RuntimeError as error:
        lost = trainer.backend.processes.lost_peer(error)
        if lost is None:
            raise
        if launch.several_nodes():
            raise launch.PeerLost(f"another node's processes went away ({lost}); this node stops too: restart "
                                  "every node (checkpoint.resume: auto continues from the last committed "
                                  "checkpoint)") from None
        raise launch.PeerLost(f"another worker of this run stopped ({lost}); this one stops too") from None
    finally:
        trainer.backend.shutdown()
    return trainer.stopped_by
