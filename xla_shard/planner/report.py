"""What `xla-shard plan` prints: the ranking for one backend, ties grouped, and the config to write."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import yaml

from xla_shard.planner.cost import STEP_RESOLUTION, Estimate, Triple, compute_bound, tie_groups

if TYPE_CHECKING:
    from xla_shard.planner import Plan


def sharding_yaml(triple: Triple) -> str:
    """The `fsdp:` section that runs `triple` (it replaces any `fsdp.sharding_strategy`)."""
    sharding = {"params": triple.params, "grads": triple.grads, "optimizer": triple.optimizer}
    if triple.kept != triple.params:
        sharding["params_after_forward"] = "none" if triple.kept == 1 else triple.kept
    return yaml.safe_dump({"fsdp": {"sharding": sharding}}, default_flow_style=None, sort_keys=False)


def for_backend(estimates: list[Estimate], runs: Callable[[Estimate], bool]) -> list[Estimate]:
    """Those the backend runs first; within each, those that fit, fastest (to the cost model's resolution),
    then smallest."""
    groups = _groups(estimates, runs)
    return sorted(estimates, key=lambda e: (groups[id(e)], e.memory["total"]))


def ranks(ordered: list[Estimate], runs: Callable[[Estimate], bool]) -> list[int]:
    """Competition ranks: rows that tie (same runs/fits, the same step time to STEP_RESOLUTION) share one."""
    groups = _groups(ordered, runs)
    found, previous = [], None
    for position, e in enumerate(ordered, start=1):
        key = groups[id(e)]
        found.append(found[-1] if key == previous else position)
        previous = key
    return found


def _groups(estimates: list[Estimate], runs: Callable[[Estimate], bool]) -> dict[int, tuple]:
    """Ties as one backend sees them: within what it runs and what fits."""
    return tie_groups(estimates, lambda e: (not runs(e), not e.fits))


@dataclass(frozen=True)
class BackendView:
    """A planner ranking read for one backend: its rows in that backend's order, with their ranks, which backends
    run each (`running`, from the registry), and the pick: the fastest row the backend runs that fits."""

    plan: Plan
    backend: str
    running: Callable[[Estimate], list[str]]

    def runs(self, e: Estimate) -> bool:
        return self.backend in self.running(e)

    @cached_property
    def ordered(self) -> list[Estimate]:
        return for_backend(self.plan.ranked, self.runs)

    @cached_property
    def best(self) -> Estimate | None:
        return next((e for e in self.ordered if e.fits and self.runs(e)), None)

    def row(self, written: str) -> Estimate | None:
        """The row a user names as the table writes it (P/G/OS, or P(k)/G/OS)."""
        return next((e for e in self.ordered if str(e.triple) == written), None)

    def as_json(self, batch_splits: bool) -> dict[str, Any]:
        best = self.best
        return {"devices": self.plan.devices, "accelerator": self.plan.accelerator.name,
                "fast_domain": self.plan.domain, "backend": self.backend, "batch_splits": batch_splits,
                "best": {"triple": str(best.triple), "yaml": sharding_yaml(best.triple)} if best else None,
                "candidates": [dict(e.as_dict(), backends=self.running(e), runs=self.runs(e), rank=rank)
                               for e, rank in zip(self.ordered, ranks(self.ordered, self.runs))]}

    def table(self, title: str, top: int, show: list[str]) -> str:
        """The ranking as a Markdown table of its `top` rows (and FULL_SHARD's), the pick's YAML, and the YAML of
        each row in `show`."""
        fast, slow = self.plan.accelerator.fast_name, self.plan.accelerator.slow_name
        backend = self.backend
        lines = [title,
                 f"| rank | P/G/OS | fits | runs on {backend} | GiB/device | {fast} GB/step | {slow} GB/step | "
                 "step ms | MFU | backends |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        rows = list(zip(self.ordered, ranks(self.ordered, self.runs)))
        baseline = self.plan.baseline
        for e, rank in rows[:top] + [(e, r) for e, r in rows[top:] if e is baseline]:
            label = f"{e.triple}" + (" (FULL_SHARD)" if e is baseline else "")
            lines.append(f"| {rank} | {label} | {'yes' if e.fits else 'no'} | {'yes' if self.runs(e) else 'no'} "
                         f"| {e.memory['total'] / 2**30:.1f} | {e.traffic[fast] / 1e9:.1f} | "
                         f"{e.traffic[slow] / 1e9:.1f} | {e.step_s * 1e3:.0f} | {e.mfu:.2f} | "
                         f"{', '.join(self.running(e)) or 'none yet'} |")
        lines.append("P(k): parameters stay split over k devices between forward and backward (fsdp.sharding."
                     "params_after_forward; (1): kept whole). Equal ranks: step times within "
                     f"{STEP_RESOLUTION:.0%} of each other, what the cost model can tell apart; among them the "
                     "least memory per device ranks first.")
        if compute_bound([e for e, _ in rows if e.fits]):
            lines.append("Every row that fits is compute-bound (its collectives hide behind the step's compute at "
                         "the efficiency assumed): the sharding changes memory, not speed.")
        text = "\n".join(lines) + "\n"
        if self.best is None:
            text += (f"nothing that {backend} runs fits in {self.plan.accelerator.hbm_bytes / 2**30:.0f} GiB per "
                     "device\n")
        else:
            text += (f"\nthe pick for {backend}, {self.best.triple} (in your config, in place of "
                     f"fsdp.sharding_strategy):\n{sharding_yaml(self.best.triple)}")
        for written in show:
            e = self.row(written)
            note = "" if self.runs(e) else f" (not on {backend}: {', '.join(self.running(e)) or 'no backend yet'})"
            text += f"\n{written}{note}:\n{sharding_yaml(e.triple)}"
        return text
