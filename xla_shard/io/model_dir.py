"""A model directory (`save_pretrained` output, local or at any fsspec URL) as untrusted input: which name
is one, what beside the weights gets copied, and what transformers must not be allowed to read from it (a link
out of the directory, a file asking it to import the directory's Python code)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from xla_shard.errors import ConfigError
from xla_shard.io.storage import Storage
from xla_shard.io.untrusted_json import SchemaError, parse_json

CONFIG = "config.json"
# What `save_pretrained` writes next to the weights that users of the exported model expect to find there.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "generation_config.json")
# JSON files of a model directory through which transformers would import Python code from it (`auto_map`).
CODE_MAPS = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


def config_location(name: str) -> tuple[str, str]:
    """(directory, file name) of the transformers config that `model.name` points at: a .json file (or any
    local file) is that config itself; anything else is a model directory holding CONFIG."""
    if name.endswith(".json") or ("://" not in name and Path(name).is_file()):
        return tuple(name.rsplit("/", 1)) if "/" in name else (".", name)
    return name, CONFIG


def model_directory(name: str, presets: Collection[str] = ()) -> str | None:
    """The model directory `model.name` names, or None for a preset or a lone config file (nothing beside it).
    The one rule for "is this a model directory": models, data and export all ask it here."""
    if name in presets:
        return None
    directory, file = config_location(name)
    return directory if file == CONFIG else None


def copy_companions(directory: str, target, extra: tuple[str, ...] = ()) -> list[str]:
    """Copy the COMPANION_FILES (and `extra`) that a model directory, local or at a URL, holds into `target` (a
    `Storage`); return the names copied. A file that a link takes outside the directory is refused."""
    storage = Storage(directory)
    present = [name for name in COMPANION_FILES + extra if storage.exists(name)]
    for name in present:
        refuse_link_out(storage, name, "model.name")
        target.write(name, storage.read_bytes(name))
    return present


def refuse_link_out(storage, name: str, key: str) -> None:
    link = storage.outside(name)
    if link is not None:
        raise ConfigError(key, f"{storage.url_of(name)} is a link to {link}, outside the model directory; "
                               "refusing to read it")


def refuse_untrusted(storage, key: str, shown: str | None = None) -> None:
    """Check what transformers will read from a model directory (a `Storage`) before it reads it: a file that
    a link takes outside the directory is refused, and so is a directory whose files ask transformers to import
    Python code from it (`auto_map`): xla_shard never runs code that came with a model (its loaders are called
    with trust_remote_code=False, which would refuse it less clearly)."""
    shown = (shown or storage.url).rstrip("/")
    present = {name for name in set(COMPANION_FILES + CODE_MAPS) if storage.exists(name)}
    for name in sorted(present):
        refuse_link_out(storage, name, key)
    for name in CODE_MAPS:
        if name not in present:
            continue
        try:
            fields = parse_json(storage.read_bytes(name))
        except SchemaError as exc:
            raise ConfigError(key, f"{shown}/{name}: {exc}") from None
        if isinstance(fields, dict) and "auto_map" in fields:
            raise ConfigError(key, f"{shown}/{name} has 'auto_map': it needs Python code from the model directory, "
                                   "which xla_shard never runs (trust_remote_code is off); use a model and "
                                   "tokenizer that transformers implements itself")
