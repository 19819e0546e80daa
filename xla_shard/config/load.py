"""Read a config file (ours, accelerate's or transformers'), apply `--set` overrides, validate."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from xla_shard.config import importers
from xla_shard.config.files import check_depth, check_keys, parse_yaml, read_raw
from xla_shard.config.schema import ShardConfig
from xla_shard.errors import ConfigError, one_line


def to_native(raw: dict[str, Any]) -> tuple[dict[str, Any], str, list[str]]:
    """(native dict, detected format, import notes)."""
    if set(raw) <= set(ShardConfig.model_fields):
        return raw, "xla_shard", []
    for looks_like, convert, kind in (
            (importers.looks_like_training_arguments, importers.from_training_arguments,
             "transformers TrainingArguments"),
            (importers.looks_like_accelerate, importers.from_accelerate, "accelerate"),
            (importers.looks_like_transformers, importers.from_transformers, "transformers fsdp_config"),
            (lambda r: any(k.startswith("fsdp_") for k in r), importers.from_accelerate, "accelerate")):
        if looks_like(raw):
            native, notes = convert(raw)
            return native, kind, notes
    return raw, "xla_shard", []  # let validation name the unknown key


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """`section.key=value` pairs; the value is parsed as YAML, so `8`, `true` and `[a, b]` keep their type."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(None, f"--set expects section.key=value, got {item!r}")
        node = raw
        *parents, leaf = key.strip().split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if isinstance(child, str) and part == "model":  # `model: tiny-llama` shorthand
                child = node[part] = {"name": child}
            if not isinstance(child, dict):
                raise ConfigError(key, f"cannot set a sub-key: '{part}' is not a section")
            node = child
        try:
            node[leaf] = parse_yaml(value)
            check_depth(node[leaf])
        except RecursionError:
            raise ConfigError(key.strip(), "--set value is nested too deeply") from None
        except (yaml.YAMLError, ValueError) as exc:
            raise ConfigError(key.strip(), f"--set value {value!r} is not valid YAML: {one_line(exc)}") from None
        check_keys(node[leaf], key.strip().split("."))
    return raw


def validate(raw: dict[str, Any]) -> ShardConfig:
    try:
        return ShardConfig.model_validate(raw)
    except ValidationError as exc:
        raise _first_error(exc) from None


def load(path: str | Path | None, overrides: Iterable[str] = ()) -> ShardConfig:
    return load_with_notes(path, overrides)[0]


def load_with_notes(path: str | Path | None, overrides: Iterable[str] = ()) -> tuple[ShardConfig, str, list[str]]:
    """The config, the format the file was in, and what the importer says became of its foreign keys."""
    raw = read_raw(path) if path is not None else {}
    native, kind, notes = to_native(raw)
    return validate(apply_overrides(native, overrides)), kind, notes


def _first_error(exc: ValidationError) -> ConfigError:
    err = exc.errors()[0]
    loc = [str(part) for part in err["loc"]]
    key = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        return ConfigError(key, "unknown key" + _did_you_mean(loc))
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] not in ("value_error", "assertion_error") and "input" in err:
        message += f" (got {err['input']!r})"
    return ConfigError(key, message)


def _did_you_mean(loc: list[str]) -> str:
    section: type[BaseModel] = ShardConfig
    for part in loc[:-1]:
        annotation = section.model_fields[part].annotation if part in section.model_fields else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        section = annotation
    close = difflib.get_close_matches(loc[-1], list(section.model_fields), n=1, cutoff=0.6)
    if not close:
        return f"; known keys here: {', '.join(section.model_fields)}"
    return f"; did you mean '{'.'.join(loc[:-1] + close)}'?"


def dump(cfg: ShardConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False)
