"""Rows from the user's files: which files `data.path` names, in which format, read by Hugging Face `datasets`.

`datasets` memory-maps Arrow tables (a corpus larger than host memory works) and caches every `map` by the
fingerprint of its input and function, so a restart reads the tokenized rows back instead of tokenizing again.
"""

from __future__ import annotations

import glob
import itertools
import os
from pathlib import Path, PurePosixPath

from xla_shard.errors import ConfigError, one_line
from xla_shard.io.storage import Storage, open_fs

# format key -> the `datasets` builder that reads it
BUILDERS = {"json": "json", "jsonl": "json", "csv": "csv", "parquet": "parquet", "txt": "text"}
_EXTENSIONS = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet",
               ".txt": "txt", ".text": "txt"}
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_GLOB = set("*?[")


def resolve_files(path: str, key: str) -> list[str]:
    """The files a path names: one file, every file in a directory, or a glob; local or any fsspec URL."""
    try:
        fs, root = open_fs(path)
    except (ValueError, ImportError) as exc:
        raise ConfigError(key, f"cannot open {path!r}: {one_line(exc)}") from None
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if _GLOB & set(root) and not fs.exists(root):  # a file or directory named `a[1]` is itself
        found = sorted(fs.glob(root))
    elif fs.isdir(root):
        found = sorted(p for p in fs.find(root) if format_of(p) is not None)
        if not found:
            raise ConfigError(key, f"{path} is a directory with no files of a format xla_shard reads "
                                   f"({', '.join(sorted(_EXTENSIONS))}, also compressed)")
    elif fs.isfile(root):
        found = [root]
    else:
        raise ConfigError(key, f"no file or directory at {path}")
    if not found:
        raise ConfigError(key, f"{path} matches no file")
    return [p if protocol in ("file", "local") else fs.unstrip_protocol(p) for p in found]


def local_copy(url: str) -> str:
    """A remote file in the local cache (downloaded once per size and modification time, with retries), so
    `datasets` reads and memory-maps it like a local one, also where the hub is offline."""
    import hashlib

    directory, name = url.rsplit("/", 1)
    storage = Storage(directory)
    info = storage.retry(f"stat {url}", lambda: storage.fs.info(storage.path(name)))
    stamp = f"{url}|{info.get('size')}|{info.get('mtime') or info.get('updated') or info.get('etag')}"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "xla_shard" / "data"
    target = cache / hashlib.sha256(stamp.encode()).hexdigest()[:16] / name
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{name}.{os.getpid()}.partial")
        storage.retry(f"downloading {url}", lambda: storage.fs.get_file(storage.path(name), str(partial)))
        os.replace(partial, target)
    return str(target)


def format_of(path: str) -> str | None:
    name = PurePosixPath(path).name.lower()
    for suffix in _COMPRESSED:
        name = name.removesuffix(suffix)
    return _EXTENSIONS.get(os.path.splitext(name)[1])


def file_format(files: list[str], declared: str | None, key: str) -> str:
    """The one format all files share: `data.format` if set, else their extension."""
    if declared:
        return declared
    formats = {format_of(f) for f in files}
    if None in formats:
        unknown = next(f for f in files if format_of(f) is None)
        raise ConfigError(key, f"cannot tell the format of {unknown} from its name; set data.format "
                               f"({', '.join(BUILDERS)})")
    formats = {"json" if f == "jsonl" else f for f in formats}
    if len(formats) > 1:
        raise ConfigError(key, f"the files mix formats ({', '.join(sorted(formats))}); name one format per path")
    return formats.pop()


def read_rows(path: str, declared_format: str | None, key: str):
    """A `datasets.Dataset` of the rows in the files `path` names (memory-mapped Arrow, cached by datasets)."""
    import datasets

    files = resolve_files(path, key)
    builder = BUILDERS[file_format(files, declared_format, key)]
    files = [local_copy(f) if "://" in f else f for f in files]
    datasets.disable_progress_bars()
    try:
        # The files are resolved already; `datasets` would read `[`, `*` and `?` in their names as patterns.
        rows = datasets.load_dataset(builder, data_files=[glob.escape(f) for f in files], split="train")
    except Exception as exc:  # datasets wraps parse errors in several exception types, all naming the file
        if _holds_no_rows(files, builder):  # which datasets reports as an error of its own
            raise ConfigError(key, f"{path} holds no rows") from None
        raise ConfigError(key, f"{path} could not be read as {builder}: {one_line(exc)[:400]}") from None
    if len(rows) == 0:
        raise ConfigError(key, f"{path} holds no rows")
    return rows


def _holds_no_rows(files: list[str], builder: str) -> bool:
    """Whether text files hold nothing but blank lines (and, in each CSV, its header); read only that far."""
    import fsspec

    if builder == "parquet":
        return False
    header = 1 if builder == "csv" else 0
    for file in files:
        with fsspec.open(file, "rt", compression="infer", errors="replace") as stream:
            lines = (line for line in stream if line.strip())
            if sum(1 for _ in itertools.islice(lines, header + 1)) > header:
                return False
    return True
