"""A LoRA run's checkpoint as the directory peft's `PeftModel.from_pretrained(base, dir)` loads.

peft's `save_pretrained` writes `adapter_config.json` (the LoraConfig, with the base model and task) and
`adapter_model.safetensors`, whose keys are the parameter names under `base_model.model.` with the adapter name
dropped (`...q_proj.lora_A.weight`; DoRA's magnitudes: `...q_proj.lora_magnitude_vector`; a module trained whole:
`score.weight`). Written here from the manifest alone, tensor by tensor, as full exports are.

`Merge` is the other export, peft's `merge_and_unload` done tensor by tensor: every weight of the base model
directory, with `alpha / r * B @ A` added where an adapter sits (under DoRA, each row of the sum then scaled to
its trained magnitude) and the trained copy of a module trained whole in place of the stored one, in the stored
dtype.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from pydantic import ValidationError

from xla_shard.checkpoint import hf_dir, meta_model, schema
from xla_shard.checkpoint.manifest import CheckpointError
from xla_shard.checkpoint.reader import ChunkReader
from xla_shard.config.schema import LoraSection
from xla_shard.io.storage import Storage

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
_TASKS = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS"}
_RECORDED = ("r", "alpha", "dropout", "target_modules")  # written since model.lora exists; newer keys may be absent
MAGNITUDE = ".lora_magnitude_vector."  # DoRA's per-row magnitude, beside a layer's lora_A and lora_B


def key(name: str) -> str:
    """`model/<param>` -> the key peft stores it under."""
    param = name[len("model/"):].replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
    param = param.replace(".modules_to_save.default.", ".").replace(f"{MAGNITUDE}default.weight", MAGNITUDE[:-1])
    return f"base_model.model.{param}"


def recorded_adapter(manifest, names: list[str]) -> LoraSection | None:
    """The run's `model.lora` as its manifest records it, None for a full fine-tune; checked as untrusted input:
    by the config schema, and against the tensors the checkpoint holds (adapters exactly where it says: every
    `lora_A` with its `lora_B` of rank `r`, under DoRA a magnitude per row of B, nothing but adapters and modules
    trained whole)."""
    model = (manifest.data.get("config") or {}).get("model")
    raw = model.get("lora") if isinstance(model, dict) else None
    adapters = [n for n in names if ".lora_A." in n or ".lora_B." in n]
    magnitudes = [n for n in names if MAGNITUDE in n]
    where = f"{manifest.url}: the manifest's config.model.lora"
    if raw is None:
        if adapters:
            raise CheckpointError(f"{where} is missing, yet the checkpoint holds LoRA tensors ({adapters[0]}): "
                                  "the manifest was altered")
        return None
    missing = [key for key in _RECORDED if isinstance(raw, dict) and key not in raw]
    if missing:  # every manifest that has the section writes these: a default would guess at the scale
        raise CheckpointError(f"{where} lacks {missing[0]!r} (the manifest was altered or is not xla_shard's)")
    try:
        section = LoraSection.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(p) for p in error["loc"])
        raise CheckpointError(f"{where}{'.' + field if field else ''}: {error['msg']} (the manifest was "
                              "altered or is not xla_shard's)") from None
    others = [n for n in names if n not in adapters and n not in magnitudes and ".modules_to_save.default." not in n]
    if others:
        raise CheckpointError(f"{where} says LoRA, but the checkpoint holds full model weights ({others[0]}): "
                              "it is a full fine-tune's checkpoint with an altered manifest")
    if not any(".lora_A." in n for n in adapters):
        raise CheckpointError(f"{where} says LoRA, but the checkpoint holds no lora_A/lora_B adapters")
    for name in adapters:
        shape = manifest.tensors[name]["shape"]
        partner = name.replace(".lora_B.", ".lora_A.") if ".lora_B." in name else name.replace(".lora_A.", ".lora_B.")
        rank = shape[0] if ".lora_A." in name else shape[-1] if shape else None
        if partner not in manifest.tensors:
            raise CheckpointError(f"{manifest.url}: {name} has no {partner.rsplit('.lora_', 1)[1][:1]} partner "
                                  f"({partner} is missing)")
        if len(shape) != 2 or rank != section.r:
            raise CheckpointError(f"{manifest.url}: {name} is {shape}, not a rank-{section.r} adapter as "
                                  "config.model.lora.r says")
    _check_magnitudes(manifest, section, adapters, magnitudes)
    return section


def _check_magnitudes(manifest, section: LoraSection, adapters: list[str], magnitudes: list[str]) -> None:
    """DoRA's magnitudes exactly where the manifest's use_dora says: one per adapted layer, one per row of B."""
    rows = {n.split(".lora_B.")[0]: manifest.tensors[n]["shape"][0] for n in adapters if ".lora_B." in n}
    held = {n.split(MAGNITUDE)[0]: manifest.tensors[n]["shape"] for n in magnitudes}
    where = f"{manifest.url}: the manifest's config.model.lora.use_dora is {str(section.use_dora).lower()}"
    if not section.use_dora and held:
        raise CheckpointError(f"{where}, yet the checkpoint holds DoRA magnitudes ({magnitudes[0]}): the manifest "
                              "was altered")
    if not section.use_dora:
        return
    for layer, out in rows.items():
        if layer not in held:
            raise CheckpointError(f"{where}, yet {layer} has no magnitude ({layer}{MAGNITUDE}default.weight)")
        if held[layer] != [out]:
            raise CheckpointError(f"{manifest.url}: {layer}{MAGNITUDE}default.weight is {held[layer]}, not one "
                                  f"magnitude per row of its lora_B ([{out}])")
    for layer in sorted(set(held) - set(rows)):
        raise CheckpointError(f"{manifest.url}: {layer}{MAGNITUDE}default.weight is a magnitude with no adapter")


def config_json(lora: LoraSection, model: dict[str, Any], names: list[str], base: str) -> bytes:
    """peft's LoraConfig for the run's `model.lora` section, as save_pretrained writes it; `base` is the base
    model's name or path as peft should find it."""
    from peft import LoraConfig

    whole = sorted({n[len("model/"):].split(".modules_to_save.")[0] for n in names if ".modules_to_save." in n})
    try:
        config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=lora.target_modules, modules_to_save=whole or None,
                            task_type=_TASKS.get(model.get("task")), base_model_name_or_path=base,
                            use_dora=lora.use_dora)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the manifest's model.lora section is not a LoRA config peft accepts: {exc}") from None
    fields = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.to_dict().items()}  # JSON has no sets
    return json.dumps(fields, indent=2, default=str).encode()


class Merge:
    """The base directory's tensors (`names`, `sizes`, read through `reader`) and the `transform` that merges
    the checkpoint's adapters into them as each is written."""

    def __init__(self, base: Storage, checkpoint: ChunkReader, manifest, names: list[str], lora: LoraSection):
        self.manifest = hf_dir.read_manifest(base)
        self.reader = ChunkReader(base, self.manifest, bridge_gaps=False)
        self.names = sorted(self.manifest.tensors)
        self.sizes = {n: schema.nbytes(self.manifest.tensors[n]["shape"], self.manifest.tensors[n]["dtype"])
                      for n in self.names}
        self.checkpoint, self.checkpoint_manifest = checkpoint, manifest
        self.scaling = lora.alpha / lora.r
        self.adapters: dict[str, tuple[str, str]] = {}  # "model/<layer>.weight" -> (A, B) checkpoint names
        self.magnitudes: dict[str, str] = {}  # "model/<layer>.weight" -> its DoRA magnitude's checkpoint name
        self.whole: dict[str, str] = {}  # "model/<module>.<param>" -> the trained copy's checkpoint name
        for name in names:
            if ".lora_A.default." in name:
                layer = name.split(".lora_A.default.")[0]
                self.adapters[f"{layer}.weight"] = (name, name.replace(".lora_A.", ".lora_B."))
                if lora.use_dora:
                    self.magnitudes[f"{layer}.weight"] = f"{layer}{MAGNITUDE}default.weight"
            elif ".modules_to_save.default." in name:
                self.whole[name.replace(".modules_to_save.default.", ".")] = name
        absent = sorted(set(self.adapters) - set(self.names)) + sorted(set(self.whole) - set(self.names))
        if absent:
            raise CheckpointError(f"{base.url} has no tensor {absent[0][len('model/'):]!r} to merge the adapter "
                                  "into (it stores the model under other names)")
        self.transposed = _conv1d_layers(manifest, list(self.adapters))

    def _read(self, name: str) -> torch.Tensor:
        shape = tuple(self.checkpoint_manifest.tensors[name]["shape"])
        (tensor,) = self.checkpoint.read([(name, ((0,) * len(shape), shape))])
        return tensor

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in self.whole:
            return self._read(self.whole[name]).to(tensor.dtype)
        if name not in self.adapters:
            return tensor
        a, b = (self._read(n).float() for n in self.adapters[name])
        transposed = name in self.transposed  # GPT-2's Conv1D stores [in, out]
        weight = tensor.float().T if transposed else tensor.float()
        if (b.shape[0], a.shape[1]) != weight.shape:
            raise CheckpointError(f"the adapter of {name[len('model/'):]} is {[b.shape[0], a.shape[1]]}, the stored "
                                  f"weight {list(tensor.shape)}: not the model this run adapted")
        merged = weight + self.scaling * (b @ a)
        if name in self.magnitudes:  # DoRA: each row of the sum scaled to its magnitude, as peft merges it
            magnitude = self._read(self.magnitudes[name]).float()
            merged = merged * (magnitude / torch.linalg.vector_norm(merged, dim=1)).unsqueeze(1)
        return (merged.T if transposed else merged).to(tensor.dtype)


def _conv1d_layers(manifest, weights: list[str]) -> set[str]:
    """The adapted weights that belong to transformers' Conv1D layers (stored transposed), found on a model
    built from the checkpoint's config on the meta device."""
    from transformers.pytorch_utils import Conv1D

    modules = dict(meta_model.build(manifest.url, manifest.data["hf_config"], weights).named_modules())
    return {w for w in weights if isinstance(modules.get(w[len("model/"):-len(".weight")]), Conv1D)}
