"""Reading a config file (YAML or JSON) as untrusted text: strict about duplicate keys, aliases, depth, size,
encoding and key types, each refusal one ConfigError naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from xla_shard.errors import ConfigError, one_line
from xla_shard.io.storage import NotAFileError, read_local_file

_MAX_TEXT_BYTES = 16 << 20  # a config or chat template; more is not one

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
        check_depth(raw)
    except RecursionError:
        raise ConfigError(None, f"{path} is not valid {kind}: nested too deeply") from None
    except (yaml.YAMLError, ValueError) as exc:
        raise ConfigError(None, f"{path} is not valid {kind}: {one_line(exc)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(None, f"{path} must hold a mapping of keys, not {type(raw).__name__}")
    check_keys(raw, [])
    return raw


def read_utf8(path: Path, key: str | None, why: str = "") -> str:
    """A text file's contents; one error naming the file, the first bad byte and `key` when it is not UTF-8."""
    try:
        return read_local_file(str(path), _MAX_TEXT_BYTES).decode("utf-8")
    except NotAFileError as exc:
        raise ConfigError(key, str(exc)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(key, f"{path} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x})"
                               + (f"; {why}" if why else "")) from None


def check_depth(node: Any) -> None:
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


def check_keys(node: Any, path: list[str]) -> None:
    """Every mapping key is a string (YAML also allows numbers, booleans, lists ... as keys)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if not isinstance(key, str):
                where = ".".join(path) or "the top level"
                raise ConfigError(".".join(path) or None, f"key {key!r} at {where} is a {type(key).__name__}; "
                                                          "config keys are names")
            check_keys(value, path + [key])
    elif isinstance(node, list):
        for item in node:
            check_keys(item, path)
