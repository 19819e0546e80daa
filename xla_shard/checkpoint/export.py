"""`xla-shard ckpt export`: a sharded checkpoint -> a Hugging Face model directory, one tensor at a time.

Consolidating by loading every shard into one process is what runs rank 0 out of host RAM elsewhere. Here
the safetensors headers are computed from the manifest alone (names, shapes, dtypes are known up front), so
each output file is written as a stream: read one tensor's chunks, write its bytes, drop it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from xla_shard.checkpoint import hf_dir, layout, meta_model, per_expert, schema
from xla_shard.checkpoint.inspect import open_checkpoint
from xla_shard.checkpoint.manifest import CheckpointError
from xla_shard.checkpoint.reader import ChunkReader
from xla_shard.config.presets import PRESETS
from xla_shard.methods import peft_export
from xla_shard.errors import ConfigError, UserError, file_in_the_way, one_line
from xla_shard.hostmem import mib, peak_growth
from xla_shard.io.model_dir import copy_companions, model_directory
from xla_shard.io.overlap import Protected, refuse_overlap
from xla_shard.io.storage import Storage
from xla_shard.io.untrusted_json import SchemaError, parse_json

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass
class ExportReport:
    step: int
    files: list[str]
    tensors: int
    bytes: int
    largest_tensor_bytes: int
    peak_rss_growth_bytes: int  # while writing, the code it needs already loaded: what streaming costs
    companions: list[str] = field(default_factory=list)  # tokenizer/generation files copied from the source
    note: str | None = None
    code_rss_bytes: int = 0  # loading that code first (peft, for an adapter's config): paid once per process
    code: str = ""

    def describe(self, to: str) -> str:
        memory = (f"host memory +{mib(self.peak_rss_growth_bytes)} while writing (largest tensor "
                  f"{mib(self.largest_tensor_bytes)})")
        if self.code_rss_bytes >= 2**20:
            memory += f", +{mib(self.code_rss_bytes)} before it to load {self.code}"
        return (f"exported step {self.step}: {self.tensors} tensors, {mib(self.bytes)} in {len(self.files)} file(s) "
                f"to {to}; {memory}"
                + (f"; copied {', '.join(self.companions)} from the model directory" if self.companions else ""))


def parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    number = text.strip().upper().rstrip()
    suffix = number.lstrip("0123456789.")
    try:
        return int(float(number[: len(number) - len(suffix)]) * units[suffix.strip()])
    except (KeyError, ValueError):
        raise CheckpointError(f"--max-shard-size {text!r}: expected a size such as 2GB or 500MiB") from None


def export(url: str, to: str, max_shard_bytes: int = 2 * 10**9, overwrite: bool = False,
           merge: bool = False, fused_experts: bool = False) -> ExportReport:
    """Write the checkpoint at `url` as a Hugging Face model directory at `to` (a path or any fsspec URL). The
    result appears whole or not at all: see `Destination`. A LoRA run's checkpoint is written as a peft adapter
    directory, or with `merge` as the whole model with the adapters merged into the weights of its model
    directory. MoE experts are written one tensor per expert, as save_pretrained does, unless `fused_experts`."""
    refuse_overlap("--to", to, [Protected("the checkpoint being read", url, inside_too=True)])
    destination = Destination(to, overwrite)  # refused before the checkpoint is even opened
    storage, manifest = open_checkpoint(url)
    refuse_overlap("--to", to, _read_by(manifest))
    hf = manifest.data.get("hf_config")
    if not isinstance(hf, dict) or not hf:
        raise CheckpointError(f"{manifest.url}: the manifest has no hf_config; it cannot be exported")
    names = sorted(n for n in manifest.tensors if n.startswith("model/"))
    if not names:
        raise CheckpointError(f"{manifest.url} holds no model tensors (model/...): nothing to export")
    sizes = {n: schema.nbytes(manifest.tensors[n]["shape"], manifest.tensors[n]["dtype"]) for n in names}
    run_model = (manifest.data.get("config") or {}).get("model")
    reader, source, transform, layout_note = ChunkReader(storage, manifest), manifest, None, None
    # What the export asks transformers or peft is asked before the writing starts, so that the memory the
    # writing takes is measured alone: their code costs some 200-340 MiB of host memory once per process.
    with peak_growth() as loading:
        adapter = peft_export.recorded_adapter(manifest, names)  # checked against peft's layout on the model
        if merge and adapter is None:
            raise CheckpointError(f"{manifest.url} is not a LoRA run's checkpoint: --merge has no adapters to "
                                  "merge (export it without --merge)")
        if adapter is not None and not merge:  # the checkpoint holds the adapters: a peft directory
            code = "peft (its adapters on the model, checked; adapter_config.json is its LoraConfig)"
            config = peft_export.CONFIG, peft_export.config_json(adapter.section, run_model, names,
                                                                   _base_name(run_model))
            pieces = per_expert.whole(names, _shapes(manifest, names), peft_export.key)
            single, max_shard_bytes = peft_export.WEIGHTS, math.inf
        elif merge:  # the model directory's weights, the adapters merged into them as they are written
            code = "peft and transformers (where the adapters sit, how the base stores them)"
            merged = peft_export.Merge(_base_directory(manifest, run_model), reader, manifest, names, adapter)
            reader, source, names, sizes, transform = (merged.reader, merged.manifest, merged.names, merged.sizes,
                                                       merged.transform)
            meta_model.check_whole(manifest.url, hf, names)
            pieces = per_expert.whole(names, _shapes(source, names), lambda name: name[len("model/"):])
            if adapter.four_bit:
                layout_note = (f"the {len(adapter.four_bit)} weights the run held in 4 bits (model.quantization) "
                               "are written as it held them, dequantized, with the adapters added: in full precision")
            config, single = ("config.json", json.dumps(hf, indent=2).encode()), WEIGHTS
        else:
            code = "transformers (how save_pretrained names the tensors)"
            meta_model.check_whole(manifest.url, hf, names)
            pieces, layout_note = _layout(manifest, names, hf, fused_experts)
            config, single = ("config.json", json.dumps(hf, indent=2).encode()), WEIGHTS
    with peak_growth() as growth, destination as out, _source_kept(storage, manifest, to):
        files = _write_weights(reader, source, pieces, out, max_shard_bytes, single, transform)
        copied, note = _copy_companions(manifest, out)
        out.write(*config)  # last: what loaders look for first
    note = "; ".join(n for n in (layout_note, note) if n) or None
    return ExportReport(manifest.step, files, len(pieces), sum(sizes.values()), max(sizes.values()),
                        growth.bytes, copied, note, loading.bytes, code)


def _shapes(manifest, names: list[str]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(manifest.tensors[n]["shape"]) for n in names}


def _read_by(manifest) -> list[Protected]:
    """What exporting this checkpoint reads or belongs to: the checkpoint, its directory, and (as the run
    recorded them; relative paths are taken from here) the run's checkpoint.dir, output_dir and model directory."""
    config = manifest.data.get("config") or {}

    def recorded(section: str | None, key: str) -> str | None:
        values = config.get(section) if section else config
        value = values.get(key) if isinstance(values, dict) else None
        return value if isinstance(value, str) and value else None

    model = recorded("model", "name")
    named = "/" in manifest.url and layout.parse_step_dir(manifest.url) is not None
    parent = manifest.url.rsplit("/", 1)[0] if named else None  # a step-* directory lies in its checkpoint.dir
    return [Protected("the checkpoint being read", manifest.url, inside_too=True),
            Protected("its checkpoint directory", parent, inside_too=True),
            Protected("the run's checkpoint.dir", recorded("checkpoint", "dir"), inside_too=True),
            Protected("the run's output_dir", recorded(None, "output_dir")),
            Protected("the model directory the run read", model and model_directory(model, PRESETS),
                      inside_too=True)]


@contextlib.contextmanager
def _source_kept(storage: Storage, manifest, to: str):
    """An export whose checkpoint is deleted under it (a running job's retention) says so, not which shard it
    then missed."""
    try:
        yield
    except UserError:  # a CheckpointError, or the StorageError of a write whose source went missing
        if storage.exists(layout.MANIFEST):
            raise
        raise CheckpointError(f"{manifest.url} was deleted while it was being exported (a run still training there "
                              "removes older checkpoints: checkpoint.keep_last / keep_every); nothing was written to "
                              f"{to}: export a newer checkpoint") from None


class Destination:
    """Where an export goes, written so that a reader never finds a stale or partial model there.

    A local directory is written as a temporary sibling and renamed into place whole (an earlier export it
    replaces is moved aside first and deleted after). An object store has no directory rename: its files are
    written in place with `config.json` last, the file `from_pretrained` needs first, so a prefix without it is
    no model. A destination that already holds files is refused unless `overwrite`, which replaces it entirely.
    A failed export removes what it wrote."""

    def __init__(self, to: str, overwrite: bool):
        self.to, self.overwrite = to.rstrip("/") or to, overwrite
        self.final = final = Storage(self.to)
        self.staging: Path | None = None
        if final.local:
            blocker = file_in_the_way(Path(final.root))
            if blocker:
                raise CheckpointError(f"--to {self.to}: {blocker} is a file, not a directory")
            held = sorted(os.listdir(final.root)) if os.path.isdir(final.root) else []  # dotfiles too
        else:
            if final.fs.isfile(final.root):
                raise CheckpointError(f"--to {self.to} is a file, not a directory")
            held = final.glob("*") if final.exists("") else []
        if held and not self.overwrite:
            raise CheckpointError(f"--to {self.to} already holds {len(held)} file(s) ({held[0]}, ...); choose an empty "
                                  "directory or pass --overwrite to replace it entirely")
        self.held = bool(held)

    def __enter__(self) -> Storage:
        final = self.final
        if final.local:
            root = Path(final.root)
            self.staging = root.with_name(f".{root.name}.partial-{os.getpid()}")
            try:
                self.staging.mkdir(parents=True)
            except OSError as exc:
                raise CheckpointError(f"--to {self.to}: cannot write next to it ({one_line(exc)})") from None
            return Storage(str(self.staging))
        if self.held:
            final.remove_tree("")
        return final

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None:
            self._discard()
            if isinstance(exc, OSError):  # a full or read-only disk, met outside Storage's retries
                raise CheckpointError(f"export to {self.to} failed, nothing was left there: {one_line(exc)}") from None
            return
        if self.final.local:
            root = Path(self.final.root)
            aside = root.with_name(f".{root.name}.replaced-{os.getpid()}")
            if root.exists():
                root.rename(aside)
            self.staging.rename(root)
            if aside.exists():
                shutil.rmtree(aside)

    def _discard(self) -> None:
        with contextlib.suppress(Exception):
            if self.final.local:
                shutil.rmtree(self.staging)
            else:
                self.final.remove_tree("")


def _write_weights(reader: ChunkReader, manifest, pieces: list[per_expert.Piece], out: Storage,
                   max_shard_bytes: float, single: str = WEIGHTS, transform=None) -> list[str]:
    """The `pieces` as safetensors files of at most `max_shard_bytes` each, in their order (a fused tensor's
    pieces together, so it is read once), each checkpoint tensor passed through `transform(name, tensor)` (same
    shape and dtype; None: as stored) as it is read."""
    dtype = {piece.key: manifest.tensors[piece.source]["dtype"] for piece in pieces}
    size = {piece.key: schema.nbytes(piece.shape, dtype[piece.key]) for piece in pieces}
    groups: list[list[per_expert.Piece]] = [[]]
    for piece in pieces:  # split by size, tensors kept whole
        if groups[-1] and sum(size[p.key] for p in groups[-1]) + size[piece.key] > max_shard_bytes:
            groups.append([])
        groups[-1].append(piece)
    files = [single] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    checked_magnitude = peft_export.checked_magnitude
    weight_map = {}
    for file, group in zip(files, groups):
        header, offset = {}, 0
        for piece in group:
            header[piece.key] = {"dtype": dtype[piece.key], "shape": list(piece.shape),
                                 "data_offsets": [offset, offset + size[piece.key]]}
            offset += size[piece.key]
            weight_map[piece.key] = file

        def parts(group=group, header=header):  # one checkpoint tensor in memory at a time
            yield layout.safetensors_prefix({**header, "__metadata__": {"format": "pt"}})
            held = None, None
            for piece in group:
                if held[0] != piece.source:
                    held = None, None  # let the last one go before reading the next
                    shape = tuple(manifest.tensors[piece.source]["shape"])
                    (tensor,) = reader.read([(piece.source, ((0,) * len(shape), shape))])
                    tensor = checked_magnitude(piece.source, tensor, manifest.url)
                    held = piece.source, transform(piece.source, tensor) if transform else tensor
                yield layout.tensor_bytes(piece.cut(held[1]))

        out.write(file, parts)
    if len(files) > 1:
        out.write(INDEX, json.dumps({"metadata": {"total_size": sum(size.values())},
                                     "weight_map": dict(sorted(weight_map.items()))}, indent=2).encode())
    return files


def _layout(manifest, names: list[str], hf: dict, fused_experts: bool) -> tuple[list[per_expert.Piece], str | None]:
    """The exported tensors under the names save_pretrained writes (MoE experts one tensor per expert, unless
    `fused_experts`; names a model renames on load, such as GPT-NeoX's, as stored), else as held. Returns
    (pieces, a note where the layout is not save_pretrained's unasked)."""
    shapes = _shapes(manifest, names)
    held = per_expert.whole(names, shapes, key=lambda name: name[len("model/"):])
    if fused_experts:
        return held, None
    try:
        split = per_expert.pieces(meta_model.build(manifest.url, hf, names), names, shapes)
    except CheckpointError as exc:  # not split, or a config transformers does not build (a manifest is untrusted)
        return held, f"tensors written as the model holds them, not as save_pretrained would: {exc}"
    if split is None:
        return held, None
    return sorted(split, key=lambda piece: (piece.source, piece.key)), None


def _copy_companions(manifest, out: Storage) -> tuple[list[str], str | None]:
    """The tokenizer and generation config of the model directory the run started from, when it had them:
    what `from_pretrained` users load next to the weights. Returns (files copied, why none could be).

    The manifest names that directory, and a manifest is untrusted: its files are copied only if the
    directory's config.json describes the model the checkpoint holds (never from an arbitrary directory)."""
    model = (manifest.data.get("config") or {}).get("model")
    name = model.get("name") if isinstance(model, dict) else None
    source = model_directory(name, PRESETS) if isinstance(name, str) else None
    if source is None:
        return [], None  # nothing beside it
    try:
        differs = _differs(Storage(source), manifest.data["hf_config"])
        if differs:
            return [], f"{source} is not the model this checkpoint holds ({differs}): no tokenizer copied"
        present = copy_companions(source, out)
    except (UserError, OSError) as exc:
        return [], f"the model directory {source} could not be copied from here ({one_line(exc)}): no tokenizer copied"
    return present, None


def _base_name(run_model: dict) -> str:
    """The base model as an exported adapter names it (peft's base_model_name_or_path): a model directory as an
    absolute path or URL, which resolves from anywhere; else the name as the run gave it."""
    name = str(run_model.get("name") or "")
    directory = model_directory(name, PRESETS) if name else None
    if directory and "://" not in directory:
        return os.path.abspath(directory)
    return directory or name


def _base_directory(manifest, run_model) -> Storage:
    """The model directory a LoRA run adapted, checked to be the model its checkpoint describes (a manifest is
    untrusted: it must not make an export read weights from anywhere else)."""
    name = run_model.get("name") if isinstance(run_model, dict) else None
    source = model_directory(name, PRESETS) if isinstance(name, str) else None
    if source is None:
        raise CheckpointError(f"{manifest.url}: the run's model.name ({name!r}) is not a model directory, so there "
                              "are no base weights to merge the adapters into; export the adapter without --merge")
    storage = Storage(source)
    differs = _differs(storage, manifest.data["hf_config"])
    recorded = manifest.data.get("base")
    if not differs and recorded is not None:
        differs = hf_dir.identity_mismatch(recorded["files"], storage)
    if differs:
        raise CheckpointError(f"{source} is not the model this checkpoint adapted ({differs}): nothing merged")
    return storage


def _differs(source: Storage, hf_config: dict) -> str | None:
    """Which architecture field a model directory's config.json has otherwise than the checkpoint's, if any."""
    try:
        fields = parse_json(source.read_bytes("config.json"))
    except (FileNotFoundError, SchemaError):
        return "it has no readable config.json"
    if not isinstance(fields, dict):
        return "its config.json is not an object"
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
        if key in hf_config and fields.get(key) != hf_config[key]:
            return f"{key} {fields.get(key)!r}, the checkpoint's {hf_config[key]!r}"
    return None


def final_export_dir(cfg) -> str:
    return f"{cfg.output_dir.rstrip('/')}/model"


def check_final_export(cfg, model_directory: str | None) -> None:
    """FULL_STATE_DICT exports the last checkpoint to output_dir/model, replacing what is there: never the
    checkpoints it reads or the model directory the run started from."""
    if not cfg.checkpoint.dir:
        raise ConfigError("fsdp.state_dict_type", "FULL_STATE_DICT also exports the final checkpoint as one Hugging "
                                                  "Face model directory (output_dir/model); set checkpoint.dir")
    try:
        refuse_overlap("output_dir/model", final_export_dir(cfg),
                       [Protected("checkpoint.dir", cfg.checkpoint.dir, inside_too=True),
                        Protected("the model directory (model.name)", model_directory, inside_too=True)])
    except UserError as exc:
        raise ConfigError("output_dir", f"fsdp.state_dict_type=FULL_STATE_DICT exports to {exc}") from None
