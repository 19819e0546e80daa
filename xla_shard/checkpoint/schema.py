"""One strict schema for the files that say where tensor bytes lie: an xla_shard manifest, and a safetensors
header (a Hugging Face model's weights, or one of our own shard files).

Both come from outside this process (a bucket, a download, another job), so nothing in them is trusted until
it is checked, and nothing is allocated or read on the strength of an unchecked number: every field has its
type (an int is an int, not a float, a string or a bool), shapes are non-negative, each tensor's byte span is
its shape times its dtype's size, spans lie inside their file and do not overlap, a manifest's chunks tile
their tensor exactly, and every file a manifest names is a plain relative name inside the checkpoint. A defect
is one error naming the file and the field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from xla_shard.checkpoint import layout
from xla_shard.io.untrusted_json import SchemaError, parse_json

MAX_DIMS = 16
_CRC32 = re.compile(r"^[0-9a-f]{8}$")
_HEADER_KEYS = {"dtype", "shape", "data_offsets"}


# ---- values -------------------------------------------------------------------------------------------
MISSING = object()  # what `.get(key, MISSING)` gives for a field that is not there


def _mapping(value: Any, field: str) -> dict:
    if not isinstance(value, dict):
        raise SchemaError(field, f"expected a JSON object, got {_kind(value)}")
    return value


def _int(value: Any, field: str, least: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SchemaError(field, f"expected an integer, got {_kind(value)}")
    if value < least:
        raise SchemaError(field, f"{value} is below {least}")
    return value


def _ints(value: Any, field: str, length: int | None = None) -> list[int]:
    if not isinstance(value, list):
        raise SchemaError(field, f"expected a list of integers, got {_kind(value)}")
    if len(value) > MAX_DIMS or (length is not None and len(value) != length):
        want = f"{length}" if length is not None else f"at most {MAX_DIMS}"
        raise SchemaError(field, f"has {len(value)} entries, expected {want}")
    return [_int(v, f"{field}[{i}]") for i, v in enumerate(value)]


def _crc32(value: Any, field: str, why: str = "") -> str:
    if not (isinstance(value, str) and _CRC32.match(value)):
        raise SchemaError(field, f"expected 8 hex digits, got {_kind(value)}{why}")
    return value


def _dtype(value: Any, field: str) -> str:
    if value not in layout.TORCH_DTYPES:
        shown = repr(value) if isinstance(value, str) else _kind(value)
        raise SchemaError(field, f"{shown} is not a dtype xla_shard loads ({', '.join(layout.TORCH_DTYPES)})")
    return value


def _kind(value: Any) -> str:
    if value is MISSING:
        return "nothing (the field is missing)"
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", float: "a number with a "
             "fraction", int: "an integer", type(None): "null"}
    return f"{names.get(type(value), type(value).__name__)} ({json.dumps(value)[:40] if _short(value) else '...'})"


def _short(value: Any) -> bool:
    return not isinstance(value, (dict, list)) or len(value) < 8


def nbytes(shape: list[int], dtype: str) -> int:
    return math.prod(shape) * layout.TORCH_DTYPES[dtype].itemsize


def relative_name(name: Any, field: str) -> str:
    """A file name as a manifest or an index may give it: relative, inside its directory, not a URL."""
    if not isinstance(name, str) or not name:
        raise SchemaError(field, f"expected a file name, got {_kind(name)}")
    parts = name.split("/")
    if ("://" in name or name.startswith(("/", "~")) or "\\" in name or "\0" in name or ":" in parts[0]
            or any(part in ("", ".", "..") for part in parts)):
        raise SchemaError(field, f"{name!r} is not a plain name inside the directory (a '..', absolute path, URL "
                                 "or empty segment); refusing to read outside it")
    return name


# ---- spans and boxes ------------------------------------------------------------------------------------
def check_disjoint_spans(spans: list[tuple[int, int, str]], field: str) -> None:
    """Byte ranges [start, end) that must not overlap (two tensors sharing bytes)."""
    spans = sorted(s for s in spans if s[1] > s[0])
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise SchemaError(field, f"{other} overlaps {name} (bytes from {start} are claimed twice)")


def check_tiling(shape: list[int], boxes: list[tuple[list[int], list[int]]], field: str) -> None:
    """Boxes inside `shape`, pairwise disjoint, together covering it: every element stored exactly once."""
    for i, (offsets, sizes) in enumerate(boxes):
        if any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise SchemaError(f"{field}[{i}]", f"box at {offsets} of {sizes} reaches outside the shape {shape}")
    total = math.prod(shape)
    stored = sum(math.prod(sizes) for _, sizes in boxes)
    if stored != total:
        raise SchemaError(field, f"the chunks hold {stored} elements, the shape {shape} has {total}")
    # With the volumes adding up, disjoint boxes cover the tensor. A sweep along the dimension the boxes split
    # most pairs only boxes that overlap along it: near-linear for shards along any one dimension (FSDP2's
    # rows, SPMD's largest dimension), where a pairwise check of a pod's shards would take seconds per resume.
    live = [b for b in boxes if math.prod(b[1])]
    dim = max(range(len(shape)), key=lambda d: len({offsets[d] for offsets, _ in live}), default=None)
    if dim is not None:
        live.sort(key=lambda b: b[0][dim])
    for i, (offsets, sizes) in enumerate(live):
        for other_offsets, other_sizes in live[i + 1:]:
            if dim is not None and other_offsets[dim] >= offsets[dim] + sizes[dim]:
                break
            if all(max(a, c) < min(a + b, c + d) for a, b, c, d in zip(offsets, sizes, other_offsets, other_sizes)):
                raise SchemaError(field, f"the chunks at {offsets} and {other_offsets} overlap")


# ---- safetensors ----------------------------------------------------------------------------------------
def safetensors_tensors(header_raw: bytes, data_bytes: int) -> dict[str, dict]:
    """The tensors of a safetensors header: name -> {dtype, shape, begin, end} (offsets into the data section
    of `data_bytes`), checked as the `safetensors` library checks them: spans back to back from byte 0 to the
    end of the file, each exactly its shape's bytes."""
    header = parse_json(header_raw)
    if not isinstance(header, dict):
        raise SchemaError("header", f"expected a JSON object of tensors, got {_kind(header)}")
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise SchemaError("__metadata__", "expected an object of strings")
            continue
        field = f"header[{name!r}]"
        meta = _mapping(meta, field)
        if not _HEADER_KEYS <= set(meta):  # other keys are ignored, as the safetensors library ignores them
            raise SchemaError(field, f"lacks {sorted(_HEADER_KEYS - set(meta))[0]!r}")
        if not isinstance(meta["dtype"], str):
            raise SchemaError(f"{field}.dtype", f"expected a string, got {_kind(meta['dtype'])}")
        shape = _ints(meta["shape"], f"{field}.shape")
        begin, end = _ints(meta["data_offsets"], f"{field}.data_offsets", length=2)
        tensors[name] = {"dtype": meta["dtype"], "shape": shape, "begin": begin, "end": end}
    position = 0
    for name, meta in sorted(tensors.items(), key=lambda item: (item[1]["begin"], item[1]["end"])):
        field = f"header[{name!r}].data_offsets"
        if meta["begin"] != position:
            problem = "overlaps the tensor before it" if meta["begin"] < position else "leaves a gap before it"
            raise SchemaError(field, f"[{meta['begin']}, {meta['end']}] {problem} (expected to start at {position})")
        if meta["end"] < meta["begin"]:
            raise SchemaError(field, f"[{meta['begin']}, {meta['end']}] ends before it begins")
        if meta["dtype"] in layout.TORCH_DTYPES and meta["end"] - meta["begin"] != nbytes(meta["shape"], meta["dtype"]):
            raise SchemaError(field, f"spans {meta['end'] - meta['begin']} bytes; a {meta['dtype']} tensor of "
                                     f"{meta['shape']} is {nbytes(meta['shape'], meta['dtype'])}")
        position = meta["end"]
        if position > data_bytes:
            raise SchemaError(field, f"ends at byte {position} of the data, which holds {data_bytes}")
    if position != data_bytes:
        raise SchemaError("header", f"the tensors span {position} bytes, the file's data section holds {data_bytes}")
    return tensors


# ---- manifests ----------------------------------------------------------------------------------------
def check_manifest(data: Any, verified: bool = True) -> dict:
    """The manifest `data`, checked whole before any of it is used. `verified`: every chunk must carry a crc32
    (a committed xla_shard checkpoint; only read-only sources such as a Hugging Face directory may have none)."""
    data = _mapping(data, "")
    _int(data.get("step", MISSING), "step")
    _int(data.get("writers", MISSING), "writers", least=1)
    for key in ("config", "rng"):
        _mapping(data.get(key, MISSING), key)
    if not isinstance(data.get("backend", ""), str):
        raise SchemaError("backend", f"expected a string, got {_kind(data['backend'])}")
    created = data.get("created", 0)
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not 0 <= created < 1e11:
        raise SchemaError("created", f"expected a time in seconds, got {_kind(created)}")
    for key in ("run", "hf_config", "plan", "extra", "base", "reference", "write"):
        if data.get(key) is not None:
            _mapping(data[key], key)
    if data.get("write") is not None:  # a save's slowest writer (`checkpoint.window`)
        for key in ("seconds", "bytes"):
            value = data["write"].get(key, MISSING)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e18:
                raise SchemaError(f"write.{key}", f"expected a number, got {_kind(value)}")
    if not isinstance(data.get("lr_warmup_rule", ""), str):
        raise SchemaError("lr_warmup_rule", f"expected a string, got {_kind(data['lr_warmup_rule'])}")
    for key in ("base", "reference"):  # identities of model directories (`hf_dir.identity`)
        if data.get(key) is not None:
            files = _mapping(data[key].get("files", MISSING), f"{key}.files")
            for file, digest in files.items():
                if not isinstance(digest, str):
                    raise SchemaError(f"{key}.files[{file!r}]", f"expected a digest string, got {_kind(digest)}")
    for name, state in (data.get("extra") or {}).items():
        _mapping(state, f"extra[{name!r}]")
    if isinstance(data.get("hf_config"), dict) and "auto_map" in data["hf_config"]:
        raise SchemaError("hf_config.auto_map", "a model config that imports Python code: xla_shard never writes or "
                                                "exports one")
    if data.get("run") is not None and not isinstance(data["run"].get("id", ""), str):
        raise SchemaError("run.id", f"expected a string, got {_kind(data['run']['id'])}")
    for rank, state in _mapping(data["rng"], "rng").items():
        _mapping(state, f"rng[{rank!r}]")
    files = {}
    for name, meta in _mapping(data.get("files", MISSING), "files").items():
        field = f"files[{name!r}]"
        relative_name(name, field)
        meta = _mapping(meta, field)
        size = _int(meta.get("bytes", MISSING), f"{field}.bytes")
        header = _int(meta.get("header_bytes", MISSING), f"{field}.header_bytes", least=8)
        if header > size:
            raise SchemaError(f"{field}.header_bytes", f"{header} is more than the file's {size} bytes")
        if verified:
            _crc32(meta.get("header_crc32", MISSING), f"{field}.header_crc32")
        files[name] = (header, size)
    spans: dict[str, list[tuple[int, int, str]]] = {name: [] for name in files}
    for name, meta in _mapping(data.get("tensors", MISSING), "tensors").items():
        field = f"tensors[{name!r}]"
        meta = _mapping(meta, field)
        shape = _ints(meta.get("shape", MISSING), f"{field}.shape")
        dtype = _dtype(meta.get("dtype", MISSING), f"{field}.dtype")
        chunks = meta.get("chunks", MISSING)
        if not isinstance(chunks, list):
            raise SchemaError(f"{field}.chunks", f"expected a list, got {_kind(chunks)}")
        boxes = []
        for i, chunk in enumerate(chunks):
            where = f"{field}.chunks[{i}]"
            boxes.append(_check_chunk(_mapping(chunk, where), where, shape, dtype, files, spans, verified))
        check_tiling(shape, boxes, f"{field}.chunks")
    for file, file_spans in spans.items():
        check_disjoint_spans(file_spans, f"files[{file!r}]")
    return data


def _check_chunk(chunk: dict, where: str, shape: list[int], dtype: str, files: dict, spans: dict,
                 verified: bool) -> tuple[list[int], list[int]]:
    offsets = _ints(chunk.get("offsets", MISSING), f"{where}.offsets", length=len(shape))
    sizes = _ints(chunk.get("sizes", MISSING), f"{where}.sizes", length=len(shape))
    start, end = _int(chunk.get("start", MISSING), f"{where}.start"), _int(chunk.get("end", MISSING), f"{where}.end")
    file = relative_name(chunk.get("file", MISSING), f"{where}.file")
    if file not in files:
        raise SchemaError(f"{where}.file", f"{file!r} is not among the manifest's files")
    if chunk.get("dtype") != dtype:
        raise SchemaError(f"{where}.dtype", f"{_kind(chunk.get('dtype', MISSING))}, the tensor is {dtype}")
    crc = chunk.get("crc32", MISSING)
    if verified or crc not in (None, MISSING):
        _crc32(crc, f"{where}.crc32", why=": every chunk of a committed checkpoint carries its checksum")
    if end - start != nbytes(sizes, dtype):
        raise SchemaError(where, f"bytes {start}-{end} are {end - start}; a {dtype} chunk of {sizes} is "
                                 f"{nbytes(sizes, dtype)}")
    header, size = files[file]
    if start < header or end > size:
        raise SchemaError(where, f"bytes {start}-{end} lie outside the data of {file} ({header}-{size})")
    spans[file].append((start, end, where))
    return offsets, sizes
