"""The reading side of the format: committed checkpoints, their manifests and the run (lineage) each belongs to.

A checkpoint is committed once `manifest.json` exists in its step directory; nothing else is ever loaded.
Each manifest names the run that wrote it (`run.id`), so several runs' checkpoints can be told apart:
retention deletes only its own run's, and `resume: auto` says which run it continues.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xla_shard.checkpoint import layout, schema
from xla_shard.errors import UserError, one_line
from xla_shard.io.storage import NotAFileError, Storage

# Manifests written before runs were recorded belong to this run.
UNRECORDED_RUN = "unrecorded"
MAX_MANIFEST_BYTES = 1 << 30  # ~5 million chunks; a larger file is not a manifest this code wrote


class CheckpointError(UserError):
    """A checkpoint that cannot be used: missing, uncommitted, corrupt, incomplete or from another model."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose bytes do not verify (crc32, size, missing file, bad manifest): `resume:
    auto` falls back to the previous committed checkpoint; an explicit URL fails."""


@dataclass
class Manifest:
    url: str
    data: dict[str, Any]
    file_bytes: dict[str, int] = field(default_factory=dict)  # sizes already measured (not merely claimed)

    @property
    def step(self) -> int:
        return self.data["step"]

    @property
    def tensors(self) -> dict[str, dict]:
        return self.data["tensors"]

    @property
    def run(self) -> str:
        return (self.data.get("run") or {}).get("id", UNRECORDED_RUN)


def read_manifest(storage: Storage, step_dir: str = "") -> Manifest:
    """A committed checkpoint's manifest, checked whole against the schema (`checkpoint.schema`) before any of
    it is used: a manifest that fails it is corrupt (resume falls back past it), one of another format is not
    ours to read."""
    url = storage.url_of(step_dir)
    rel = f"{step_dir}/{layout.MANIFEST}" if step_dir else layout.MANIFEST
    where = f"{url}/{layout.MANIFEST}"
    try:
        raw = storage.read_bytes(rel, limit=MAX_MANIFEST_BYTES)  # a regular file, bounded
    except FileNotFoundError:
        raise CheckpointError(f"{url} is not a committed checkpoint: it has no {layout.MANIFEST} "
                              "(a save that never finished, or not an xla_shard checkpoint)") from None
    except (NotAFileError, IsADirectoryError) as exc:
        raise CorruptCheckpointError(f"{where}: {one_line(exc)}") from None
    try:
        data = schema.parse_json(raw)
        if isinstance(data, dict) and isinstance(data.get("format"), str) and data["format"] != layout.FORMAT:
            raise CheckpointError(f"{where}: format {data['format']!r}, this xla_shard reads {layout.FORMAT!r}")
        schema.check_manifest(data, verified=True)
        if data.get("format") != layout.FORMAT:
            raise schema.SchemaError("format", f"expected {layout.FORMAT!r}")
    except schema.SchemaError as exc:
        raise CorruptCheckpointError(f"{where} is damaged: {exc}") from None
    named = layout.parse_step_dir(url)
    if named is not None and named != data["step"]:
        raise CorruptCheckpointError(f"{where} says step {data['step']} but lies in {layout.step_dir(named)}: "
                                     "it was moved or edited; not loading it")
    return Manifest(url, data)


def committed_steps(storage: Storage) -> list[int]:
    steps = {layout.parse_step_dir(path.rsplit("/", 1)[0]) for path in storage.glob(f"step-*/{layout.MANIFEST}")}
    return sorted(s for s in steps if s is not None)


def all_steps(storage: Storage) -> list[int]:
    steps = {layout.parse_step_dir(path) for path in storage.glob("step-*")}
    return sorted(s for s in steps if s is not None)


class Runs:
    """Which run wrote each committed checkpoint under a checkpoint.dir. Committed manifests are never
    rewritten, so each is read once."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._run_of: dict[int, str] = {}

    def run_of(self, step: int) -> str:
        if step not in self._run_of:
            try:
                self._run_of[step] = read_manifest(self.storage, layout.step_dir(step)).run
            except CorruptCheckpointError:
                self._run_of[step] = UNRECORDED_RUN
        return self._run_of[step]

    def forget(self, step: int) -> None:
        self._run_of.pop(step, None)
