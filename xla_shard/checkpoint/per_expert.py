"""An export's tensors in the layout `save_pretrained` writes: MoE experts one tensor per expert.

A checkpoint holds what the model holds: transformers 5 fuses each layer's experts into one parameter
(`experts.gate_up_proj`, experts stacked, gate and up concatenated), and its `save_pretrained` splits them again
(`revert_weight_conversion`), so the directories users have store `experts.3.gate_proj.weight`. The names and
shapes here are transformers' own revert, run on the meta device; which part of which checkpoint tensor each
one is comes from reading the same names back the way a load does (`fused.renamer`, `fused.plan`'s layout),
so the export loads, through `from_pretrained` or xla_shard, as the weights it was written from."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from xla_shard.checkpoint import fused
from xla_shard.checkpoint.manifest import CheckpointError


class NotSplit(CheckpointError):
    """save_pretrained's layout is one this module does not produce: the tensors are written as held."""


@dataclass(frozen=True)
class Piece:
    """One exported tensor: `key` in the files, read from checkpoint tensor `source` (whole, or expert
    `expert`'s `length` entries from `start` along `dim` of the fused parameter when `expert` is set)."""

    key: str
    source: str
    shape: tuple[int, ...]
    expert: int | None = None
    dim: int = 1
    start: int = 0
    length: int = 0

    def cut(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.expert is None:
            return tensor
        return tensor[self.expert].narrow(self.dim - 1, self.start, self.length).reshape(self.shape)


def whole(names: list[str], shapes: dict[str, tuple[int, ...]], key) -> list[Piece]:
    return [Piece(key(name), name, shapes[name]) for name in names]


def pieces(model, names: list[str], shapes: dict[str, tuple[int, ...]]) -> list[Piece] | None:
    """The checkpoint tensors `names` ("model/...", `shapes`) as save_pretrained of `model` names them, or None
    where it writes them as they are (no experts fused)."""
    from transformers.core_model_loading import revert_weight_conversion

    state = {name[len("model/"):]: torch.empty(shapes[name], device="meta") for name in names}
    saved = {key: tuple(t.shape) for key, t in revert_weight_conversion(model, dict(state)).items()}
    if saved.keys() == state.keys():
        return None
    rename = fused.renamer(model, list(state))
    out, lengths = [], {}
    for key, shape in saved.items():
        target, converter, pattern = rename(key)
        source = "model/" + target
        if source not in shapes:
            raise NotSplit(f"save_pretrained would write {key!r}, which xla_shard reads back as {target!r}: "
                                  "no tensor of this checkpoint")
        if converter is None:
            out.append(Piece(key, source, shape))
            continue
        ops = [type(op).__name__ for op in converter.operations]
        if ops not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]):
            raise NotSplit(f"{target} is saved through transformers' {converter}, which xla_shard does not split")
        dim = converter.operations[1].dim if len(ops) == 2 else 1
        index = converter.source_patterns.index(pattern)
        lengths.setdefault(source, {})[index] = shape[dim - 1] if len(ops) == 2 else shapes[source][1]
        out.append(Piece(key, source, shape, fused.expert_of(key, pattern), dim, index, 0))
    placed = []
    for piece in out:  # a pattern's entries start after the earlier patterns' along the concatenated dimension
        if piece.expert is not None:
            before = lengths[piece.source]
            piece = Piece(piece.key, piece.source, piece.shape, piece.expert, piece.dim,
                          sum(before[i] for i in range(piece.start)), before[piece.start])
        placed.append(piece)
    _check_tiling(placed, shapes)
    return placed


def _check_tiling(placed: list[Piece], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every checkpoint tensor is written exactly once, whole or as pieces that add up to it."""
    volume: dict[str, int] = {}
    for piece in placed:
        volume[piece.source] = volume.get(piece.source, 0) + math.prod(piece.shape)
    for source, shape in shapes.items():
        if volume.get(source) != math.prod(shape):
            raise NotSplit(f"save_pretrained's layout covers {volume.get(source, 0)} of the {math.prod(shape)} "
                           f"values of {source[len('model/'):]}")
