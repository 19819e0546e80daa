"""What backends and the checkpoint layer agree on, and all a backend imports from `checkpoint/`.

A checkpoint stores each tensor of the training state as boxes (offsets, sizes) of its global shape, the
model DCP uses too: FSDP2 row shards, SPMD shards along any dimension and FSDPv1's flat shards (cut by
`range_to_boxes`) are all boxes, so any backend reads what any other wrote by intersecting them. A backend
hands its state out and takes it back as `StateTensor`s, through the `ShardedState` protocol; nothing in
`checkpoint/` imports a backend.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) within a tensor's global shape
Chunk = tuple[tuple[int, ...], torch.Tensor]  # (offsets, host copy of that box)


@dataclass
class StateTensor:
    """One tensor of the training state as checkpointing sees it: a global name and shape, the boxes this
    process writes (host copies, taken before the step goes on) and, for loading, the boxes it holds and how
    to put values into them."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: Callable[[], list[Chunk]]
    boxes: Callable[[], list[Box]]
    fill: Callable[[list[torch.Tensor]], None]
    # A parameter that does not train (LoRA's frozen base): its values are in the model directory, so a
    # checkpoint of what trains leaves it out, and a resumed run reads it from the directory again.
    frozen: bool = False


class ShardedState(Protocol):
    """Something that can hand out and take back a run's sharded state: a backend's `backend.state`, after
    setup."""

    @property
    def writer(self) -> tuple[int, int]:
        """(index, count) of the processes that write checkpoint shards; this process's slot."""

    @property
    def is_main(self) -> bool:
        """The one process that commits manifests, applies retention and logs."""

    def tensors(self, model, optimizer, stored: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
                ) -> list[StateTensor]:
        """Model parameters as `model/<name>`, optimizer state as `optim/<name>/<key>`; when loading, `stored`
        names what the checkpoint holds (so lazily created optimizer state can be made)."""

    def rng_state(self) -> dict[str, Any]: ...

    def set_rng_state(self, state: dict[str, Any]) -> None: ...

    def any_rank(self, flag: bool) -> bool:
        """True on every process if `flag` is set on any: processes that disagree must decide together."""

    def describe(self) -> dict[str, Any]:
        """What a manifest records about the run that wrote it (backend, devices, sharding plan, config)."""

    def run_identity(self) -> dict[str, Any]:
        """Config keys and values a checkpoint must share for a resume to continue the same run."""


def unstack(whole: StateTensor, names: list[str]) -> list[StateTensor]:
    """A tensor kept stacked as [layers, ...] (scanned layers) as one StateTensor per layer, under the names
    the unstacked model gives them: checkpoints and pretrained loads do not depend on how a run stores layers.

    Each layer's boxes are the stacked tensor's boxes that hold it, less their first dimension. Saving copies the
    stacked shards to the host once for all layers; loading collects every layer's values and fills the stacked
    tensor once the last layer has arrived. A scalar (AdamW's `step` of a stacked parameter) is every layer's."""
    if not whole.shape:
        return [dataclasses.replace(whole, name=name, chunks=functools.cache(whole.chunks)) for name in names]
    chunks, boxes = functools.cache(whole.chunks), functools.cache(whole.boxes)
    received: dict[int, list[torch.Tensor]] = {}

    def holding(layer: int) -> list[int]:
        return [j for j, (offsets, sizes) in enumerate(boxes()) if offsets[0] <= layer < offsets[0] + sizes[0]]

    def layer_chunks(layer: int) -> list[Chunk]:
        return [(offsets[1:], data[layer - offsets[0]]) for offsets, data in chunks()
                if offsets[0] <= layer < offsets[0] + data.shape[0]]

    def layer_boxes(layer: int) -> list[Box]:
        return [(boxes()[j][0][1:], boxes()[j][1][1:]) for j in holding(layer)]

    def layer_fill(layer: int, values: list[torch.Tensor]) -> None:
        received[layer] = values
        if len(received) < len(names):
            return
        by_layer = {k: dict(zip(holding(k), received[k])) for k in received}
        whole.fill([torch.stack([by_layer[k][j] for k in range(offsets[0], offsets[0] + sizes[0])])
                    for j, (offsets, sizes) in enumerate(boxes())])
        received.clear()

    return [StateTensor(name, whole.shape[1:], whole.dtype, functools.partial(layer_chunks, layer),
                        functools.partial(layer_boxes, layer), functools.partial(layer_fill, layer), whole.frozen)
            for layer, name in enumerate(names)]


# ---- boxes --------------------------------------------------------------------------------------------
def intersect(a: Box, b: Box) -> Box | None:
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def region(box: Box, within: Box) -> tuple[slice, ...]:
    """Index of `box` inside a tensor that holds `within`."""
    return tuple(slice(o - wo, o - wo + s) for o, s, wo in zip(box[0], box[1], within[0]))


def range_to_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes covering elements [start, stop) of a row-major tensor (FSDPv1 shards of flat parameters)."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    first_full, last_full = -(-start // inner), stop // inner
    if first_full > last_full:  # inside one row
        row = start // inner
        return [((row, *o), (1, *s)) for o, s in range_to_boxes(shape[1:], start - row * inner, stop - row * inner)]
    boxes = []
    if start < first_full * inner:
        row = first_full - 1
        boxes += [((row, *o), (1, *s)) for o, s in range_to_boxes(shape[1:], start - row * inner, inner)]
    if last_full > first_full:
        boxes.append(((first_full,) + (0,) * (len(shape) - 1), (last_full - first_full, *shape[1:])))
    if stop > last_full * inner:
        boxes += [((last_full, *o), (1, *s)) for o, s in range_to_boxes(shape[1:], 0, stop - last_full * inner)]
    return boxes
