"""Read a config file (ours, accelerate's or transformers'), apply `--set` overrides, validate."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from xla_shard.config import importers
from xla_shard.config.files import check_depth, check_keys, parse_yaml, read_raw
from xla_shard.config.schema import ShardConfig
from xla_shard.methods.registry import METHODS
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
    errors = exc.errors()
    err = errors[0]
    branches = _union_branches(err, errors)
    if len(branches) > 1:  # one value against a union (`"auto" | int`): the key, and what each member says
        said = " or ".join(b["msg"].removeprefix("Input should be ") for b in branches)
        return ConfigError(".".join(str(part) for part in err["loc"][:-1]), f"should be {said} (got {err['input']!r})")
    loc = [str(part) for part in err["loc"]]
    key = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        return ConfigError(key, "unknown key" + _did_you_mean(loc))
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] not in ("value_error", "assertion_error") and "input" in err:
        message += f" (got {err['input']!r})"
    return ConfigError(key, message)


def _union_branches(err: dict, errors: list[dict]) -> list[dict]:
    """The errors pydantic gives for each member of a union field that refused one value: their locations end in
    the member's tag (`literal['auto']`, `int`) rather than in a key of ours."""
    loc = err["loc"]
    if len(loc) < 2 or not isinstance(loc[-1], str) or not _is_leaf(loc[:-1]):
        return [err]
    return [e for e in errors if e["loc"][:-1] == loc[:-1]]


def _is_leaf(loc: tuple) -> bool:
    """Whether `loc` names a key of ours that holds a value, not a section."""
    model: type[BaseModel] | None = ShardConfig
    for part in loc:
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return False
        # a section's model, also where the key may be null (`lora: LoraSection | None`)
        model = next((t for t in (field.annotation, *typing.get_args(field.annotation))
                      if isinstance(t, type) and issubclass(t, BaseModel)), None)
    return model is None


# Names the Trainer's TrainingArguments, TRL's SFTConfig and peft's LoraConfig use for a key of ours. A recipe
# ported from them gets the key, where spelling alone would guess wrong (max_steps is not eval_steps).
_TRAINER, _TRL, _PEFT = "the Trainer's", "TRL's", "peft's"
FOREIGN_NAMES = {  # name: (our key, whose name it is, what differs)
    "max_steps": ("train.steps", _TRAINER, ""),
    "num_train_epochs": ("train.epochs", _TRAINER, ""),
    "learning_rate": ("train.lr", _TRAINER, ""),
    "lr_scheduler_type": ("train.lr_schedule", _TRAINER, ""),
    "per_device_train_batch_size": ("train.global_batch_size", _TRAINER,
                                    ", which counts all rows of a step: per device x devices x train.grad_accum_steps"),
    "gradient_accumulation_steps": ("train.grad_accum_steps", _TRAINER, ""),
    "logging_steps": ("train.log_every", _TRAINER, ""),
    "optim": ("train.optimizer", _TRAINER, ""),
    "torch_compile": ("train.compile", _TRAINER, ""),
    "gradient_checkpointing": ("fsdp.activation_checkpointing", _TRAINER, ""),
    "bf16": ("fsdp.mixed_precision", _TRAINER, ": bf16"),
    "save_steps": ("checkpoint.every_steps", _TRAINER, ""),
    "save_total_limit": ("checkpoint.keep_last", _TRAINER, ""),
    "resume_from_checkpoint": ("checkpoint.resume", _TRAINER, ""),
    "max_seq_length": ("train.seq_len", _TRL, ""),
    "max_length": ("train.seq_len", _TRL, ""),
    "dataset_text_field": ("data.text_field", _TRL, ""),
    "lora_alpha": ("model.lora.alpha", _PEFT, ""),
    "lora_dropout": ("model.lora.dropout", _PEFT, ""),
    "lora_r": ("model.lora.r", _PEFT, ""),
    "use_dora": ("model.lora.use_dora", _PEFT, ""),
}


def _did_you_mean(loc: list[str]) -> str:
    if loc[-1] in FOREIGN_NAMES:
        ours, whose, differs = FOREIGN_NAMES[loc[-1]]
        return f"; {whose} {loc[-1]} is '{ours}' here{differs}"
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


def revalidated(cfg: ShardConfig, changes: dict[str, Any]) -> ShardConfig:
    """`cfg` with `changes` ({dotted key: value}) set, validated again as a whole (a model_copy would skip the
    validators that read keys together): a ConfigError where the changed config is refused."""
    raw = yaml.safe_load(dump(cfg))
    for key, value in changes.items():
        *sections, name = key.split(".")
        place = raw
        for section in sections:
            place = place.setdefault(section, {})
        place[name] = value
    return validate(raw)


def dump(cfg: ShardConfig) -> str:
    """`cfg` as YAML, every value filled in, that validates again to the same config (what a launcher hands its
    workers, what `config check` prints): a key whose setting a validator reads (`SET_ONLY_BESIDE`) is written
    only where it was set. Of the methods' sections, the run's method's alone (the others hold their defaults),
    after the data section."""
    data = _method_section_after_data(cfg, cfg.model_dump(mode="json", by_alias=True))
    for key, beside in cfg.SET_ONLY_BESIDE.items():
        section, name = key.split(".")
        other_section, other = beside.split(".")
        if getattr(getattr(cfg, other_section), other) is not None and \
                name not in getattr(cfg, section).model_fields_set:
            del data[section][name]
    return yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False)


def _method_section_after_data(cfg: ShardConfig, data: dict[str, Any]) -> dict[str, Any]:
    sections = {name: data.pop(name) for name, entry in METHODS.items() if entry.section is not None}
    placed = {}
    for key, value in data.items():
        placed[key] = value
        if key == "data" and cfg.method in sections:
            placed[cfg.method] = sections[cfg.method]
    return placed
