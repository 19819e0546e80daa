"""A run's output_dir on a bucket: files written to a local folder, uploaded whole to the URL.

Objects in a bucket cannot be appended to, and a pod or a spot VM loses its disk with it: so the logger writes
metrics (and TensorBoard events) to a local staging folder as it would to a local output_dir, and each file goes
up whole at most every `every_s` seconds and when the run ends. A failed upload is said once and tried again at
the next sync; the staging folder is kept when the last one fails, so nothing is lost.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from xla_shard.errors import one_line
from xla_shard.io.storage import Storage, StorageError


def is_url(path: str) -> bool:
    return "://" in path


class StagedDir:
    def __init__(self, url: str, retry_deadline_s: float = 120.0, every_s: float = 30.0,
                 warn: Callable[[str], None] = print):
        self.url, self.every_s, self.warn = url.rstrip("/"), every_s, warn
        self.storage = Storage(self.url, retry_deadline_s)
        self.local = Path(tempfile.mkdtemp(prefix="xla_shard_output_"))
        self._synced_at = time.monotonic()
        self._failed = False

    def fetch(self, name: str) -> Path:
        """The local copy of `name` as the bucket holds it (absent if it holds none)."""
        path = self.local / name
        if self.storage.exists(name):
            path.write_bytes(self.storage.read_bytes(name))
        return path

    def sync(self, force: bool = False) -> bool:
        """Upload every staged file whole (at most every `every_s` seconds unless `force`); False if it failed."""
        if not force and time.monotonic() - self._synced_at < self.every_s:
            return True
        self._synced_at = time.monotonic()
        try:
            for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
                self.storage.write(path.relative_to(self.local).as_posix(), path.read_bytes())
        except StorageError as exc:
            if not self._failed:
                self.warn(f"output_dir: uploading to {self.url} failed ({one_line(exc)}); trying again at the next "
                          "record")
            self._failed = True
            return False
        self._failed = False
        return True

    def close(self) -> None:
        """The last upload; the staging folder goes only once everything in it is in the bucket."""
        if self.sync(force=True):
            shutil.rmtree(self.local, ignore_errors=True)
        else:
            self.warn(f"output_dir: this run's metrics stay in {self.local} (the upload to {self.url} failed)")
