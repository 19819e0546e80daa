"""JSON from outside this process (a manifest, a model's config.json, a tokenizer's files), parsed so that its
shape cannot hurt the reader: nested at most MAX_JSON_DEPTH deep, and every defect one `SchemaError` naming
the field."""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 64  # manifests nest about 6 deep; transformers configs rarely more than 4


class SchemaError(ValueError):
    """A field that fails the schema; `field` is its path inside the document (`tensors['x'].chunks[0].end`)."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field}: {problem}" if field else problem)


def parse_json(raw: bytes | str) -> Any:
    """JSON from untrusted bytes: UTF-8, nested at most MAX_JSON_DEPTH deep (the json module stops a
    200,000-deep list with a RecursionError; anything deeper than a manifest needs is refused too)."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise SchemaError("", f"not valid JSON ({type(exc).__name__}: {str(exc)[:120]})") from None
    stack = [(value, 1)]
    while stack:  # iterative: a walk must not recurse either
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise SchemaError("", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return value
