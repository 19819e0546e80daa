"""Read a config file (ours, accelerate's or transformers'), apply `--set` overrides, validate."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from xla_shard.config import importers
from xla_shard.config.schema import ShardConfig
from xla_shard.errors import ConfigError, one_line

MAX_CONFIG_BYTES = 1 << 20  # a config is a few KiB; anything near this is not one


class _StrictLoader(yaml.SafeLoader):
    """Safe YAML that refuses what would otherwise be read silently wrong or without bound: a key given twice
    in one mapping (the last would win), and more aliases than any config needs (an alias bomb expands
    exponentially as it is walked)."""

    MAX_ALIASES = 32
    MAX_DEPTH = 32  # a config nests 3 deep; a deeper one is a mistake or an attack (a RecursionError to walk)

    def __init__(self, stream):
        super().__init__(stream)
        self.aliases = 0
        self.depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > self.MAX_ALIASES:
                raise yaml.YAMLError(f"more than {self.MAX_ALIASES} aliases (*name); refusing to expand them")
        self.depth += 1
        try:
            if self.depth > self.MAX_DEPTH:
                raise yaml.YAMLError(f"nested deeper than {self.MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key) if isinstance(key, (str, int, float, bool)) else None
        return super().construct_mapping(node, deep)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)


def read_raw(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(None, f"no config file at {path}" + (" (a directory)" if path.is_dir() else ""))
    kind = "JSON" if path.suffix == ".json" else "YAML"
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(None, f"{path} is {path.stat().st_size} bytes; a config is at most {MAX_CONFIG_BYTES}")
    text = read_utf8(path, None)
    try:
        raw = json.loads(text, object_pairs_hook=_unique_keys) if kind == "JSON" else parse_yaml(text)
        _check_depth(raw)
    except RecursionError:
        raise ConfigError(None, f"{path} is not valid {kind}: nested too deeply") from None
    except (yaml.YAMLError, ValueError) as exc:
        raise ConfigError(None, f"{path} is not valid {kind}: {one_line(exc)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(None, f"{path} must hold a mapping of keys, not {type(raw).__name__}")
    _check_keys(raw, [])
    return raw


def read_utf8(path: Path, key: str | None, why: str = "") -> str:
    """A text file's contents; one error naming the file, the first bad byte and `key` when it is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(key, f"{path} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x})"
                               + (f"; {why}" if why else "")) from None


def _check_depth(node: Any) -> None:
    stack = [(node, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > _StrictLoader.MAX_DEPTH:
                raise ValueError(f"nested deeper than {_StrictLoader.MAX_DEPTH} levels")
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is given twice in one object")
        out[key] = value
    return out


def _check_keys(node: Any, path: list[str]) -> None:
    """Every mapping key is a string (YAML also allows numbers, booleans, lists ... as keys)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if not isinstance(key, str):
                where = ".".join(path) or "the top level"
                raise ConfigError(".".join(path) or None, f"key {key!r} at {where} is a {type(key).__name__}; "
                                                          "config keys are names")
            _check_keys(value, path + [key])
    elif isinstance(node, list):
        for item in node:
            _check_keys(item, path)


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
            _check_depth(node[leaf])
        except RecursionError:
            raise ConfigError(key.strip(), "--set value is nested too deeply") from None
        except (yaml.YAMLError, ValueError) as exc:
            raise ConfigError(key.strip(), f"--set value {value!r} is not valid YAML: {one_line(exc)}") from None
        _check_keys(node[leaf], key.strip().split("."))
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
