"""`xla-shard ckpt list` and `ckpt verify`: what a checkpoint directory holds, and whether it is intact."""

from __future__ import annotations

from dataclasses import dataclass

from xla_shard.checkpoint import layout
from xla_shard.checkpoint.manifest import (
    CheckpointError,
    CorruptCheckpointError,
    Manifest,
    all_steps,
    committed_steps,
    read_manifest,
)
from xla_shard.checkpoint.reader import ChunkReader
from xla_shard.errors import one_line
from xla_shard.io.storage import NotAFileError, Storage


def open_checkpoint(url: str) -> tuple[Storage, Manifest]:
    """A URL naming one checkpoint, or a checkpoint.dir (its newest committed checkpoint)."""
    storage = Storage(url)
    if not storage.exists(layout.MANIFEST):
        steps = committed_steps(storage)
        if not steps:
            raise CheckpointError(f"{url}: no committed checkpoint here (no {layout.MANIFEST}, and no "
                                  "step-*/ directory with one)")
        storage = Storage(storage.url_of(layout.step_dir(steps[-1])))
    return storage, read_manifest(storage)


@dataclass
class Row:
    step: int
    committed: bool
    damaged: str | None = None  # why a committed checkpoint's manifest cannot be used
    bytes: int | None = None
    writers: int | None = None
    backend: str | None = None
    created: float | None = None


def list_checkpoints(url: str) -> list[Row]:
    storage = Storage(url)
    if not storage.exists(""):
        raise CheckpointError(f"{url}: no such directory")
    if storage.fs.isfile(storage.root):
        raise CheckpointError(f"{url} is a file, not a checkpoint directory")
    committed = set(committed_steps(storage))
    rows = []
    for step in all_steps(storage):
        if step not in committed:
            rows.append(Row(step, False))
            continue
        try:
            data = read_manifest(storage, layout.step_dir(step)).data
        except CorruptCheckpointError as exc:
            rows.append(Row(step, True, damaged=str(exc)))
            continue
        rows.append(Row(step, True, None, sum(f["bytes"] for f in data["files"].values()), data["writers"],
                        data.get("backend", "?"), data.get("created")))
    return rows


def _file_problem(storage, name: str, meta: dict) -> str | None:
    """What is wrong with one of the checkpoint's files as a whole (where it is, its size, its header)."""
    where = storage.url_of(name)
    link = storage.outside(name)
    if link is not None:
        return f"{where} is a link to {link}, outside the checkpoint; not read"
    try:
        size = storage.size(name)
        if size != meta["bytes"]:
            return f"{where}: {size} bytes, the manifest says {meta['bytes']}"
        (header,) = storage.read_ranges([name], [0], [meta["header_bytes"]])
    except FileNotFoundError:
        return f"{where}: missing"
    except IsADirectoryError:
        return f"{where} is a directory"
    except NotAFileError as exc:
        return one_line(exc)
    if layout.crc32_hex(header) != meta["header_crc32"]:
        return f"{where}: crc32 of the safetensors header does not match the manifest"
    return None


def verify(url: str) -> tuple[Manifest, list[str]]:
    """Every file present with its size, header and every chunk matching its crc32, every tensor fully
    covered. Reads one tensor at a time (bounded memory); returns the problems found."""
    storage, manifest = open_checkpoint(url)
    problems: list[str] = []
    unread: set[str] = set()  # files said above: their tensors are not read (and said) again
    for name, meta in manifest.data["files"].items():
        problem = _file_problem(storage, name, meta)
        if problem is not None:
            problems.append(problem)
            unread.add(name)
    reader = ChunkReader(storage, manifest)
    for name, meta in manifest.tensors.items():
        if any(chunk["file"] in unread for chunk in meta["chunks"]):
            continue
        shape = tuple(meta["shape"])
        try:
            reader.read([(name, ((0,) * len(shape), shape))])
        except CheckpointError as exc:
            message = str(exc)
            if message not in problems:
                problems.append(message)
    return manifest, problems
