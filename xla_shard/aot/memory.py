"""What a compiled TPU program holds in HBM, read from the compiler's own buffer assignment.

The TPU compiler lays every buffer of a program out ahead of time: the arguments where they are, the outputs, and
every temporary in one preallocated block (the heap), its values packed into slots that live at different times
share. That block is what the runtime allocates for a step's temporaries. libtpu 0.0.20 (and 0.0.42) report a
larger figure in `get_compiled_memory_stats()`: the heap plus, again, about the size of its largest buffer
(measured on every program compiled here with the dumps beside it: Llama-3-8B's shape on a v5p-64, 5.58 GiB of
heap reported as 7.59; 9.22 as 13.23); libtpu 0.0.52 reports the heap alone. The buffer assignment is the
compiler's plan, so the heap is the figure `xla-shard compile` holds a step to, the other said beside it.

The heap's largest slots are named by what their largest value is, from its shape and the model's dimensions:
the layers' checkpoints, the logits, gathered weights, attention's, the MLP's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

# The heap in HBM: `allocation 7: size S, preallocated-temp:` (libtpu 0.0.20, 0.0.42) or `..., page 0,
# preallocated-temp:` (0.0.52); blocks in other memories say their `color N` and are not it.
_HEAP = re.compile(r"^allocation \d+: size (\d+)(?:, page \d+)?, preallocated-temp:\n((?: value:.*\n)+)", re.M)
_VALUE = re.compile(r" value: <\d+ [^ ]+ @\d+> \(size=(\d+),offset=(\d+)\): (\w+)\[([0-9,]*)\]")
_SLOTS_SHOWN = 6
_LANES = 128  # the attention kernels keep their per-row statistics (log-sum-exp) widened to a vector's lanes
KEPT = 24  # slots a compile keeps for its report


@dataclass(frozen=True)
class Slot:
    """Bytes of the heap at one offset, and its largest value's dtype and shape."""

    bytes: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def spelled(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass
class BufferAssignment:
    heap: int  # bytes of the preallocated temporaries' block
    slots: list[Slot] = field(default_factory=list)  # largest first


def dump_options(options, directory: str) -> None:
    """Ask the compiler (its `CompileOptions`) to write its buffer assignment into `directory`."""
    debug = options.executable_build_options.debug_options
    debug.xla_dump_to = directory
    debug.xla_dump_hlo_as_text = True


def read(directory: str) -> BufferAssignment | None:
    """The program's buffer assignment from a compile's dumps: the largest module's (the step; Pallas kernels are
    modules of their own). None where the compiler wrote none."""
    files = sorted(Path(directory).glob("*after_optimizations-buffer-assignment.txt"), key=lambda f: f.stat().st_size)
    if not files:
        return None
    return parse(files[-1].read_text())


def parse(text: str) -> BufferAssignment | None:
    heap = _HEAP.search(text)
    if heap is None:
        return None
    largest: dict[int, tuple[int, str, tuple[int, ...]]] = {}
    for size, offset, dtype, dims in _VALUE.findall(heap.group(2)):
        shape = tuple(int(d) for d in dims.split(",") if d)
        if int(size) > largest.get(int(offset), (0,))[0]:
            largest[int(offset)] = (int(size), dtype, shape)
    slots = sorted((Slot(*value) for value in largest.values()), key=lambda s: -s.bytes)
    return BufferAssignment(int(heap.group(1)), slots)


@dataclass(frozen=True)
class Dims:
    """The model's dimensions, to name a buffer by its shape."""

    hidden: int
    vocab: int
    layers: int
    intermediate: int
    head_dim: int
    kv_width: int  # keys' (and values') projection width: KV heads x head_dim
    tokens: int  # per sequence
    devices: int
    context: int = 1  # devices a sequence is split over (mesh.context): each holds tokens / context of it


def named(slot: Slot, dims: Dims | None) -> str:
    """What a heap slot holds, as far as its largest value's shape tells."""
    if dims is None:
        return "temporaries"
    shape = [d for d in slot.shape if d != 1]
    if not shape:
        return "scalars"
    vocab = {dims.vocab, -(-dims.vocab // dims.devices)}
    widths = {dims.hidden, dims.intermediate, dims.kv_width}
    widths |= {-(-w // dims.devices) for w in widths}  # a device's shard of one
    sequence = bool({dims.tokens, dims.tokens // dims.context} & set(shape))  # whole, or a device's piece
    if sequence and shape[-1] == dims.hidden and shape[0] == dims.layers and len(shape) >= 3:
        return "layer checkpoints (the residual stream each layer keeps)"
    if not sequence and len(shape) >= 2 and set(shape[-2:]) <= widths | vocab and shape[-1] not in vocab - widths:
        return "weights gathered whole, or their gradients"
    if not sequence and math.prod(shape) in {dims.vocab * dims.hidden, -(-dims.vocab // dims.devices) * dims.hidden}:
        return "the output head's gradient, laid out for its sum over devices"
    if shape[-1] in vocab:
        return "logits (or their gradient)"
    if sequence and (shape[-1] == dims.head_dim or (slot.dtype == "f32" and shape[-1] == _LANES)):
        return "attention (queries, keys, values, flash attention's statistics)"
    if sequence and shape[-1] == dims.intermediate:
        return "MLP activations"
    if sequence and shape[-1] == dims.hidden:
        return "hidden states"
    return "other temporaries"


def largest(assignment: BufferAssignment, dims: Dims | None, count: int = _SLOTS_SHOWN) -> list[tuple[str, Slot]]:
    return [(named(slot, dims), slot) for slot in assignment.slots[:count]]
