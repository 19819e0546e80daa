"""Trace several configs' steps for one TPU slice as `xla-shard compile` does (placeholders for parameters and
optimizer state), compile each with libtpu, and print what the compiler says of it beside what the planner's
cost model predicts, one JSON line per run. With --real, each is also traced with real parameters and state:
the placeholders must not change the program.

Usage: aot_traces.py SLICE [--real] [KEY=VALUE ...] -- [KEY=VALUE ...] [-- ...]   (common overrides, then each run's)
"""

import json
import math
import re
import sys

from runs import split_runs

from xla_shard import config, planner
from xla_shard.aot import compiler, target, trace
from xla_shard.backends.xla_spmd import XlaSpmdBackend
from xla_shard.planner import cost, hlo
from xla_shard.planner.settle import settle


_GATHERED = re.compile(r"= [a-z][a-z0-9]*\[([0-9,]*)\][^ ]* all-gather(?:-start)?\(")


def compiled(cfg, tpu, placeholders: bool) -> dict:
    traced = trace.trace(cfg, tpu, placeholders=placeholders)
    program = tpu.compile(traced.proto)
    return {"traced": [traced.parameters, traced.optimizer_state, traced.batch, traced.reference],
            "memory": [program.argument_bytes, program.output_bytes, program.temporaries],
            "flops": program.flops, "collectives": hlo.collective_totals(program.hlo_text, traced.loop_trips),
            "kernels": traced.kernels, "executed": hlo.executed_flops(program.hlo_text, traced.loop_trips),
            "devices": tpu.count,
            "all_gathered": sorted({tuple(int(d) for d in dims.split(",") if d) for dims in _GATHERED.findall(
                program.hlo_text)}, key=lambda dims: -math.prod(dims))}  # each all-gather's result dims


def predicted(cfg, devices: int, chip) -> dict:
    """The cost model's bytes per device for parameters + optimizer state, and its collectives' result bytes
    by kind (a reduce-scatter's result is one shard of the tensor it reduces), as the compiled program counts."""
    work = planner.workload(cfg, devices, XlaSpmdBackend.capabilities, chip)
    triple = settle(cfg, devices, XlaSpmdBackend.capabilities, "cpu").degrees
    held = cost.memory(work, triple, devices)
    phases = cost.scanned_phases(work, held)
    return {"params_and_optimizer": held["params"] + held["optimizer"], "logits": held["logits"],
            "total": held["total"], "scanned_peak": max(phases, key=phases.get),
            "collectives": cost.result_bytes(cost.collectives(work, triple, devices))}


def main(slice_name: str, *args: str) -> None:
    real = "--real" in args
    common, *runs = split_runs([a for a in args if a != "--real"])
    chosen = target.parse(slice_name)
    tpu = compiler.describe(chosen.topology)
    for run in runs:
        cfg = config.load(None, [*common, *run])
        result = {"placeholders": compiled(cfg, tpu, True), "planner": predicted(cfg, tpu.count, chosen.chip)}
        if real:
            result["real"] = compiled(cfg, tpu, False)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
