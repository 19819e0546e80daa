"""`xla-shard compile`: trace, compile, report; and, when the step does not fit, what would, checked by
compiling it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace

from xla_shard import hostmem
from xla_shard.aot import compiler, generation, target, trace
from xla_shard.aot.report import Refused, Report
from xla_shard.config.load import revalidated
from xla_shard.config.schema import ShardConfig, ShardingStrategy
from xla_shard.errors import ConfigError, UserError


# The host memory libtpu's compile of a step takes here, by the layers it compiles (all of them unrolled, one
# body scanned): measured with `python bench/aot_compile.py --checkpointing --layers L --seq-len 4096 --batch 32`
# (Llama-3-8B's width on a v5p-64, the process's peak): 5.60 GiB at 4 layers, 8.03 at 8, 12.30 at 16.
_HOST_BASE, _HOST_PER_LAYER = 3.37 * 2**30, 0.56 * 2**30


def check_host_memory(cfg: ShardConfig, available: int) -> None:
    """Refuse, before anything is traced, a compile this machine's memory (`available` bytes; 0: unknown) cannot
    hold: the kernel would kill it without a word, minutes in."""
    from xla_shard.models import model_config

    if not available:
        return
    config = model_config(cfg.model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", 1) or 1
    compiled = 1 if cfg.fsdp.scan_layers else layers
    needed = _HOST_BASE + _HOST_PER_LAYER * compiled
    if needed <= available:
        return
    fix = "compile on a machine with more memory"
    if compiled > 1:
        scanned = (_HOST_BASE + _HOST_PER_LAYER) / 2**30
        fix = f"set fsdp.scan_layers: true (one layer's body compiled: about {scanned:.0f} GiB), or {fix}"
    raise UserError(f"compiling this step takes about {needed / 2**30:.0f} GiB of host memory (libtpu's, "
                    f"{compiled} layer(s) compiled; about {_HOST_PER_LAYER / 2**30:.2f} GiB a layer at "
                    f"Llama-3-8B's width) and this machine has {available / 2**30:.1f} GiB available: {fix}")


def compile_for(cfg: ShardConfig, slice_name: str, slices: int = 1) -> Report | Refused:
    chosen = target.parse(slice_name, slices=slices)
    tpu = compiler.describe(chosen.topology, slices)  # first: without the compiler, nothing else runs
    check_host_memory(cfg, hostmem.available_bytes())
    traced = trace.trace(cfg, tpu)
    per_device = chosen.per_device(tpu.count)
    try:
        compiled = tpu.compile(traced.proto)
    except compiler.OutOfHbm as verdict:
        return Refused(chosen, traced, verdict, per_device)
    generating = None
    if traced.generation is not None:
        generating = generation.GenerationReport(traced.generation, generation.compile_programs(traced.generation, tpu),
                                                 per_device, traced.parameters + traced.optimizer_state,
                                                 chosen.chips * chosen.slices)
    return Report(chosen, traced, compiled, per_device, planned_collectives(cfg, tpu.count, chosen.chip),
                  planned_generation(cfg, tpu.count, chosen.chip), generating)


# What each of the planner's collectives moves, as the report says it beside the compiled program's.
_PURPOSES = {
    "params": "parameters gathered for forward and backward",
    "params_backward": "parameters gathered again for backward, from where forward left them",
    "grads": "gradients reduced to their shards",
    "replicas": "gradient shards summed over the replicas",
    "summed": "gradients all-reduced whole",
    "update": "updated parameters gathered after the optimizer step",
    "reference": "the reference model's parameters gathered",
    "lookup": "embedding rows sent to the tokens' devices, and their gradients back",
    "head": "the output head's gradient, summed where its shards lie (the chunked loss)",
    "context_kv": "keys and values gathered along the sequence axis",
    "context_kv_grads": "their gradients summed back along the sequence axis",
}


def planned_generation(cfg: ShardConfig, devices: int, chip) -> tuple[float, float]:
    """The planner's (static KV cache, generation phase) bytes per device for an online method (0s: none)."""
    from xla_shard import planner
    from xla_shard.backends.xla_spmd import XlaSpmdBackend
    from xla_shard.planner import cost
    from xla_shard.methods import method_for
    from xla_shard.planner.settle import settle, with_generation

    capabilities, method = XlaSpmdBackend.capabilities, method_for(cfg)  # (built once: it imports reward functions)
    resolved = settle(cfg, devices, capabilities, "tpu", method)  # (no chip named: the weights whole to generate)
    try:  # the split mesh.generation takes on this chip; none fits: whole, and the report says it does not fit
        resolved = with_generation(cfg, resolved, capabilities, chip.name, method)
    except ConfigError:
        pass
    work = replace(planner.workload(cfg, devices, capabilities, chip, method), generation_split=resolved.generation)
    return work.generation_bytes(cost.memory(work, resolved.degrees, devices))


def planned_collectives(cfg: ShardConfig, devices: int, chip) -> dict[str, list[tuple[str, float]]]:
    """The planner's collectives for this step by op: (what they move, result bytes per device), so that each
    line of the compiled program's collectives says what it is, or that the planner does not model it."""
    from xla_shard import planner
    from xla_shard.backends.xla_spmd import XlaSpmdBackend
    from xla_shard.planner import cost
    from xla_shard.planner.settle import settle

    work = planner.workload(cfg, devices, XlaSpmdBackend.capabilities, chip)
    triple = settle(cfg, devices, XlaSpmdBackend.capabilities, "tpu").degrees
    found: dict[str, list[tuple[str, float]]] = {}
    for x in cost.collectives(work, triple, devices):
        found.setdefault(x.op, []).append((_PURPOSES.get(x.name, x.name), cost.result_bytes([x])[x.op]))
    return found


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


def what_fits(cfg: ShardConfig, report: Report | Refused, bigger: Callable[[str], Report | None],
              budget_s: float = 1800.0, clock: Callable[[], float] = time.monotonic) -> tuple[str | None, list[str]]:
    """The first remedy whose compiled step fits (each compiled in this process), else the next slice size
    (compiled in a fresh process: the device count is set once per process): (it, or None; what the time budget
    left untried). A compile is not cut short: the budget is checked before each."""
    generation, size = report.target.name.rsplit("-", 1)
    larger = f"{generation}-{int(size) * 2}"
    tries = [(change, lambda changed=changed: compile_for(changed, report.target.name, report.target.slices))
             for change, changed in remedies(cfg)] + [(f"--tpu {larger}", lambda: bigger(larger))]
    deadline = clock() + budget_s
    for index, (change, attempt) in enumerate(tries):
        if clock() > deadline:
            return None, [name for name, _ in tries[index:]]
        try:
            tried = attempt()
        except ConfigError:  # a change this slice refuses (micro-batches that do not split over its devices)
            continue
        if tried is not None and tried.fits:
            return f"{change} (compiled: {tried.needed / 2**30:.2f} GiB per device)", []
    return None, []


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


def refusal(report: Report | Refused, fix: str | None, untried: list[str] = ()) -> UserError:
    consumers = ", ".join(f"{name.split(' (')[0]} {size / 2**30:.2f}" for name, size in
                          list(report.consumers.items())[:3])
    if fix:
        found = f"it fits with {fix}"
    elif untried:
        found = (f"the time budget (--budget-minutes) ran out before trying {', '.join(untried)}; more chips, a "
                 "smaller batch, or LoRA")
    else:
        found = "nothing tried fits: more chips, a smaller batch, or LoRA"
    return UserError(f"the step needs {report.needed / 2**30:.2f} GiB per device on {report.target.label}, which has "
                     f"{report.available / 2**30:.2f} GiB (largest: {consumers} GiB); {found}")


def _with(cfg: ShardConfig, seq_len: int, context: int) -> ShardConfig:
    """`cfg` at another length and axis, validated again: a ConfigError where the config refuses them (a GRPO
    run generates whole sequences; a router loss is summed over whole ones)."""
    return revalidated(cfg, {"train.seq_len": seq_len, "mesh.context": context})


def context_sizes(cfg: ShardConfig, devices: int) -> list[int]:
    """The sequence-axis sizes the config can run on `devices`: powers of two inside a parameter's devices,
    leaving each micro-batch's rows split evenly over the rest."""
    from xla_shard import plan as planlib

    params = planlib.resolve(cfg.fsdp, cfg.mesh, devices).params if cfg.fsdp.sharding != "auto" else devices
    micro = cfg.train.global_batch_size // cfg.train.grad_accum_steps
    sizes, c = [], 1
    while c <= params:
        if params % c == 0 and micro % (devices // c) == 0 and _allows(cfg, c):
            sizes.append(c)
        c *= 2
    return sizes


def _allows(cfg: ShardConfig, context: int) -> bool:
    if context == cfg.mesh.context:
        return True  # the user's own: its refusal is theirs to read, at the first compile
    try:
        _with(cfg, cfg.train.seq_len, context)
    except ConfigError:
        return False
    return True


def longest(cfg: ShardConfig, slice_name: str, slices: int = 1, budget_s: float = 1800.0,
            say: Callable[[str], None] = print) -> tuple[int, int, float] | None:
    """The longest sequence (doubling from `train.seq_len`) whose step fits the slice, and the smallest
    sequence axis (`mesh.context`) it fits with, each answer a compile: first with the largest axis the batch
    allows (the least memory per device), doubling the length until the compiler refuses it (or the model's
    positions end), then halving the axis at that length while it still fits (fewer collectives). Returns
    (seq_len, context, GiB per device), or None if even `train.seq_len` does not fit; what the time budget
    left untried is said."""
    import time

    from xla_shard.models import check_sequence_length, max_positions, model_config

    check_sequence_length(model_config(cfg.model), cfg.train.seq_len)  # where the search starts: the user's own
    started = time.monotonic()
    devices = compiler.describe(target.parse(slice_name, slices=slices).topology, slices).count
    sizes = context_sizes(cfg, devices)
    limit = max_positions(model_config(cfg.model))
    tried: dict[tuple[int, int], float | None] = {}

    def fits(seq_len: int, context: int) -> bool:
        if time.monotonic() - started > budget_s:
            raise TimeoutError
        try:
            candidate = _with(cfg, seq_len, context)
        except ConfigError as refused:
            if seq_len == cfg.train.seq_len:
                raise
            say(f"  {seq_len} tokens, mesh.context {context}: the config refuses it ({refused})")
            return False
        report = compile_for(candidate, slice_name, slices)
        tried[seq_len, context] = report.needed / 2**30 if report.fits else None
        say(f"  {seq_len} tokens, mesh.context {context}: {report.needed / 2**30:.2f} GiB per device of "
            f"{report.available / 2**30:.0f}" + ("" if report.fits else " (does not fit)"))
        return report.fits

    best, context = None, sizes[-1]
    seq_len = cfg.train.seq_len
    try:
        while seq_len % (2 * context) == 0 and (limit is None or seq_len <= limit) and fits(seq_len, context):
            best, seq_len = seq_len, seq_len * 2
        if best is None:
            return None
        smaller = [c for c in sizes if c < context]
        while smaller and fits(best, smaller[-1]):
            context = smaller.pop()
    except TimeoutError:
        if best is None:  # nothing compiled: whether train.seq_len fits is not known
            raise UserError(f"--budget-minutes {budget_s / 60:g}: the time budget ran out before train.seq_len "
                            f"{cfg.train.seq_len} was compiled; give the search more time") from None
        say(f"  the time budget ({budget_s / 60:.0f} min) ran out: longer sequences and smaller axes than those "
            "above were not compiled")
    if limit is not None and seq_len > limit:
        say(f"  the model has {limit} positions (max_position_embeddings): no longer sequence was tried")
    return best, context, tried[best, context]
