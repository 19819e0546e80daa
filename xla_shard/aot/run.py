"""`xla-shard compile`: trace, compile, report; and, when the step does not fit, what would, checked by
compiling it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

from xla_shard.aot import compiler, target, trace
from xla_shard.aot.report import Refused, Report
from xla_shard.config.schema import ShardConfig, ShardingStrategy
from xla_shard.errors import UserError


def compile_for(cfg: ShardConfig, slice_name: str, slices: int = 1) -> Report | Refused:
    chosen = target.parse(slice_name, slices=slices)
    tpu = compiler.describe(chosen.topology, slices)  # first: without the compiler, nothing else runs
    traced = trace.trace(cfg, tpu)
    per_device = chosen.per_device(tpu.count)
    try:
        compiled = tpu.compile(traced.proto)
    except compiler.OutOfHbm as verdict:
        return Refused(chosen, traced, verdict, per_device)
    return Report(chosen, traced, compiled, per_device)


def remedies(cfg: ShardConfig) -> list[tuple[str, ShardConfig]]:
    """Changes that lower the memory per device at the same chip count, most effective first."""
    found = []
    fsdp, train = cfg.fsdp, cfg.train
    if not fsdp.activation_checkpointing:
        found.append(("fsdp.activation_checkpointing: true",
                      cfg.model_copy(update={"fsdp": fsdp.model_copy(update={"activation_checkpointing": True})})))
    if fsdp.sharding is not None or fsdp.sharding_strategy is not ShardingStrategy.FULL_SHARD:
        full = fsdp.model_copy(update={"sharding": None, "sharding_strategy": ShardingStrategy.FULL_SHARD})
        found.append(("fsdp.sharding_strategy: FULL_SHARD", cfg.model_copy(update={"fsdp": full})))
    k = train.grad_accum_steps * 2
    if train.global_batch_size % k == 0:
        found.append((f"train.grad_accum_steps: {k}",
                      cfg.model_copy(update={"train": train.model_copy(update={"grad_accum_steps": k})})))
    return found


def what_fits(cfg: ShardConfig, report: Report | Refused, bigger: Callable[[str], Report | None]) -> str | None:
    """The first remedy whose compiled step fits (each compiled in this process), else the next slice size
    (compiled in a fresh process: the device count is set once per process); None if neither does."""
    for change, changed in remedies(cfg):
        tried = compile_for(changed, report.target.name, report.target.slices)
        if tried.fits:
            return f"{change} (compiled: {tried.needed / 2**30:.2f} GiB per device)"
    generation, size = report.target.name.rsplit("-", 1)
    larger = f"{generation}-{int(size) * 2}"
    tried = bigger(larger)
    if tried is not None and tried.fits:
        return f"--tpu {larger} (compiled: {tried.needed / 2**30:.2f} GiB per device)"
    return None


def compile_elsewhere(config: str | None, sets: list[str], slices: int = 1) -> Callable[[str], Report | None]:
    """Compile for another slice (as many of them) in a fresh `xla-shard compile` process; None where it
    cannot."""
    def run(slice_name: str):
        command = [sys.executable, "-m", "xla_shard.cli", "compile", *([config] if config else []), "--tpu",
                   slice_name, "--slices", str(slices), "--json", "--no-suggest",
                   *[a for s in sets for a in ("--set", s)]]
        done = subprocess.run(command, capture_output=True, text=True)
        if not done.stdout.strip():
            return None
        return _Summary(json.loads(done.stdout))

    return run


class _Summary:
    """What another process's report said (its JSON)."""

    def __init__(self, data: dict):
        self.fits, self.needed = data["fits"], data["needed_bytes_per_device"]


def refusal(report: Report | Refused, fix: str | None) -> UserError:
    consumers = ", ".join(f"{name.split(' (')[0]} {size / 2**30:.2f}" for name, size in
                          list(report.consumers.items())[:3])
    return UserError(f"the step needs {report.needed / 2**30:.2f} GiB per device on {report.target.label}, which has "
                     f"{report.available / 2**30:.2f} GiB (largest: {consumers} GiB); "
                     + (f"it fits with {fix}" if fix else "nothing tried fits: more chips, a smaller batch, or LoRA"))
