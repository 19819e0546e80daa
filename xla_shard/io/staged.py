"""A run's output_dir on a bucket: files written to a local folder, uploaded whole to the URL.

Objects in a bucket cannot be appended to, and a pod or a spot VM loses its disk with it: so the logger writes
metrics (and TensorBoard events) to a local staging folder as it would to a local output_dir, and each file goes
up whole at most every `every_s` seconds and when the run ends. Metrics are the run's record, not its master: a
bucket that cannot be read or written (an outage, a bucket that does not exist or was deleted mid-run) is said
once, naming the staging folder, and the training goes on; the staging folder is kept when the last upload
fails, so nothing is lost.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from xla_shard.errors import ConfigError, file_in_the_way, one_line
from xla_shard.io.storage import Storage, StorageError


# what a bucket that is down, missing or forbidden raises through `Storage` (a missing bucket: FileNotFoundError)
_UNREACHABLE = (StorageError, OSError)


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
        """The local copy of `name` as the bucket holds it (absent if it holds none, or if it cannot be read:
        said once)."""
        path = self.local / name
        try:
            if self.storage.exists(name):
                path.write_bytes(self.storage.read_bytes(name))
        except _UNREACHABLE as exc:
            self.warn(f"output_dir: reading {self.url}/{name} failed ({one_line(exc)}); this run's records start "
                      f"afresh in {self.local}, uploaded when the bucket answers")
        return path

    def sync(self, force: bool = False) -> bool:
        """Upload every staged file whole (at most every `every_s` seconds unless `force`); False if it failed."""
        if not force and time.monotonic() - self._synced_at < self.every_s:
            return True
        self._synced_at = time.monotonic()
        try:
            for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
                self.storage.write(path.relative_to(self.local).as_posix(), path.read_bytes())
        except _UNREACHABLE as exc:
            if not self._failed:
                self.warn(f"output_dir: uploading to {self.url} failed ({one_line(exc)}); the records stay in "
                          f"{self.local}, tried again at the next one")
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


def check_output_dir(path: str) -> None:
    """output_dir is a directory, or can become one (a URL is written through a staging folder)."""
    if is_url(path):  # written through a staging folder (StagedDir)
        return
    blocker = file_in_the_way(Path(path))
    if blocker:
        raise ConfigError("output_dir", f"{path!r}: {blocker} is a file, not a directory")
