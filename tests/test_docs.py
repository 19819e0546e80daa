"""docs/config.md lists every key of the schema, with its default, and nothing else: the manual cannot drift."""

import json
import re
import typing
from pathlib import Path

from pydantic import BaseModel

from xla_shard.config.schema import ShardConfig

PAGE = Path(__file__).resolve().parent.parent / "docs" / "config.md"
OPTIONAL_SECTION = object()  # a section that is off (null) unless written: `model.lora`, `fsdp.sharding`


def _schema(model: type[BaseModel] = ShardConfig, prefix: str = "") -> dict[str, object]:
    """Every key as YAML spells it (aliases: `checkpoint.async`) -> its default. A section always present is a
    heading of the page, not a row."""
    keys = {}
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        section = next((t for t in (field.annotation, *typing.get_args(field.annotation))
                        if isinstance(t, type) and issubclass(t, BaseModel)), None)
        default = field.get_default(call_default_factory=True)
        if section is None:
            keys[key] = getattr(default, "value", default)
            continue
        if default is None:
            keys[key] = OPTIONAL_SECTION
        keys.update(_schema(section, key + "."))
    return keys


def _problems(page: str) -> list[str]:
    rows = re.findall(r"^\| `([\w.]+)` \| `([^`]*)` \|", page, re.M)
    documented = dict(rows)
    schema = _schema()
    problems = [f"{key}: documented twice" for key in {k for k, _ in rows if [r[0] for r in rows].count(k) > 1}]
    problems += [f"{key}: not documented" for key in schema.keys() - documented.keys()]
    problems += [f"{key}: not in the schema" for key in documented.keys() - schema.keys()]
    for key in schema.keys() & documented.keys():
        want, shown = schema[key], documented[key]
        if want is OPTIONAL_SECTION:
            right = shown == "null"
        else:
            right = shown == want if isinstance(want, str) else json.loads(shown) == want
        if not right:
            problems.append(f"{key}: documented default {shown}, the schema's is {want}")
    return sorted(problems)


def test_every_schema_key_is_documented_once_with_its_default():
    assert _problems(PAGE.read_text()) == []


def test_a_wrong_default_or_a_missing_key_is_caught():
    page = PAGE.read_text().replace("| `train.steps` | `8` |", "| `train.steps` | `9` |")
    page = re.sub(r"^\| `data.shuffle_buffer` .*\n", "", page, flags=re.M)
    assert _problems(page) == ["data.shuffle_buffer: not documented",
                               "train.steps: documented default 9, the schema's is 8"]
