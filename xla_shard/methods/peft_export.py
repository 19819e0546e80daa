"""A LoRA run's checkpoint as the directory peft's `PeftModel.from_pretrained(base, dir)` loads.

peft's `save_pretrained` writes `adapter_config.json` (the LoraConfig, with the base model and task) and
`adapter_model.safetensors`, whose keys are the parameter names under `base_model.model.` with the adapter name
dropped (`...q_proj.lora_A.weight`; DoRA's magnitudes: `...q_proj.lora_magnitude_vector`; a module trained whole:
`score.weight`). Written here from the manifest alone, tensor by tensor, as full exports are.

`Merge` is the other export, peft's `merge_and_unload` done tensor by tensor: every weight of the base model
directory, with `alpha / r * B @ A` added where an adapter sits (under DoRA, each row of the sum then scaled to
its trained magnitude) and the trained copy of a module trained whole in place of the stored one, in the stored
dtype. On transformers 5's fused MoE experts peft adapts the stacked parameter (`experts.gate_up_proj`), one
rank-r pair per expert side by side; the base directory stores one tensor per expert, and each gets its expert's
piece of the change. A QLoRA run's (`model.quantization`) base is what the run held: each weight it held in 4
bits is quantized and dequantized before the change is added, as peft's `merge_and_unload` dequantizes its
bitsandbytes base, and written in full precision (not quantized again).
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn

from xla_shard.checkpoint import fused, hf_dir, meta_model, schema
from xla_shard.checkpoint.manifest import CheckpointError
from xla_shard.checkpoint.reader import ChunkReader
from xla_shard.config.schema import LoraSection, QuantizationSection
from xla_shard.errors import one_line
from xla_shard.io.storage import Storage

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
_TASKS = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS"}
_RECORDED = ("r", "alpha", "dropout", "target_modules")  # written since model.lora exists; newer keys may be absent
MAGNITUDE = ".lora_magnitude_vector."  # DoRA's per-row magnitude, beside a layer's lora_A and lora_B
WHOLE = ".modules_to_save.default."  # a module trained whole beside the adapters: its trained copy
ADAPTER = "default"  # peft's adapter name; exports drop it, as peft's save_pretrained does
# What peft puts into a wrapped module's parameter names: removed, they are the names the model holds them by.
_INFIXES = re.compile(r"\.(base_layer|original_module|modules_to_save\.default)(?=\.)")


def checked_magnitude(name: str, tensor: torch.Tensor, url: str) -> torch.Tensor:
    """A DoRA magnitude read from a checkpoint: NaN is the value it holds until derived from the base (`methods.
    dora`), never a trained one, so a checkpoint holding it was saved before that, or edited."""
    if MAGNITUDE in name and tensor.is_floating_point() and bool(torch.isnan(tensor).any()):
        raise CheckpointError(f"{url}: {name[len('model/'):] if name.startswith('model/') else name} holds NaN, "
                              "DoRA's value for a magnitude not yet derived from its base: the checkpoint was "
                              "saved before training began, or edited; not exporting it")
    return tensor


def stored_name(name: str) -> str:
    """A parameter's name as the model holds it without peft (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return _INFIXES.sub("", name)


def key(name: str) -> str:
    """`model/<param>` -> the key peft stores it under."""
    param = name[len("model/"):].replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
    param = param.replace(".modules_to_save.default.", ".").replace(f"{MAGNITUDE}default.weight", MAGNITUDE[:-1])
    return f"base_model.model.{param}"


@dataclass
class Recorded:
    """A LoRA run's adapters as its manifest records them: the `model.lora` section, and the model of the
    manifest's hf_config on the meta device with peft's adapters where that section puts them."""

    section: LoraSection
    model: nn.Module
    quantization: QuantizationSection | None = None
    four_bit: frozenset[str] = frozenset()  # `model/<stored name>` of each weight the run held in 4 bits


def recorded_adapter(manifest, names: list[str]) -> Recorded | None:
    """The run's `model.lora` as its manifest records it, None for a full fine-tune; checked as untrusted input:
    by the config schema, and against the tensors the checkpoint holds, which must be exactly the adapters peft
    puts into the model for that section (each in peft's layout: `r` rows for a linear layer's `lora_A`, `r`
    per expert for fused MoE experts, twice that for experts' gate and up fused in one parameter; under DoRA a
    magnitude per row), and modules trained whole."""
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
    section = _recorded_section(LoraSection, raw, where)
    others = [n for n in names if n not in adapters and n not in magnitudes and WHOLE not in n]
    if others:
        raise CheckpointError(f"{where} says LoRA, but the checkpoint holds full model weights ({others[0]}): "
                              "it is a full fine-tune's checkpoint with an altered manifest")
    if not any(".lora_A." in n for n in adapters):
        raise CheckpointError(f"{where} says LoRA, but the checkpoint holds no lora_A/lora_B adapters")
    quantization = _recorded_quantization(manifest, model)
    adapted, four_bit = _adapted_model(manifest, section, names, quantization)
    expected = {f"model/{n}": list(p.shape) for n, p in adapted.named_parameters() if ".lora_" in n or WHOLE in n}
    _check_layout(manifest, section, {n: manifest.tensors[n]["shape"] for n in names}, expected)
    return Recorded(section, adapted, quantization, four_bit)


def _recorded_quantization(manifest, model: dict) -> QuantizationSection | None:
    raw = model.get("quantization")
    if raw is None:
        return None
    return _recorded_section(QuantizationSection, raw, f"{manifest.url}: the manifest's config.model.quantization")


def _recorded_section(kind: type, raw, where: str):
    """A config section as a manifest records it, checked by the schema as untrusted input: the first error in
    one line naming its key under `where`."""
    try:
        return kind.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(p) for p in error["loc"])
        raise CheckpointError(f"{where}{'.' + field if field else ''}: {error['msg']} (the manifest was "
                              "altered or is not xla_shard's)") from None


def _adapted_model(manifest, section: LoraSection, names: list[str], quantization: QuantizationSection | None
                   ) -> tuple[nn.Module, frozenset[str]]:
    """The manifest's model on the meta device, adapted by peft as the run's `section` and the modules the
    checkpoint trained whole say, and the weights the run held in 4 bits (chosen as the run chose them)."""
    from peft import inject_adapter_in_model

    from xla_shard.quant import model as quant

    model = meta_model.build(manifest.url, manifest.data["hf_config"], names)
    keep = quant.kept(model, quantization.llm_int8_skip_modules) if quantization else []
    try:
        with quiet_moe_conversion():
            inject_adapter_in_model(lora_config(section, _trained_whole(names)), model, adapter_name=ADAPTER,
                                    low_cpu_mem_usage=True)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointError(f"{manifest.url}: peft does not adapt the manifest's model as its config.model.lora "
                              f"says: {one_line(exc)[:200]}") from None
    four_bit = frozenset(f"model/{name}" for name in quant.four_bit_weights(model, keep, stored_name)) \
        if quantization else frozenset()
    return model, four_bit


def _check_layout(manifest, section: LoraSection, held: dict[str, list[int]], expected: dict[str, list[int]]) -> None:
    """`held` (the checkpoint's tensors and shapes) is exactly `expected` (peft's, on the manifest's model)."""
    url, dora = manifest.url, f"config.model.lora.use_dora is {str(section.use_dora).lower()}"
    for name in sorted(held):
        shape, want = held[name], expected.get(name)
        if want is None and MAGNITUDE in name:
            raise CheckpointError(f"{url}: {name} is a DoRA magnitude peft does not put there ({dora})" if
                                  section.use_dora else f"{url}: the manifest's {dora}, yet the checkpoint holds "
                                  f"DoRA magnitudes ({name}): the manifest was altered")
        if want is None:
            raise CheckpointError(f"{url}: {name} is not a tensor peft puts into this model for the manifest's "
                                  "config.model.lora (its target_modules, modules_to_save): the manifest was altered")
        if shape == want:
            continue
        if MAGNITUDE in name:
            raise CheckpointError(f"{url}: {name} is {shape}, not one magnitude per row of its lora_B ({want})")
        if WHOLE in name:
            raise CheckpointError(f"{url}: {name} is {shape}, the model's is {want}: not the model trained")
        raise CheckpointError(f"{url}: {name} is {shape}, not {want} (peft's rank-{section.r} adapter there, as "
                              "config.model.lora.r says)")
    for name in sorted(set(expected) - set(held)):
        if MAGNITUDE in name:
            raise CheckpointError(f"{url}: the manifest's {dora}, yet {name.split(MAGNITUDE)[0]} has no magnitude "
                                  f"({name})")
        pair = {".lora_A.": ".lora_B.", ".lora_B.": ".lora_A."}
        partner = next((name.replace(k, v) for k, v in pair.items() if k in name), None)
        if partner in held:
            raise CheckpointError(f"{url}: {partner} has no {name.rsplit('.lora_', 1)[1][:1]} partner "
                                  f"({name} is missing)")
        raise CheckpointError(f"{url}: {name} is missing: peft puts it into this model for the manifest's "
                              "config.model.lora, and the checkpoint does not hold it")


def _trained_whole(names: list[str]) -> list[str]:
    return sorted({n[len("model/"):].split(WHOLE)[0] for n in names if WHOLE in n})


def lora_config(section: LoraSection, modules_to_save: list[str] | None = None, **fields):
    """peft's LoraConfig for a `model.lora` section."""
    from peft import LoraConfig

    return LoraConfig(r=section.r, lora_alpha=section.alpha, lora_dropout=section.dropout,
                      target_modules=section.target_modules, modules_to_save=modules_to_save or None,
                      use_dora=section.use_dora, **fields)


@contextlib.contextmanager
def quiet_moe_conversion():
    """peft adapts transformers 5's fused MoE experts by rewriting the LoraConfig (experts' gate and up, fused in
    one parameter, get twice the rank and alpha by pattern), then warns that those patterns match no module: they
    match the parameter, which is adapted at that rank. The warning is about peft's own rewrite, not the config."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match",
                                category=RuntimeWarning)
        yield


def config_json(lora: LoraSection, model: dict[str, Any], names: list[str], base: str) -> bytes:
    """peft's LoraConfig for the run's `model.lora` section, as save_pretrained writes it; `base` is the base
    model's name or path as peft should find it."""
    try:
        config = lora_config(lora, _trained_whole(names), task_type=_TASKS.get(model.get("task")),
                             base_model_name_or_path=base)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the manifest's model.lora section is not a LoRA config peft accepts: {exc}") from None
    fields = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.to_dict().items()}  # JSON has no sets
    return json.dumps(fields, indent=2, default=str).encode()


@dataclass(frozen=True)
class _Adapted:
    """One adapted weight: its adapter's checkpoint tensors and how peft turns them into the weight's change.
    `experts` is 0 for a matrix (a linear layer's weight, or a 2-D parameter), else the number of matrices a
    fused MoE parameter stacks, whose adapter holds a rank-`r` pair per expert side by side; `out_in` says
    whether each matrix is stored [out, in] (transformers' Linear) or [in, out] (GPT-2's Conv1D, experts stored
    transposed)."""

    a: str
    b: str
    scaling: float
    experts: int
    out_in: bool
    magnitude: str | None = None

    def delta(self, a: torch.Tensor, b: torch.Tensor, expert: int | None) -> torch.Tensor:
        """The change peft's merge adds to the weight, or to matrix `expert` of a fused one, as stored."""
        if self.experts:
            rows = a.reshape(self.experts, -1, a.shape[-1])  # [experts, r, in]
            columns = b.reshape(b.shape[0], -1, self.experts)  # [out, r, experts]
            matrices = [columns[:, :, e] @ rows[e] for e in ([expert] if expert is not None else
                                                              range(self.experts))]
            change = torch.stack([m if self.out_in else m.T for m in matrices])
            return self.scaling * (change[0] if expert is not None else change)
        change = self.scaling * (b @ a)
        return change if self.out_in else change.T


def _adapted_weights(model: nn.Module, use_dora: bool) -> dict[str, _Adapted]:
    """Each weight peft adapted in `model` (the meta model of `recorded_adapter`), by the name the model
    holds it under ("model/..."), with its adapter."""
    from peft.tuners.lora import LoraLayer, ParamWrapper
    from transformers.pytorch_utils import Conv1D

    out = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer) or ADAPTER not in layer.lora_A:
            continue
        adapter = f"model/{name}.lora_{{}}.{ADAPTER}.weight"
        if isinstance(layer, ParamWrapper):
            weight, experts = f"{name}.{layer.parameter_name}", layer.num_experts if layer._param_ndim == 3 else 0
            out_in = layer._did_swap_in_out_features or not experts
        else:
            weight, experts, out_in = f"{name}.weight", 0, not isinstance(layer.get_base_layer(), Conv1D)
        magnitude = f"model/{name}{MAGNITUDE}{ADAPTER}.weight" if use_dora else None
        out[f"model/{stored_name(weight)}"] = _Adapted(adapter.format("A"), adapter.format("B"),
                                                             float(layer.scaling[ADAPTER]), experts, out_in, magnitude)
    return out


@dataclass(frozen=True)
class _Place:
    """Where a stored tensor sits in the weight the model holds: whole, or one expert's matrix of a fused MoE
    parameter, `length` entries from `start` along dimension `dim` of the fused parameter."""

    weight: str
    expert: int | None = None
    dim: int = 1
    start: int = 0
    length: int = 0

    def cut(self, change: torch.Tensor) -> torch.Tensor:
        return change if self.expert is None else change.narrow(self.dim - 1, self.start, self.length)


class Merge:
    """The base directory's tensors (`names`, `sizes`, read through `reader`) and the `transform` that merges
    the checkpoint's adapters into them as each is written: a stored tensor that is one expert's piece of a
    fused MoE parameter gets that piece of the parameter's change."""

    def __init__(self, base: Storage, checkpoint: ChunkReader, manifest, names: list[str], recorded: Recorded):
        self.manifest = hf_dir.read_manifest(base)
        if _stored_four_bit(self.manifest):
            raise CheckpointError(f"{base.url} stores its weights in 4 bits (bitsandbytes): --merge writes the base "
                                  "in full precision and is not built over a 4-bit directory yet; export the "
                                  "adapter (peft loads it onto that base)")
        self.reader = ChunkReader(base, self.manifest, bridge_gaps=False)
        self.names = sorted(self.manifest.tensors)
        self.sizes = {n: schema.nbytes(self.manifest.tensors[n]["shape"], self.manifest.tensors[n]["dtype"])
                      for n in self.names}
        self.checkpoint, self.checkpoint_manifest = checkpoint, manifest
        self.adapted = _adapted_weights(recorded.model, recorded.section.use_dora)
        self.quantization, self.four_bit = recorded.quantization, recorded.four_bit
        self.whole = {n.replace(WHOLE, "."): n for n in names if WHOLE in n}  # held name -> trained copy
        self.places = _places(recorded.model, self.manifest, [*self.adapted, *self.whole])
        absent = sorted((set(self.adapted) | set(self.whole)) - {p.weight for p in self.places.values()})
        if absent:
            raise CheckpointError(f"{base.url} has no tensor {absent[0][len('model/'):]!r} to merge the adapter "
                                  "into (it stores the model under other names)")
        self._read = functools.lru_cache(maxsize=8)(self._read_whole)  # a layer's adapters, for all its experts

    def _read_whole(self, name: str) -> torch.Tensor:
        shape = tuple(self.checkpoint_manifest.tensors[name]["shape"])
        (tensor,) = self.checkpoint.read([(name, ((0,) * len(shape), shape))])
        return tensor

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in self.four_bit:  # the base as the run held it
            from xla_shard.quant import bnb4

            q = self.quantization
            tensor = bnb4.dequantize(bnb4.quantize(tensor.float(), q.bnb_4bit_quant_type, q.bnb_4bit_use_double_quant)
                                     ).reshape(tensor.shape).to(tensor.dtype)
        place = self.places.get(name)
        if place is None:
            return tensor
        if place.weight in self.whole:
            return self._read(self.whole[place.weight]).to(tensor.dtype)
        adapted = self.adapted[place.weight]
        a, b = self._read(adapted.a).float(), self._read(adapted.b).float()
        change = place.cut(adapted.delta(a, b, place.expert))
        if change.shape != tensor.shape:
            raise CheckpointError(f"the adapter of {place.weight[len('model/'):]} changes {list(change.shape)} of "
                                  f"{name[len('model/'):]}, stored as {list(tensor.shape)}: not the model this run "
                                  "adapted")
        merged = tensor.float() + change
        if adapted.magnitude is not None:  # DoRA: each row of the sum scaled to its magnitude, as peft merges it
            rows = merged if adapted.out_in else merged.T
            magnitude = checked_magnitude(adapted.magnitude, self._read(adapted.magnitude),
                                          self.checkpoint_manifest.url).float()
            rows = rows * (magnitude / torch.linalg.vector_norm(rows, dim=1)).unsqueeze(1)
            merged = rows if adapted.out_in else rows.T
        return merged.to(tensor.dtype)


def _stored_four_bit(manifest) -> bool:
    from xla_shard.quant.model import stored_four_bit

    return bool(stored_four_bit(manifest.tensors))


def _places(model: nn.Module, base, weights: list[str]) -> dict[str, _Place]:
    """The base directory's tensors that hold (part of) `weights`, each with its place: read back as a load
    reads them (transformers' renamings, MoE experts stored one tensor per expert)."""
    wanted = {w[len("model/"):] for w in weights}
    rename = fused.renamer(model, sorted(wanted))
    shapes = {n: p.shape for n, p in model.named_parameters()}
    places: dict[str, _Place] = {}
    pieces: dict[str, tuple[Any, dict[str, dict[int, str]]]] = {}  # fused weight -> (converter, its sources)
    for stored in base.tensors:
        key, converter, pattern = rename(stored[len("model/"):])
        if key not in wanted:
            continue
        if converter is None:
            places[stored] = _Place(f"model/{key}")
            continue
        expert = fused.expert_of(stored, pattern)
        if expert is not None:
            pieces.setdefault(key, (converter, {}))[1].setdefault(pattern, {})[expert] = stored
    stored_shapes = {n: tuple(t["shape"]) for n, t in base.tensors.items()}
    held = {stored_name(n): s for n, s in shapes.items()}
    for key, (converter, sources) in pieces.items():
        planned = fused.plan(key, tuple(held[key]), converter, sources, stored_shapes)
        if isinstance(planned, str):
            raise CheckpointError(f"{base.url}: {key} {planned}")
        for index, experts in enumerate(planned.sources):
            start = sum(planned.lengths[:index])
            for expert, stored in experts.items():
                places[stored] = _Place(f"model/{key}", expert, planned.dim or 1, start,
                                        planned.lengths[index] if planned.dim else held[key][1])
    return places
