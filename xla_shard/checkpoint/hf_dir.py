"""A Hugging Face model directory read as a read-only checkpoint.

`save_pretrained` writes `model.safetensors` (or several files and `model.safetensors.index.json`). A safetensors
header gives each tensor's dtype, shape and byte range, so the directory maps onto a `Manifest` whose chunks are
whole tensors with no crc32; `ChunkReader` then reads any box of any tensor with ranged reads, the rows a box
touches and nothing else. Only the headers are read up front (two small requests per file).
"""

from __future__ import annotations

import json
import math
import struct

from xla_shard.checkpoint import layout
from xla_shard.checkpoint.manifest import CheckpointError, Manifest
from xla_shard.checkpoint.storage import Storage

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100 << 20  # the safetensors library's own limit


class NoWeights(CheckpointError):
    """The directory holds no safetensors weights (a config only, or weights in a format not read here)."""


def weight_files(storage: Storage) -> list[str]:
    """The safetensors files holding the model's weights, as the directory's index (or lack of one) says."""
    if storage.exists(INDEX):
        try:
            index = json.loads(storage.read_bytes(INDEX))
            files = sorted(set(index["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{storage.url_of(INDEX)} is not a safetensors index (no weight_map of tensor "
                                  "names to files)") from None
        if not files or not all(isinstance(f, str) and f and "/" not in f and f != ".." for f in files):
            raise CheckpointError(f"{storage.url_of(INDEX)}: its weight_map names no usable file")
        return files
    if storage.exists(SINGLE):
        return [SINGLE]
    others = [p for p in storage.glob("*") if p.endswith((".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack"))]
    if others:
        raise NoWeights(f"{storage.url}: weights only as {others[0]} (pickle/other formats); xla_shard reads "
                        "safetensors shard by shard: re-save it with save_pretrained(..., safe_serialization=True)")
    raise NoWeights(f"{storage.url} holds no {SINGLE} or {INDEX}")


def read_manifest(storage: Storage) -> Manifest:
    """Tensors as `model/<key>`: one unverified chunk each, its byte range from its file's header."""
    tensors: dict[str, dict] = {}
    for file in weight_files(storage):
        try:
            (prefix,) = storage.read_ranges([file], [0], [8])
        except FileNotFoundError:
            raise CheckpointError(f"{storage.url_of(file)}: named by {INDEX} but missing") from None
        where = storage.url_of(file)
        if len(prefix) < 8:
            raise CheckpointError(f"{where} is not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER:
            raise CheckpointError(f"{where} is not a safetensors file (a header of {length} bytes)")
        (raw,) = storage.read_ranges([file], [8], [8 + length])
        try:
            header = json.loads(raw)
        except ValueError:
            raise CheckpointError(f"{where}: its safetensors header is not JSON; the file is damaged") from None
        data_start = 8 + length
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            tensors[f"model/{key}"] = _entry(where, file, key, meta, data_start, tensors)
    return Manifest(storage.url, {"step": 0, "tensors": tensors})


def _entry(where: str, file: str, key: str, meta, data_start: int, seen: dict) -> dict:
    if f"model/{key}" in seen:
        raise CheckpointError(f"{where}: tensor {key!r} is also in {seen[f'model/{key}']['chunks'][0]['file']}")
    try:
        dtype, shape, (begin, end) = meta["dtype"], [int(n) for n in meta["shape"]], meta["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{where}: the header entry of {key!r} is malformed") from None
    if dtype not in layout.TORCH_DTYPES:
        raise CheckpointError(f"{where}: tensor {key!r} is {dtype}, which xla_shard does not load "
                              f"({', '.join(layout.TORCH_DTYPES)})")
    if end - begin != math.prod(shape) * layout.TORCH_DTYPES[dtype].itemsize:
        raise CheckpointError(f"{where}: the byte range of {key!r} does not match its {dtype} shape {shape}")
    chunk = {"file": file, "start": data_start + begin, "end": data_start + end, "offsets": [0] * len(shape),
             "sizes": shape, "dtype": dtype, "crc32": None}
    return {"shape": shape, "dtype": dtype, "chunks": [chunk]}
