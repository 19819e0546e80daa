"""What `xla-shard plan` prints: the ranking for one backend, ties grouped, and the config to write."""

from __future__ import annotations

from collections.abc import Callable

import yaml

from xla_shard.planner.cost import Estimate, Triple


def sharding_yaml(triple: Triple) -> str:
    """The `fsdp:` section that runs `triple` (it replaces any `fsdp.sharding_strategy`)."""
    sharding = {"params": triple.params, "grads": triple.grads, "optimizer": triple.optimizer}
    if triple.kept != triple.params:
        sharding["params_after_forward"] = "none" if triple.kept == 1 else triple.kept
    return yaml.safe_dump({"fsdp": {"sharding": sharding}}, default_flow_style=None, sort_keys=False)


def for_backend(estimates: list[Estimate], runs: Callable[[Estimate], bool]) -> list[Estimate]:
    """Those the backend runs first; within each, those that fit, fastest, then smallest."""
    return sorted(estimates, key=lambda e: (not runs(e), not e.fits, e.step_s, e.memory["total"]))


def ranks(ordered: list[Estimate], runs: Callable[[Estimate], bool]) -> list[int]:
    """Competition ranks: rows that tie (same runs/fits, same step time to the millisecond) share one."""
    found, previous = [], None
    for position, e in enumerate(ordered, start=1):
        key = (runs(e), e.fits, round(e.step_s * 1e3))
        found.append(found[-1] if key == previous else position)
        previous = key
    return found
