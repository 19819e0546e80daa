"""Parameters transformers fuses on load from several stored tensors: MoE experts.

Mixtral, Qwen2/3-MoE, OLMoE and the others transformers maps to them store one tensor per expert
(`experts.3.gate_proj.weight`); transformers 5 builds one parameter per layer from them with a `WeightConverter`
(`experts.gate_up_proj`: the experts stacked on a new first dimension, gate and up concatenated along the next).
A sharded load cannot run that converter on whole tensors: each process reads only its boxes. So the
converter's two operations are mapped onto boxes instead: a box of the fused parameter is, for each expert it
spans, the pieces of the stored tensors that fall in it, read by byte range and put together.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from xla_shard.checkpoint.layout import Box

PREFIX = "fused:"  # names of fused parameters among the stored tensors' (never a stored name)


@dataclass
class Fused:
    """One fused parameter of `shape`: `sources[p][e]` is pattern p's stored tensor of expert e; with `dim`
    (in the fused parameter's dimensions) the patterns are concatenated along it, each `lengths[p]` long."""

    name: str
    shape: tuple[int, ...]
    dim: int | None
    sources: list[dict[int, str]] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def pieces(self, box: Box) -> list[list[tuple[str, Box]]]:
        """Per expert the box spans, the (stored tensor, box in it) pieces, in order along `dim`."""
        (first, *starts), (count, *sizes) = box
        out = []
        for expert in range(first, first + count):
            if self.dim is None:
                out.append([(self.sources[0][expert], (tuple(starts), tuple(sizes)))])
                continue
            axis, offset, parts = self.dim - 1, 0, []
            for pattern, length in enumerate(self.lengths):
                lo, hi = max(starts[axis], offset), min(starts[axis] + sizes[axis], offset + length)
                if lo < hi:
                    at, size = list(starts), list(sizes)
                    at[axis], size[axis] = lo - offset, hi - lo
                    parts.append((self.sources[pattern][expert], (tuple(at), tuple(size))))
                offset += length
            out.append(parts)
        return out


class FusedReader:
    """A `ChunkReader` that also serves fused parameters (`PREFIX` + name), from their stored pieces."""

    def __init__(self, reader, fused: dict[str, Fused]):
        self.reader, self.fused = reader, fused

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    def read(self, requests: list[tuple[str, Box]]) -> list[torch.Tensor]:
        flat: list[tuple[str, Box]] = []
        plans = []
        for name, box in requests:
            if name not in self.fused:
                plans.append(None)
                flat.append((name, box))
                continue
            per_expert = self.fused[name].pieces(box)
            plans.append([len(parts) for parts in per_expert])
            flat += [piece for parts in per_expert for piece in parts]
        values = iter(self.reader.read(flat))
        out = []
        for (name, box), plan in zip(requests, plans):
            if plan is None:
                out.append(next(values))
                continue
            fused = self.fused[name]
            experts = [[next(values) for _ in range(n)] for n in plan]
            if not experts:
                out.append(torch.empty(box[1]))
                continue
            axis = None if fused.dim is None else fused.dim - 1
            out.append(torch.stack([parts[0] if axis is None else torch.cat(parts, dim=axis) for parts in experts]))
        return out


def plan(name: str, shape: tuple[int, ...], converter, found: dict[str, dict[int, str]],
         stored_shapes: dict[str, tuple[int, ...]]) -> Fused | str:
    """The `Fused` for parameter `name` from the stored tensors `found` (converter source pattern -> expert ->
    stored name), or why it cannot be read that way (one line)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0 or len(ops) > 2 or (
            len(ops) == 2 and not isinstance(ops[1], Concatenate)):
        return f"needs transformers' weight conversion ({converter}), which xla_shard reads only as stacked experts"
    dim = ops[1].dim if len(ops) == 2 else None
    patterns = list(converter.source_patterns)
    if dim is None and len(patterns) != 1:
        return f"fuses {len(patterns)} stored tensors per expert without concatenating them"
    experts = shape[0]
    fused = Fused(name, shape, dim)
    for pattern in patterns:
        have = found.get(pattern, {})
        missing = [e for e in range(experts) if e not in have]
        if missing:
            return f"has {experts} experts but no stored tensor for expert {missing[0]} ({pattern})"
        beyond = sorted(e for e in have if e >= experts)
        if beyond:  # nothing stored is silently left out
            extra = have[beyond[0]].removeprefix("model/")
            return f"has {experts} experts, but the directory stores expert {beyond[0]} ({extra}) too"
        shapes = {stored_shapes[have[e]] for e in range(experts)}
        if len(shapes) != 1:
            return f"stores experts of different shapes for {pattern}: {sorted(shapes)}"
        fused.sources.append({e: have[e] for e in range(experts)})
        (one,) = shapes
        fused.lengths.append(one[dim - 1] if dim is not None else 0)
        expected = list(shape[1:])
        if dim is not None:
            expected[dim - 1] = one[dim - 1]
        if list(one) != expected:
            return f"stores {pattern} as {list(one)}, which does not make {list(shape)}"
    if dim is not None and sum(fused.lengths) != shape[dim]:
        return f"concatenates to {sum(fused.lengths)} along dimension {dim}, the parameter has {shape[dim]}"
    return fused


def expert_of(stored: str, pattern: str) -> int | None:
    """The expert index the `*` of a converter's source pattern stands for in a stored key."""
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    match = re.search(regex, stored)
    return int(match.group(1)) if match else None


def renamer(model, names: list[str]) -> Callable[[str], tuple[str, Any, str | None]]:
    """A stored key as this model names it (`names`: its tensors' names as saved): transformers' renamings for
    the class (legacy gamma/beta and the like) and its base-model prefix added or removed; and, for keys
    transformers rebuilds into another tensor (MoE experts fused), the converter that does it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_state = dict.fromkeys(names, True)  # transformers tests `.get(key) is not None`
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> tuple[str, Any, str | None]:
        """(the model's name for it, the converter that builds that parameter from it or None, its pattern)."""
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if pattern is None:
            return renamed, None, None
        return renamed, next(c for c in converters if pattern in c.source_patterns), pattern

    return rename
