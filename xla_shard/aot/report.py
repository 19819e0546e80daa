"""What a user needs before renting a slice, from the TPU compiler's own numbers: memory per device against
the chip's HBM, FLOPs and bytes, each collective, and a roofline lower bound of the step time.

Memory. The compiled program's arguments (parameters, optimizer state, the batch), temporaries (activations,
gradients, gathered parameters: the block the compiler's buffer assignment lays them out in, `aot.memory`; its
largest slots are named) and code. torch_xla donates the buffers of tensors a step updates in place, so the
outputs that replace them (`Trace.updated`) take no memory of their own; any other output does. What is not
counted: the runtime's own reserve, and a second program (evaluation).

FLOPs. What the program executes per device (`planner.hlo.executed_flops`: its matmuls as often as they run, a
scanned layer's once per layer, and its attention kernels), which bounds the step's compute time; and the model's
in two conventions: PaLM's (attention counted for every pair of positions), which the trainer's MFU uses, and
MaxText's (causal attention at half), which its published MFU figures use. With a step time (the roofline's bound,
or a measured one) each gives its MFU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from xla_shard.aot import memory
from xla_shard.aot.compiler import Compiled, OutOfHbm
from xla_shard.aot.generation import GenerationReport
from xla_shard.aot.target import Target
from xla_shard.aot.trace import Trace
from xla_shard.planner.hardware import Accelerator
from xla_shard.planner.hlo import collective_totals, executed_flops

GiB = 2**30
_SCALARS = 4096  # bytes an op at most, for a collective of scalars (and a few short vectors)


@dataclass
class Report:
    target: Target
    trace: Trace
    compiled: Compiled
    device: Accelerator  # the chip's figures per device of the program
    # the planner's collectives for this step by op: (what they move, result bytes per device)
    planned: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    # An online method's generation, which runs apart from the step, as the planner prices it: (its static KV
    # cache, the whole phase's bytes) per device; (0, 0) without one.
    generation: tuple[float, float] = (0.0, 0.0)
    compiled_generation: GenerationReport | None = None  # and its programs, compiled

    @property
    def consumers(self) -> dict[str, int]:
        """Bytes per device by what holds them, largest first."""
        t, c = self.trace, self.compiled
        other_args = max(0, c.argument_bytes - t.parameters - t.optimizer_state - t.batch - t.reference)
        parts = {"parameters": t.parameters, "optimizer state": t.optimizer_state, "batch": t.batch + other_args,
                 **({"reference model (frozen parameters)": t.reference} if t.reference else {}),
                 "temporaries (activations, gradients, gathered parameters)": c.temporaries,
                 "outputs not written in place": max(0, c.output_bytes - t.updated), "code": c.code_bytes}
        return dict(sorted(parts.items(), key=lambda kv: -kv[1]))

    @property
    def needed(self) -> int:
        return sum(self.consumers.values())

    @property
    def available(self) -> float:
        return self.device.hbm_bytes

    @property
    def fits(self) -> bool:
        return self.needed <= self.device.hbm_bytes

    @functools.cached_property
    def collectives(self) -> dict[str, dict[str, int]]:
        """Read once from the program's text (tens of MB for a large model): the roofline, JSON and text use it."""
        totals = collective_totals(self.compiled.hlo_text, self.trace.loop_trips, dcn=self.target.slices > 1)
        return {k: v for k, v in totals.items() if v["count"]}

    @functools.cached_property
    def executed(self) -> dict[str, float]:
        """FLOPs per device per step by what runs them (matmuls, the attention kernels' passes)."""
        return executed_flops(self.compiled.hlo_text, self.trace.loop_trips)

    @property
    def executed_flops(self) -> float:
        return sum(v for k, v in self.executed.items() if k != "other kernels")

    def roofline(self) -> dict[str, float]:
        """Seconds per step if nothing but compute, HBM traffic, ICI or DCN traffic bounded it (each alone,
        perfectly overlapped): the largest is a lower bound of the step time, and the MFU it allows is a
        ceiling. What crosses slices (the program's transfers to the DCN runtime) goes over DCN."""
        d, c = self.device, self.compiled
        dcn = sum(v.get("dcn_bytes", 0) for v in self.collectives.values())
        ici = sum(v["bytes"] for v in self.collectives.values()) - dcn
        # What the program executes; where it calls kernels whose FLOPs are not read (the MoE experts' grouped
        # matmuls) or nothing was read, the model's own FLOPs bound it from below (the cost analysis counts a
        # loop's body once).
        flops = self.executed_flops
        if self.executed["other kernels"] or not flops:
            flops = max(flops, c.flops, self.trace.model_flops / c.devices)
        times = {"compute_s": flops / d.peak_flops, "hbm_s": c.bytes_accessed / d.hbm_bw,
                 "ici_s": ici / d.fast_bw if ici else 0.0,
                 **({"dcn_s": dcn / d.slow_bw} if self.target.slices > 1 else {})}
        bound = max(times.values())
        ceiling = self.trace.model_flops / (bound * d.peak_flops * c.devices) if bound else 0.0
        causal = self.trace.causal_flops / (bound * d.peak_flops * c.devices) if bound else 0.0
        # at the bound, in both conventions, as computed: PaLM's passes 1 where the program runs fewer FLOPs than
        # it counts (causal attention past the diagonal skipped, at long context)
        return {**times, "lower_bound_s": bound, "mfu_ceiling": min(1.0, ceiling),
                "mfu_at_bound": {"palm": ceiling, "maxtext": causal}}

    def as_dict(self) -> dict:
        return {"target": self.target.name, "topology": self.target.topology, "slices": self.target.slices,
                "devices": self.compiled.devices, "chips": self.target.chips * self.target.slices,
                "plan": self.trace.plan, "hbm_bytes_per_device": self.device.hbm_bytes,
                "needed_bytes_per_device": self.needed, "fits": self.fits, "consumers": self.consumers,
                "argument_bytes": self.compiled.argument_bytes, "output_bytes": self.compiled.output_bytes,
                "temp_bytes": self.compiled.temporaries, "compiler_temp_stat_bytes": self.compiled.temp_bytes,
                "largest_temporaries": [{"what": what, "bytes": slot.bytes, "shape": slot.spelled}
                                        for what, slot in self.largest_temporaries()],
                "code_bytes": self.compiled.code_bytes,
                "model_tflop_per_device": {"palm": self.trace.model_flops / self.compiled.devices / 1e12,
                                           "maxtext": self.trace.causal_flops / self.compiled.devices / 1e12},
                "pallas_kernels": self.trace.kernels, "pallas_kernel_kinds": self.trace.kernel_kinds,
                "flops_per_device": self.compiled.flops,
                "executed_flops_per_device": {**self.executed, "total": self.executed_flops},
                "bytes_accessed_per_device": self.compiled.bytes_accessed,
                "collectives": self.collectives,
                "planned_collectives": {kind: [{"what": what, "bytes": planned} for what, planned in found]
                                        for kind, found in self.planned.items()},
                "planned_generation": {"kv_cache_bytes": self.generation[0], "phase_bytes": self.generation[1]},
                **({"generation": self.compiled_generation.as_dict()} if self.compiled_generation else {}),
                "what_collectives_move": {kind: self._what_moves(kind, v) for kind, v in self.collectives.items()},
                "roofline": self.roofline()}

    def _what_moves(self, kind: str, found: dict[str, int]) -> str:
        """The planner's account of a collective kind in this program, or what it is where the planner has none
        (`found`: the program's count and bytes of that kind)."""
        if kind in self.planned:
            return "; ".join(f"{what} ({planned / 2**20:.1f} MiB planned)" for what, planned in self.planned[kind])
        if kind == "collective-permute":
            return "XLA's partitioner moving shards between layouts (not in the planner's model)"
        if kind == "all-reduce" and found["bytes"] <= _SCALARS * found["count"]:
            return "scalars: the loss, the gradient norm, the step's token counts"
        return "not in the planner's model of this step"

    def largest_temporaries(self) -> list[tuple[str, memory.Slot]]:
        slots = [memory.Slot(size, dtype, tuple(shape)) for size, dtype, shape in self.compiled.slots]
        return memory.largest(memory.BufferAssignment(self.compiled.temporaries, slots), self.trace.dims)

    def text(self) -> str:
        c, d, roof = self.compiled, self.device, self.roofline()
        t = self.target
        lines = [f"{t.label} ({t.topology}{' each' if t.slices > 1 else ''}: {t.chips * t.slices} chips, "
                 f"{c.devices} devices), {self.trace.plan}",
                 f"memory per device: {_gib(self.needed)} of {_gib(d.hbm_bytes)} HBM: "
                 + (f"fits, {_gib(d.hbm_bytes - self.needed)} to spare" if self.fits
                    else f"does NOT fit, {_gib(self.needed - d.hbm_bytes)} over")]
        lines += [f"  {name}: {_gib(size)}" for name, size in self.consumers.items()]
        if c.heap_bytes is not None and c.heap_bytes != c.temp_bytes:
            lines.append(f"  (temporaries: the buffer assignment's block; libtpu's own stat says {_gib(c.temp_bytes)}, "
                         "that block and about its largest buffer again: docs/planner.md)")
        lines += self._largest_temporaries_line()
        lines.append(f"compiler's cost analysis per device: {c.flops / 1e12:.3f} TFLOP, "
                     f"{c.bytes_accessed / 1e9:.3f} GB accessed"
                     + (f" (a loop's body counted once: {self.trace.loop_trips} scanned layers run it; the model's "
                        f"{self.trace.model_flops / c.devices / 1e12:.3f} TFLOP per device bound the roofline)"
                        if self.trace.loop_trips > 1 else ""))
        ran = self.executed
        attention = {k.split()[-1]: v for k, v in ran.items() if k.startswith("attention") and v}
        lines.append(f"executed per device per step: {self.executed_flops / 1e12:.3f} TFLOP (matmuls "
                     f"{ran['matmuls'] / 1e12:.3f}" + (", attention kernels " + ", ".join(
                         f"{kind} {v / 1e12:.3f}" for kind, v in attention.items()) if attention else "")
                     + (f"; {ran['other kernels']:.0f} other kernel calls, their FLOPs not counted"
                        if ran["other kernels"] else "") + ")")
        kinds = self.trace.kernel_kinds
        if kinds:
            lines.append("Pallas kernels compiled into the program: "
                         + ", ".join(f"{count} {kind}" for kind, count in kinds.items()))
        lines.append("collectives in the compiled TPU program (per device, results' bytes):")
        lines += [f"  {kind}: {v['count']} ops, {v['bytes'] / 2**20:.1f} MiB"
                  + (f", {v['dcn_bytes'] / 2**20:.1f} MiB of it across slices (DCN)" if v.get("dcn_bytes") else "")
                  + f": {self._what_moves(kind, v)}" for kind, v in self.collectives.items()]
        if not self.collectives:
            lines.append("  none (one device)")
        bound = max(("compute", "hbm", "ici", "dcn"), key=lambda k: roof.get(f"{k}_s", 0.0))
        lines.append(f"roofline lower bound of the step (not a measurement): {roof['lower_bound_s'] * 1e3:.1f} ms "
                     f"(compute {roof['compute_s'] * 1e3:.1f}, HBM {roof['hbm_s'] * 1e3:.1f}, ICI "
                     f"{roof['ici_s'] * 1e3:.1f}" + (f", DCN {roof['dcn_s'] * 1e3:.1f}" if "dcn_s" in roof else "")
                     + f"): {bound.upper() if bound != 'compute' else 'compute'}-bound"
                     + f"; MFU at that bound: {roof['mfu_at_bound']['palm']:.2f} by PaLM's count, "
                     f"{roof['mfu_at_bound']['maxtext']:.2f} by MaxText's")
        palm, causal = (flops / c.devices / 1e12 for flops in (self.trace.model_flops, self.trace.causal_flops))
        peak = d.peak_flops / 1e12
        lines.append(f"model FLOPs per device per step: {palm:.1f} TFLOP by PaLM's count (attention over every pair "
                     f"of positions: the trainer's MFU), {causal:.1f} by MaxText's (causal attention at half); a "
                     f"step of T seconds is MFU {palm:.1f} / ({peak:.0f} x T) or {causal:.1f} / ({peak:.0f} x T)")
        if self.compiled_generation is not None:
            lines += self.compiled_generation.lines()
        cache, generating = self.generation
        if cache:
            lines.append(f"  the planner's estimate: {_gib(generating)} per device, its static KV cache {_gib(cache)}: "
                         + ("fits" if generating <= d.hbm_bytes else "does NOT fit"))
        return "\n".join(lines)


    def _largest_temporaries_line(self) -> list[str]:
        """The largest temporary buffers, alike slots (one a layer) said once with their count."""
        counted: dict[tuple[str, str, int], int] = {}
        for what, slot in self.largest_temporaries():
            key = (what, slot.spelled, slot.bytes)
            counted[key] = counted.get(key, 0) + 1
        return ["largest temporaries: " + "; ".join((f"{n} x " if n > 1 else "") + f"{_gib(size)} {what} ({spelled})"
                                                    for (what, spelled, size), n in counted.items())] if counted else []

def _gib(size: float) -> str:
    return f"{size / GiB:.2f} GiB" if size >= GiB else f"{size / 2**20:.1f} MiB"


@dataclass
class Refused:
    """A step the TPU compiler refused for want of HBM: its verdict, with what the trace knows of the rest."""

    target: Target
    trace: Trace
    verdict: OutOfHbm
    device: Accelerator

    fits = False

    @property
    def needed(self) -> int:
        return self.verdict.used

    @property
    def available(self) -> float:
        return self.verdict.capacity

    @property
    def consumers(self) -> dict[str, int]:
        t = self.trace
        parts = {"parameters": t.parameters, "optimizer state": t.optimizer_state, "batch": t.batch,
                 **({"reference model (frozen parameters)": t.reference} if t.reference else {})}
        if self.verdict.temporaries is not None:
            parts["temporaries (activations, gradients, gathered parameters)"] = self.verdict.temporaries
        if self.verdict.allocation:
            parts[f"one buffer, {self.verdict.allocation}"] = self.verdict.used
        return dict(sorted(parts.items(), key=lambda kv: -kv[1]))

    def as_dict(self) -> dict:
        return {"target": self.target.name, "topology": self.target.topology, "slices": self.target.slices,
                "chips": self.target.chips * self.target.slices,
                "plan": self.trace.plan, "hbm_bytes_per_device": self.verdict.capacity,
                "needed_bytes_per_device": self.needed, "fits": False, "consumers": self.consumers,
                "compiler": str(self.verdict)}

    def text(self) -> str:
        t = self.target
        lines = [f"{t.label} ({t.topology}: {t.chips * t.slices} chips), {self.trace.plan}",
                 f"memory per device: does NOT fit: the TPU compiler needs {_gib(self.needed)} of the "
                 f"{_gib(self.verdict.capacity)} a device leaves a program, "
                 f"{_gib(self.needed - self.verdict.capacity)} over"]
        lines += [f"  {name}: {_gib(size)}" for name, size in self.consumers.items()]
        return "\n".join(lines)
