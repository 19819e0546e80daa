"""A TPU slice to compile for, named as `deploy.accelerator_type` names it (v5p-64, v6e-16, v5litepod-8)."""

from __future__ import annotations

from dataclasses import dataclass

from xla_shard.deploy import tpu
from xla_shard.errors import UserError
from xla_shard.planner.hardware import Accelerator, accelerator

_JAX_NAMES = {"v4": "v4", "v5litepod": "v5e", "v5p": "v5p", "v6e": "v6e", "tpu7x": "tpu7x"}


@dataclass(frozen=True)
class Target:
    name: str  # v5p-64
    generation: str  # the planner's key: v5p
    chips: int  # of one slice
    topology: str  # as jax names it: v5p:4x4x2
    chip: Accelerator  # per-chip HBM, peak and bandwidths
    slices: int = 1  # a multislice job: this many slices, joined by DCN

    @property
    def label(self) -> str:
        return f"{self.slices} x {self.name}" if self.slices > 1 else self.name

    def per_device(self, devices: int) -> Accelerator:
        """The chip's figures per device of the compiled program (jax counts a TPU7x or v4 chip as 2 devices)."""
        share = self.chips * self.slices / devices
        chip = self.chip
        return Accelerator(chip.name, chip.hbm_bytes * share, chip.peak_flops * share, chip.fast_bw * share,
                           chip.slow_bw * share, chip.fast_name, chip.slow_name, chip.domain_max,
                           hbm_bw=chip.hbm_bw * share)


def parse(name: str, flag: str = "--tpu", slices: int = 1) -> Target:
    """The slice `name` (`slices` of them: a multislice job), given as `flag`."""
    try:
        generation, chips = tpu.parse_type(name)
    except UserError as exc:
        raise UserError(f"{flag} {name}: {str(exc).split(': ', 1)[-1]}") from None
    shape = tpu.topology(chips, generation.topology_dims)
    if shape is None:
        raise UserError(f"{flag} {name}: {chips} chips is no slice shape (1 chip, or 4, 8, 16, ... chips)")
    key = _JAX_NAMES[generation.prefix]
    return Target(name, key, chips, f"{key}:{'x'.join(map(str, shape))}", accelerator(key), slices)
