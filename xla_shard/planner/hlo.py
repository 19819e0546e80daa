"""Collectives in a compiled XLA program, read from its optimized HLO text (`XLA_FLAGS=--xla_dump_to=DIR
--xla_dump_hlo_as_text`): what the cost model's predictions are checked against."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s16": 2, "u16": 2, "s8": 1, "u8": 1,
          "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_OP = re.compile(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^ ]* (all-gather|all-reduce|reduce-scatter)(?:-start)?\("
                 r".*?replica_groups=(\{\{[0-9,{} ]*\}\}|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?)")


def _tensor_bytes(dtype: str, dims: str) -> int:
    """Bytes of an HLO shape `dtype[dims]` (dims as written: `4,256`, or empty for a scalar)."""
    return math.prod(int(d) for d in dims.split(",") if d) * _BYTES.get(dtype, 4)


def collectives(hlo_text: str) -> dict[tuple[str, int, int], dict[str, int]]:
    """{(op, group size, stride): {"count", "bytes"}}; bytes of each op's result (the whole gathered or reduced
    tensor for all-gather and all-reduce, one shard for reduce-scatter). The stride is the distance between
    neighbouring device ids of the first group, sorted (1: consecutive devices, the inner mesh axis)."""
    totals: dict[tuple[str, int, int], dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for match in _OP.finditer(hlo_text):
        dtype, dims, op, groups = match.groups()
        first = sorted(_first_group(groups))
        size, stride = len(first), (first[1] - first[0] if len(first) > 1 else 1)
        entry = totals[(op, size, stride)]
        entry["count"] += 1
        entry["bytes"] += _tensor_bytes(dtype, dims)
    return dict(totals)


KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = (.*?) (" + "|".join(KINDS) + r")(-start)?\(", re.M)
_TENSOR = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


def collective_totals(hlo_text: str, loop_trips: int = 1, dcn: bool = False) -> dict[str, dict[str, int]]:
    """{kind: {"count", "bytes"}} of every collective an optimized program runs, any kind (KINDS), sync or async
    (an async pair counted once, at its start); bytes of each op's results, all of a combined op's tensors.

    Wherever it sits: in a fusion (the TPU compiler fuses collectives with their neighbours), in an async call
    (TPU7x runs all-gathers on its SparseCores: `call-start ... to_apply=`), and in a while
    loop's body, once per iteration: `loop_trips` times (a traced step's loops are its scanned layers). The TPU
    compiler spells a reduce-scatter as an `all-reduce-scatter` fusion (an all-reduce, then each device's
    slice), which it runs as one: it is counted as a reduce-scatter of the fusion's result.

    One collective, one count: the TPU compiler splits a collective into pieces it overlaps with the compute
    around it (async collective fusions: a start, then continuations, each spelling the whole op with the same
    `channel_id` and writing into one buffer), and cloned computations repeat an op; an op is counted once per
    channel, as often as its most frequently run piece runs.

    A multislice program is compiled per slice: its collectives stay inside one, and what crosses slices is a
    transfer to the DCN runtime (a `send` to `xla_megascale_runtime` of its transfer type, ALL_REDUCE ...),
    counted as a collective of that kind, bytes as sent. With `dcn`, each kind also has "dcn_bytes": those."""
    computations = {name: (header, body) for header, name, body in _COMPUTATION.findall(hlo_text)}
    runs = _runs(computations, loop_trips)
    ops: dict[tuple, tuple[str, int, int]] = {}  # channel (or the op, without one) -> kind, runs, bytes
    for name, (header, body) in computations.items():
        for match in _INSTRUCTION.finditer(body):
            result, kind, start = match.groups()
            tensors = _TENSOR.findall(result)
            if start and len(tensors) > 1:  # an async start's tuple holds its operands, then its results
                tensors = tensors[len(tensors) // 2:]
            if kind == "all-reduce" and name.startswith("all-reduce-scatter"):
                kind, tensors = "reduce-scatter", _TENSOR.findall(header.rpartition("->")[2])
            channel = _CHANNEL.search(body[match.end():body.find("\n", match.end())])  # on the op's own line
            key = ("ici", kind, channel.group(1)) if channel else ("ici", name, match.start())
            _, seen_runs, seen_size = ops.get(key, (kind, 0, 0))
            size = sum(_tensor_bytes(dtype, dims) for dtype, dims in tensors)
            ops[key] = (kind, max(seen_runs, runs.get(name, 0)), max(seen_size, size))
        for match in _DCN_SEND.finditer(body):
            data, channel, transfer = match.groups()
            kind = _DCN_KINDS.get(transfer, transfer.lower().replace("_", "-"))
            ops[("dcn", channel)] = (kind, runs.get(name, 0), sum(_tensor_bytes(*t) for t in _TENSOR.findall(data)))
    blank = {"count": 0, "bytes": 0, **({"dcn_bytes": 0} if dcn else {})}
    totals = {kind: dict(blank) for kind in KINDS}
    for (link, *_), (kind, times, size) in ops.items():
        entry = totals.setdefault(kind, dict(blank))
        entry["count"] += times
        entry["bytes"] += times * size
        if dcn and link == "dcn":
            entry["dcn_bytes"] += times * size
    return totals


def _runs(computations: dict[str, tuple[str, str]], loop_trips: int) -> dict[str, int]:
    """How many times each computation runs per execution of the entry one, through every call (a fusion, an
    async op, a branch, a while loop's body: its trip count, read from its condition's `i < N`, else
    `loop_trips`)."""
    def trips(condition: str) -> int:
        text = computations.get(condition, ("", ""))[1]
        constants = dict(_CONSTANT.findall(text))
        bounds = [int(constants[bound]) for bound in _LESS_THAN.findall(text) if bound in constants]
        return max(bounds) if bounds else loop_trips

    calls = {}
    for name, (_, body) in computations.items():
        loops = {loop_body: trips(condition) for condition, loop_body in _WHILE.findall(body)}
        calls[name] = [(callee, loops.get(callee, 1) if site == "body" else 1)
                       for site, callees in _CALL.findall(body) for callee in _CALLEE.findall(callees)]
    entry = next(name for name, (header, _) in computations.items() if header.startswith("ENTRY"))
    runs: dict[str, int] = {entry: 1}
    order, seen = [], set()

    def visit(name: str) -> None:  # callees after all their callers: a reverse post-order from the entry
        seen.add(name)
        for callee, _ in calls.get(name, []):
            if callee not in seen and callee in computations:
                visit(callee)
        order.append(name)

    visit(entry)
    for name in reversed(order):
        for callee, times in calls.get(name, []):
            runs[callee] = runs.get(callee, 0) + runs.get(name, 0) * times
    return runs


_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
# A transfer to the DCN runtime: `%s = (f32[44,8,128]{...}, u32[], token[]) send(...), channel_id=N, ...
# _xla_megascale_transfer_type="ALL_REDUCE"` (its recv, the answer, is not counted again).
_DCN_SEND = re.compile(r"^\s*(?:ROOT )?%[\w.-]+ = \(([a-z][a-z0-9]*\[[0-9,]*\])[^\n]*? send\([^\n]*?channel_id=(\d+)"
                       r"[^\n]*?_xla_megascale_transfer_type=\"(\w+)\"", re.M)
_DCN_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
              "ALL_TO_ALL": "all-to-all"}
_WHILE = re.compile(r"\bwhile\(.*?condition=%?([\w.-]+), body=%?([\w.-]+)")
_CONSTANT = re.compile(r"%([\w.-]+) = [su]\d+\[\][^ ]* constant\((\d+)\)")
_LESS_THAN = re.compile(r"compare\(%[\w.-]+, %([\w.-]+)\), direction=LT")
_COMPUTATION = re.compile(r"^((?:ENTRY )?%?([\w.-]+) [^\n]*)\{\n(.*?)^\}", re.M | re.S)
# A call site and its callees: one (`calls=%f`) or a list (`branch_computations={%a, %b}`: each branch counted as
# if it ran, an upper bound).
_CALL = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|called_computations)=(\{[^}]*\}|%[\w.-]+)")
_CALLEE = re.compile(r"%([\w.-]+)")


def _first_group(groups: str) -> list[int]:
    """The device ids of the first replica group, from `{{0,1},{2,3}}` or the iota form
    `[groups,size]<=[dims]T(perm)` (iota over dims, transposed by perm, reshaped to groups x size)."""
    if groups.startswith("{{"):
        return [int(d) for d in groups[2:].split("}")[0].split(",")]
    match = re.match(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", groups)
    shape, dims, perm = ([int(d) for d in g.split(",")] if g else None for g in match.groups())
    ids = np.arange(math.prod(dims)).reshape(dims)
    if perm:
        ids = ids.transpose(perm)
    return ids.reshape(shape[0], -1)[0].tolist()


def step_program(dump: str | Path | list[Path]) -> str:
    """The largest optimized module in a dump directory (or among some of its files): the training step (the
    others are small setup graphs)."""
    files = (sorted(Path(dump).glob("*after_optimizations.txt")) if isinstance(dump, (str, Path))
             else [f for f in dump if f.name.endswith("after_optimizations.txt")])
    if not files:
        raise FileNotFoundError(f"no optimized HLO in {dump} (was XLA_FLAGS set before XLA started?)")
    return max(files, key=lambda f: f.stat().st_size).read_text()
