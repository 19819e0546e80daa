"""User-facing errors: the CLI prints them as one line and exits 2, with no traceback."""

import re
from pathlib import Path

# user:password@ in a URL, and the query parameters that carry credentials in signed or keyed URLs.
_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@]+@")
_SECRET_QUERY = re.compile(r"(?i)([?&](?:access_token|token|key|sig|signature|x-goog-signature|"
                           r"x-goog-credential|x-amz-signature|x-amz-credential|password)=)[^&\s'\"]+")


def redact(text: str) -> str:
    """The text with credentials embedded in URLs replaced by ***, for anything printed or logged."""
    return _SECRET_QUERY.sub(r"\1***", _USERINFO.sub(r"\1***@", text))


def one_line(text) -> str:
    """Any message (an exception's too) on one line: a multi-line error must not read as several."""
    return " ".join(str(text).split())


def file_in_the_way(path: Path) -> Path | None:
    """The file that stands where `path` or one of its parent directories must be, if any."""
    existing = next((p for p in [path, *path.parents] if p.exists()), None)
    return existing if existing is not None and not existing.is_dir() else None


class UserError(Exception):
    """A mistake the user can fix (config, path, command line). Never a bug in xla_shard."""


class ConfigError(UserError):
    """A config value that is malformed, or that the chosen backend cannot honour.

    `key` is the dotted config key (`fsdp.sharding_strategy`), so every message points at what to change.
    """

    def __init__(self, key: str | None, message: str, backend: str | None = None):
        self.key, self.message, self.backend = key, message, backend
        where = f"config key '{key}'" if key else "config"
        if backend:
            where += f" (backend {backend})"
        super().__init__(f"{where}: {message}")

    def __reduce__(self):  # raised in a spawned worker, it is pickled back to the launcher intact
        return type(self), (self.key, self.message, self.backend)


class Problems(UserError):
    """Several mistakes found at once (a rendering checks everything before it stops): one line each."""

    def __init__(self, errors: list[UserError]):
        self.errors = list(errors)
        super().__init__(" | ".join(one_line(e) for e in self.errors))

    def lines(self) -> list[str]:
        return [one_line(e) for e in self.errors]
