"""Collectives in a compiled XLA program, read from its optimized HLO text (`XLA_FLAGS=--xla_dump_to=DIR
--xla_dump_hlo_as_text`): what the cost model's predictions are checked against."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
_OP = re.compile(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^ ]* (all-gather|all-reduce|reduce-scatter)(?:-start)?\("
                 r".*?replica_groups=(\{\{[0-9,{} ]*\}\}|\[[0-9,]+\]<=\[[0-9,]+\][^,]*)")


def collectives(hlo_text: str) -> dict[tuple[str, int], dict[str, int]]:
    """{(op, group size): {"count", "bytes"}}; bytes of each op's result (the whole gathered or reduced
    tensor for all-gather and all-reduce, one shard for reduce-scatter)."""
    totals: dict[tuple[str, int], dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for match in _OP.finditer(hlo_text):
        dtype, dims, op, groups = match.groups()
        elements = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        if groups.startswith("{{"):
            size = len(groups[2:].split("}")[0].split(","))
        else:  # iota form [groups,size]<=[...]
            size = int(groups.split("]")[0].split(",")[-1])
        entry = totals[(op, size)]
        entry["count"] += 1
        entry["bytes"] += elements * _BYTES.get(dtype, 4)
    return dict(totals)


def step_program(dump_dir: str | Path) -> str:
    """The largest optimized module in a dump: the training step (the others are small setup graphs)."""
    files = sorted(Path(dump_dir).glob("*after_optimizations.txt"), key=lambda f: f.stat().st_size)
    if not files:
        raise FileNotFoundError(f"no optimized HLO in {dump_dir} (was XLA_FLAGS set before XLA started?)")
    return files[-1].read_text()
