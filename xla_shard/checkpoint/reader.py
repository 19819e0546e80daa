"""Reading boxes of stored tensors: the one reader behind resume, verify and export."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch

from xla_shard.checkpoint import layout
from xla_shard.checkpoint.manifest import CorruptCheckpointError, Manifest
from xla_shard.checkpoint.storage import Storage


class ChunkReader:
    """Assembles boxes of stored tensors from the chunks that overlap them, verifying each chunk's crc32."""

    def __init__(self, storage: Storage, manifest: Manifest, step_dir: str = ""):
        self.storage, self.manifest, self.step_dir = storage, manifest, step_dir

    def read(self, requests: list[tuple[str, layout.Box]]) -> list[torch.Tensor]:
        needed: dict[tuple[str, int], dict] = {}
        plans = []
        for name, box in requests:
            meta = self.manifest.tensors[name]
            parts = []
            for chunk in meta["chunks"]:
                overlap = layout.intersect(box, (tuple(chunk["offsets"]), tuple(chunk["sizes"])))
                if overlap is not None or not box[1]:
                    needed[(chunk["file"], chunk["start"])] = chunk
                    parts.append((chunk, overlap or box))
            plans.append((name, box, meta["dtype"], parts))
        keys = list(needed)
        blobs = self._fetch(keys, needed)
        values = []
        for name, box, dtype, parts in plans:
            within = [(tuple(chunk["offsets"]), tuple(chunk["sizes"])) for chunk, _ in parts]
            if len(parts) == 1 and within[0] == box:  # the common case: a box is exactly one stored chunk
                values.append(blobs[(parts[0][0]["file"], parts[0][0]["start"])])
                continue
            out = torch.empty(box[1], dtype=layout.TORCH_DTYPES[dtype])
            covered = 0  # stored chunks never overlap (checked at commit), so volumes add up
            for (chunk, overlap), chunk_box in zip(parts, within):
                src = blobs[(chunk["file"], chunk["start"])]
                out[layout.region(overlap, box)] = src[layout.region(overlap, chunk_box)]
                covered += math.prod(overlap[1])
            if covered != math.prod(box[1]):
                raise CorruptCheckpointError(f"{self.manifest.url}: tensor {name} is incomplete: part of "
                                      f"{list(box[1])} at {list(box[0])} is in no shard file")
            values.append(out)
        return values

    def _fetch(self, keys: list[tuple[str, int]], chunks: dict) -> dict[tuple[str, int], torch.Tensor]:
        """Chunks adjacent in one file are fetched as one range (up to `_MAX_SPAN`), spans in parallel threads,
        each verifying and decoding its own chunks while the others still read."""
        spans: list[list] = []  # [file, start, end, keys]
        for key in sorted(keys):
            chunk = chunks[key]
            last = spans[-1] if spans else None
            if (last and last[0] == chunk["file"] and chunk["start"] - last[2] <= _MAX_GAP
                    and chunk["end"] - last[1] <= _MAX_SPAN):
                last[2] = max(last[2], chunk["end"])
                last[3].append(key)
            else:
                spans.append([chunk["file"], chunk["start"], chunk["end"], [key]])
        prefix = f"{self.step_dir}/" if self.step_dir else ""

        def fetch(span) -> list[tuple[tuple[str, int], torch.Tensor]]:
            file, span_start, span_end, span_keys = span
            try:
                (blob,) = self.storage.read_ranges([prefix + file], [span_start], [span_end])
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{self.manifest.url}/{file}: shard file missing") from None
            view, out = memoryview(blob), []
            for key in span_keys:
                chunk = chunks[key]
                data = view[chunk["start"] - span_start:chunk["end"] - span_start]
                itemsize = layout.TORCH_DTYPES[chunk["dtype"]].itemsize
                if len(data) != math.prod(chunk["sizes"]) * itemsize:
                    raise CorruptCheckpointError(f"{self.manifest.url}: the manifest's {chunk['dtype']} chunk of "
                                                 f"{chunk['sizes']} does not span bytes {chunk['start']}-{chunk['end']} "
                                                 f"of {file}; the manifest was edited or is damaged")
                if layout.crc32_hex(data) != chunk["crc32"]:
                    raise CorruptCheckpointError(f"{self.manifest.url}/{file} is corrupt: bytes {chunk['start']}-"
                                          f"{chunk['end']} fail their crc32 (run `xla-shard ckpt verify`)")
                out.append((key, layout.decode_chunk(data, chunk["dtype"], chunk["sizes"])))
            return out

        if len(spans) == 1:
            return dict(fetch(spans[0]))
        with ThreadPoolExecutor(min(_THREADS, len(spans))) as pool:
            return {key: value for result in pool.map(fetch, spans) for key, value in result}


_MAX_GAP = 1 << 20  # bytes of unneeded data worth reading to save a request
_MAX_SPAN = 32 << 20  # ... and the most one request reads, so that reads and checksums overlap
_THREADS = 4
