"""What a checkpoint holds beside the tensors for the caller (`save(extra=...)`, `restore(extra=...)`): named
JSON state (a data loader's position, a rollout's), refused at save where it would not come back as saved."""

from __future__ import annotations

import json
from typing import Any

from xla_shard.checkpoint import layout
from xla_shard.checkpoint.manifest import CheckpointError, CorruptCheckpointError, Manifest
from xla_shard.errors import UserError
from xla_shard.io.untrusted_json import MAX_JSON_DEPTH

Extra = dict[str, Any]  # name -> an object with state_dict()/load_state_dict(), or a dict


# A manifest holds extra state at manifest -> "extra" -> name -> state: the reader's depth limit less those two.
MAX_EXTRA_DEPTH = MAX_JSON_DEPTH - 2


def snapshot(extra: Extra) -> dict[str, Any]:
    """The extra state as JSON values, taken now (the save may finish in the background), refused here if the
    manifest reader would not give it back as it was: keys that are not strings (JSON would turn `{1: 'a'}`
    into `{'1': 'a'}`), values JSON cannot hold, or nesting deeper than the reader accepts (such a checkpoint
    would be set aside as corrupt on resume)."""
    found = {}
    for name, value in extra.items():
        if not isinstance(name, str) or not name:
            raise UserError(f"checkpoint extra state {name!r}: names are non-empty strings")
        state = value.state_dict() if hasattr(value, "state_dict") else value
        if not isinstance(state, dict):
            raise UserError(f"checkpoint extra state {name!r}: expected a dict or an object with state_dict(), got "
                            f"{type(value).__name__}")
        problem = _unfaithful(state)
        if problem:
            raise UserError(f"checkpoint extra state {name!r}: {problem}; it would not come back as saved, so it is "
                            "not saved")
        found[name] = json.loads(json.dumps(state))  # Python's JSON: inf and nan round-trip
    return found


def _unfaithful(state: dict) -> str | None:
    """What of `state` JSON and the manifest reader would not return as it is, if anything (walked without
    recursion, so any depth is reported rather than crashing)."""
    stack: list[tuple[Any, str, int]] = [(state, "", 1)]
    while stack:
        node, where, depth = stack.pop()
        if isinstance(node, dict):
            if depth > MAX_EXTRA_DEPTH:
                return f"nested deeper than {MAX_EXTRA_DEPTH} levels (at {where or 'the top'})"
            for key, child in node.items():
                if not isinstance(key, str):
                    return f"key {key!r} at {where or 'the top'} is a {type(key).__name__}, not a string"
                stack.append((child, f"{where}[{key!r}]", depth + 1))
        elif isinstance(node, list):
            if depth > MAX_EXTRA_DEPTH:
                return f"nested deeper than {MAX_EXTRA_DEPTH} levels (at {where or 'the top'})"
            stack.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(node))
        elif isinstance(node, tuple):
            return f"{where} is a tuple, which comes back as a list: store a list"
        elif not (node is None or isinstance(node, (str, bool, int, float))):
            return f"{where} is a {type(node).__name__}, not JSON data (dicts, lists, strings, numbers, None)"
    return None


def restorable(extra: Any) -> Extra:
    """`restore(extra=...)` checked before anything is read or changed: a dict of names to objects with
    `load_state_dict()` or dicts (filled in place), as `save(extra=...)` takes them."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise UserError(f"checkpoint extra state: expected a dict of names to objects with load_state_dict() or "
                        f"dicts, got a {type(extra).__name__}")
    for name, target in extra.items():
        if not isinstance(name, str) or not name:
            raise UserError(f"checkpoint extra state {name!r}: names are non-empty strings")
        if not (hasattr(target, "load_state_dict") or isinstance(target, dict)):
            raise UserError(f"checkpoint extra state {name!r}: expected a dict or an object with load_state_dict() to "
                            f"restore into, got a {type(target).__name__}")
    return extra


def check_extra(manifest: Manifest, wanted: Extra) -> None:
    stored = manifest.data.get("extra") or {}
    missing = [name for name in wanted if name not in stored]
    if missing:
        raise CheckpointError(f"{manifest.url} holds no extra state {missing[0]!r} (it has: "
                              f"{', '.join(sorted(stored)) or 'none'}); it was saved without it")
    for name, target in wanted.items():
        if not hasattr(target, "load_state_dict") and not isinstance(stored[name], dict):
            raise CorruptCheckpointError(f"{manifest.url}/{layout.MANIFEST} is damaged: its extra state {name!r} is "
                                         f"a {type(stored[name]).__name__}, not the dict that was saved")


def load_extra(manifest: Manifest, wanted: Extra) -> None:
    stored = manifest.data.get("extra") or {}
    for name, target in wanted.items():
        if hasattr(target, "load_state_dict"):
            target.load_state_dict(stored[name])
        else:
            target.clear()
            target.update(stored[name])
