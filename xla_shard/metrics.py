"""Step metrics: model FLOPs, MFU against the planner's device peaks, JSON lines and a progress bar."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from xla_shard.errors import ConfigError
from xla_shard.io.staged import StagedDir, is_url
from xla_shard.planner.hardware import for_device_kind


def train_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """PaLM's count (appendix B): 6 x non-embedding params + 12 x layers x hidden x seq for attention.

    Recomputation under activation checkpointing is not counted: this is MFU, not hardware utilisation.
    """
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    params -= model.get_input_embeddings().weight.numel()
    layers = config.num_hidden_layers
    hidden = config.hidden_size
    return 6.0 * params + 12.0 * layers * hidden * seq_len


def peak_for(device_kind: str) -> float | None:
    """Dense bf16 peak FLOP/s of one device of this kind: the planner's hardware table, which its estimates
    divide by too, so a step record's MFU and the plan's are taken against the same peak."""
    hardware = for_device_kind(device_kind)
    return hardware.peak_flops if hardware else None


# What MFU counts (`train_flops_per_token`), said in a run's first record: at long context it reads well above
# MaxText's convention for the same step time.
MFU_CONVENTION = ("FLOPs by PaLM's count: 6 x non-embedding parameters + 12 x layers x hidden x seq_len a token, "
                  "attention over every pair of positions (MaxText's count takes causal attention at half)")


class Mfu:
    """Model FLOPs utilisation of a run's steps, against the peak FLOP/s of its devices (`configured`:
    train.peak_flops_per_device; else the device's kind's, from the hardware table). No peak, no MFU: a CPU has no
    spec-sheet peak, and a matmul timed on a busy machine is no ceiling (it once gave MFU 19). Never above 1: a
    peak the run exceeds is not a peak, so MFU stops (once, with a warning naming the basis) rather than report a
    number that cannot be true."""

    def __init__(self, flops_per_token: float, device_kind: str, devices: int, configured: float | None = None):
        self.flops_per_token, self.devices = flops_per_token, devices
        self.peak = configured or peak_for(device_kind)
        self.basis = (f"train.peak_flops_per_device={configured:.3g}; {MFU_CONVENTION}" if configured
                      else f"{device_kind} dense bf16 peak {self.peak:.3g} FLOP/s; {MFU_CONVENTION}" if self.peak
                      else f"no MFU: {device_kind} has no known peak FLOP/s (set train.peak_flops_per_device to "
                           "report one)")

    def of(self, tokens_per_s: float, warn: Callable[[str], None]) -> float | None:
        if self.peak is None:
            return None
        mfu = self.flops_per_token * tokens_per_s / (self.peak * self.devices)
        if mfu <= 1.0:
            return mfu
        warn(f"MFU {mfu:.2f} > 1 against {self.basis}: that peak is below what this run does, so MFU is no longer "
             "reported (tokens_per_s is)")
        self.peak = None
        return None


def require_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError("train.tensorboard", "needs the tensorboard package: pip install 'xla_shard[tensorboard]'"
                          ) from None


@dataclass
class Lap:
    """The steps since the last record: seconds per step with compiling left out, and the compiling."""

    step_time_s: float
    compile_time_s: float
    steady: bool  # past the warm-up and nothing compiled: a fair sample of what the rest of the run takes


class GraphCount:
    """The graphs a run's steps compile, told apart from the rest: what was compiled before the steps (setup, a
    restore) and for evaluation is not theirs, and a step past the warm-up (`warmed_up_at`, a step number) that
    compiles a new graph is a recompile: its shapes or its Python-side control flow change. `compilations`: the
    backend's running total (None where nothing compiles: nothing is counted)."""

    def __init__(self, compilations: Callable[[], Any], warmed_up_at: int):
        self._compilations, self.warmed_up_at = compilations, warmed_up_at
        compiled = compilations()
        self._not_steps = compiled.graphs if compiled is not None else 0
        self._after_warmup: int | None = None  # the steps' graphs at the end of the warm-up
        self._evaluated = False

    def count_step(self, record: dict[str, Any], done: int, warn: Callable[[str], None]) -> None:
        """`compilations` (and `recompiles`, warned) into the record of step `done`."""
        compiled = self._compilations()
        if compiled is None:
            return
        graphs = record["compilations"] = compiled.graphs - self._not_steps
        if self._after_warmup is None and done >= self.warmed_up_at:
            self._after_warmup = graphs
        elif self._after_warmup is not None and graphs > self._after_warmup:
            record["recompiles"] = graphs - self._after_warmup
            warn(f"step {done}: {record['recompiles']} new graph(s) compiled after warm-up; the step is not static "
                 "(changing shapes or Python-side control flow). Set PT_XLA_DEBUG_LEVEL=2 (torch_xla) or "
                 "TORCH_LOGS=recompiles (train.compile) to see why.")

    @contextlib.contextmanager
    def evaluation(self, done: int, warn: Callable[[str], None]):
        """Around an evaluation after step `done`: yields the dict its record's compile keys are put in."""
        before, found = self._compilations(), {}
        yield found
        compiled = self._compilations()
        if compiled is not None:
            new = compiled.graphs - before.graphs
            self._not_steps += new  # evaluation's graphs are not the steps' (nor their recompiles)
            found["eval_compilations"] = new
            if new:
                found["eval_compile_time_s"] = compiled.seconds - before.seconds
            if new and self._evaluated:
                warn(f"step {done}: XLA compiled {new} new graph(s) for evaluation after the first; evaluation "
                     "shapes are not static")
        self._evaluated = True


class StepClock:
    """Wall time of the training steps alone, for step_time_s, tokens_per_s and the ETA.

    Evaluation runs `paused()`, outside every step. Graph compilation (`compiled_seconds`, the backend's
    running total; None where nothing compiles) is subtracted from the steps it fell in and reported apart, so
    a step that compiled shows what it will cost from then on. The ETA is the mean of the steady laps: past
    the first `warmup_steps` of this run and compiling nothing. A checkpoint's save stays in (it recurs)."""

    def __init__(self, compiled_seconds: Callable[[], float | None], start_step: int, warmup_steps: int):
        self.compiled_seconds = compiled_seconds
        self.steady_after = start_step + warmup_steps
        self.steady_s, self.steady_steps = 0.0, 0
        self._begin()

    def _begin(self) -> None:
        self.start, self.steps, self.paused_s = time.perf_counter(), 0, 0.0
        self.compiled_at = self.compiled_seconds() or 0.0

    def tick(self) -> None:
        self.steps += 1

    @contextlib.contextmanager
    def paused(self):
        start, compiled = time.perf_counter(), self.compiled_seconds() or 0.0
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - start
            self.compiled_at += (self.compiled_seconds() or 0.0) - compiled  # not the steps' compiling either

    def lap(self, done: int) -> Lap:
        """Closes the lap of the steps up to `done` (the caller has synchronised with the device)."""
        wall = time.perf_counter() - self.start - self.paused_s
        compiling = max(0.0, (self.compiled_seconds() or 0.0) - self.compiled_at)
        step_time = max(wall - compiling, 1e-9) / self.steps
        steady = done - self.steps >= self.steady_after and compiling == 0.0
        if steady:
            self.steady_s += step_time * self.steps
            self.steady_steps += self.steps
        lap = Lap(step_time, compiling, steady)
        self._begin()
        return lap

    def eta_s(self, done: int, total: int) -> float | None:
        """Seconds the steps after `done` will take at the steady pace, or None before any steady lap."""
        if not self.steady_steps:
            return None
        return (total - done) * self.steady_s / self.steady_steps


class StepLogger:
    """Writes one JSON line per logged step (and evaluation) to output_dir/metrics.jsonl, TensorBoard events
    if asked, and drives a progress bar on a terminal (main process only).

    metrics.jsonl holds one run's series: a new run (from step 0) moves an earlier run's file aside, and a
    resumed run drops the records past its resume point, which it is about to redo. An output_dir on a bucket
    (gs://) is written through a local staging folder whose files go up whole (`xla_shard.io.staged`)."""

    def __init__(self, output_dir: str, total_steps: int, enabled: bool, start_step: int = 0,
                 tensorboard: bool = False, log=print, retry_deadline_s: float = 120.0):
        self.enabled = enabled
        self.total_steps = total_steps
        self.file = None
        self.bar = None
        self.board = None
        self.staged = None
        if not enabled:
            return
        if is_url(output_dir):
            self.staged = StagedDir(output_dir, retry_deadline_s, warn=self.warn)
            out = self.staged.local
            self.staged.fetch("metrics.jsonl")
        else:
            out = Path(output_dir)
            out.mkdir(parents=True, exist_ok=True)
        path = out / "metrics.jsonl"
        if path.exists() and path.stat().st_size:
            if start_step == 0:
                aside = out / f"metrics-{time.strftime('%Y%m%d-%H%M%S', time.localtime(path.stat().st_mtime))}.jsonl"
                path.rename(aside)
                log(f"{output_dir}/metrics.jsonl held an earlier run's metrics (this run starts at step 0): moved "
                    f"to {aside.name}")
            else:
                self._keep_until(path, start_step, f"{output_dir}/metrics.jsonl", log)
        self.file = open(path, "a")
        if tensorboard:
            require_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(str(out))
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", disable=not sys.stderr.isatty(),
                        dynamic_ncols=True)

    @staticmethod
    def _keep_until(path: Path, step: int, shown: str, log) -> None:
        """Keep the records up to `step` (a resumed run redoes the rest); a line that is not a record (not UTF-8
        JSON, its step not a number) is the file's damage, dropped with a word, never the run's end."""
        kept, damaged = [], 0
        for line in path.read_bytes().splitlines():
            at = _step_of(line)
            if at is None:
                damaged += line.strip() != b""
            elif at <= step:
                kept.append(line)
        if damaged:
            log(f"{shown}: {damaged} line(s) that are not a record (UTF-8 JSON with a numeric step) dropped")
        path.write_bytes(b"".join(line + b"\n" for line in kept))

    def log(self, record: dict[str, Any], eta_s: float | None = None) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.board is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.board.add_scalar(key if key.startswith("eval_") else f"train/{key}", value, record["step"])
            if self.staged is not None:
                self.board.flush()
        if self.staged is not None:
            self.staged.sync()
        if "eval_loss" in record and not self.bar.disable:
            self.bar.write(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()), file=sys.stderr)
        if self.bar.disable:  # no terminal (a log file): one line per record, with the time left
            line = " ".join(f"{k}={_fmt(v)}" for k, v in record.items())
            if eta_s is not None:
                left = round(eta_s)
                line += f" eta={left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}"
            print(line, file=sys.stderr, flush=True)

    def advance(self, record: dict[str, Any] | None) -> None:
        if self.enabled:
            self.bar.update(1)
            if record:
                shown = {"loss": f"{record['loss']:.4f}", "tok_s": f"{record['tokens_per_s']:.0f}"}
                if "mfu" in record:
                    shown["mfu"] = f"{record['mfu']:.2%}"
                self.bar.set_postfix(shown)

    def warn(self, message: str) -> None:
        if self.enabled:
            tqdm.write(f"WARNING: {message}", file=sys.stderr)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.file.close()
            if self.board is not None:
                self.board.close()
            if self.staged is not None:
                self.staged.close()


def _step_of(line: bytes) -> float | None:
    """A record's step, or None where the line is not one."""
    try:
        record = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        return None
    step = record.get("step") if isinstance(record, dict) else None
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    return step


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


@dataclass
class MemoryReport:
    """Bytes on one device, and what the same tensors take unsharded."""

    params: int
    grads: int
    optimizer: int
    params_unsharded: int
    grads_unsharded: int
    optimizer_unsharded: int


def memory_report(model, optimizer, local_bytes) -> MemoryReport:
    """A model's and its optimizer's tensors on one device (`local_bytes`: the backend's, each tensor's bytes on
    this process's device), and unsharded."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]

    def full(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    return MemoryReport(sum(local_bytes(params)), sum(local_bytes(grads)), sum(local_bytes(states)),
                        full(params), full(grads), full(states))
