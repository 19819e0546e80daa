"""Reading boxes of stored tensors: the one reader behind resume, verify and export."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from xla_shard.checkpoint import layout
from xla_shard.checkpoint.contract import StateTensor
from xla_shard.checkpoint.manifest import CorruptCheckpointError, Manifest
from xla_shard.errors import one_line
from xla_shard.io.storage import NotAFileError, Storage


class ChunkReader:
    """Assembles boxes of stored tensors from the chunks that overlap them, verifying each chunk's crc32.

    A chunk with no crc32 (a foreign file, such as a Hugging Face model's safetensors, where each tensor is one
    chunk) cannot be verified, so nothing obliges reading it whole: only the rows a request overlaps are read.
    A row shard of a tensor is then exactly its own bytes; `bytes_read` counts what came from storage."""

    def __init__(self, storage: Storage, manifest: Manifest, step_dir: str = "", bridge_gaps: bool = True):
        """`bridge_gaps`: read small unneeded ranges between needed ones to save requests (off where what each
        process reads must stay its own part)."""
        self.storage, self.manifest, self.step_dir = storage, manifest, step_dir
        self.bridge_gaps = bridge_gaps
        self.bytes_read = 0
        self._sizes = dict(manifest.file_bytes)  # file -> its real size, measured before reading it
        self._lock = threading.Lock()

    def _stored_size(self, file: str) -> int:
        """The real size of a file the manifest names, measured once (its chunks' claims are bounded by it
        before anything is allocated); a link out of the checkpoint is refused."""
        with self._lock:
            if file in self._sizes:
                return self._sizes[file]
        rel = f"{self.step_dir}/{file}" if self.step_dir else file
        link = self.storage.outside(rel)
        if link is not None:
            raise CorruptCheckpointError(f"{self.manifest.url}: {file} is a link to {link}, outside the checkpoint; "
                                         "refusing to read it")
        try:
            size = self.storage.size(rel)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.manifest.url}/{file}: shard file missing") from None
        except (NotAFileError, IsADirectoryError) as exc:
            raise CorruptCheckpointError(f"{self.manifest.url}/{file}: {one_line(exc)}") from None
        with self._lock:
            self._sizes[file] = size
        return size

    def read(self, requests: list[tuple[str, layout.Box]]) -> list[torch.Tensor]:
        needed: dict[tuple[str, int, int], dict] = {}
        plans = []
        for name, box in requests:
            meta = self.manifest.tensors[name]
            parts = []
            for chunk in meta["chunks"]:
                overlap = layout.intersect(box, (tuple(chunk["offsets"]), tuple(chunk["sizes"])))
                if overlap is not None or not box[1]:
                    if chunk.get("crc32") is None and overlap is not None:
                        chunk = _rows_of(chunk, overlap)
                    needed[_key(chunk)] = chunk
                    parts.append((chunk, overlap or box))
            plans.append((name, box, meta["dtype"], parts))
        keys = list(needed)
        blobs = self._fetch(keys, needed)
        values = []
        for name, box, dtype, parts in plans:
            within = [(tuple(chunk["offsets"]), tuple(chunk["sizes"])) for chunk, _ in parts]
            if len(parts) == 1 and within[0] == box:  # the common case: a box is exactly one stored chunk
                values.append(blobs[_key(parts[0][0])])
                continue
            out = torch.empty(box[1], dtype=layout.TORCH_DTYPES[dtype])
            covered = 0  # stored chunks never overlap (checked at commit), so volumes add up
            for (chunk, overlap), chunk_box in zip(parts, within):
                src = blobs[_key(chunk)]
                out[layout.region(overlap, box)] = src[layout.region(overlap, chunk_box)]
                covered += math.prod(overlap[1])
            if covered != math.prod(box[1]):
                raise CorruptCheckpointError(f"{self.manifest.url}: tensor {name} is incomplete: part of "
                                      f"{list(box[1])} at {list(box[0])} is in no shard file")
            values.append(out)
        return values

    def _fetch(self, keys: list[tuple[str, int, int]], chunks: dict) -> dict[tuple[str, int, int], torch.Tensor]:
        """Chunks adjacent in one file are fetched as one range, spans in parallel threads, each read straight
        into one host buffer, verified, and handed out as views of it (no copy after the read)."""
        max_span, max_gap = (_MAX_SPAN, _MAX_GAP) if self.storage.local else (_MAX_REMOTE_SPAN, _MAX_REMOTE_GAP)
        max_gap = max_gap if self.bridge_gaps else 0
        spans: list[list] = []  # [file, start, end, keys]
        for key in sorted(keys):
            chunk = chunks[key]
            last = spans[-1] if spans else None
            if (last and last[0] == chunk["file"] and chunk["start"] - last[2] <= max_gap
                    and chunk["end"] - last[1] <= max_span):
                last[2] = max(last[2], chunk["end"])
                last[3].append(key)
            else:
                spans.append([chunk["file"], chunk["start"], chunk["end"], [key]])
        if not self.storage.local and self.bridge_gaps:  # object stores serve a range from byte 0 best: take it
            for span in spans:
                if span[1] <= max_gap:
                    span[1] = 0
        prefix = f"{self.step_dir}/" if self.step_dir else ""
        self.bytes_read += sum(end - start for _, start, end, _ in spans)

        def fetch(span) -> list[tuple[tuple[str, int], torch.Tensor]]:
            file, span_start, span_end, span_keys = span
            stored = self._stored_size(file)
            if span_end > stored:
                raise CorruptCheckpointError(f"{self.manifest.url}/{file} holds {stored} bytes, the manifest places "
                                             f"chunks up to byte {span_end}: it was truncated or the manifest edited")
            buffer = torch.empty(span_end - span_start, dtype=torch.uint8)  # uninitialised: the read fills it
            view = memoryview(buffer.numpy())
            try:
                got = self.storage.read_into(prefix + file, span_start, view)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{self.manifest.url}/{file}: shard file missing") from None
            except (NotAFileError, IsADirectoryError) as exc:
                raise CorruptCheckpointError(f"{self.manifest.url}/{file}: {one_line(exc)}") from None
            out = []
            for key in span_keys:
                chunk = chunks[key]
                lo, hi = chunk["start"] - span_start, chunk["end"] - span_start
                if hi > got:
                    raise CorruptCheckpointError(f"{self.manifest.url}/{file} is shorter than its manifest says "
                                                 f"(ends before byte {chunk['end']}); it was truncated")
                dtype = layout.TORCH_DTYPES[chunk["dtype"]]
                if hi - lo != math.prod(chunk["sizes"]) * dtype.itemsize:
                    raise CorruptCheckpointError(f"{self.manifest.url}: the manifest's {chunk['dtype']} chunk of "
                                                 f"{chunk['sizes']} does not span bytes "
                                                 f"{chunk['start']}-{chunk['end']} of {file}; the manifest was edited "
                                                 "or is damaged")
                if chunk["crc32"] is not None and layout.crc32_hex(view[lo:hi]) != chunk["crc32"]:
                    raise CorruptCheckpointError(f"{self.manifest.url}/{file} is corrupt: bytes {chunk['start']}-"
                                                 f"{chunk['end']} fail their crc32 (run `xla-shard ckpt verify`)")
                out.append((key, layout.view_chunk(buffer[lo:hi], dtype, chunk["sizes"])))
            return out

        if len(spans) == 1:
            return dict(fetch(spans[0]))
        with ThreadPoolExecutor(min(_THREADS, len(spans))) as pool:
            return {key: value for result in pool.map(fetch, spans) for key, value in result}


def fill(reader: ChunkReader, targets: list[StateTensor], max_bytes: int = 256 << 20,
         convert: Callable[[StateTensor, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Read the boxes each target holds on this process and hand them to it, a batch of about `max_bytes` of
    them at a time (one concurrent fetch per batch, so host memory stays bounded by the batch)."""
    batch, size = [], 0
    for target in targets:
        boxes = target.boxes()
        nbytes = sum(math.prod(sizes) for _, sizes in boxes) * target.dtype.itemsize
        if batch and size + nbytes > max_bytes:
            _fill_batch(reader, batch, convert)
            batch, size = [], 0
        batch.append((target, boxes))
        size += nbytes
    if batch:
        _fill_batch(reader, batch, convert)


def _fill_batch(reader: ChunkReader, batch: list[tuple[StateTensor, list[layout.Box]]], convert) -> None:
    values = iter(reader.read([(target.name, box) for target, boxes in batch for box in boxes]))
    for target, boxes in batch:
        got = [next(values) for _ in boxes]
        target.fill([convert(target, value) for value in got] if convert else got)


def _key(chunk: dict) -> tuple[str, int, int]:
    return chunk["file"], chunk["start"], chunk["end"]


def _rows_of(chunk: dict, overlap: layout.Box) -> dict:
    """The part of an unverified chunk that holds the rows (first-dimension indices) `overlap` touches: one
    contiguous byte range, since tensors are stored row-major."""
    offsets, sizes = chunk["offsets"], chunk["sizes"]
    if not sizes:
        return chunk
    first, count = overlap[0][0] - offsets[0], overlap[1][0]
    row_bytes = math.prod(sizes[1:]) * layout.TORCH_DTYPES[chunk["dtype"]].itemsize
    start = chunk["start"] + first * row_bytes
    return {**chunk, "start": start, "end": start + count * row_bytes,
            "offsets": [offsets[0] + first, *offsets[1:]], "sizes": [count, *sizes[1:]]}


_MAX_GAP = 1 << 20  # local disk: bytes of unneeded data worth reading to save a request
_MAX_SPAN = 32 << 20  # ... and the most one read takes, so that reads and checksums of other spans overlap
# Object stores: every request costs a round trip (and some servers re-read the object per range), so fetch
# up to a quarter GiB at once; loads are batched to about that much anyway.
_MAX_REMOTE_GAP = 16 << 20
_MAX_REMOTE_SPAN = 256 << 20
_THREADS = 4
