"""fsspec storage with bounded retries: local paths, gs:// (gcsfs), memory://, anything fsspec opens.

Every call that touches storage goes through `Storage`, so transient failures (HTTP 408/429/5xx, timeouts,
refused or reset connections) are retried with jittered exponential backoff up to one deadline, and a real
outage ends in a `StorageError` naming the URL. Credentials come from the environment (on a TPU VM, the VM's
service account through the metadata server) and are never logged: messages carry URLs only.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fnmatch
import logging
import os
import stat
from collections.abc import Callable, Iterable
from typing import TypeVar

import tenacity
from fsspec.core import url_to_fs

from xla_shard.errors import UserError, one_line, redact

T = TypeVar("T")

_TRANSIENT_HTTP = {408, 425, 429, 500, 502, 503, 504}
_TRANSIENT_ERRNO = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
                    errno.EHOSTUNREACH, errno.ENETUNREACH}


# gcsfs logs a full traceback each time its own inner retries run out; `Storage.retry` retries again and
# reports the failure once, as a StorageError naming the URL. Users who set a gcsfs log level keep it.
if logging.getLogger("gcsfs").level == logging.NOTSET:
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)


class StorageError(UserError):
    """Storage stayed unreachable past the retry deadline, or refused the request outright."""


class NotAFileError(StorageError):
    """What a reader expected to be a file is something else (a FIFO, a device, a socket, a directory), or
    larger than what it reads: never opened as a stream that has no end or blocks for ever."""


# What a path that names no file to read says, whatever is stored: it is not there to be read (as a missing file
# is), not a storage fault to report as one.
_NO_FILE_THERE = (errno.ELOOP, errno.ENOTDIR)

SMALL_FILE_BYTES = 256 << 20  # what `read_bytes` reads whole unless told otherwise: configs, indexes, tokenizers

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


def read_local_file(path: str, limit: int = SMALL_FILE_BYTES) -> bytes:
    """A local regular file's bytes, at most `limit` of them (`NotAFileError` naming it otherwise)."""
    with _open_regular(path, path) as stream:
        data = stream.read(limit + 1)
    if len(data) > limit:
        raise NotAFileError(f"{path} is larger than {limit} bytes, which is all that is read of such a file")
    return data


def _open_regular(path: str, shown: str):
    """A local file opened for reading, if it is a regular one (links followed): a FIFO is opened without
    blocking, then refused with anything else that is not a file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory", path)
            raise NotAFileError(f"{shown} is {_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, not a file; "
                                "refusing to read it")
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def is_transient(exc: BaseException) -> bool:
    if _retried_by_gcsfs(exc):
        return True
    code = getattr(exc, "code", None) or getattr(exc, "status", None)
    if isinstance(code, int):
        return code in _TRANSIENT_HTTP
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNO:
        return True
    try:
        import aiohttp
    except ImportError:  # only gcsfs/http filesystems bring aiohttp
        return False
    return isinstance(exc, aiohttp.ClientError) and not isinstance(exc, aiohttp.ClientResponseError)


def _retried_by_gcsfs(exc: BaseException) -> bool:
    """What gcsfs's own retries covered before `Storage` took them over (xla_shard/io/gcs.py): among others, a
    failed credential refresh, a checksum mismatch, expired credentials."""
    module = type(exc).__module__
    if not module.startswith(("gcsfs", "google", "requests")):
        return False
    from gcsfs.retry import is_retriable

    return is_retriable(exc)


def _emulated(url: str) -> bool:
    return url.startswith("gs://") and bool(os.environ.get("STORAGE_EMULATOR_HOST"))


def storage_options(url: str) -> dict:
    if _emulated(url):
        # A local GCS emulator (tests, benchmarks): no credentials, and no gRPC probe for zonal/HNS buckets,
        # which an emulator never answers (gcsfs would wait 60 s per bucket before falling back). gcsfs reads
        # this switch when it is first imported; `open_fs` does not depend on that having happened after.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        return {"token": "anon"}
    return {}


def open_fs(url: str, retried_by_caller: bool = False):
    """(filesystem, root path) for a URL. Against a GCS emulator, gcsfs's plain client, whatever gcsfs chose
    as its default class at import (its experimental one probes each bucket over gRPC, which hung a test run
    for minutes when gcsfs had been imported before the emulator was set). `retried_by_caller`: gs:// gets
    a client that tries each request once (xla_shard/io/gcs.py), for `Storage`, which retries to its deadline."""
    if retried_by_caller and url.startswith(("gs://", "gcs://")):
        from xla_shard.io.gcs import SingleAttemptGCSFileSystem as GCSFileSystem
    elif _emulated(url):
        from gcsfs.core import GCSFileSystem
    else:
        return url_to_fs(url, **storage_options(url))
    fs = GCSFileSystem(**storage_options(url))
    return fs, fs._strip_protocol(url)


def _matches(parts: list[str], segments: list[str]) -> bool:
    return len(parts) == len(segments) and all(fnmatch.fnmatchcase(p, s) for p, s in zip(parts, segments))


class Storage:
    """One filesystem rooted at a URL; paths passed to methods are relative to the root."""

    def __init__(self, url: str, retry_deadline_s: float = 120.0):
        self.url = url.rstrip("/")
        self.retry_deadline_s = retry_deadline_s
        try:
            self.fs, self.root = open_fs(self.url, retried_by_caller=True)
        except (ValueError, ImportError) as exc:
            raise StorageError(redact(one_line(f"cannot open storage URL {self.url!r}: {exc}"))) from None
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *[p.strip("/") for p in parts if p]])

    def url_of(self, *parts: str) -> str:
        return "/".join([self.url, *[p.strip("/") for p in parts if p]])

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=tenacity.stop_after_delay(self.retry_deadline_s),
            wait=tenacity.wait_exponential_jitter(multiplier=0.2, max=10.0, jitter=0.2),
            reraise=True,
        )
        try:
            return retrying(fn)
        except (FileNotFoundError, IsADirectoryError, NotAFileError):
            raise
        except OSError as exc:
            if exc.errno in _NO_FILE_THERE:  # the path itself: a link that loops, a file where a folder should be
                raise NotAFileError(redact(one_line(f"{what}: {os.strerror(exc.errno).lower()}"))) from None
            raise self._failed(what, exc) from exc
        except Exception as exc:
            raise self._failed(what, exc) from exc

    def _failed(self, what: str, exc: Exception) -> StorageError:
        kind = "gave up after retrying for" if is_transient(exc) else "failed, not retried (not transient), within"
        return StorageError(redact(one_line(f"{what}: {kind} {self.retry_deadline_s:g}s: {type(exc).__name__}: "
                                            f"{exc}")))

    # ---- operations -------------------------------------------------------------------------------
    def write(self, rel: str, parts: bytes | list[bytes | memoryview] | Callable[[], Iterable[bytes]]) -> None:
        """Write one whole object from its parts. A local file goes to a temporary name first and is renamed,
        so a crash leaves the old file or the new one; object stores make single-object writes atomic. Parts
        given as a function are streamed (and produced again if a transient error makes the write start over),
        so an object larger than memory never has to be held whole."""
        parts = [parts] if isinstance(parts, (bytes, bytearray, memoryview)) else parts
        path = self.path(rel)

        def write():
            if self.local:
                self.fs.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.tmp-{os.getpid()}"
                try:
                    with open(tmp, "wb") as out:
                        for part in parts() if callable(parts) else parts:
                            out.write(part)
                        out.flush()
                        os.fsync(out.fileno())
                    os.replace(tmp, path)
                except BaseException:  # a full disk must not stay full of our half-written file
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
            elif callable(parts):
                with self.fs.open(path, "wb") as out:
                    for part in parts():
                        out.write(part)
            else:
                self.fs.pipe_file(path, parts[0] if len(parts) == 1 and isinstance(parts[0], bytes)
                                  else b"".join(parts))

        self.retry(f"writing {self.url_of(rel)}", write)

    def read_bytes(self, rel: str, limit: int = SMALL_FILE_BYTES) -> bytes:
        """The whole of `rel`: a regular file of at most `limit` bytes (`NotAFileError` naming it otherwise)."""
        path, shown = self.path(rel), self.url_of(rel)

        def too_large(size: int) -> NotAFileError:
            return NotAFileError(f"{shown} is {size} bytes or more; at most {limit} are read from such a file")

        def read() -> bytes:
            if self.local:
                with self._open_local(rel) as stream:
                    data = stream.read(limit + 1)
            else:
                size = self.fs.size(path)
                if size > limit:
                    raise too_large(size)
                data = self.fs.cat_file(path, start=0, end=limit + 1)
            if len(data) > limit:
                raise too_large(len(data))
            return data

        return self.retry(f"reading {shown}", read)

    def read_ranges(self, rel_paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        """Byte ranges from many objects in one call; gcsfs fetches them concurrently."""
        if not rel_paths:
            return []
        paths = [self.path(p) for p in rel_paths]
        if self.local:
            for rel in set(rel_paths):
                self.size(rel)  # each a regular file
        result = self.retry(f"reading {len(paths)} range(s) under {self.url}",
                            lambda: self.fs.cat_ranges(paths, starts, ends, on_error="raise"))
        return list(result)

    def read_into(self, rel: str, start: int, out: memoryview) -> int:
        """Fill `out` with the bytes of `rel` from `start` on; return how many there were (fewer at the end of
        the file). Local files are read straight into `out`, with no temporary; other stores take one ranged
        request."""
        path = self.path(rel)

        def read() -> int:
            if self.local:
                with self._open_local(rel) as stream:
                    stream.seek(start)
                    got = 0
                    while got < len(out):
                        count = stream.readinto(out[got:])
                        if not count:
                            break
                        got += count
                    return got
            (data,) = self.fs.cat_ranges([path], [start], [start + len(out)], on_error="raise")
            out[:len(data)] = data
            return len(data)

        return self.retry(f"reading {self.url_of(rel)}", read)

    def _open_local(self, rel: str):
        """A local file under the root opened for reading: a regular file, and inside the root (links
        followed); `NotAFileError` naming it otherwise."""
        link = self.outside(rel)
        if link is not None:
            raise NotAFileError(f"{self.url_of(rel)} is a link to {link}, outside {self.url}; refusing to read it")
        return _open_regular(self.path(rel), self.url_of(rel))

    def outside(self, rel: str) -> str | None:
        """Where `rel` really is, if a symbolic link takes it outside the root (None: inside). Object stores
        have no links. A Hugging Face cache snapshot (`models--org--name/snapshots/<revision>/`) links each
        file into its repository's `blobs/`: that is inside too."""
        if not self.local:
            return None
        root = os.path.realpath(self.root)
        real = os.path.realpath(self.path(rel))
        allowed = [root]
        if os.path.basename(os.path.dirname(root)) == "snapshots":
            allowed.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
        return None if any(real == a or real.startswith(a + os.sep) for a in allowed) else real

    def exists(self, rel: str) -> bool:
        path = self.path(rel)

        def check():
            if self.local:  # a link that leads nowhere (or to itself) is there: reading it says what it is
                return os.path.lexists(path)
            self.fs.invalidate_cache(os.path.dirname(path))
            return self.fs.exists(path)

        return self.retry(f"checking {self.url_of(rel)}", check)

    def size(self, rel: str) -> int:
        """The size of `rel`, a file (`NotAFileError` for anything else: a FIFO's or a device's size says
        nothing of what reading it gives)."""
        if self.local:
            def local() -> int:
                with self._open_local(rel) as stream:
                    return os.fstat(stream.fileno()).st_size

            return self.retry(f"stat {self.url_of(rel)}", local)
        return self.retry(f"stat {self.url_of(rel)}", lambda: self.fs.size(self.path(rel)))

    def glob(self, pattern: str) -> list[str]:
        """Paths below the root matching `pattern` (`fnmatch` per segment: `step-*/manifest.json`), relative to
        the root. Only the pattern is a pattern: the root is listed, never globbed, so a directory named
        `run[1]` or `a*b` is itself and nothing else."""
        segments = pattern.strip("/").split("/")
        root = self.root.rstrip("/")

        def run():
            self.fs.invalidate_cache(root)
            try:
                found = self.fs.find(root, maxdepth=len(segments), withdirs=True, detail=False)
            except FileNotFoundError:
                return []
            relative = (p.rstrip("/")[len(root) + 1:] for p in found if p.rstrip("/").startswith(root + "/"))
            return [rel for rel in relative if _matches(rel.split("/"), segments)]

        return sorted(set(self.retry(f"listing {self.url}", run)))

    def remove_tree(self, rel: str) -> None:
        def remove():
            try:
                self.fs.rm(self.path(rel), recursive=True)
            except FileNotFoundError:
                pass

        self.retry(f"deleting {self.url_of(rel)}", remove)

    def move(self, rel: str, to: str) -> None:
        """Rename a tree (a rename on local disks; copy then delete on object stores)."""
        self.retry(f"moving {self.url_of(rel)} to {self.url_of(to)}",
                   lambda: self.fs.mv(self.path(rel), self.path(to), recursive=True))
