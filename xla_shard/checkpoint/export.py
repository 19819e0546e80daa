"""`xla-shard ckpt export`: a sharded checkpoint -> a Hugging Face model directory, one tensor at a time.

Consolidating by loading every shard into one process is what runs rank 0 out of host RAM elsewhere. Here
the safetensors headers are computed from the manifest alone (names, shapes, dtypes are known up front), so
each output file is written as a stream: read one tensor's chunks, write its bytes, drop it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from xla_shard.checkpoint import layout
from xla_shard.checkpoint.inspect import open_checkpoint
from xla_shard.checkpoint.manifest import CheckpointError
from xla_shard.checkpoint.storage import StorageError
from xla_shard.errors import file_in_the_way, one_line
from xla_shard.hostmem import peak_growth
from xla_shard.checkpoint.reader import ChunkReader

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass
class ExportReport:
    step: int
    files: list[str]
    tensors: int
    bytes: int
    largest_tensor_bytes: int
    peak_rss_growth_bytes: int
    companions: list[str] = field(default_factory=list)  # tokenizer/generation files copied from the source
    note: str | None = None


def parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    number = text.strip().upper().rstrip()
    suffix = number.lstrip("0123456789.")
    try:
        return int(float(number[: len(number) - len(suffix)]) * units[suffix.strip()])
    except (KeyError, ValueError):
        raise CheckpointError(f"--max-shard-size {text!r}: expected a size such as 2GB or 500MiB") from None


def export(url: str, out_dir: str, max_shard_bytes: int = 2 * 10**9) -> ExportReport:
    out = Path(out_dir)
    blocker = file_in_the_way(out)
    if blocker:
        raise CheckpointError(f"--to {out_dir}: {blocker} is a file, not a directory")
    with peak_growth() as growth:
        storage, manifest = open_checkpoint(url)
        hf = manifest.data.get("hf_config")
        if not hf:
            raise CheckpointError(f"{manifest.url}: the manifest has no hf_config; it cannot be exported")
        names = sorted(n for n in manifest.tensors if n.startswith("model/"))
        sizes = {n: math.prod(manifest.tensors[n]["shape"])
                 * layout.TORCH_DTYPES[manifest.tensors[n]["dtype"]].itemsize for n in names}
        out.mkdir(parents=True, exist_ok=True)
        files = _write_weights(ChunkReader(storage, manifest), manifest, names, sizes, out, max_shard_bytes)
        (out / "config.json").write_text(json.dumps(hf, indent=2))
        copied, note = _copy_companions(manifest, out)
    return ExportReport(manifest.step, files, len(names), sum(sizes.values()), max(sizes.values()),
                        growth.bytes, copied, note)


def _write_weights(reader: ChunkReader, manifest, names: list[str], sizes: dict[str, int], out: Path,
                   max_shard_bytes: int) -> list[str]:
    groups: list[list[str]] = [[]]
    for name in names:  # split by size, tensors kept whole, in name order
        if groups[-1] and sum(sizes[n] for n in groups[-1]) + sizes[name] > max_shard_bytes:
            groups.append([])
        groups[-1].append(name)
    files = [WEIGHTS] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for file, group in zip(files, groups):
        header, offset = {}, 0
        for name in group:
            meta = manifest.tensors[name]
            header[name[len("model/"):]] = {"dtype": meta["dtype"], "shape": meta["shape"],
                                            "data_offsets": [offset, offset + sizes[name]]}
            offset += sizes[name]
            weight_map[name[len("model/"):]] = file
        header["__metadata__"] = {"format": "pt"}
        tmp = out / f".{file}.partial"
        with open(tmp, "wb") as stream:
            stream.write(layout.safetensors_prefix(header))
            for name in group:
                shape = tuple(manifest.tensors[name]["shape"])
                (tensor,) = reader.read([(name, ((0,) * len(shape), shape))])
                stream.write(layout.tensor_bytes(tensor))
                del tensor
        os.replace(tmp, out / file)
    if len(files) > 1:
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": sum(sizes.values())},
                                             "weight_map": weight_map}, indent=2))
    return files


def _copy_companions(manifest, out: Path) -> tuple[list[str], str | None]:
    """The tokenizer and generation config of the model directory the run started from, when it had them:
    what `from_pretrained` users load next to the weights. Returns (files copied, why none could be)."""
    from xla_shard.config.presets import PRESETS
    from xla_shard.models import copy_companions

    source = ((manifest.data.get("config") or {}).get("model") or {}).get("name")
    if not isinstance(source, str) or source in PRESETS or source.endswith(".json"):
        return [], None  # nothing beside it
    try:
        present = copy_companions(source, out)
    except (StorageError, OSError) as exc:
        return [], f"the model directory {source} is not readable from here ({one_line(exc)}): no tokenizer copied"
    return present, None
