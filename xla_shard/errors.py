"""User-facing errors: the CLI prints them as one line and exits 2, with no traceback."""


class UserError(Exception):
    """A mistake the user can fix (config, path, command line). Never a bug in xla_shard."""


class ConfigError(UserError):
    """A config value that is malformed, or that the chosen backend cannot honour.

    `key` is the dotted config key (`fsdp.sharding_strategy`), so every message points at what to change.
    """

    def __init__(self, key: str | None, message: str, backend: str | None = None):
        self.key = key
        self.backend = backend
        where = f"config key '{key}'" if key else "config"
        if backend:
            where += f" (backend {backend})"
        super().__init__(f"{where}: {message}")
