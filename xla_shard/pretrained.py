"""Pretrained weights into a sharded model, shard by shard.

The model is built on the meta device, wrapped and sharded by the backend, and only then filled: each process
(under SPMD, each host) asks its backend which boxes of each parameter it holds and reads those byte ranges
of the model directory's safetensors files, through the same `ChunkReader` a resume uses. No process ever
holds a full copy of the model; what it holds at once is its shard plus one read batch.

Names are matched before anything is sharded, as transformers matches them (its key renamings, the base
model prefix added or stripped), so a wrong directory fails in `config check`, naming the keys.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from xla_shard import experts
from xla_shard.checkpoint import fused, hf_dir, layout
from xla_shard.checkpoint.contract import StateTensor, region
from xla_shard.checkpoint.reader import ChunkReader, fill
from xla_shard.errors import ConfigError
from xla_shard.hostmem import mib, peak_growth
from xla_shard.io.storage import Storage
from xla_shard.methods import Adapter, adapter_for
from xla_shard.models import ModelSource, build_model, check_sequence_length, resolve_source
from xla_shard.quant import model as quant
from xla_shard.wrap import check_scannable, checkpoint_targets, wrap_targets

_SHOWN = 4  # keys named in one error or log line
READ_BATCH_BYTES = 256 << 20  # read (and fetched concurrently) at once, per process


@dataclass
class LoadReport:
    """What one process did: `bytes_read` of the directory's `bytes_stored` tensor bytes, for the `bytes_held`
    of parameters it holds. Host memory grows by at most what it holds in host memory (on a CPU backend, its
    shard) plus one read batch (`READ_BATCH_BYTES`) and, where dtypes differ, that batch converted."""

    tensors: int
    bytes_read: int
    bytes_stored: int
    peak_host_growth: int
    bytes_held: int = 0
    converted: dict[str, set[str]] = field(default_factory=dict)  # "BF16->F32": the tensors converted
    fresh: list[str] = field(default_factory=list)  # parameters the directory lacks, initialised from the seed
    skipped: list[str] = field(default_factory=list)  # directory tensors this model has no place for

    def describe(self) -> str:
        text = (f"read {mib(self.bytes_read)} of the {mib(self.bytes_stored)} stored ({self.tensors} tensors), "
                f"peak host memory +{mib(self.peak_host_growth)}")
        if self.converted:
            text += "; converted " + ", ".join(f"{len(names)} tensor(s) {kind}"
                                               for kind, names in self.converted.items())
        return text


class PretrainedWeights:
    """A model directory's weights, matched to one model's parameters. `match` runs on the unwrapped model
    (on the meta device is fine), `load` after the backend wrapped it."""

    def __init__(self, source: ModelSource, retry_deadline_s: float = 120.0):
        self.source = source
        self.storage = Storage(source.directory, retry_deadline_s)
        self.manifest = hf_dir.read_manifest(self.storage)
        self.names: dict[str, str] = {}  # parameter or buffer name -> manifest tensor name
        self.fresh: dict[str, torch.Tensor] = {}
        self.skipped: list[str] = []
        self.fused: dict[str, fused.Fused] = {}  # MoE experts: fused parameters read from per-expert tensors
        self.quantized: dict[str, quant.Source] = {}  # 4-bit parameters: quantized from a stored weight as read
        self.four_bit_state: set[str] = set()  # what a directory saved in 4 bits stores beside its packed weights

    def identity(self) -> dict[str, Any]:
        """What these weights are, for a LoRA run's manifest (see `hf_dir.identity`)."""
        return {"directory": self.storage.url, "files": hf_dir.identity(self.storage, self.manifest)}

    @classmethod
    def find(cls, source: ModelSource, init: str, retry_deadline_s: float = 120.0) -> PretrainedWeights | None:
        """The weights `model.init` asks for: None for random init; an error where pretrained ones are wanted
        and missing."""
        if init == "random":
            return None
        if source.directory is None:
            if init == "pretrained":
                kind = "a preset" if source.is_preset else "a config file"
                raise ConfigError("model.init", f"pretrained, but model.name {source.name!r} is {kind}: name a model "
                                                "directory holding safetensors weights")
            return None
        try:
            return cls(source, retry_deadline_s)
        except hf_dir.NoWeights as exc:
            if init == "pretrained":
                raise ConfigError("model.init", f"pretrained, but {exc}") from None
            return None

    # ---- before sharding ------------------------------------------------------------------------------
    def match(self, model: nn.Module, seed: int, adapters: dict[str, torch.Tensor] | None = None,
              adapter: Adapter | None = None) -> None:
        """Pair every parameter (and stored buffer) with a stored tensor; parameters of a head the directory
        lacks get fresh values from `seed`, LoRA `adapters` the values given. Anything else missing, unexpected
        or of another shape is refused. An adapted layer's parameters are matched under their stored names
        (`adapter.stored_name`); a module trained whole beside adapters has two copies, both read from the file."""
        adapters = adapters or {}
        stored_name = (adapter or Adapter()).stored_name
        params = {n: p for n, p in model.named_parameters() if n not in adapters}
        aliases: dict[str, list[str]] = {}
        for name in [*params, *(n for n, _ in _persistent_buffers(model))]:
            aliases.setdefault(stored_name(name), []).append(name)
        shapes = {**{n: tuple(p.shape) for n, p in params.items()},
                  **{n: tuple(b.shape) for n, b in _persistent_buffers(model)}}
        wanted = {key: shapes[names[0]] for key, names in aliases.items()}
        four_bit = self._four_bit(model, aliases)
        packed = quant.stored_four_bit(self.manifest.tensors)  # a directory saved in 4 bits: read as stored
        state = self.four_bit_state = {name for names in packed.values() for name in names}
        rename = fused.renamer(model, list(wanted))
        tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
        ignored = _ignored_unexpected(model)
        unexpected = []
        pieces: dict[str, tuple[Any, dict[str, dict[int, str]]]] = {}  # fused key -> (converter, its sources)
        for stored in self.manifest.tensors:
            key, converter, pattern = rename(stored[len("model/"):])
            expert = fused.expert_of(stored, pattern) if converter is not None else None
            if expert is not None and key in wanted:
                experts = pieces.setdefault(key, (converter, {}))[1].setdefault(pattern, {})
                if expert in experts:  # `experts.03` beside `experts.3`: transformers' own loader refuses it too
                    raise ConfigError("model.name", f"{self.storage.url}: {experts[expert][len('model/'):]!r} and "
                                                    f"{stored[len('model/'):]!r} are both expert {expert} of {key}")
                experts[expert] = stored
            elif converter is not None and key in wanted:
                raise ConfigError("model.name", f"stored tensor {stored[len('model/'):]!r} needs transformers' weight "
                                                f"conversion ({converter}) to become {key!r}; xla_shard reads "
                                                "tensors as stored, or experts stacked")
            elif stored in state:
                continue  # read with its 4-bit weight
            elif key in wanted and stored in packed:
                raise ConfigError("model.quantization", f"{self.storage.url} stores {key} in 4 bits, which this run "
                                                        "keeps whole (model.quantization.llm_int8_skip_modules?)")
            elif key in wanted:
                self.names.update((name, stored) for name in aliases[key])
            elif key in four_bit:
                self._plan_four_bit(key, stored, four_bit[key], aliases, stored in packed)
            elif key in tied or ignored(key):
                self.skipped.append(key)
            else:
                unexpected.append(key)
        self._plan_fused(pieces, wanted, aliases)
        missing = sorted({stored_name(n) for n in set(params) - set(self.names)})
        base = _base_prefix(model)
        head = [k for k in missing if base and not k.startswith(base)]
        lost = [k for k in missing if k not in head]
        other_heads = [k for k in unexpected if base and not k.startswith(base)]
        unexpected = [k for k in unexpected if k not in other_heads]
        where = self.storage.url
        if lost or unexpected:
            parts = []
            if lost:
                parts.append(f"lacks {len(lost)} tensor(s) the model has: {_some(lost)}")
            if unexpected:
                parts.append(f"holds {len(unexpected)} the model has no place for: {_some(unexpected)}")
            raise ConfigError("model.name", f"{where} does not fit {type(model).__name__}: {'; '.join(parts)}"
                                            f"{self._saved_as(model)}")
        for key, stored in self.names.items():
            if stored.startswith((fused.PREFIX, quant.PREFIX)):
                continue  # its pieces' shapes were checked by fused.plan, a 4-bit weight's by _plan_four_bit
            have = tuple(self.manifest.tensors[stored]["shape"])
            if have != shapes[key]:
                hint = " (set model.num_labels to match it)" if key in head or "classifier" in key else ""
                raise ConfigError("model.name", f"{where}: {key} is {list(have)} there, {list(shapes[key])} in the "
                                                f"model{hint}")
        self.skipped += other_heads
        self.fresh = {**_fresh_values(model, [n for n in params if stored_name(n) in head], seed), **adapters}

    def _plan_fused(self, pieces: dict[str, tuple[Any, dict[str, dict[int, str]]]], wanted: dict[str, tuple],
                    aliases: dict[str, list[str]]) -> None:
        """Fused parameters (MoE experts) matched to their stored pieces, each read as `fused.PREFIX + name`."""
        stored_shapes = {n: tuple(t["shape"]) for n, t in self.manifest.tensors.items()}
        for key, (converter, sources) in pieces.items():
            planned = fused.plan(key, wanted[key], converter, sources, stored_shapes)
            if isinstance(planned, str):
                raise ConfigError("model.name", f"{self.storage.url}: {key} {planned}")
            self.fused[fused.PREFIX + key] = planned
            self.names.update((name, fused.PREFIX + key) for name in aliases[key])

    @staticmethod
    def _four_bit(model: nn.Module, aliases: dict[str, list[str]]) -> dict[str, nn.Module]:
        """The stored weight name of each 4-bit layer (`quant.Linear4bit`), and the layer."""
        found = {}
        for key, names in aliases.items():
            if key.endswith(".weight_packed"):
                found[key.removesuffix("_packed")] = model.get_submodule(names[0].rpartition(".")[0])
        return found

    def _plan_four_bit(self, key: str, stored: str, layer: nn.Module, aliases: dict[str, list[str]],
                       packed: bool) -> None:
        """A 4-bit layer's parameters read from its stored weight `key`: quantized as they are read, or as
        stored where the directory holds it in 4 bits (`packed`: two codes a byte, [n / 2, 1])."""
        have = tuple(self.manifest.tensors[stored]["shape"])
        want = (layer.out_features * layer.in_features // 2, 1) if packed else (layer.out_features, layer.in_features)
        if have != want:
            raise ConfigError("model.name", f"{self.storage.url}: {key} is {list(have)} there, {list(want)} in the "
                                            f"model{' (4 bits, two a byte)' if packed else ''}")
        for part in quant.PARTS:
            name = f"{key.removesuffix('weight')}{part}"
            self.quantized[quant.PREFIX + name] = quant.Source(stored, part, layer.kind, layer.nested, packed)
            self.names.update((alias, quant.PREFIX + name) for alias in aliases[name])

    def _saved_as(self, model: nn.Module) -> str:
        saved = self.source.fields.get("architectures") or []
        if not saved or type(model).__name__ in saved:
            return " (another architecture or config?)"
        hint = ("; set model.task: sequence_classification" if any("SequenceClassification" in a for a in saved)
                else "; check model.task" if saved else "")
        return f" (it was saved from a {saved[0]}{hint})"

    # ---- after sharding -------------------------------------------------------------------------------
    def load(self, backend, model: nn.Module, frozen_only: bool = False) -> LoadReport:
        """Fill the wrapped model: each process reads the boxes of each tensor it holds, nothing else.
        `frozen_only`: only the parameters not trained (a resumed LoRA run: its checkpoint holds the rest)."""
        targets = [t for t in backend.state.tensors(model) if t.frozen or not frozen_only]
        used = {s for s in self.names.values() if not s.startswith((fused.PREFIX, quant.PREFIX))}
        used |= {s for f in self.fused.values() for sources in f.sources for s in sources.values()}
        used |= {source.stored for source in self.quantized.values()}
        used |= self.four_bit_state
        report = LoadReport(0, 0, sum(_stored_bytes(self.manifest.tensors[s]) for s in used), 0,
                            fresh=sorted(self.fresh), skipped=sorted(self.skipped))
        reader = self._reader()
        backend.after_step()  # XLA: allocate the sharded parameters now, so the measure below is the load's alone
        with peak_growth() as growth:
            from_files, from_seed = [], []
            for target in targets:
                name = target.name[len("model/"):]
                if name in self.fresh:
                    from_seed.append(target)
                elif name in self.names:
                    from_files.append(dataclasses.replace(target, name=self.names[name]))
                else:
                    raise ConfigError("model.name", f"{backend.name} holds a parameter {name!r} the model did not "
                                                    "have when it was matched")
            fill(reader, from_files, max_bytes=READ_BATCH_BYTES, convert=_converter(report.converted))
            for target in from_seed:
                full = self.fresh[target.name[len("model/"):]]
                whole = ((0,) * full.dim(), tuple(full.shape))
                target.fill([full[region(box, whole)].to(target.dtype) for box in target.boxes()])
            self._load_buffers(backend, model, reader, report.converted)
        report.tensors = len(from_files)
        report.bytes_held = sum(math.prod(sizes) * t.dtype.itemsize for t in from_files for _, sizes in t.boxes())
        report.bytes_read = reader.bytes_read
        report.peak_host_growth = growth.bytes
        return report

    def load_buffers(self, backend, model: nn.Module) -> None:
        """Only the stored buffers (a resumed run: checkpoints hold parameters, not buffers)."""
        self._load_buffers(backend, model, self._reader(), {})

    def _reader(self):
        reader = ChunkReader(self.storage, self.manifest, bridge_gaps=False)
        reader = fused.FusedReader(reader, self.fused) if self.fused else reader
        return quant.QuantReader(reader, self.quantized, self.manifest) if self.quantized else reader

    @torch.no_grad()
    def _load_buffers(self, backend, model: nn.Module, reader: ChunkReader, converted: dict[str, set[str]]) -> None:
        """Persistent buffers stored with the weights (replicated, small) are loaded whole; a stacked one
        (scanned layers) from each of its layers'."""
        per_layer = backend.state.layer_names(model)
        for name, buffer in model.named_buffers():
            name = backend.state.canonical(name)
            stored = [self.names.get(n) for n in per_layer.get(name, [name])]
            if None in stored:
                continue
            values = []
            for one in stored:
                shape = tuple(self.manifest.tensors[one]["shape"])
                (value,) = reader.read([(one, ((0,) * len(shape), shape))])
                values.append(_convert(value, buffer.dtype, one, converted))
            buffer.copy_((torch.stack(values) if name in per_layer else values[0]).to(buffer.device))


def build_for(cfg, accelerator: str | None = None, capabilities=None, empty: bool = False,
              adapter: Adapter | None = None):
    """The config's model and its pretrained weights (None for random init), matched to each other: on the
    meta device when weights will fill it after wrapping, or when `empty` (a trace that never reads a value:
    `xla-shard compile`). `accelerator` picks the attention kernel, the backend's `capabilities` how MoE experts
    run and whether their router loss can; `adapter` is the run's method's (`Method.adapter`; None: the
    config's). Returns (model, weights, source)."""
    deadline = cfg.checkpoint.retry_deadline_s
    source = resolve_source(cfg.model, deadline)
    quant.check_stored(source.fields, cfg.model.quantization, source.directory or source.name)
    weights = PretrainedWeights.find(source, cfg.model.init, deadline)
    empty = empty or weights is not None
    model = build_model(cfg.model, cfg.train.seed, empty=empty, source=source, accelerator=accelerator,
                        experts=experts.choose(capabilities.experts, accelerator) if capabilities else None)
    _check_router_loss(cfg, model, source, capabilities)
    adapter = adapter or adapter_for(cfg)
    settings = cfg.model.quantization
    keep = quant.kept(model, settings.llm_int8_skip_modules) if settings else []
    adapters = adapter.inject(model, cfg.model.task, cfg.train.seed)
    if adapters and not empty:
        adapter.materialize(model, adapters)
    if settings:
        quant.replace_linears(model, settings, keep, adapter.stored_name)
    if weights is not None:
        weights.match(model, cfg.train.seed, adapters, adapter)
    return model, weights, source


def check_model(cfg, model: nn.Module) -> None:
    """What the run asks of every model it loads (the policy, a reference): its positions cover train.seq_len,
    and the wrap, scan and checkpointing keys find their layers in it."""
    check_sequence_length(model.config, cfg.train.seq_len)
    wrap_targets(model, cfg.fsdp)
    if cfg.fsdp.scan_layers:
        check_scannable(model, cfg.fsdp)
    if cfg.fsdp.activation_checkpointing:
        checkpoint_targets(model, cfg.fsdp)
    if cfg.mesh.context > 1:
        check_split_sequence(model, cfg.mesh.context)


def check_split_sequence(model: nn.Module, context: int, backend: str | None = None) -> None:
    """What the sequence axis (mesh.context > 1) asks of a model, whichever backend splits it: a loss scored per
    piece of the split sequence (`lm_head`), and attention to every earlier position (no sliding windows or
    chunks, which the split sequence's mask does not express). Checked on the meta model before any process
    starts, and again where a backend splits the sequence."""
    from xla_shard import lm_head
    from xla_shard.attention import plain_causal

    unscorable = lm_head.unscorable(model)
    if unscorable is not None:
        raise ConfigError("mesh.context", f"{context}: the loss is scored per piece of the split sequence, and "
                                          f"{unscorable}", backend=backend)
    if not plain_causal(model.config):
        raise ConfigError("mesh.context", f"{context}: {type(model).__name__} attends through sliding windows or "
                                          "chunks, which the split sequence's mask does not express; set it to 1",
                          backend=backend)


def reference_model(cfg, objective, policy_config, **build) -> tuple[nn.Module, Any]:
    """The model at the objective's `reference_directory` (DPO's reference), built as the policy is (`build`:
    `build_for`'s arguments) but frozen and without the policy's adapter, and its pretrained weights. One line
    naming the objective's `reference_key` where it is no model, or reads other tokens than the policy."""
    directory, key = objective.reference_directory, objective.reference_key
    model_section = cfg.model.model_copy(update={"name": directory, "lora": None, "init": "pretrained"})
    try:
        model, weights, _ = build_for(cfg.model_copy(update={"model": model_section}), **build)
    except ConfigError as exc:
        raise ConfigError(key, f"{directory}: {exc.message}") from None
    try:
        check_model(cfg, model)
    except ConfigError as exc:  # the policy passed it: the reference's own
        raise ConfigError(key, f"{directory}, under {exc.key}: {exc.message}") from None
    if model.config.vocab_size != policy_config.vocab_size:
        raise ConfigError(key, f"{directory} has {model.config.vocab_size} token embeddings, the policy "
                               f"{policy_config.vocab_size}: the reference must read the same tokens")
    if directory != cfg.model.name:
        _same_text_for_each_id(cfg, directory, key, model.config, policy_config)
    model.requires_grad_(False)
    return model, weights


def _same_text_for_each_id(cfg, directory: str, key: str, reference_config, policy_config) -> None:
    """A reference with the policy's vocabulary size may still read its ids as other text (another tokenizer of
    that size): its log-probabilities would then score other words. Where the reference's directory holds a
    tokenizer, its vocabulary must be the policy's."""
    if not any(Storage(directory).exists(name) for name in ("tokenizer.json", "tokenizer_config.json")):
        return  # nothing to compare: the embedding's size is all the directory says
    from xla_shard.data import load_tokenizer  # (its tokenizers and datasets: only where there is one to read)

    reference = load_tokenizer(directory, reference_config, explicit=False, model_name=directory)
    policy_dir = cfg.data.tokenizer or resolve_source(cfg.model).directory
    policy = load_tokenizer(policy_dir, policy_config, explicit=cfg.data.tokenizer is not None,
                            model_name=cfg.model.name)
    theirs, ours = reference.get_vocab(), policy.get_vocab()
    if theirs == ours:
        return
    by_id_theirs, by_id_ours = ({i: t for t, i in vocab.items()} for vocab in (theirs, ours))
    differs = next(i for i in sorted(set(by_id_theirs) | set(by_id_ours)) if by_id_theirs.get(i) != by_id_ours.get(i))
    raise ConfigError(key, f"{directory}'s tokenizer reads token ids as other text than the policy's ({policy_dir}): "
                           f"id {differs} is {by_id_theirs.get(differs)!r} there and {by_id_ours.get(differs)!r} "
                           "here; the reference must read the same tokens")


def _check_router_loss(cfg, model: nn.Module, source: ModelSource, capabilities) -> None:
    """An MoE router's load-balancing loss, which transformers adds to the loss: where the backend cannot add it,
    or where each device would sum it over its piece of a sequence (the sequence axis), not over the row."""
    if not getattr(model.config, "output_router_logits", False):
        return
    if capabilities and capabilities.router_aux_loss:
        capabilities.refuse("model.overrides.output_router_logits", f"is true for {source.name}, and "
                                                                    f"{capabilities.router_aux_loss}: set it to false, "
                                                                    "or train on backend torch_fsdp, which adds it")
    if cfg.mesh.context > 1:
        raise ConfigError("mesh.context", f"{cfg.mesh.context}: {source.name}'s router loss would be each device's "
                                          "over its piece of a sequence, not the row's; set it to 1 or "
                                          "model.overrides.output_router_logits to false")


def load_model(cfg, backend) -> nn.Module:
    """For your own loop: the config's model wrapped by `backend` (after `backend.setup()`), holding its
    pretrained weights (read shard by shard) if `model.name` is a directory with weights, else random init."""
    adapter = backend.method.adapter
    model, weights, _ = build_for(cfg, backend.accelerator, backend.capabilities, adapter=adapter)
    wrapped = backend.wrap(model)
    if weights is not None:
        weights.load(backend, wrapped)
    adapter.derive(wrapped)
    return wrapped


def _ignored_unexpected(model: nn.Module) -> Callable[[str], bool]:
    """Stored keys transformers itself ignores for this class (old rotary tables, position ids, ...)."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    patterns |= {r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"}
    regex = re.compile("|".join(f"({p})" for p in patterns))
    return lambda key: regex.search(key) is not None


def _base_prefix(model: nn.Module) -> str | None:
    """'bert.' for BertForSequenceClassification: parameters outside it belong to the task head."""
    prefix = getattr(model, "base_model_prefix", "")
    return f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else None


def _persistent_buffers(model: nn.Module):
    state = set(model.state_dict())
    return [(n, b) for n, b in model.named_buffers() if n in state]


def _fresh_values(model: nn.Module, keys: list[str], seed: int) -> dict[str, torch.Tensor]:
    """A new task head (a classifier on a base model's weights), initialised as transformers initialises it,
    from `seed`: the same values on every process and backend, computed once on the host."""
    if not keys:
        return {}
    generator_state = torch.get_rng_state()
    torch.manual_seed(seed)
    values = {}
    try:
        for owner in sorted({k.rsplit(".", 1)[0] for k in keys}):
            clone = copy.deepcopy(model.get_submodule(owner)).to_empty(device="cpu")
            with torch.no_grad():
                model._init_weights(clone)
            for name, param in clone.named_parameters(recurse=False):
                if f"{owner}.{name}" in keys:
                    values[f"{owner}.{name}"] = param.detach()
    finally:
        torch.set_rng_state(generator_state)
    return values


def _converter(converted: dict[str, set[str]]):
    def convert(target: StateTensor, value: torch.Tensor) -> torch.Tensor:
        return _convert(value, target.dtype, target.name, converted)
    return convert


def _convert(value: torch.Tensor, dtype: torch.dtype, stored: str, converted: dict[str, set[str]]):
    """Stored dtype -> the model's (a bf16 file into fp32 master weights): done, and counted for the log."""
    if value.dtype == dtype:
        return value
    kind = f"{layout.DTYPES.get(value.dtype, value.dtype)}->{layout.DTYPES.get(dtype, dtype)}"
    converted.setdefault(kind, set()).add(stored)
    return value.to(dtype)


def _stored_bytes(meta: dict) -> int:
    chunk = meta["chunks"][0]
    return chunk["end"] - chunk["start"]


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:_SHOWN]) + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")
