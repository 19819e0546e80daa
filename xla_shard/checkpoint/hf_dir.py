"""A Hugging Face model directory read as a read-only checkpoint.

`save_pretrained` writes `model.safetensors` (or several files and `model.safetensors.index.json`). A safetensors
header gives each tensor's dtype, shape and byte range, so the directory maps onto a `Manifest` whose chunks are
whole tensors with no crc32; `ChunkReader` then reads any box of any tensor with ranged reads, the rows a box
touches and nothing else. Only the sizes and headers are read up front (three small requests per file), and
each header is checked against the schema every checkpoint passes (`checkpoint.schema`).
"""

from __future__ import annotations

import hashlib
import struct

from xla_shard.checkpoint import layout, schema
from xla_shard.checkpoint.manifest import CheckpointError, Manifest
from xla_shard.io.storage import Storage

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100 << 20  # the safetensors library's own limit


class NoWeights(CheckpointError):
    """The directory holds no safetensors weights (a config only, or weights in a format not read here)."""


def weight_files(storage: Storage) -> list[str]:
    """The safetensors files holding the model's weights, as the directory's index (or lack of one) says."""
    if storage.exists(INDEX):
        where = storage.url_of(INDEX)
        try:
            if storage.size(INDEX) > _MAX_HEADER:
                raise schema.SchemaError("", f"larger than {_MAX_HEADER} bytes")
            index = schema.parse_json(storage.read_bytes(INDEX))
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise schema.SchemaError("weight_map", "expected an object of tensor names to files")
            files = sorted({schema.relative_name(f, f"weight_map[{k!r}]") for k, f in weight_map.items()})
        except schema.SchemaError as exc:
            raise CheckpointError(f"{where} is not a usable safetensors index: {exc}") from None
        return files
    if storage.exists(SINGLE):
        return [SINGLE]
    others = [p for p in storage.glob("*") if p.endswith((".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack"))]
    if others:
        raise NoWeights(f"{storage.url}: weights only as {others[0]} (pickle/other formats); xla_shard reads "
                        "safetensors shard by shard: re-save it with save_pretrained(..., safe_serialization=True)")
    raise NoWeights(f"{storage.url} holds no {SINGLE} or {INDEX}")


def read_manifest(storage: Storage) -> Manifest:
    """Tensors as `model/<key>`: one unverified chunk each, its byte range from its file's header. Each header
    is checked by the schema against the file's real size before anything is allocated for it."""
    tensors: dict[str, dict] = {}
    sizes: dict[str, int] = {}
    for file in weight_files(storage):
        where = storage.url_of(file)
        link = storage.outside(file)
        if link is not None:
            raise CheckpointError(f"{where} is a link to {link}, outside {storage.url}; refusing to read it")
        try:
            size = storage.size(file)
            (prefix,) = storage.read_ranges([file], [0], [8])
        except FileNotFoundError:
            raise CheckpointError(f"{where}: named by {INDEX} but missing") from None
        if len(prefix) < 8:
            raise CheckpointError(f"{where} is not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{where} is not a safetensors file (a header of {length} bytes in a file of "
                                  f"{size})")
        (raw,) = storage.read_ranges([file], [8], [8 + length])
        try:
            entries = schema.safetensors_tensors(raw, size - 8 - length)
        except schema.SchemaError as exc:
            raise CheckpointError(f"{where}: its safetensors header is damaged: {exc}") from None
        for key, meta in entries.items():
            tensors[f"model/{key}"] = _entry(where, file, key, meta, 8 + length, tensors)
        sizes[file] = size
    return Manifest(storage.url, {"step": 0, "tensors": tensors}, file_bytes=sizes)


def _entry(where: str, file: str, key: str, meta: dict, data_start: int, seen: dict) -> dict:
    if f"model/{key}" in seen:
        raise CheckpointError(f"{where}: tensor {key!r} is also in {seen[f'model/{key}']['chunks'][0]['file']}")
    dtype, shape = meta["dtype"], meta["shape"]
    if dtype not in layout.TORCH_DTYPES:
        raise CheckpointError(f"{where}: tensor {key!r} is {dtype}, which xla_shard does not load "
                              f"({', '.join(layout.TORCH_DTYPES)})")
    chunk = {"file": file, "start": data_start + meta["begin"], "end": data_start + meta["end"],
             "offsets": [0] * len(shape), "sizes": shape, "dtype": dtype, "crc32": None}
    return {"shape": shape, "dtype": dtype, "chunks": [chunk]}


IDENTITY_WINDOW = 16 << 10  # bytes hashed at each of a tensor's start, middle and end


def identity(storage: Storage, manifest: Manifest | None = None) -> dict[str, str]:
    """Which bytes a model directory's weights are, file by file (file -> sha256 hex), cheaply enough to take at
    every load of a 70B base: each tensor's name, dtype and shape, and its bytes whole below three windows,
    else its first, middle and last IDENTITY_WINDOW bytes (about 35 MB read for a 70B Llama). Another model of
    the same shapes differs in every window; a file edited only between windows is not told apart."""
    manifest = manifest or read_manifest(storage)
    spans: dict[str, list[tuple[str, int, int]]] = {}
    for name, meta in sorted(manifest.tensors.items()):
        chunk = meta["chunks"][0]
        start, end, window = chunk["start"], chunk["end"], IDENTITY_WINDOW
        middle = start + (end - start) // 2
        picks = [(start, end)] if end - start <= 3 * window else [
            (start, start + window), (middle, middle + window), (end - window, end)]
        spans.setdefault(chunk["file"], []).extend(
            (f"{name}|{meta['dtype']}|{meta['shape']}|{a}", a, b) for a, b in picks)
    found = {}
    for file, picks in sorted(spans.items()):
        digest = hashlib.sha256(f"{manifest.file_bytes.get(file)}".encode())
        data = storage.read_ranges([file] * len(picks), [a for _, a, _ in picks], [b for _, _, b in picks])
        for (label, _, _), part in zip(picks, data):
            digest.update(label.encode())
            digest.update(part)
        found[file] = digest.hexdigest()
    return found


def identity_mismatch(recorded: dict, storage: Storage, manifest: Manifest | None = None) -> str | None:
    """Which file of the directory at `storage` is not the one `recorded` (an `identity`) describes, if any."""
    current = identity(storage, manifest)
    for file in sorted(set(recorded) | set(current)):
        if file not in current:
            return f"{storage.url_of(file)} is gone (the base had it)"
        if file not in recorded:
            return f"{storage.url_of(file)} was not part of the base"
        if current[file] != recorded[file]:
            return f"{storage.url_of(file)} holds other bytes than when the run first read it"
    return None
