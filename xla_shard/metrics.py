"""Step metrics: model FLOPs, MFU against a table of device peaks, JSON lines and a progress bar."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from xla_shard.errors import ConfigError

# Dense bf16 peak FLOP/s per chip (TPU) or per GPU, from the vendors' spec sheets.
PEAK_FLOPS: dict[str, float] = {
    "tpu v4": 275e12,
    "tpu v5e": 197e12,
    "tpu v5litepod": 197e12,
    "tpu v5p": 459e12,
    "tpu v6e": 918e12,
    "tpu7x": 2307e12,
    "h200": 989e12,
    "h100": 989e12,
    "a100": 312e12,
}


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
    kind = device_kind.lower()
    for name, flops in PEAK_FLOPS.items():
        if name in kind:
            return flops
    return None


def require_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError("train.tensorboard", "needs the tensorboard package: pip install 'xla_shard[tensorboard]'"
                          ) from None


class StepLogger:
    """Writes one JSON line per logged step (and evaluation) to output_dir/metrics.jsonl, TensorBoard events
    if asked, and drives a progress bar on a terminal (main process only).

    metrics.jsonl holds one run's series: a new run (from step 0) moves an earlier run's file aside, and a
    resumed run drops the records past its resume point, which it is about to redo."""

    def __init__(self, output_dir: str, total_steps: int, enabled: bool, start_step: int = 0,
                 tensorboard: bool = False, log=print):
        self.enabled = enabled
        self.total_steps = total_steps
        self.file = None
        self.bar = None
        self.board = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "metrics.jsonl"
        if path.exists() and path.stat().st_size:
            if start_step == 0:
                aside = out / f"metrics-{time.strftime('%Y%m%d-%H%M%S', time.localtime(path.stat().st_mtime))}.jsonl"
                path.rename(aside)
                log(f"{path} held an earlier run's metrics (this run starts at step 0): moved to {aside.name}")
            else:
                kept = [line for line in path.read_text().splitlines() if _step_of(line) <= start_step]
                path.write_text("".join(line + "\n" for line in kept))
        self.file = open(path, "a")
        if tensorboard:
            require_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(str(out))
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", disable=not sys.stderr.isatty(),
                        dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.board is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.board.add_scalar(key if key.startswith("eval_") else f"train/{key}", value, record["step"])
        if "eval_loss" in record and not self.bar.disable:
            self.bar.write(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()), file=sys.stderr)
        if self.bar.disable:  # no terminal (a log file): one line per record, with the time left
            line = " ".join(f"{k}={_fmt(v)}" for k, v in record.items())
            if "step_time_s" in record:
                left = round(max(0, self.total_steps - record["step"]) * record["step_time_s"])
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


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except (ValueError, AttributeError):
        return 0


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
