"""Save, commit, retain and restore sharded checkpoints.

A save has three phases. (1) Snapshot: each process copies the boxes it owns to host memory; this is all
the training step waits for. (2) Upload: each writer puts one shard file and then its index file; in a
background thread when `checkpoint.async` is on. (3) Commit: the main process waits until every writer's
index exists, merges them into `manifest.json` and writes it last. Loaders only see checkpoints that have a
manifest, so a crash or an outage before (3) leaves no loadable half-checkpoint, and older checkpoints are
deleted only after a newer one committed. Coordination goes through storage, not collectives, so an async
save never races the training step for the process group.
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from xla_shard.checkpoint import layout
from xla_shard.checkpoint.storage import Storage
from xla_shard.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that cannot be used: missing, uncommitted, corrupt, incomplete or from another model."""


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("xla_shard", "torch", "torch_xla", "transformers", "fsspec", "gcsfs"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found


# ---- reading ------------------------------------------------------------------------------------------
@dataclass
class Manifest:
    url: str
    data: dict[str, Any]

    @property
    def step(self) -> int:
        return self.data["step"]

    @property
    def tensors(self) -> dict[str, dict]:
        return self.data["tensors"]


def read_manifest(storage: Storage, step_dir: str = "") -> Manifest:
    url = storage.url_of(step_dir)
    try:
        raw = storage.read_bytes(f"{step_dir}/{layout.MANIFEST}" if step_dir else layout.MANIFEST)
    except FileNotFoundError:
        raise CheckpointError(f"{url} is not a committed checkpoint: it has no {layout.MANIFEST} "
                              "(a save that never finished, or not an xla_shard checkpoint)") from None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{url}/{layout.MANIFEST} is not valid JSON: {exc}") from None
    if data.get("format") != layout.FORMAT:
        raise CheckpointError(f"{url}/{layout.MANIFEST}: format {data.get('format')!r}, this xla_shard reads "
                              f"{layout.FORMAT!r}")
    return Manifest(url, data)


def committed_steps(storage: Storage) -> list[int]:
    steps = {layout.parse_step_dir(path.rsplit("/", 1)[0]) for path in storage.glob(f"step-*/{layout.MANIFEST}")}
    return sorted(s for s in steps if s is not None)


def all_steps(storage: Storage) -> list[int]:
    steps = {layout.parse_step_dir(path) for path in storage.glob("step-*")}
    return sorted(s for s in steps if s is not None)


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
                raise CheckpointError(f"{self.manifest.url}: tensor {name} is incomplete: part of "
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
                raise CheckpointError(f"{self.manifest.url}/{file}: shard file missing") from None
            view, out = memoryview(blob), []
            for key in span_keys:
                chunk = chunks[key]
                data = view[chunk["start"] - span_start:chunk["end"] - span_start]
                if len(data) != chunk["end"] - chunk["start"] or layout.crc32_hex(data) != chunk["crc32"]:
                    raise CheckpointError(f"{self.manifest.url}/{file} is corrupt: bytes {chunk['start']}-"
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


# ---- writing ------------------------------------------------------------------------------------------
class Checkpointer:
    """One per training process. `save` returns once the step may go on; `wait` surfaces any failure."""

    def __init__(self, section, backend, describe: Callable[[], dict[str, Any]], log: Callable[[str], None] = print):
        self.section = section
        self.backend = backend
        self.describe = describe  # config, mesh, ... for the manifest
        self.log = log
        self.storage = Storage(section.dir, section.retry_deadline_s)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.saving_step: int | None = None
        self.last_blocking_s = 0.0
        self.last_committed: int | None = None

    # ---- save ---------------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, block: bool = False) -> None:
        self.wait()  # at most one save in flight; an earlier failure surfaces here
        start = time.perf_counter()
        entries = [layout.Entry(t.name, t.shape, t.dtype, t.chunks()) for t in self.backend.state(model, optimizer)]
        rng = self.backend.rng_state()
        self.last_blocking_s = time.perf_counter() - start
        self.saving_step = step
        if self.section.async_save and not block:
            self._thread = threading.Thread(target=self._background, args=(step, entries, rng),
                                            name=f"xla-shard-save-{step}", daemon=True)
            self._thread.start()
        else:
            self._upload_and_commit(step, entries, rng)
            self.saving_step = None

    def _background(self, step, entries, rng) -> None:
        try:
            self._upload_and_commit(step, entries, rng)
        except BaseException as exc:  # handed to the training thread at the next save or at exit
            self._error = exc

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the save in flight is done; raise its error. False if `timeout` passed first."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
            self.saving_step = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, UserError):
                raise CheckpointError(f"checkpoint save failed: {error}") from error
            raise error
        return True

    def _upload_and_commit(self, step: int, entries: list[layout.Entry], rng: dict) -> None:
        directory = layout.step_dir(step)
        rank, world = self.backend.writer
        parts, index = layout.encode_shard(entries)
        shard = layout.shard_file(rank, world)
        with ThreadPoolExecutor(1) as pool:  # checksum while uploading: both release the GIL
            checksums = pool.submit(layout.add_checksums, parts, index)
            self.storage.write(f"{directory}/{shard}", parts)
            checksums.result()
        index.update(file=shard, writer=rank, writers=world, rng=rng)
        self.storage.write(f"{directory}/{layout.index_file(rank, world)}", json.dumps(index).encode())
        if self.backend.is_main:
            self._commit(step, world)
            self._retain(step)

    def _commit(self, step: int, world: int) -> None:
        directory = layout.step_dir(step)
        indexes = self._gather_indexes(directory, world)
        files, tensors = layout.merge_indexes(indexes)
        rng = {str(index["writer"]): index["rng"] for index in indexes}
        for name, meta in tensors.items():  # every element of every tensor is in exactly one chunk
            stored = sum(math.prod(c["sizes"]) for c in meta["chunks"])
            if stored != math.prod(meta["shape"]):
                raise CheckpointError(f"step {step}: tensor {name} has {stored} of {math.prod(meta['shape'])} "
                                      "elements in its shards; not committing")
        manifest = {"format": layout.FORMAT, "step": step, "writers": world, "created": time.time(),
                    **self.describe(), "versions": versions(), "data": {"next_step": step},
                    "files": files, "rng": rng, "tensors": tensors}
        self.storage.write(f"{directory}/{layout.MANIFEST}", json.dumps(manifest, indent=1).encode())
        self.last_committed = step
        self.log(f"checkpoint step {step} committed: {self.storage.url_of(directory)}")

    def _gather_indexes(self, directory: str, world: int) -> list[dict]:
        deadline = time.monotonic() + self.section.commit_timeout_s
        pending = {rank: layout.index_file(rank, world) for rank in range(world)}
        found: dict[int, dict] = {}
        while pending:
            for rank, name in list(pending.items()):
                if self.storage.exists(f"{directory}/{name}"):
                    found[rank] = json.loads(self.storage.read_bytes(f"{directory}/{name}"))
                    del pending[rank]
            if pending:
                if time.monotonic() > deadline:
                    raise CheckpointError(f"{self.storage.url_of(directory)}: writers {sorted(pending)} did not finish "
                                          f"within checkpoint.commit_timeout_s={self.section.commit_timeout_s:g}")
                time.sleep(0.05)
        return [found[rank] for rank in range(world)]

    def _retain(self, newest: int) -> None:
        """Keep the newest `keep_last` committed checkpoints and every `keep_every`-th; delete the rest, and
        the debris of saves that never committed, older than the newest commit."""
        committed = committed_steps(self.storage)
        keep = set(committed[-self.section.keep_last:])
        if self.section.keep_every:
            keep |= {s for s in committed if s % self.section.keep_every == 0}
        for step in all_steps(self.storage):
            if step < newest and step not in keep:
                self.storage.remove_tree(layout.step_dir(step))

    # ---- resume ---------------------------------------------------------------------------------------
    def resume_point(self) -> str | None:
        """URL of the checkpoint `checkpoint.resume` asks for, or None for a fresh start."""
        resume = self.section.resume
        if resume == "never":
            return None
        if resume == "auto":
            steps = committed_steps(self.storage)
            return self.storage.url_of(layout.step_dir(steps[-1])) if steps else None
        return resume

    def load(self, url: str, model, optimizer, check: Callable[[Manifest], None]) -> Manifest:
        storage = Storage(url, self.section.retry_deadline_s)
        manifest = read_manifest(storage)
        check(manifest)
        stored = {name: (tuple(meta["shape"]), layout.TORCH_DTYPES[meta["dtype"]])
                  for name, meta in manifest.tensors.items()}
        targets = self.backend.state(model, optimizer, stored=stored)
        _match(manifest, stored, targets)
        reader = ChunkReader(storage, manifest)
        for batch in _batches(targets, max_bytes=256 << 20):  # one concurrent fetch per batch, bounded memory
            requests = [(target, target.boxes()) for target in batch]
            values = iter(reader.read([(target.name, box) for target, boxes in requests for box in boxes]))
            for target, boxes in requests:
                target.fill([next(values) for _ in boxes])
        rank, world = self.backend.writer
        if manifest.data["writers"] == world:
            self.backend.set_rng_state(manifest.data["rng"][str(rank)])
        else:
            self.log(f"checkpoint written by {manifest.data['writers']} writer(s), now {world}: random number "
                     "generators start fresh (model, optimizer and data position are restored exactly)")
        return manifest


def _match(manifest: Manifest, stored: dict, targets) -> None:
    wanted = {t.name: t for t in targets}
    missing = sorted(set(wanted) - set(stored))
    extra = sorted(set(stored) - set(wanted))
    if missing or extra:
        detail = (f"this model has {missing[0]!r}, the checkpoint does not" if missing
                  else f"the checkpoint has {extra[0]!r}, this model does not")
        raise CheckpointError(f"{manifest.url} is from another model or optimizer: {detail} "
                              f"({len(missing)} missing, {len(extra)} unexpected tensors)")
    for name, target in wanted.items():
        if tuple(stored[name][0]) != tuple(target.shape):
            raise CheckpointError(f"{manifest.url} is from another model: {name} is {list(stored[name][0])} in the "
                                  f"checkpoint, {list(target.shape)} here")


def _batches(targets, max_bytes: int):
    batch, size = [], 0
    for target in targets:
        nbytes = math.prod(target.shape) * target.dtype.itemsize
        if batch and size + nbytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(target)
        size += nbytes
    if batch:
        yield batch
