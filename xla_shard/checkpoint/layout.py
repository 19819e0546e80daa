"""The on-storage format: where files go, how shards are encoded, how boxes of a tensor are addressed.

    <dir>/step-00000020/
        shards/00001-of-00004.safetensors   one per writer (rank; under SPMD, host): only its own chunks
        shards/00001-of-00004.json          that writer's index (chunks, byte ranges, crc32s, RNG), last
        manifest.json                       merged index + step, world, mesh, config, versions: the commit

Every tensor is stored as chunks: boxes (offsets, sizes) of its global shape, the model DCP uses too. Boxes
describe FSDP2 row shards, SPMD shards along any dimension and, cut into a few boxes each, FSDPv1's flat
parameter shards, so any backend at any world size reads any checkpoint by intersecting boxes. Shard files
are plain safetensors files (readable by the `safetensors` library), written here so the byte range of each
chunk is known before upload and can be fetched alone.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field

import torch

from xla_shard.checkpoint.contract import Box, intersect, range_to_boxes, region  # noqa: F401 (the format's boxes)

FORMAT = "xla_shard.checkpoint/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")

DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}

def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    match = _STEP_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def shard_file(rank: int, world: int) -> str:
    return f"shards/{rank:05d}-of-{world:05d}.safetensors"


def index_file(rank: int, world: int) -> str:
    return f"shards/{rank:05d}-of-{world:05d}.json"


@dataclass
class Entry:
    """One tensor of the training state, and the chunks of it this process writes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)  # (offsets, host tensor)


# ---- shard files ----------------------------------------------------------------------------------------
def chunk_key(name: str, offsets: tuple[int, ...]) -> str:
    return f"{name}@{','.join(map(str, offsets))}"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()).toreadonly()


def encode_shard(entries: list[Entry]) -> tuple[list[memoryview], dict]:
    """The safetensors bytes of this writer's chunks (as parts, not joined: part 0 is the header, then one
    part per chunk in index order) and its index, without checksums: `add_checksums` fills those in, in a
    thread that runs while the parts upload."""
    header, parts, chunks, offset = {}, [], {}, 0
    for entry in entries:
        for offsets, tensor in entry.chunks:
            raw = tensor_bytes(tensor)
            key = chunk_key(entry.name, offsets)
            header[key] = {"dtype": DTYPES[entry.dtype], "shape": list(tensor.shape),
                           "data_offsets": [offset, offset + raw.nbytes]}
            chunks.setdefault(entry.name, []).append(
                {"offsets": list(offsets), "sizes": list(tensor.shape), "start": offset, "end": offset + raw.nbytes})
            parts.append(raw)
            offset += raw.nbytes
    header["__metadata__"] = {"format": "pt", "writer": FORMAT}
    prefix = safetensors_prefix(header)
    for chunk_list in chunks.values():  # byte ranges relative to the start of the file
        for chunk in chunk_list:
            chunk["start"] += len(prefix)
            chunk["end"] += len(prefix)
    tensors = {e.name: {"shape": list(e.shape), "dtype": DTYPES[e.dtype], "chunks": chunks.get(e.name, [])}
               for e in entries}
    return [memoryview(prefix), *parts], {"bytes": len(prefix) + offset, "header_bytes": len(prefix),
                                          "tensors": tensors}


def safetensors_prefix(header: dict) -> bytes:
    """The bytes before a safetensors file's data: header length, then the JSON header padded to 8 bytes."""
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors aligns the data section to 8 bytes
    return struct.pack("<Q", len(head)) + head


def merge_indexes(indexes: list[dict]) -> tuple[dict, dict]:
    """Writers' indexes -> the manifest's `files` and `tensors` (each chunk tagged with its file)."""
    files, tensors = {}, {}
    for index in indexes:
        files[index["file"]] = {"bytes": index["bytes"], "header_bytes": index["header_bytes"],
                                "header_crc32": index["header_crc32"]}
        for name, meta in index["tensors"].items():
            merged = tensors.setdefault(name, {"shape": meta["shape"], "dtype": meta["dtype"], "chunks": []})
            merged["chunks"] += [{**chunk, "file": index["file"], "dtype": meta["dtype"]} for chunk in meta["chunks"]]
    return files, tensors


def add_checksums(parts: list[memoryview], index: dict) -> None:
    """crc32 of the header and of every chunk: a load that reads one chunk verifies exactly what it read."""
    index["header_crc32"] = crc32_hex(parts[0])
    chunks = [c for meta in index["tensors"].values() for c in meta["chunks"]]
    for chunk, part in zip(chunks, parts[1:]):
        chunk["crc32"] = crc32_hex(part)


def view_chunk(raw: torch.Tensor, dtype: torch.dtype, sizes: list[int]) -> torch.Tensor:
    """A chunk's bytes (a uint8 slice of a read buffer) as its tensor: a view when the bytes are aligned for
    the dtype (the usual case), else a copy."""
    if raw.numel() == 0:
        return torch.empty(sizes, dtype=dtype)
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).reshape(sizes)


def crc32_hex(data: bytes | memoryview) -> str:
    return f"{_crc32(data):08x}"


try:  # ISA-L computes the same crc32 as zlib, several times faster (SIMD); zlib where it is not installed
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover
    from zlib import crc32 as _crc32
