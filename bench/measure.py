"""What a run does under its sharding, measured the way the cost model predicts it: per-device bytes of
parameters, gradients and optimizer state, the collectives of the compiled step (XLA), and the step time.

Used by `bench/sharding_triples.py` and the planner's tests, on any backend the `Trainer` runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from xla_shard.planner.hlo import collectives, step_program


@dataclass
class Measured:
    triple: str
    losses: list[float]  # one per training step, the global-batch mean
    memory: dict[str, int]  # bytes on one device: params, grads, optimizer
    step_s: float  # median wall time of the steps after the two that compile
    collectives: dict[tuple[str, int, int], dict[str, int]] = field(default_factory=dict)  # XLA: the step's HLO


class _Run:
    """One set-up Trainer being measured: its first two steps compile (the first also creates the optimizer
    state), the rest are timed."""

    def __init__(self, trainer, hlo_dump: Path | None):
        self.trainer, self.hlo_dump = trainer, hlo_dump
        self.losses, self.times, self.program = [], [], ""

    def warm_up(self) -> None:
        compiled = []
        for step in (0, 1):
            before = set(self.hlo_dump.iterdir()) if self.hlo_dump else set()
            self.step(step)
            compiled.append(sorted(set(self.hlo_dump.iterdir()) - before) if self.hlo_dump else [])
        # The second step's program if it compiled one, else the first's; none when both were compiled earlier
        # in this process (a layout another run had: see `compare`).
        new = compiled[1] or compiled[0]
        self.program = step_program(new) if new else ""

    def step(self, step: int) -> None:
        started = time.perf_counter()
        self.losses.append(self.trainer.backend.mean_loss(self.trainer.step(step)))  # waits for the step
        self.times.append(time.perf_counter() - started)

    def result(self) -> Measured:
        backend = self.trainer.backend
        memory = bytes_after_backward(self.trainer, len(self.losses))
        return Measured(backend.plan.triple, self.losses, memory, statistics.median(self.times[2:]),
                        collectives(self.program) if self.program else {})


def measure_all(trainers: list, steps: int, hlo_dump: str | Path | None = None) -> list[Measured]:
    """Run `steps` (>= 3) training steps of each set-up Trainer, the timed ones taken in turn (step k of every
    run before step k+1 of any), so that all see the same machine; then one more step of each to read the
    gradients' bytes.

    `hlo_dump`: the directory XLA dumps optimized HLO into (`XLA_FLAGS=--xla_dump_to=...`, set before XLA
    starts).
    """
    if steps < 3:
        raise ValueError("measuring needs at least 3 steps: two compile, the rest are timed")
    dump = Path(hlo_dump) if hlo_dump else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)  # XLA makes it at its first dump
    runs = [_Run(trainer, dump) for trainer in trainers]
    for run in runs:
        run.warm_up()
    for step in range(2, steps):
        for run in runs:
            run.step(step)
    return [run.result() for run in runs]


def bytes_after_backward(trainer, step: int) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state on one device, read in one more step (number `step`)
    cut after backward so the gradients exist, then stepped."""
    backend, model = trainer.backend, trainer.model
    batch = backend.place(trainer.trained_batches(step)[0])
    with backend.forward_context():
        trainer.objective.loss(model, batch).backward()
    backend.after_step()
    report = trainer.memory_report()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    backend.after_step()
    return {"params": report.params, "grads": report.grads, "optimizer": report.optimizer}


def attribute(found: dict[tuple[str, int, int], dict[str, int]], params: int, grads: int, update: int,
              devices: int, after_forward: int | None = None) -> dict[str, float]:
    """The collectives of a compiled step (`hlo.collectives`) as the cost model's kinds (`cost.collectives`:
    params, params_backward, grads, replicas, update; its all-to-alls, lookup and head, together), in tensor
    bytes; `other` is what fits none of them.
    `update`: the degree the optimizer updates at (OS; G for an optimizer without state); `after_forward`: the
    devices parameters stay split over until backward (default: params).

    A reduce-scatter's result is one shard (x group size for the tensor). XLA's CPU compiler emits the
    gradient reduce-scatter as an all-reduce of the whole tensor plus a slice, and reduces some small tensors
    over all devices in one all-reduce: that counts as the reduction over G and, 1/G of it, across replicas."""
    remaining = {key: value["bytes"] for key, value in found.items()}

    def take(op: str, size: int, stride: int) -> float:
        return remaining.pop((op, size, stride), 0) if size > 1 else 0

    whole = take("all-reduce", devices, 1) if 1 < grads < devices else 0
    kept = params if after_forward is None else after_forward
    out = {"params": take("all-gather", params, 1),
           "params_backward": take("all-gather", kept, 1) if kept < params else 0,
           "update": take("all-gather", update // params, params),
           "grads": take("reduce-scatter", grads, 1) * grads + take("all-reduce", grads, 1) + whole,
           "replicas": take("all-reduce", devices // grads, grads) + whole / grads,
           # the embedding's looked-up rows (over P) and the chunked loss's head gradient (over G), both moved
           "all-to-all": take("all-to-all", params, 1) + (take("all-to-all", grads, 1) if grads != params else 0)}
    out["other"] = sum(remaining.values())
    return out


@dataclass
class Comparison:
    """One triple: what the cost model predicts next to what the run measured."""

    measured: Measured
    predicted_memory: dict[str, float]  # bytes per device: params, grads, optimizer
    predicted_comm: dict[str, float]  # tensor bytes per step by kind (cost.collectives)
    measured_comm: dict[str, float]  # the same, from the compiled step (`attribute`), with `other`


def compare(overrides: list[str], triples: list[tuple[int, int, int]], steps: int,
            hlo_dump: str | Path | None = None) -> list[Comparison]:
    """Train `steps` steps of the config `overrides` under each triple, side by side in this process, and set
    the cost model's predictions beside the measurements."""
    from xla_shard import config
    from xla_shard.planner import Triple, memory, update_degree, workload
    from xla_shard.planner import collectives as predicted_collectives
    from xla_shard.train import Trainer

    configs = [config.load(None, [*overrides, f"train.steps={steps}",
                                  f"fsdp.sharding={{params: {p}, grads: {g}, optimizer: {o}}}"]) for p, g, o in triples]
    trainers = [Trainer(cfg).setup() for cfg in configs]
    rows, seen = [], {}
    for (p, g, o), cfg, trainer, measured in zip(triples, configs, trainers, measure_all(trainers, steps, hlo_dump)):
        devices = trainer.backend.num_devices
        work, triple = workload(cfg, devices, trainer.backend.capabilities), Triple(p, g, o)
        held = memory(work, triple)
        predicted = {x.name: x.tensor_bytes for x in predicted_collectives(work, triple, devices)}
        predicted["all-to-all"] = predicted.pop("lookup", 0) + predicted.pop("head", 0)
        update = update_degree(cfg.train.optimizer, triple)
        if hlo_dump:
            # (P, G, update degree) fix every annotation: a layout met before compiles to the program XLA cached.
            measured.collectives = measured.collectives or seen.get((p, g, update), {})
            seen[(p, g, update)] = measured.collectives
        found = attribute(measured.collectives, p, g, update, devices) if measured.collectives else {}
        rows.append(Comparison(measured, {k: held[k] for k in ("params", "grads", "optimizer")}, predicted, found))
    for trainer in trainers:
        trainer.backend.shutdown()
    return rows
