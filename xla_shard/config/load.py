"""Read a config file (ours, accelerate's or transformers'), apply `--set` overrides, validate."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel, ValidationError

from xla_shard.config import importers
from xla_shard.config.schema import ShardConfig
from xla_shard.errors import ConfigError


def read_raw(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(None, f"no config file at {path}")
    try:
        text = path.read_text()
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(None, f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                                f"{str(exc).splitlines()[0]}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(None, f"{path} must hold a mapping of keys, not {type(raw).__name__}")
    return raw


def to_native(raw: dict[str, Any]) -> tuple[dict[str, Any], str, list[str]]:
    """(native dict, detected format, import notes)."""
    if set(raw) <= set(ShardConfig.model_fields):
        return raw, "xla_shard", []
    if importers.looks_like_accelerate(raw):
        return _imported(importers.from_accelerate(raw), "accelerate")
    if importers.looks_like_transformers(raw):
        return _imported(importers.from_transformers(raw), "transformers fsdp_config")
    if any(k.startswith("fsdp_") for k in raw):
        return _imported(importers.from_accelerate(raw), "accelerate")
    return raw, "xla_shard", []  # let validation name the unknown key


def _imported(result: tuple[dict[str, Any], list[str]], kind: str) -> tuple[dict[str, Any], str, list[str]]:
    native, notes = result
    return native, kind, notes


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
        node[leaf] = yaml.safe_load(value)
    return raw


def validate(raw: dict[str, Any]) -> ShardConfig:
    try:
        return ShardConfig.model_validate(raw)
    except ValidationError as exc:
        raise _first_error(exc) from None


def load(path: str | Path | None, overrides: Iterable[str] = ()) -> ShardConfig:
    raw = read_raw(path) if path is not None else {}
    native, _, _ = to_native(raw)
    return validate(apply_overrides(native, overrides))


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
