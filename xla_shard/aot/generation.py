"""An online method's generation (GRPO's sampler) for the slice, traced as `xla-shard compile` traces the step and
compiled by the same TPU compiler: what a rollout costs before a slice is rented.

A generation on xla_spmd runs three programs (`backends.xla_spmd.generation_context`, `sampling.Decoding`):
- `layout`: the weights copied into the layout the generation runs in (`mesh.generation`), once a generation;
- `prompt`: the prompts' forward filling the static KV cache, and the first token, once a generation;
- `token`: one token's forward and draw, once for each further token.
Each is traced here from the calls the sampler makes, on placeholders (no weights, no cache in host memory): the
token's program starts from placeholders laid out as the runtime lays the carried state out (rows over the
generation mesh's rows), so it is compiled alone, as the runtime runs it after each token's step marker.

What the report says of them: memory per device (the phase holds training's state at rest beside the program that
needs the most), the collectives each runs (the token's, per token), and a decode roofline: the token program's
time if only its FLOPs, its HBM traffic or its collectives bounded it, and the tokens per second that allows.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from xla_shard.aot.compiler import ISOLATED, Compiled, CompileTimedOut, OutOfHbm, Slice
from xla_shard.errors import UserError
from xla_shard.planner.hardware import Accelerator
from xla_shard.planner.hlo import collective_totals
from xla_shard.sampling import Generation

PROGRAMS = ("layout", "prompt", "token")
_RUNS = {"layout": "once a generation", "prompt": "once a generation", "token": "once a token"}


@dataclass
class GenerationTrace:
    generation: Generation
    split: int  # mesh.generation: the devices each MLP is split over (1: every weight whole)
    programs: dict[str, bytes]  # HloModuleProto by PROGRAMS


def trace(trainer) -> GenerationTrace | None:
    """The generation programs of the traced trainer's method (None: it generates nothing). The backend is
    xla_spmd with placeholders (`aot.trace`); nothing runs and nothing is kept pending."""
    import torch_xla

    from xla_shard.backends.xla_spmd import placeholder
    from xla_shard.sampling import Decoding, row_keys

    model, backend = trainer.model, trainer.backend
    shape = trainer.method.rollout.generation(model, trainer.source)
    if shape is None:
        return None
    prompts = {"input_ids": torch.full((shape.rows, shape.prompt_len), shape.sampling.pad_token_id),
               "attention_mask": torch.ones(shape.rows, shape.prompt_len, dtype=torch.long)}
    keys = row_keys((trainer.cfg.train.seed, 0), range(shape.rows))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), backend.generation_context(model) as place:
            placed = place(prompts)
            decoding = Decoding(model, placed["input_ids"], placed["attention_mask"], shape.sampling, keys,
                                group=shape.group)
            decoding.draw(0)
            prompt = _program(decoding)
            decoding.replace_carried(lambda _, tensor: place.laid_out(placeholder(tensor)))
            decoding.advance(0)
            decoding.draw(1)
            token = _program(decoding)
            layout = place.layout_program
    finally:
        model.train(was_training)
        torch_xla._XLAC._clear_pending_irs(str(backend.device))  # never run: placeholders and all
    return GenerationTrace(shape, backend.plan.generation, {"layout": layout, "prompt": prompt, "token": token})


def _program(decoding) -> bytes:
    import torch_xla

    return torch_xla._XLAC._get_xla_tensors_hlo_proto(list(decoding.carried().values()))


# How long one generation program may take to compile: each is compiled in a process of its own, stopped after
# this long. The sampler's int64 hash once held divisions (torch_xla's `>>`), which the TPU compiler expands into
# hundreds of 32-bit ops each: libtpu 0.0.20 then took 66-106 s per program, and did not finish a bf16 token's in
# 10 minutes. With shifts (`sampling._shr`) it compiles each in 3-8 s (Dec 7, a tiny Llama's GRPO on a v5p-8).
COMPILE_S = 900.0


def compile_programs(traced: GenerationTrace, tpu: Slice,
                     say: Callable[[str], None] = lambda _: None) -> dict[str, Compiled | UserError]:
    """Each program compiled, or why not: the compiler's verdict that it does not fit a device's HBM (OutOfHbm),
    or that it did not finish in COMPILE_S (CompileTimedOut). Where XLA_SHARD_TPU_COMPILER names a newer
    compiler, it compiles them."""
    isolated = os.environ.get(ISOLATED)
    if isolated and tpu.python is None:
        tpu = replace(tpu, python=isolated, devices=None)
    compiled: dict[str, Compiled | UserError] = {}
    for name in PROGRAMS:
        started = time.monotonic()
        try:
            compiled[name] = tpu.compile(traced.programs[name], timeout_s=COMPILE_S)
        except (OutOfHbm, CompileTimedOut) as verdict:
            compiled[name] = verdict
        say(f"{name}: {time.monotonic() - started:.0f} s in the compiler")
    return compiled


@dataclass
class GenerationReport:
    trace: GenerationTrace
    compiled: dict[str, Compiled | UserError]  # or why a program was not compiled (`compile_programs`)
    device: Accelerator  # per device of the program
    resting: int  # bytes per device training keeps through a generation: parameters and optimizer state
    chips: int

    def held(self, name: str) -> int:
        """Bytes per device a program needs beside training's state at rest: the layout's arguments are that state
        and its outputs the copies; the token's outputs replace its carried arguments in place (torch_xla donates
        the buffers of tensors a program updates); the prompt's outputs (the cache, the buffer) are new."""
        c = self.compiled[name]
        if isinstance(c, OutOfHbm):  # the compiler's own count: every buffer, arguments included
            return max(0, c.used - (self.resting if name == "layout" else 0))
        if not isinstance(c, Compiled):  # not compiled in time: unknown
            return 0
        arguments = 0 if name == "layout" else c.argument_bytes
        outputs = 0 if name == "token" else c.output_bytes
        return arguments + outputs + c.temporaries + c.code_bytes

    @property
    def needed(self) -> int:
        return self.resting + max(self.held(name) for name in PROGRAMS)

    @property
    def fits(self) -> bool | None:
        """Whether the phase fits a device's HBM; None where a program that did not finish compiling leaves it
        unknown."""
        if any(isinstance(c, CompileTimedOut) for c in self.compiled.values()) and not self.refused:
            return None
        return self.needed <= self.device.hbm_bytes and not self.refused

    @property
    def refused(self) -> list[str]:
        """The programs the compiler refused for want of HBM."""
        return [name for name, c in self.compiled.items() if isinstance(c, OutOfHbm)]

    def refusal(self, label: str) -> str:
        """One line: the step fits, its generation does not."""
        largest = max(PROGRAMS, key=self.held)
        return (f"the step fits, but its generation needs {_gib(self.needed)} per device on {label}, which has "
                f"{_gib(self.device.hbm_bytes)} (training's state at rest {_gib(self.resting)} + the {largest} "
                f"program {_gib(self.held(largest))}): fewer rows a generation (train.global_batch_size), a shorter "
                "grpo.max_completion_length, mesh.generation, or more chips")

    def collectives(self, name: str) -> dict[str, dict[str, int]]:
        c = self.compiled[name]
        if not isinstance(c, Compiled):
            return {}
        totals = collective_totals(c.hlo_text)
        return {kind: v for kind, v in totals.items() if v["count"]}

    def decode_roofline(self) -> dict[str, float]:
        """The token program's seconds if only its FLOPs, its HBM bytes or its collectives (over ICI) bounded it
        (each alone), the largest a lower bound; and the tokens per second of the slice and of a chip that
        bound allows (every row draws a token a program)."""
        c, d = self.compiled["token"], self.device
        if not isinstance(c, Compiled):
            return {}
        ici = sum(v["bytes"] for v in self.collectives("token").values())
        times = {"compute_s": c.flops / d.peak_flops, "hbm_s": c.bytes_accessed / d.hbm_bw,
                 "ici_s": ici / d.fast_bw if ici else 0.0}
        bound = max(times.values())
        rows = self.trace.generation.rows
        return {**times, "token_s": bound, "tokens_per_s": rows / bound if bound else 0.0,
                "tokens_per_s_per_chip": rows / bound / self.chips if bound else 0.0}

    def as_dict(self) -> dict:
        g = self.trace.generation
        return {"rows": g.rows, "prompt_len": g.prompt_len, "max_new_tokens": g.sampling.max_new_tokens,
                "group": g.group, "split": self.trace.split, "needed_bytes_per_device": self.needed,
                "resting_bytes_per_device": self.resting, "fits": self.fits,
                "programs": {name: {"runs": _RUNS[name], "held_bytes_per_device": self.held(name),
                                    **({"compiler": _why(c)} if not isinstance(c, Compiled) else {
                                        "argument_bytes": c.argument_bytes, "output_bytes": c.output_bytes,
                                        "temp_bytes": c.temporaries, "flops_per_device": c.flops,
                                        "bytes_accessed_per_device": c.bytes_accessed,
                                        "collectives": self.collectives(name)})}
                             for name, c in self.compiled.items()},
                "decode_roofline": self.decode_roofline()}

    def lines(self) -> list[str]:
        g, roof = self.trace.generation, self.decode_roofline()
        layout = "every weight whole" if self.trace.split == 1 else f"MLPs split over {self.trace.split} devices"
        lines = [f"generation (compiled; mesh.generation {self.trace.split}: {layout}): {g.rows} rows x "
                 f"{g.sampling.max_new_tokens} tokens after {g.prompt_len}-token prompts, {g.group} rows a prompt",
                 f"  the phase holds {_gib(self.needed)} per device (training's state at rest {_gib(self.resting)} "
                 f"+ the largest program): " + ("fits" if self.fits else "unknown: a program was not compiled"
                                                if self.fits is None else
                                                f"does NOT fit, {_gib(self.needed - self.device.hbm_bytes)} over")]
        for name in PROGRAMS:
            if not isinstance(self.compiled[name], Compiled):
                lines.append(f"  {name} ({_RUNS[name]}): {_why(self.compiled[name])}")
                continue
            found = self.collectives(name)
            said = ", ".join(f"{kind} {v['count']} ops {v['bytes'] / 2**20:.2f} MiB" for kind, v in found.items())
            lines.append(f"  {name} ({_RUNS[name]}): {_gib(self.held(name))} per device beside the state at rest; "
                         f"collectives{' per token' if name == 'token' else ''}: {said or 'none'}")
        if not roof:
            return lines
        bound = max(("compute", "hbm", "ici"), key=lambda k: roof[f"{k}_s"])
        lines.append(f"  decode roofline (not a measurement): {roof['token_s'] * 1e3:.3f} ms a token (compute "
                     f"{roof['compute_s'] * 1e3:.3f}, HBM {roof['hbm_s'] * 1e3:.3f}, ICI {roof['ici_s'] * 1e3:.3f}: "
                     f"{bound.upper() if bound != 'compute' else 'compute'}-bound), at most "
                     f"{roof['tokens_per_s']:,.0f} tokens/s ({roof['tokens_per_s_per_chip']:,.0f} a chip)")
        return lines


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def _why(verdict: UserError) -> str:
    if isinstance(verdict, CompileTimedOut):
        return (f"not compiled: the TPU compiler did not finish within {verdict.timeout_s:g} s (a newer one, named "
                f"by {ISOLATED}, may: docs/planner.md)")
    return f"does NOT fit: {verdict}"
