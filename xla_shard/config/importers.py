"""Convert the FSDP configs TPU users already have into our schema, unchanged input in.

Two foreign formats:
- the `accelerate` FSDP YAML (`accelerate config`), with `fsdp_*` keys either nested under `fsdp_config:`
  (what accelerate writes) or flat at the top level (how the FSDP guide prints it);
- the transformers `fsdp_config` JSON (`TrainingArguments.fsdp_config`), whose keys may carry an `fsdp_`
  prefix that transformers strips.

Each importer returns (native dict, notes). A note says what a foreign key became when it has no key of its
own here, so nothing is dropped silently.
"""

from __future__ import annotations

from typing import Any

from xla_shard.errors import ConfigError

Notes = list[str]

# Keys that describe how accelerate launches processes, not how the model is sharded.
_ACCELERATE_LAUNCH_KEYS = {
    "compute_environment", "debug", "machine_rank", "main_training_function", "num_machines",
    "num_processes", "rdzv_backend", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo",
    "use_cpu", "downcast_bf16", "main_process_ip", "main_process_port", "gpu_ids", "dynamo_config",
    "enable_cpu_affinity", "tpu_name", "tpu_zone", "commands", "command_file",
}

# FSDP1 knobs whose behaviour is fixed in every xla_shard backend, with the reason.
_FIXED_BEHAVIOUR = {
    "backward_prefetch": "prefetching is built into FSDP2 and XLA's scheduler",
    "backward_prefetch_policy": "prefetching is built into FSDP2 and XLA's scheduler",
    "forward_prefetch": "prefetching is built into FSDP2 and XLA's scheduler",
    "limit_all_gathers": "FSDP2 bounds in-flight all-gathers itself",
    "use_orig_params": "FSDP2 and SPMD always keep the original parameters",
    "sync_module_states": "every rank builds the same weights from train.seed, so there is nothing to sync",
    "cpu_ram_efficient_loading": "models are built from configs with random init, not loaded",
    "version": "xla_shard picks the FSDP implementation from `backend`",
}


def looks_like_accelerate(raw: dict[str, Any]) -> bool:
    """Keys only accelerate writes; transformers' fsdp_config may also spell its keys with `fsdp_`."""
    markers = {"distributed_type", "fsdp_config", "compute_environment", "fsdp_sharding_strategy",
               "fsdp_auto_wrap_policy", "mixed_precision", "num_processes"}
    return bool(markers & set(raw))


def looks_like_transformers(raw: dict[str, Any]) -> bool:
    known = {"min_num_params", "transformer_layer_cls_to_wrap", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt",
             "xla_fsdp_settings", "activation_checkpointing"}
    return bool(known & {k.removeprefix("fsdp_") for k in raw})


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(key, f"expected true or false, got {value!r}")


def _wrap_settings(fsdp: dict[str, Any], get, notes: Notes) -> None:
    """Shared by both importers: what goes into our `fsdp` section from FSDP1-style keys."""
    settings = get("xla_fsdp_settings")
    if settings:
        if not isinstance(settings, dict):
            raise ConfigError("xla_fsdp_settings", f"expected a mapping of XLA FSDP arguments, got {settings!r}")
        fsdp["xla_settings"] = dict(settings)
    if get("xla_fsdp_grad_ckpt") is not None and _bool("xla_fsdp_grad_ckpt", get("xla_fsdp_grad_ckpt")):
        fsdp["activation_checkpointing"] = True
        notes.append("xla_fsdp_grad_ckpt -> fsdp.activation_checkpointing (xla_shard's exact checkpointing, "
                     "not torch_xla's checkpoint_module)")


def _xla_backend(get) -> str | None:
    if get("xla_fsdp_v2") is not None and _bool("xla_fsdp_v2", get("xla_fsdp_v2")):
        return "xla_spmd"
    if get("xla") is not None and _bool("xla", get("xla")):
        return "xla_fsdp"
    return None


def _fixed_notes(keys, notes: Notes) -> None:
    for key in keys:
        bare = key.removeprefix("fsdp_")
        if bare in _FIXED_BEHAVIOUR:
            notes.append(f"{key}: not needed ({_FIXED_BEHAVIOUR[bare]})")


def from_accelerate(raw: dict[str, Any]) -> tuple[dict[str, Any], Notes]:
    flat = {k: v for k, v in raw.items() if k != "fsdp_config"}
    nested = raw.get("fsdp_config")
    if nested is not None and not isinstance(nested, dict):
        raise ConfigError("fsdp_config", f"expected a mapping of fsdp_* keys, got {nested!r}")
    flat.update(nested or {})
    notes: Notes = []

    kind = flat.get("distributed_type")
    if kind is not None and str(kind).upper() not in ("FSDP", "XLA"):
        raise ConfigError("distributed_type", f"{kind!r} is not an FSDP config; expected FSDP")

    fsdp: dict[str, Any] = {}
    direct = {
        "fsdp_sharding_strategy": "sharding_strategy",
        "fsdp_auto_wrap_policy": "auto_wrap_policy",
        "fsdp_transformer_layer_cls_to_wrap": "transformer_layer_cls_to_wrap",
        "fsdp_min_num_params": "min_num_params",
        "fsdp_offload_params": "offload_params",
        "fsdp_state_dict_type": "state_dict_type",
        "fsdp_activation_checkpointing": "activation_checkpointing",
    }
    for key, ours in direct.items():
        if flat.get(key) is not None:
            fsdp[ours] = flat[key]
    if flat.get("mixed_precision") is not None:
        fsdp["mixed_precision"] = flat["mixed_precision"]
    _wrap_settings(fsdp, flat.get, notes)

    native: dict[str, Any] = {"fsdp": fsdp, "backend": _xla_backend(flat.get) or "torch_fsdp"}
    if native["backend"] == "torch_fsdp":
        notes.append("no `xla: true`: backend torch_fsdp, as accelerate would run it (set backend: auto to "
                     "pick per machine)")
    if flat.get("num_processes") is not None:
        notes.append(f"num_processes={flat['num_processes']}: pass --nproc-per-node to `xla-shard train` "
                     "(launch setting, not part of the config)")

    fixed = [k for k in flat if k.removeprefix("fsdp_") in _FIXED_BEHAVIOUR]
    _fixed_notes(fixed, notes)
    handled = set(direct) | set(fixed) | _ACCELERATE_LAUNCH_KEYS | {
        "mixed_precision", "xla", "xla_fsdp_v2", "xla_fsdp_settings", "xla_fsdp_grad_ckpt", "distributed_type",
        "num_processes"}
    unknown = sorted(k for k in flat if k not in handled)
    if unknown:
        raise ConfigError(unknown[0], "not an accelerate FSDP key that xla_shard knows how to import")
    return native, notes


def from_transformers(raw: dict[str, Any]) -> tuple[dict[str, Any], Notes]:
    # transformers strips a leading "fsdp_" from every key before reading it; so do we.
    cfg = {k.removeprefix("fsdp_"): v for k, v in raw.items()}
    notes: Notes = []
    fsdp: dict[str, Any] = {}

    min_params = cfg.get("min_num_params", 0) or 0
    layers = cfg.get("transformer_layer_cls_to_wrap")
    if min_params and layers:
        raise ConfigError("min_num_params", "transformers' fsdp_config takes min_num_params or "
                                            "transformer_layer_cls_to_wrap, not both")
    if min_params:
        fsdp.update(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=min_params)
    elif layers:
        fsdp.update(auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_layer_cls_to_wrap=layers)
    else:
        fsdp["auto_wrap_policy"] = "NO_WRAP"
    if cfg.get("activation_checkpointing") is not None:
        fsdp["activation_checkpointing"] = _bool("activation_checkpointing", cfg["activation_checkpointing"])
    _wrap_settings(fsdp, cfg.get, notes)
    notes.append("the sharding strategy lives in TrainingArguments.fsdp, not fsdp_config: "
                 "fsdp.sharding_strategy defaults to FULL_SHARD")

    native: dict[str, Any] = {"fsdp": fsdp, "backend": _xla_backend(cfg.get) or "torch_fsdp"}
    handled = {"min_num_params", "transformer_layer_cls_to_wrap", "activation_checkpointing", "xla",
               "xla_fsdp_v2", "xla_fsdp_settings", "xla_fsdp_grad_ckpt"}
    fixed = [k for k in cfg if k in _FIXED_BEHAVIOUR]
    _fixed_notes(fixed, notes)
    unknown = sorted(k for k in cfg if k not in handled | set(fixed))
    if unknown:
        raise ConfigError(unknown[0], "not a transformers fsdp_config key that xla_shard knows how to import")
    return native, notes
