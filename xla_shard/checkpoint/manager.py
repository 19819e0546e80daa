"""Save, commit, retain and restore sharded checkpoints.

A save has three phases. (1) Snapshot: each process copies the boxes it owns to host memory; this is all
the training step waits for. (2) Upload: each writer puts one shard file and then its index file; in a
background thread when `checkpoint.async` is on. (3) Commit: the main process waits until every writer's
index exists, merges them into `manifest.json` and writes it last. Loaders only see checkpoints that have a
manifest, so a crash or an outage before (3) leaves no loadable half-checkpoint, and older checkpoints are
deleted only after a newer one committed. Coordination goes through storage, not collectives, so an async
save never races the training step for the process group.

Runs: every manifest records the run (lineage) that wrote it. A step directory that holds a manifest is never
written again; a run that would write steps another run committed in the same directory is refused before it
trains; retention deletes only the run's own checkpoints; `resume: auto` says which run it continues, and
falls back past committed checkpoints that fail verification, setting them aside.
"""

from __future__ import annotations

import datetime
import json
import math
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from xla_shard.checkpoint import extra_state, layout, schema, window
from xla_shard.checkpoint.contract import ShardedState
from xla_shard.checkpoint.extra_state import Extra
from xla_shard.checkpoint.run_record import RunRecord, changed_identity
from xla_shard.checkpoint.manifest import (
    UNRECORDED_RUN,
    CheckpointError,
    CorruptCheckpointError,
    Manifest,
    Runs,
    all_steps,
    committed_steps,
    read_manifest,
)
from xla_shard.checkpoint.model_config import hf_config
from xla_shard.checkpoint.reader import ChunkReader, fill
from xla_shard.errors import ConfigError, UserError
from xla_shard.io.storage import Storage
from xla_shard.io.untrusted_json import SchemaError

if TYPE_CHECKING:
    import torch


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("xla_shard", "torch", "torch_xla", "transformers", "fsspec", "gcsfs"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found


# ---- writing ------------------------------------------------------------------------------------------
class Checkpointer:
    """One per training process. `restore` picks up where `checkpoint.resume` says; `save` returns once the
    step may go on; `wait` surfaces any failure.

    `section` is the config's `checkpoint` section; `state` (a backend's `backend.state`) hands out and takes
    back the sharded state. A checkpoint whose run identity (`state.run_identity()`: model, optimizer, seed,
    data, batch) or model architecture (the model's transformers config, read from the model) differs from this
    run's is refused by `restore`, naming the key: it would not continue that run.
    """

    def __init__(self, section, state: ShardedState, log: Callable[[str], None] = print, trained_only: bool = False,
                 record: RunRecord | None = None):
        self.section = section
        self.state = state
        self.log = log
        # Frozen parameters (LoRA's base model) are left out: they are in the model directory already.
        self.trained_only = trained_only
        self.storage = Storage(section.dir, section.retry_deadline_s)
        self.runs = Runs(self.storage)
        self.run: dict[str, Any] = _new_run()
        self._thread: threading.Thread | None = None
        self._hf_config: dict[str, Any] | None = None
        self._extra: dict[str, Any] | None = None  # what the save in flight stores as extra state
        # The run's record (its owner, the trainer, fills it in as it learns it), written into every manifest;
        # `restored`: the record of the checkpoint `restore` read.
        self.record = record if record is not None else RunRecord()
        self.restored = RunRecord()
        self._error: BaseException | None = None
        self.saving_step: int | None = None
        self.last_saved: int | None = None  # newest step this process saved (committed or in flight)
        self.last_committed: int | None = None
        self.last_write: dict[str, Any] | None = None  # the newest commit's `window.write_record`
        self._own: dict | None = None  # what `restore(own=)` fills

    # ---- save ---------------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, block: bool = False, extra: Extra | None = None,
             own: dict[str, torch.Tensor] | None = None) -> None:
        """Snapshot now, upload and commit (in the background with `checkpoint.async`). A step already saved
        by this process is not saved again: its directory is committed and is never rewritten.

        `extra`: more state of your loop, by name: objects with `state_dict()` / `load_state_dict()` (torch's
        Stateful: an LR scheduler, a data loader) or plain dicts; the main process's is stored, as JSON, in the
        manifest, and `restore(..., extra=)` puts it back. `own`: host tensors of this process alone (what it
        generated), stored in its shard under `own/<writer>/`; `restore(..., own=)` gives them back to the same
        process where the run has as many writers."""
        if step == self.last_saved:
            return
        self.wait()  # at most one save in flight; an earlier failure surfaces here
        self._extra = extra_state.snapshot(extra) if extra else None
        self._hf_config = hf_config(model)
        entries = [layout.Entry(t.name, t.shape, t.dtype, t.chunks()) for t in self._tensors(model, optimizer)]
        prefix = _own_prefix(self.state.writer[0])
        entries += [layout.Entry(prefix + name, tuple(value.shape), value.dtype,
                                 [((0,) * value.dim(), value.detach().cpu().contiguous())])
                    for name, value in (own or {}).items()]
        rng = self.state.rng_state()
        self.saving_step = self.last_saved = step
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

    def last_committed_url(self) -> str | None:
        """Where the newest checkpoint this run committed is (what `checkpoint.export.export` reads); None if it
        committed none. Waits for a save in flight first."""
        self.wait()
        if self.last_committed is None:
            return None
        return self.storage.url_of(layout.step_dir(self.last_committed))

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
        _refuse_non_finite(step, entries, self.last_committed)  # here, off the step's critical path
        directory = layout.step_dir(step)
        if self.storage.exists(f"{directory}/{layout.MANIFEST}"):
            self.runs.forget(step)
            raise CheckpointError(f"{self.storage.url_of(directory)} is already committed (run "
                                  f"{self.runs.run_of(step)}); a committed checkpoint is never rewritten in place. "
                                  "Another run is writing to this checkpoint.dir")
        rank, world = self.state.writer
        started = time.monotonic()
        parts, index = layout.encode_shard(entries)
        shard = layout.shard_file(rank, world)
        with ThreadPoolExecutor(1) as pool:  # checksum while uploading: both release the GIL
            checksums = pool.submit(layout.add_checksums, parts, index)
            self.storage.write(f"{directory}/{shard}", parts)
            checksums.result()
        # the writer's time for its share: what an emergency save takes (`checkpoint.window`)
        index.update(file=shard, writer=rank, writers=world, rng=rng, write_s=time.monotonic() - started)
        self.storage.write(f"{directory}/{layout.index_file(rank, world)}", json.dumps(index).encode())
        if self.state.is_main:
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
                    "run": self.run, **self.state.describe(), "hf_config": self._hf_config, "versions": versions(),
                    "files": files, "rng": rng, "tensors": tensors}
        if self._extra is not None:
            manifest["extra"] = self._extra
        written = window.write_record(indexes)
        if written is not None:
            manifest["write"] = written
        manifest.update(self.record.to_manifest())
        raw = json.dumps(manifest, indent=1).encode()
        try:  # what is committed must read back: the reader's own rules, on the very bytes (the tensors' tiling
            # was checked above, and is the costly part on a pod)
            schema.check_manifest({**schema.parse_json(raw), "files": {}, "tensors": {}}, verified=True)
        except SchemaError as exc:
            raise CheckpointError(f"step {step}: the manifest would not read back ({exc}); not committing") from None
        self.storage.write(f"{directory}/{layout.MANIFEST}", raw)
        first = self.last_committed is None
        self.last_committed = step
        self.last_write = written
        self.log(f"checkpoint step {step} committed: {self.storage.url_of(directory)}")
        if first and written is not None:
            self._say_window(written)

    def _say_window(self, written: dict[str, Any]) -> None:
        """After the run's first save: how long a stop's save takes, against the grace the trainer gives it."""
        grace = self.section.preemption_grace_s
        took = (f"a save takes {written['seconds']:.1f} s for its slowest writer ({written['bytes'] / 2**20:.0f} MiB "
                f"of {written['writers']} writer(s))")
        if written["seconds"] > grace:
            self.log(f"WARNING: {took}, longer than checkpoint.preemption_grace_s={grace:g}: a preemption would lose "
                     f"the steps since the last checkpoint (checkpoint.every_steps={self.section.every_steps})")
        else:
            self.log(f"{took}: a stop's save (after the step in flight) fits checkpoint.preemption_grace_s="
                     f"{grace:g}; a spot VM gets {window.SPOT_WINDOW_S:g} s (xla-shard gcp render says it for the "
                     "target)")

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
        """Keep this run's newest `keep_last` committed checkpoints and every `keep_every`-th; delete its others,
        and the debris of saves that never committed, older than the newest commit. Other runs' committed
        checkpoints are never touched."""
        committed = committed_steps(self.storage)
        own = [s for s in committed if self.runs.run_of(s) == self.run["id"]]
        keep = set(own[-self.section.keep_last:])
        if self.section.keep_every:
            keep |= {s for s in own if s % self.section.keep_every == 0}
        others = set(committed) - set(own)
        for step in all_steps(self.storage):
            if step < newest and step not in keep and step not in others:
                self.storage.remove_tree(layout.step_dir(step))
                self.runs.forget(step)

    # ---- restore --------------------------------------------------------------------------------------
    def restore(self, model, optimizer, extra: Extra | None = None, own: dict | None = None) -> int:
        """Load what `checkpoint.resume` asks for into `model` and `optimizer` (and this process's RNGs, and
        each object of `extra` that `save` stored under its name; `own`, a dict, is filled with the tensors this
        process saved as its own, where the checkpoint's writers are this run's); return the step to continue
        from, 0 for a fresh start (`extra` and `own` then stay as they are)."""
        resume = self.section.resume
        extra = extra_state.restorable(extra)
        self._own = own
        if resume == "never":
            self._claim(0, "checkpoint.resume=never starts a new run")
            return 0
        if resume == "auto":
            return self._restore_newest(model, optimizer, extra)
        return self._restore_url(resume, model, optimizer, extra)

    def _restore_newest(self, model, optimizer, extra: Extra) -> int:
        skipped: list[str] = []
        for step in reversed(committed_steps(self.storage)):
            url = self.storage.url_of(layout.step_dir(step))
            try:
                manifest, error = self._load(url, model, optimizer, extra), None
            except CorruptCheckpointError as exc:
                manifest, error = None, exc
            if self.state.any_rank(error is not None):  # each process reads only its own chunks: agree
                skipped.append(f"step {step}: {error or 'failed verification on another process'}")
                self._set_aside(step, skipped[-1])
                continue
            self._continue(manifest)
            self._clear_debris(after=step)
            return step
        if skipped:
            raise CheckpointError(f"no committed checkpoint under {self.storage.url} loads; the newest: {skipped[0]}")
        self._clear_debris(after=0)
        return 0

    def _restore_url(self, url: str, model, optimizer, extra: Extra) -> int:
        try:
            manifest = self._load(url, model, optimizer, extra)
        except CheckpointError as exc:
            if type(exc) is not CheckpointError:  # damaged, or not this model's: said as it is
                raise
            raise ConfigError("checkpoint.resume", str(exc)) from None
        step = manifest.step
        source = Storage(url)
        committed = committed_steps(self.storage)
        if (type(source.fs) is type(self.storage.fs) and source.root.rstrip("/") ==
                self.storage.path(layout.step_dir(step)).rstrip("/") and committed and committed[-1] == step):
            self._continue(manifest)  # the newest checkpoint here: the same run goes on
        else:  # an older step, or another directory: a new run branches off it
            self.run["parent"] = {"run": manifest.run, "step": step, "url": url}
            self._claim(step, f"it resumes from {url}")
            self._log_resume(url, step, f"branching off run {manifest.run} as new")
        self._clear_debris(after=step)
        return step

    def _continue(self, manifest: Manifest) -> None:
        self.run = manifest.data.get("run") or {"id": UNRECORDED_RUN, "started": None, "parent": None}
        self._log_resume(manifest.url, manifest.step, "continuing")

    def _claim(self, start: int, why: str) -> None:
        """Refuse to start a new run where it would write steps that another run committed here."""
        later = [s for s in committed_steps(self.storage) if s > start]
        if later:
            runs = sorted({self.runs.run_of(s) for s in later})
            raise ConfigError("checkpoint.dir", f"{self.storage.url} holds committed checkpoints of run "
                                                f"{', '.join(runs)} up to step {later[-1]}; this new run ({why}) would "
                                                f"write steps after {start} there and overwrite them. Use another "
                                                "checkpoint.dir for a new run, or checkpoint.resume=auto to continue "
                                                "the newest")

    def _clear_debris(self, after: int) -> None:
        """Remove uncommitted step directories past the resume point, so that no shard or index of a save that
        died can be mistaken for one of this run's. Every rank is still before its first step, which it cannot
        finish without the main process, so this happens before any of them saves."""
        if not self.state.is_main:
            return
        committed = set(committed_steps(self.storage))
        for step in all_steps(self.storage):
            if step > after and step not in committed:
                self.storage.remove_tree(layout.step_dir(step))

    def _set_aside(self, step: int, why: str) -> None:
        """A committed checkpoint that fails verification moves out of the step-* namespace (nothing deletes it)."""
        aside = f"corrupt-{layout.step_dir(step)}-{int(time.time())}"
        self.log(f"checkpoint {why}; falling back to the previous committed checkpoint"
                 + (f" (set aside as {self.storage.url_of(aside)})" if self.state.is_main else ""))
        if self.state.is_main:
            self.storage.move(layout.step_dir(step), aside)
            self.runs.forget(step)

    def _log_resume(self, url: str, step: int, how: str) -> None:
        started = self.run.get("started")
        when = f", started {datetime.datetime.fromtimestamp(started).isoformat(timespec='seconds')}" if started else ""
        self.log(f"resumed from {url} at step {step}, {how} run {self.run['id']}{when}")

    def _load(self, url: str, model, optimizer, extra: Extra) -> Manifest:
        storage = Storage(url, self.section.retry_deadline_s)
        manifest = read_manifest(storage)
        self._check_identity(manifest, hf_config(model))
        stored = {name: (tuple(meta["shape"]), layout.TORCH_DTYPES[meta["dtype"]])
                  for name, meta in manifest.tensors.items() if not name.startswith(_OWN)}
        targets = self._tensors(model, optimizer, stored)
        _match(manifest, stored, targets)
        extra_state.check_extra(manifest, extra)
        reader = ChunkReader(storage, manifest)
        fill(reader, targets)
        extra_state.load_extra(manifest, extra)
        self.restored = RunRecord.from_manifest(manifest.data)
        rank, world = self.state.writer
        if self._own is not None and manifest.data["writers"] == world:
            prefix = _own_prefix(rank)
            names = [name for name in manifest.tensors if name.startswith(prefix)]
            boxes = [(name, ((0,) * len(manifest.tensors[name]["shape"]), tuple(manifest.tensors[name]["shape"])))
                     for name in names]
            self._own.clear()
            if names:
                self._own.update({name[len(prefix):]: value for name, value in zip(names, reader.read(boxes))})
        if manifest.data["writers"] == world and str(rank) in manifest.data["rng"]:
            try:
                self.state.set_rng_state(manifest.data["rng"][str(rank)])
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:  # binascii.Error is a ValueError
                raise CorruptCheckpointError(f"{manifest.url}/{layout.MANIFEST} is damaged: rng[{str(rank)!r}] is "
                                             f"not a random-number state ({type(exc).__name__})") from None
        else:
            self.log(f"checkpoint written by {manifest.data['writers']} writer(s), now {world}: random number "
                     "generators start fresh (model, optimizer and data position are restored exactly)")
        return manifest

    def _tensors(self, model, optimizer, stored=None) -> list:
        return [t for t in self.state.tensors(model, optimizer, stored=stored) if not (self.trained_only and t.frozen)]

    def _check_identity(self, manifest: Manifest, architecture: dict[str, Any] | None) -> None:
        changed = changed_identity(manifest, self.state.run_identity())
        if changed:
            raise ConfigError(*changed)
        if architecture is not None and isinstance(manifest.data.get("hf_config"), dict):
            saved, now = _architecture(manifest.data["hf_config"]), _architecture(architecture)
            changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
            if changed:
                first = changed[0]
                raise ConfigError("model.name", f"the model's config differs from the one {manifest.url} was written "
                                                f"with: {first} is {now.get(first)!r}, was {saved.get(first)!r}"
                                                + (f" (and {len(changed) - 1} more field(s))"
                                                   if len(changed) > 1 else "")
                                                + "; resuming would not continue that run")


def _refuse_non_finite(step: int, entries: list[layout.Entry], last_committed: int | None) -> None:
    """A diverged run's state is worth nothing as a resume point: never commit NaN or inf."""
    def finite(chunk) -> bool:  # a NaN or inf makes the sum non-finite; only then (or on overflow) look closer
        return bool(chunk.sum().isfinite()) or bool(chunk.isfinite().all())

    for entry in entries:
        if entry.dtype.is_floating_point and not all(finite(chunk) for _, chunk in entry.chunks):
            kept = f"step {last_committed}" if last_committed is not None else "none yet"
            raise CheckpointError(f"step {step}: {entry.name} holds NaN or inf, so training diverged; not saving it "
                                  f"(the last committed checkpoint, {kept}, stays the resume point). Lower train.lr")


# transformers config fields that say nothing about the architecture (versions, runtime switches).
_NOT_ARCHITECTURE = {"transformers_version", "_name_or_path", "use_cache", "dtype", "torch_dtype",
                     "output_attentions", "output_hidden_states", "return_dict", "_attn_implementation_autoset"}


class NoCheckpoints:
    """What a run without `checkpoint.dir` checkpoints with: nothing. The trainer calls it as it would a
    `Checkpointer`, so it never asks whether there is one."""

    last_committed: int | None = None

    def __init__(self, record: RunRecord | None = None):
        self.record = record if record is not None else RunRecord()  # kept, never written
        self.restored = RunRecord()  # what a resume restored: nothing, there is none

    def save(self, step: int, model, optimizer, block: bool = False, extra: Extra | None = None,
             own: dict | None = None) -> None:
        pass

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def restore(self, model, optimizer, extra: Extra | None = None, own: dict | None = None) -> int:
        extra_state.restorable(extra)  # a mistake is said whether or not there is a checkpoint to restore from
        return 0

    def last_committed_url(self) -> None:
        return None


def _architecture(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Compared as the manifest stores it: through JSON (int keys of id2label become strings)."""
    return {k: v for k, v in json.loads(json.dumps(hf_config)).items() if k not in _NOT_ARCHITECTURE}


def _new_run() -> dict[str, Any]:
    return {"id": uuid.uuid4().hex[:12], "started": time.time(), "parent": None}


_OWN = "own/"  # a process's own tensors (`save(own=)`), under its writer's index


def _own_prefix(writer: int) -> str:
    return f"{_OWN}{writer:05d}/"


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
        if stored[name][1] != target.dtype:
            raise CheckpointError(f"{manifest.url} stores {name} as {layout.DTYPES[stored[name][1]]}, this run "
                                  f"holds it as {layout.DTYPES.get(target.dtype, target.dtype)}; not converting it "
                                  "silently")
