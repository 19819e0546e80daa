"""Collectives and executed FLOPs of a compiled XLA program, read from its optimized HLO text
(`XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text`, or the TPU compiler's answer): what the cost model's
predictions and the compile report's roofline are held to."""

from __future__ import annotations

import base64
import math
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s16": 2, "u16": 2, "s8": 1, "u8": 1,
          "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_OP = re.compile(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^ ]* (all-gather|all-reduce|reduce-scatter)(?:-start)?\("
                 r".*?replica_groups=(\{\{[0-9,{} ]*\}\}|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?)")
_ALL_TO_ALL = re.compile(r"= (\([^)]*\)|\S+) all-to-all\(.*?replica_groups=(\{\{[0-9,{} ]*\}\}|\[[0-9,]+\]<=\[[0-9,]+\]"
                         r"(?:T\([0-9,]+\))?)")


def _tensor_bytes(dtype: str, dims: str) -> int:
    """Bytes of an HLO shape `dtype[dims]` (dims as written: `4,256`, or empty for a scalar)."""
    return math.prod(_dims(dims)) * _BYTES.get(dtype, 4)


def collectives(hlo_text: str) -> dict[tuple[str, int, int], dict[str, int]]:
    """{(op, group size, stride): {"count", "bytes"}}; bytes of each op's result (the whole gathered or reduced
    tensor for all-gather and all-reduce, one shard for reduce-scatter, every piece an all-to-all sends: XLA's
    CPU compiler spells one as a tuple of them). The stride is the distance between neighbouring device ids of
    the first group, sorted (1: consecutive devices, the inner mesh axis)."""
    totals: dict[tuple[str, int, int], dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    found = [(match.group(3), match.group(4), _tensor_bytes(*match.group(1, 2))) for match in _OP.finditer(hlo_text)]
    found += [("all-to-all", match.group(2), sum(_tensor_bytes(*t) for t in _TENSOR.findall(match.group(1))))
              for match in _ALL_TO_ALL.finditer(hlo_text)]
    for op, groups, size_bytes in found:
        first = sorted(_first_group(groups))
        size, stride = len(first), (first[1] - first[0] if len(first) > 1 else 1)
        entry = totals[(op, size, stride)]
        entry["count"] += 1
        entry["bytes"] += size_bytes
    return dict(totals)


KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = (.*?) (" + "|".join(KINDS) + r")(-start)?\(", re.M)
_CONTEXT_DTYPES = ("u32", "s32")
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

    A windowed einsum (XLA's collective matmul: a loop passing shards around a ring of collective-permutes
    while it multiplies) is the all-gather or reduce-scatter it spreads over the matmul, a step per iteration
    (`_windowed_step`). An async start's tuple holds its operands, its results, then scalar contexts (u32[]).

    A multislice program is compiled per slice: its collectives stay inside one, and what crosses slices is a
    transfer to the DCN runtime (a `send` to `xla_megascale_runtime` of its transfer type, ALL_REDUCE ...),
    counted as a collective of that kind, bytes as sent. With `dcn`, each kind also has "dcn_bytes": those."""
    computations = {name: (header, body) for header, name, body in _COMPUTATION.findall(hlo_text)}
    program = _Program(computations)
    runs, trips = _runs(computations, loop_trips, program)
    ops: dict[tuple, tuple[str, int, int]] = {}  # channel (or the op, without one) -> kind, runs, bytes
    for name, (header, body) in computations.items():
        windowed = _WINDOWED.search(name)
        sends = trips.get(name, 1) * len(_PERMUTE.findall(body)) if windowed else 0  # per device, per run of it
        for match in _INSTRUCTION.finditer(body):
            result, kind, start = match.groups()
            tensors = _TENSOR.findall(result)
            if start:  # an async start's tuple: its operands, its results, then scalar contexts (u32[])
                tensors = [t for t in tensors if t[1] or t[0] not in _CONTEXT_DTYPES]
                tensors = tensors[len(tensors) // 2:]
            line = body[match.end():body.find("\n", match.end())]
            parts = [(kind, _tensor_bytes(*tensor)) for tensor in tensors]
            if kind == "all-reduce" and name.startswith("all-reduce-scatter"):
                result = _TENSOR.findall(header.rpartition("->")[2])
                parts = [("reduce-scatter", sum(_tensor_bytes(*t) for t in result))]
            elif kind == "all-reduce":  # an operand laid into zeros is a shard gathered (TPU7x's SparseCores)
                operands = _CALLEE.findall(line[:line.find(")")])
                parts = [("all-gather" if program.laid_into_zeros(name, operand) else kind, size)
                         for (_, size), operand in zip(parts, operands + [""] * len(parts))]
            if kind == "collective-permute" and windowed:
                pairs = _PAIRS.search(line)
                ring = pairs.group(1).count("{") if pairs else 2
                parts = [_windowed_step(windowed.group(1), sum(size for _, size in parts), ring, sends)]
            channel = _CHANNEL.search(line)  # on the op's own line
            for part, size in _summed(parts).items():
                key = ("ici", part, channel.group(1)) if channel else ("ici", part, name, match.start())
                _, seen_runs, seen_size = ops.get(key, (part, 0, 0))
                ops[key] = (part, max(seen_runs, runs.get(name, 0)), max(seen_size, size))
        for match in _DCN_SEND.finditer(body):
            data, channel, transfer = match.groups()
            kind = _DCN_KINDS.get(transfer, transfer.lower().replace("_", "-"))
            ops[("dcn", channel)] = (kind, runs.get(name, 0), sum(_tensor_bytes(*t) for t in _TENSOR.findall(data)))
    blank = {"count": 0, "bytes": 0, **({"dcn_bytes": 0} if dcn else {})}
    totals = {kind: dict(blank) for kind in KINDS}
    for (link, *_), (kind, times, size) in ops.items():
        entry = totals.setdefault(kind, dict(blank))
        entry["count"] += times
        entry["bytes"] += round(times * size)
        if dcn and link == "dcn":
            entry["dcn_bytes"] += round(times * size)
    return totals


def executed_flops(hlo_text: str, loop_trips: int = 1) -> dict[str, float]:
    """FLOPs the program runs per device per execution, by what runs them, each op as often as its computation
    runs (a scanned layer's loop body: its trip count, which the compiler's cost analysis counts once):

    - "matmuls": every dot and convolution, 2 x its result's elements x the products each sums;
    - "attention forward" / "attention dq" / "attention dkv": the Pallas attention kernels (flash or splash), told
      apart by the name their Mosaic body carries. A kernel's FLOPs are not in the program; they are counted as
      the causal attention they compute (blocks past the diagonal skipped): with F = 2 x 2 x rows x heads x
      queries x keys x head size / 2, the forward F (QK^T, PV), dq 1.5 F (QK^T, dO V^T, dS K) and dkv 2 F
      (QK^T, dO V^T, P^T dO, dS^T Q), read from the shapes of the queries and keys they are given;
    - "other kernels": how many other custom kernel calls ran (the MoE experts' grouped matmuls), uncounted."""
    computations = {name: (header, body) for header, name, body in _COMPUTATION.findall(hlo_text)}
    runs, _ = _runs(computations, loop_trips, _Program(computations))
    found = {"matmuls": 0.0, "attention forward": 0.0, "attention dq": 0.0, "attention dkv": 0.0,
             "other kernels": 0.0}
    for name, (header, body) in computations.items():
        times = runs.get(name, 0)
        if not times:
            continue
        shapes = _value_shapes(header, body)
        for line in body.splitlines():
            matmul = _MATMUL.search(line)
            if matmul:
                found["matmuls"] += times * _matmul_flops(matmul, line, shapes)
            elif 'custom_call_target="tpu_custom_call"' in line:
                kind, flops = _kernel_flops(line)
                found[kind] += times * flops
    return found


def _value_shapes(header: str, body: str) -> dict[str, list[int]]:
    """Each value's dims in a computation (its parameters' from the header where they are not defined)."""
    shapes = {name: _dims(dims) for name, _, dims in _HEADER_PARAM.findall(header)}
    shapes.update({name: _dims(dims) for name, _, dims in _VALUE.findall(body)})
    return shapes


def _dims(dims: str) -> list[int]:
    return [int(d) for d in dims.split(",") if d]


def _matmul_flops(match: re.Match, line: str, shapes: dict[str, list[int]]) -> float:
    out, op, operands = _dims(match.group(1)), match.group(2), _CALLEE.findall(match.group(3))
    lhs, rhs = (shapes.get(o) for o in (operands + ["", ""])[:2])
    if lhs is None or rhs is None:
        return 0.0
    if op == "dot":
        contracting = _CONTRACTING.search(line)
        summed = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting else 1
        return 2.0 * math.prod(out) * summed
    labels = _DIM_LABELS.search(line)
    if labels is None:
        return 0.0
    return 2.0 * _convolution_products(out, lhs, rhs, *labels.groups(), _WINDOW.search(line))


def _convolution_products(out, lhs, rhs, lhs_labels: str, rhs_labels: str, out_labels: str, window) -> float:
    """The products a convolution sums into its outputs: each output element's input features, times the kernel
    taps that meet the input rather than its padding, counted along each spatial dim. The TPU compiler writes
    matmuls as convolutions, a batch dim as a spatial one padded so that one tap of its window meets the
    input: counting the window's whole size there would count that matmul as many times over."""
    features = rhs[rhs_labels.index("i")]
    sizes = _window_list(window, "size")
    pads = [tuple(int(x) for x in p.split("_")) for p in _window_list(window, "pad", raw=True)]
    strides = _window_list(window, "stride")
    elements = math.prod(out)
    taps = 1
    for d, size in enumerate(sizes):
        inputs, outputs = lhs[lhs_labels.index(str(d))], out[out_labels.index(str(d))]
        low = pads[d][0] if d < len(pads) else 0
        stride = strides[d] if d < len(strides) else 1
        # taps k of the window at output o that land on input o * stride - low + k inside [0, inputs)
        met = sum(max(0, min(outputs, -(-(inputs + low - k) // stride)) - max(0, -(-(low - k) // stride)))
                  for k in range(size))
        taps *= met / outputs
    return elements * features * taps


def _window_list(window, key: str, raw: bool = False) -> list:
    found = re.search(rf"\b{key}=([0-9_x]+)", window.group(1)) if window else None
    items = found.group(1).split("x") if found else []
    return items if raw else [int(x) for x in items]


def _kernel_flops(line: str) -> tuple[str, float]:
    body = _MOSAIC_BODY.search(line)
    names = b" ".join(_ATTENTION_KERNEL.findall(base64.b64decode(body.group(1)) if body else b""))
    layouts = _LAYOUTS.search(line)
    # queries [rows..., heads, tokens, head size] then keys (a batch of one row loses its rows dim)
    operands = [_dims(dims) for dtype, dims in _TENSOR.findall(layouts.group(1) if layouts else "")
                if dtype in ("bf16", "f32", "f16") and dims.count(",") >= 2]
    if not names or len(operands) < 2:
        return "other kernels", 1.0
    query, keys = operands[0], operands[1][-2]
    forward = 2 * 2 * math.prod(query) * keys / 2
    # a backward kernel's body also names the forward's functions it shares: its own pass decides
    if b"dkv" in names:
        return "attention dkv", 2 * forward
    if b"dq" in names:
        return "attention dq", 1.5 * forward
    return "attention forward", forward


def _summed(parts: list[tuple[str, float]]) -> dict[str, float]:
    found: dict[str, float] = {}
    for kind, size in parts:
        found[kind] = found.get(kind, 0) + size
    return found


class _Program:
    """Where an instruction's value comes from, across call boundaries: enough to tell an all-reduce that
    gathers (each device's shard laid into zeros, then summed: how TPU7x runs an all-gather on its SparseCores,
    `call-start(dynamic-update-slice(broadcast, shard))`, and inside a loop as a fused dynamic-update-slice)
    from one that reduces."""

    def __init__(self, computations: dict[str, tuple[str, str]]):
        self.made: dict[str, dict[str, tuple[str, str, str]]] = {}  # computation -> value -> (op, operands, rest)
        self.roots: dict[str, str] = {}
        self.callers: dict[str, list[tuple[str, list[str]]]] = defaultdict(list)  # callee -> (caller, operands)
        for name, (_, body) in computations.items():
            made = self.made[name] = {}
            for root, value, op, operands, rest in _DEFINITION.findall(body):
                made[value] = (op, operands, rest)
                if root:
                    self.roots[name] = value
                for callee in _CALLEE.findall(" ".join(c for _, c in _CALL.findall(rest))):
                    self.callers[callee].append((name, _CALLEE.findall(operands)))

    def laid_into_zeros(self, computation: str, value: str, depth: int = 2) -> bool:
        op, operands, rest = self.made.get(computation, {}).get(value, ("", "", ""))
        args = _CALLEE.findall(operands)
        while op in ("copy-done", "copy-start", "copy", "bitcast") and args:  # moved, not computed
            op, operands, rest = self.made.get(computation, {}).get(args[0], ("", "", ""))
            args = _CALLEE.findall(operands)
        if op == "dynamic-update-slice" and args:
            return self._made_by(computation, args[0], "broadcast", depth)
        if op == "fusion":  # a fused dynamic-update-slice (maybe converted) whose base is one of the fusion's operands
            fused = next((c.lstrip("%") for site, c in _CALL.findall(rest) if site == "calls"), "")
            root = self.made.get(fused, {}).get(self.roots.get(fused, ""), ("", "", ""))
            while root[0] in ("convert", "bitcast", "copy") and _CALLEE.findall(root[1]):
                root = self.made.get(fused, {}).get(_CALLEE.findall(root[1])[0], ("", "", ""))
            base = _CALLEE.findall(root[1])[:1] if root[0] == "dynamic-update-slice" else []
            index = self._parameter(fused, base[0]) if base else None
            return index is not None and index < len(args) and self._made_by(computation, args[index], "broadcast",
                                                                             depth)
        return self._at_call_sites(computation, value, depth, self.laid_into_zeros)

    def _made_by(self, computation: str, value: str, op: str, depth: int) -> bool:
        return self.made.get(computation, {}).get(value, ("",))[0] == op or self._at_call_sites(
            computation, value, depth, lambda caller, arg, left: self._made_by(caller, arg, op, left))

    def _at_call_sites(self, computation: str, value: str, depth: int, holds) -> bool:
        """For a parameter: whether `holds` for what some call site passes (an async call's, a fusion's)."""
        index = self._parameter(computation, value)
        return index is not None and depth > 0 and any(
            index < len(site) and holds(caller, site[index], depth - 1)
            for caller, site in self.callers.get(computation, []))

    def _parameter(self, computation: str, value: str) -> int | None:
        op, operands, _ = self.made.get(computation, {}).get(value, ("", "", ""))
        return int(operands) if op == "parameter" and operands.strip().isdigit() else None

    def step(self, condition: str, counter: str, body: str) -> int:
        """What a while loop's body adds to the counter its condition compares: 1 where it cannot tell (XLA runs
        a bidirectional windowed einsum two ring steps an iteration, counting by 2)."""
        index = self._element(condition, counter)
        root = self.made.get(body, {}).get(self.roots.get(body, ""), ("", "", ""))
        carried = _CALLEE.findall(root[1]) if root[0] == "tuple" else []
        if index is None or index >= len(carried):
            return 1
        op, operands, _ = self.made[body].get(carried[index], ("", "", ""))
        terms = _CALLEE.findall(operands)
        if op != "add" or len(terms) != 2:
            return 1
        for term, other in (terms, terms[::-1]):
            made = self.made[body].get(other, ("", "", ""))
            if self._element(body, term) == index and made[0] == "constant" and made[1].strip().isdigit():
                return max(1, int(made[1]))
        return 1

    def _element(self, computation: str, value: str) -> int | None:
        """The tuple index a get-tuple-element reads (a loop's carried values)."""
        op, _, rest = self.made.get(computation, {}).get(value, ("", "", ""))
        found = _INDEX.search(rest) if op == "get-tuple-element" else None
        return int(found.group(1)) if found else None


def _windowed_step(loop: str, chunk: int, ring: int, sends: int) -> tuple[str, float]:
    """One send of a windowed einsum's ring (XLA's collective matmul: `windowed_dot_general_body_ag` gathers an
    operand chunk by chunk, `..._rs` passes partial sums around until each device holds its shard of the
    result), as its share of the collective the loop spreads over a matmul, in result bytes: each run of the
    loop (`sends` sends of a `chunk` per device) gathers `ring` chunks, or reduces to one. A loop one way round
    sends ring - 1 chunks; a bidirectional one (two ring steps an iteration, a chunk each way) sends `ring`."""
    return ("all-gather", chunk * ring / sends) if loop == "ag" else ("reduce-scatter", chunk / sends)


def _runs(computations: dict[str, tuple[str, str]], loop_trips: int, program: _Program
          ) -> tuple[dict[str, int], dict[str, int]]:
    """How many times each computation runs per execution of the entry one, through every call (a fusion, an
    async op, a branch, a while loop's body: its trip count, read from its condition's `i < N` and the step its
    body adds to `i`, else `loop_trips`); and each loop body's trip count."""
    def trips(condition: str, body: str) -> int:
        text = computations.get(condition, ("", ""))[1]
        constants = dict(_CONSTANT.findall(text))
        bounds = [(int(constants[bound]), counter) for counter, bound in _LESS_THAN.findall(text)
                  if bound in constants]
        if not bounds:
            return loop_trips
        bound, counter = max(bounds)
        return -(-bound // program.step(condition, counter, body))

    calls, bodies = {}, {}
    for name, (_, body) in computations.items():
        loops = {loop_body: trips(condition, loop_body) for condition, loop_body in _WHILE.findall(body)}
        bodies.update(loops)
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
    return runs, bodies


# `[ROOT] %value = TYPE op(operands), attributes`: whether it is its computation's root, the op, its operands (a
# parameter's: its index), and the attributes (its callees).
_DEFINITION = re.compile(r"^\s*(ROOT )?%([\w.-]+) = .*? ([a-z][\w-]*)\(([^)]*)\)(.*)$", re.M)
_WINDOWED = re.compile(r"windowed_dot_general_body_(ag|rs)")
_PERMUTE = re.compile(r" collective-permute(?:-start)?\(")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9]+,[0-9]+\},?)+)\}")  # a ring's (source, target) pairs
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_INDEX = re.compile(r"\bindex=(\d+)")
# A transfer to the DCN runtime: `%s = (f32[44,8,128]{...}, u32[], token[]) send(...), channel_id=N, ...
# _xla_megascale_transfer_type="ALL_REDUCE"` (its recv, the answer, is not counted again).
_DCN_SEND = re.compile(r"^\s*(?:ROOT )?%[\w.-]+ = \(([a-z][a-z0-9]*\[[0-9,]*\])[^\n]*? send\([^\n]*?channel_id=(\d+)"
                       r"[^\n]*?_xla_megascale_transfer_type=\"(\w+)\"", re.M)
_DCN_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
              "ALL_TO_ALL": "all-to-all"}
_WHILE = re.compile(r"\bwhile\(.*?condition=%?([\w.-]+), body=%?([\w.-]+)")
_CONSTANT = re.compile(r"%([\w.-]+) = [su]\d+\[\][^ ]* constant\((\d+)\)")
_LESS_THAN = re.compile(r"compare\(%([\w.-]+), %([\w.-]+)\), direction=LT")  # counter, bound
# A computation: its header, then its instructions up to a line that starts with its closing brace (and may go on
# with the computation's attributes: `}, execution_thread="sparsecore"`), followed by a blank line, the next
# computation's header (at the line's start, where instructions are indented) or the end. An instruction's
# attribute may span lines (newer jax's `kernel_metadata`), its own closing brace at a line's start: the
# instruction goes on after it, so that does not end the computation.
_COMPUTATION = re.compile(
    r"^((?:ENTRY )?%?([\w.-]+) [^\n]*)\{\n(.*?)^\}[^\n]*$"
    r"(?=\n[ \t]*\n|\n(?:ENTRY )?%?[\w.-]+ [^\n]*\{[ \t]*\n|\n?\Z)", re.M | re.S)
# A call site and its callees: one (`calls=%f`) or a list (`branch_computations={%a, %b}`: each branch counted as
# if it ran, an upper bound).
_CALL = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|called_computations)=(\{[^}]*\}|%[\w.-]+)")
_CALLEE = re.compile(r"%([\w.-]+)")


# `%v = bf16[2048,512]{1,0:T(8,128)} convolution(%a, %b), dim_labels=fb_io->bf`, or `... dot(...)`.
_MATMUL = re.compile(r"= [a-z][a-z0-9]*\[([0-9,]*)\][^ ]* (dot|convolution)\(([^)]*)\)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)")  # input, kernel, output: b f i o, spatial
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_VALUE = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = ([a-z][a-z0-9]*)\[([0-9,]*)\]", re.M)
_HEADER_PARAM = re.compile(r"([\w.-]+): ([a-z][a-z0-9]*)\[([0-9,]*)\]")
_LAYOUTS = re.compile(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}")  # each operand's type and layout
_MOSAIC_BODY = re.compile(r'"body": ?"([A-Za-z0-9+/=]+)"')
# A Pallas attention kernel, by the function its Mosaic body is named after: splash's (`splash_mha_fwd...`,
# `splash_mha_dq...`, `splash_mha_dkv...`) and flash's (`flash_attention_kernel`, `_flash_attention_dq_kernel`...)
_ATTENTION_KERNEL = re.compile(rb"(?<![A-Za-z0-9])(splash_mha_[a-z_]+|_?flash_attention[a-z_]*)")


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
