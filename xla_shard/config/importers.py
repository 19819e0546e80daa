"""Convert the FSDP configs users already have into our schema, unchanged input in.

Three foreign shapes, all written by their own tools:
- the `accelerate` config YAML (`accelerate config`, 1.x): launch keys at the top, `fsdp_*` keys nested under
  `fsdp_config:` (or flat at the top level, as the FSDP guide prints them);
- the transformers `fsdp_config` JSON (the file `--fsdp_config` names), keys with or without `fsdp_`;
- saved `TrainingArguments` (`to_json_string()`, a training-args JSON): `fsdp` (true, or the older option
  string / list such as "full_shard auto_wrap") beside an `fsdp_config` object, among the trainer's settings.

Every key is mapped to its meaning here, or reported in a note saying what became of it, or refused with the
reason when it asks for something no xla_shard backend does. Nothing is dropped silently; no key is refused
only for being unfamiliar to an older xla_shard unless it really has no counterpart.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from xla_shard.config.files import read_raw
from xla_shard.errors import ConfigError

Notes = list[str]
_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")

# FSDP plugin knobs whose behaviour is built into every xla_shard backend, with the reason.
_BUILT_IN = {
    "backward_prefetch": "prefetching is built into FSDP2 and XLA's scheduler",
    "backward_prefetch_policy": "prefetching is built into FSDP2 and XLA's scheduler",  # accelerate < 0.20
    "forward_prefetch": "prefetching is built into FSDP2 and XLA's scheduler",
    "limit_all_gathers": "FSDP2 bounds in-flight all-gathers itself",
    "use_orig_params": "FSDP2 and SPMD always keep the original parameters",
    "sync_module_states": "every rank builds the same weights (from train.seed, or reads its part of the "
                          "pretrained ones), so there is nothing to sync",
    "cpu_ram_efficient_loading": "pretrained weights are always loaded shard by shard (meta device, wrap, then "
                                 "each process reads only the parts it holds); no process reads a full copy",
    "version": "xla_shard picks the FSDP implementation from `backend` (FSDP2 on GPUs and CPUs, XLA FSDP on TPUs)",
    "state_dict_config": "checkpoints are always sharded safetensors; `xla-shard ckpt export` consolidates",
    "optim_state_dict_config": "optimizer state is saved sharded with the model",
}
# Set programmatically in accelerate (Python objects); a YAML that carries one asks for something we lack.
_UNSUPPORTED = {
    "activation_checkpointing_offload": "xla_shard recomputes checkpointed activations, it does not offload them",
    "ignored_modules": "every module is sharded; there is no ignore list",
    "param_init_fn": "models are built from their configs; there is no custom init hook",
}

# accelerate's top-level launch keys: what each becomes.
_ACCELERATE_LAUNCH_NOTES = {
    "compute_environment": "where accelerate runs (xla_shard: `gcp render` targets)",
    "debug": "accelerate's debug mode has no counterpart",
    "machine_rank": "each node's rank is given to torchrun on that node",
    "main_process_ip": "multi-node rendezvous: torchrun --rdzv-endpoint",
    "main_process_port": "multi-node rendezvous: torchrun --rdzv-endpoint",
    "rdzv_backend": "multi-node rendezvous: torchrun --rdzv-backend",
    "same_network": "multi-node rendezvous: torchrun",
    "main_training_function": "xla_shard runs its own training loop",
    "enable_cpu_affinity": "not applied",
    "gpu_ids": "all visible GPUs are used (set CUDA_VISIBLE_DEVICES to restrict them)",
    "use_cpu": "xla_shard runs on CPUs when no accelerator is present",
    "downcast_bf16": "bf16 is fsdp.mixed_precision",
    "tpu_name": "the TPU comes from deploy.name", "tpu_zone": "the zone comes from deploy.zone",
    "tpu_use_cluster": "multi-host TPU slices: `xla-shard gcp render`",
    "tpu_use_sudo": "not needed", "tpu_env": "not applied", "tpu_vm": "not applied",
    "commands": "`xla-shard gcp render` writes the commands", "command_file": "not applied",
}
# accelerate sections that configure something other than FSDP: fine when empty, refused when set.
_OTHER_ENGINES = {"deepspeed_config": "DeepSpeed", "megatron_lm_config": "Megatron-LM", "fp8_config": "FP8 training",
                  "parallelism_config": "tensor/context parallelism", "mpirun_config": "mpirun launching",
                  "dynamo_config": "torch.compile (dynamo)"}
# TrainingArguments that have a counterpart here: (our key, converter).
_TRAINING_ARGUMENTS = {
    "learning_rate": ("train.lr", float),
    "weight_decay": ("train.weight_decay", float),
    "seed": ("train.seed", int),
    "output_dir": ("output_dir", str),
    "logging_steps": ("train.log_every", lambda v: max(1, int(v))),
    "save_total_limit": ("checkpoint.keep_last", int),
    "gradient_accumulation_steps": ("train.grad_accum_steps", int),
}
# transformers' lr_scheduler_type -> train.lr_schedule (warm-up is train.lr_warmup_steps either way)
_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}


def looks_like_accelerate(raw: dict[str, Any]) -> bool:
    markers = {"distributed_type", "compute_environment", "fsdp_sharding_strategy", "fsdp_auto_wrap_policy",
               "fsdp_reshard_after_forward", "fsdp_version", "mixed_precision", "num_processes"}
    return bool(markers & set(raw)) or (isinstance(raw.get("fsdp_config"), dict) and "fsdp" not in raw)


def looks_like_training_arguments(raw: dict[str, Any]) -> bool:
    """A saved TrainingArguments always has `fsdp` (accelerate never writes that bare key)."""
    return "fsdp" in raw and ("fsdp_config" in raw or "per_device_train_batch_size" in raw or "output_dir" in raw)


def looks_like_transformers(raw: dict[str, Any]) -> bool:
    known = {"min_num_params", "transformer_layer_cls_to_wrap", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt",
             "xla_fsdp_settings", "activation_checkpointing", "reshard_after_forward", "cpu_offload", "version"}
    return bool(known & {k.removeprefix("fsdp_") for k in raw})


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.strip().lower() in ("true", "yes", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(key, f"expected true or false, got {value!r}")


def _strategy(key: str, value: Any) -> str:
    """accelerate/transformers spell the strategy as a name (any case), 1-5, or for FSDP2 a reshard bool."""
    if isinstance(value, bool):
        return "FULL_SHARD" if value else "SHARD_GRAD_OP"
    if isinstance(value, int) and 1 <= value <= len(_STRATEGIES):
        return _STRATEGIES[value - 1]
    if isinstance(value, str):
        name = value.strip().upper()
        if name.isdigit() and 1 <= int(name) <= len(_STRATEGIES):
            return _STRATEGIES[int(name) - 1]
        if name in ("TRUE", "FALSE"):
            return "FULL_SHARD" if name == "TRUE" else "SHARD_GRAD_OP"
        if name in _STRATEGIES:
            return name
    raise ConfigError(key, f"{value!r} is not a sharding strategy ({', '.join(_STRATEGIES)}, 1-5, or for FSDP2 "
                           "true/false)")


def _fsdp_keys(items: dict[str, Any], origin: Callable[[str], str], notes: Notes) -> tuple[dict[str, Any], str | None]:
    """The FSDP plugin keys both accelerate and transformers write (without their `fsdp_` prefix) -> our
    `fsdp` section, and the XLA backend they ask for (or None). `origin` spells a key as the file does."""
    fsdp: dict[str, Any] = {}
    for key, value in items.items():
        where = origin(key)
        if key in ("sharding_strategy", "reshard_after_forward"):
            fsdp["sharding_strategy"] = _strategy(where, value)
            if key == "reshard_after_forward" and isinstance(value, bool):
                notes.append(f"{where}: {str(value).lower()} -> fsdp.sharding_strategy: {fsdp['sharding_strategy']}")
        elif key in ("offload_params", "cpu_offload"):
            fsdp["offload_params"] = _bool(where, value)
        elif key == "auto_wrap_policy":
            fsdp["auto_wrap_policy"] = value
        elif key in ("transformer_layer_cls_to_wrap", "transformer_cls_names_to_wrap"):
            if value:
                fsdp["transformer_layer_cls_to_wrap"] = value
        elif key == "min_num_params":
            if value:
                fsdp["min_num_params"] = value
        elif key == "state_dict_type":
            fsdp["state_dict_type"] = str(value).upper()
        elif key == "activation_checkpointing":
            if _bool(where, value):
                fsdp["activation_checkpointing"] = True
        elif key == "xla_fsdp_grad_ckpt":
            if _bool(where, value):
                fsdp["activation_checkpointing"] = True
                notes.append(f"{where} -> fsdp.activation_checkpointing (xla_shard's exact checkpointing, not "
                             "torch_xla's checkpoint_module)")
        elif key == "xla_fsdp_settings":
            if value:
                if not isinstance(value, dict):
                    raise ConfigError(where, f"expected a mapping of XLA FSDP arguments, got {value!r}")
                fsdp["xla_settings"] = dict(value)
        elif key == "mixed_precision_policy":
            if value:
                dtype = value.get("param_dtype") if isinstance(value, dict) else value
                fsdp["mixed_precision"] = str(dtype).replace("torch.", "")
        elif key in ("xla", "xla_fsdp_v2"):
            pass  # read below
        elif key in _BUILT_IN:
            notes.append(f"{where}: not needed ({_BUILT_IN[key]})")
        elif key in _UNSUPPORTED:
            if value not in (None, False, [], {}, ""):
                raise ConfigError(where, f"{value!r} cannot be honoured: {_UNSUPPORTED[key]}")
        else:
            raise ConfigError(where, "not an FSDP setting that accelerate or transformers write; xla_shard does not "
                                     "know what it should do")
    if "min_num_params" in fsdp and "auto_wrap_policy" not in fsdp and "transformer_layer_cls_to_wrap" not in fsdp:
        fsdp["auto_wrap_policy"] = "SIZE_BASED_WRAP"
    xla_backend = None
    if "xla_fsdp_v2" in items and _bool(origin("xla_fsdp_v2"), items["xla_fsdp_v2"]):
        xla_backend = "xla_spmd"
    elif "xla" in items and _bool(origin("xla"), items["xla"]):
        xla_backend = "xla_fsdp"
    return fsdp, xla_backend


def from_accelerate(raw: dict[str, Any]) -> tuple[dict[str, Any], Notes]:
    top = {k: v for k, v in raw.items() if k != "fsdp_config"}
    nested = raw.get("fsdp_config")
    if nested is not None and not isinstance(nested, dict):
        raise ConfigError("fsdp_config", f"expected a mapping of fsdp_* keys, got {nested!r}")
    notes: Notes = []
    plugin = {k.removeprefix("fsdp_"): v for k, v in {**{k: v for k, v in top.items() if k.startswith("fsdp_")},
                                                        **(nested or {})}.items()}
    for key in ("xla", "xla_fsdp_v2", "xla_fsdp_settings", "xla_fsdp_grad_ckpt"):  # the FSDP guide's TPU lines
        if key in top:
            plugin[key] = top[key]
    origin = {k.removeprefix("fsdp_"): k for k in [*top, *(nested or {})]}
    fsdp, xla_backend = _fsdp_keys(plugin, lambda k: origin.get(k, f"fsdp_{k}"), notes)
    if top.get("mixed_precision") is not None:
        fsdp["mixed_precision"] = top["mixed_precision"]

    kind = str(top.get("distributed_type", "FSDP")).upper().removeprefix("DISTRIBUTEDTYPE.")
    if kind in ("XLA", "TPU"):
        backend = xla_backend or "xla_spmd"
        notes.append(f"distributed_type: {kind} -> backend {backend}"
                     + ("" if xla_backend else " (torch_xla SPMD FSDPv2; set backend: xla_fsdp for FSDPv1)"))
    elif kind == "FSDP":
        backend = xla_backend or "torch_fsdp"
        if not xla_backend:
            notes.append("distributed_type: FSDP -> backend torch_fsdp, as accelerate would run it (set backend: "
                         "auto to pick per machine)")
    else:
        raise ConfigError("distributed_type", f"{top['distributed_type']!r} is not an FSDP config; expected FSDP "
                                              "or XLA")
    native: dict[str, Any] = {"fsdp": fsdp, "backend": backend}
    # accelerate launches FSDP on GPUs through torchrun, one process per GPU: its counts carry over.
    _launch(top, backend, kind == "FSDP" and not xla_backend, native, notes)
    for key, value in top.items():
        if key in _ACCELERATE_LAUNCH_NOTES:
            notes.append(f"{key}: not imported ({_ACCELERATE_LAUNCH_NOTES[key]})")
        elif key in _OTHER_ENGINES:
            if value:
                raise ConfigError(key, f"configures {_OTHER_ENGINES[key]}, which xla_shard does not do; remove it")
        elif not (key.startswith("fsdp_") or key in ("distributed_type", "mixed_precision", "num_processes",
                                                     "num_machines", "xla", "xla_fsdp_v2", "xla_fsdp_settings",
                                                     "xla_fsdp_grad_ckpt")):
            raise ConfigError(key, "not a key accelerate's config writer produces; xla_shard does not know what it "
                                   "should do")
    return native, notes


def _launch(top: dict[str, Any], backend: str, torchrun: bool, native: dict[str, Any], notes: Notes) -> None:
    """accelerate's num_processes counts processes over all machines; torchrun wants them per node."""
    processes, machines = top.get("num_processes"), top.get("num_machines") or 1
    if processes in (None, -1, 0):
        return
    if not torchrun:
        notes.append(f"num_processes={processes}: {backend} drives every local device from one process per "
                     "host, so there is no process count to set")
        return
    if not isinstance(processes, int) or not isinstance(machines, int) or processes % machines:
        raise ConfigError("num_processes", f"{processes} processes do not split evenly over {machines} machine(s)")
    native["launch"] = {"nproc_per_node": processes // machines, "nnodes": machines}
    notes.append(f"num_processes={processes}, num_machines={machines} -> launch.nproc_per_node="
                 f"{processes // machines}, launch.nnodes={machines}")


def from_transformers(raw: dict[str, Any]) -> tuple[dict[str, Any], Notes]:
    """The `fsdp_config` JSON: transformers strips a leading `fsdp_` from every key before reading it."""
    notes: Notes = []
    items = {k.removeprefix("fsdp_"): v for k, v in raw.items()}
    origin = {k.removeprefix("fsdp_"): k for k in raw}
    _check_wrap_exclusive(items, lambda k: origin.get(k, k))
    fsdp, xla_backend = _fsdp_keys(items, lambda k: origin.get(k, k), notes)
    if "sharding_strategy" not in fsdp:
        notes.append("no reshard_after_forward: fsdp.sharding_strategy is FULL_SHARD (transformers' default)")
    return {"fsdp": fsdp, "backend": xla_backend or "torch_fsdp"}, notes


def from_training_arguments(raw: dict[str, Any]) -> tuple[dict[str, Any], Notes]:
    """A saved TrainingArguments: its `fsdp` option and `fsdp_config`, plus the trainer settings that have a
    counterpart here; every other key is listed in one note."""
    notes: Notes = []
    option = raw.get("fsdp")
    if option in (None, False, "", []):
        raise ConfigError("fsdp", "FSDP is off in these TrainingArguments (fsdp is empty): nothing to import")
    fsdp_config = raw.get("fsdp_config") or {}
    if isinstance(fsdp_config, str):
        fsdp_config = read_raw(fsdp_config)
    if not isinstance(fsdp_config, dict):
        raise ConfigError("fsdp_config", f"expected an object (or the path of a JSON file), got {fsdp_config!r}")
    items = {k.removeprefix("fsdp_"): v for k, v in fsdp_config.items()}
    for word in ([] if option is True else option.split() if isinstance(option, str) else list(option)):
        name = str(word).strip().lower()
        if name.upper() in _STRATEGIES:
            items.setdefault("sharding_strategy", name)
        elif name == "offload":
            items.setdefault("cpu_offload", True)
        elif name != "auto_wrap":
            raise ConfigError("fsdp", f"unknown FSDP option {word!r} (full_shard, shard_grad_op, no_shard, "
                                      "hybrid_shard, hybrid_shard_zero2, offload, auto_wrap)")
    if "sharding_strategy" in items and "reshard_after_forward" in items:
        items.pop("sharding_strategy")  # transformers lets fsdp_config win over the option string
    _check_wrap_exclusive(items, lambda k: f"fsdp_config.{k}")
    fsdp, backend = _fsdp_keys(items, lambda k: f"fsdp_config.{k}", notes)
    native: dict[str, Any] = {"fsdp": fsdp, "backend": backend or "torch_fsdp"}
    if raw.get("gradient_checkpointing"):
        fsdp["activation_checkpointing"] = True
        notes.append("gradient_checkpointing -> fsdp.activation_checkpointing")
    if raw.get("bf16") or raw.get("bf16_full_eval"):
        fsdp.setdefault("mixed_precision", "bf16")
    if raw.get("fp16"):
        fsdp["mixed_precision"] = "fp16"  # the backends refuse it, naming the key: no loss scaling here
    train = native.setdefault("train", {})
    max_steps = raw.get("max_steps") if isinstance(raw.get("max_steps"), int) and raw["max_steps"] > 0 else None
    if max_steps:
        train["steps"] = max_steps
    elif isinstance(raw.get("num_train_epochs"), (int, float)) and raw["num_train_epochs"] > 0:
        train["epochs"] = float(raw["num_train_epochs"])
    _schedule_keys(raw, train, max_steps, notes)
    for key, (ours, convert) in _TRAINING_ARGUMENTS.items():
        if raw.get(key) is not None:
            section, _, name = ours.rpartition(".")
            (native.setdefault(section, {}) if section else native)[name] = convert(raw[key])
    if str(raw.get("optim", "")).startswith("adamw") or raw.get("optim") == "sgd":
        native.setdefault("train", {})["optimizer"] = "sgd" if raw["optim"] == "sgd" else "adamw"
    if not native["train"]:
        native.pop("train")
    used = {"fsdp", "fsdp_config", "gradient_checkpointing", "bf16", "fp16", "max_steps", "optim", "num_train_epochs",
            "max_grad_norm", "warmup_steps", "warmup_ratio", "lr_scheduler_type", "eval_steps", "eval_strategy",
            *_TRAINING_ARGUMENTS}
    ignored = sorted(k for k in raw if k not in used)
    if ignored:
        notes.append(f"{len(ignored)} TrainingArguments that are not FSDP settings were not imported (set their "
                     f"counterparts in the train section yourself): {', '.join(ignored)}")
    return native, notes


def _schedule_keys(raw: dict[str, Any], train: dict[str, Any], max_steps: int | None, notes: Notes) -> None:
    """Learning-rate schedule, warm-up, clipping and evaluation cadence: what the Trainer would have done."""
    kind = raw.get("lr_scheduler_type")
    options = raw.get("lr_scheduler_kwargs") if isinstance(raw.get("lr_scheduler_kwargs"), dict) else {}
    lr = raw.get("learning_rate")
    floor = options.get("min_lr_rate")
    if floor is None and isinstance(options.get("min_lr"), (int, float)) and isinstance(lr, (int, float)) and lr > 0:
        floor = options["min_lr"] / lr  # the same floor, as a fraction of the learning rate
    if kind in _SCHEDULES:
        train["lr_schedule"] = _SCHEDULES[kind]
    elif kind == "cosine_with_min_lr" and isinstance(floor, (int, float)):
        train["lr_schedule"], train["lr_min_ratio"] = "cosine", float(floor)
    elif kind is not None:
        notes.append(f"lr_scheduler_type: {kind!r} not imported (train.lr_schedule has constant, linear, cosine)")
    warmup = raw.get("warmup_steps") if isinstance(raw.get("warmup_steps"), (int, float)) else 0
    # transformers 5 reads a warmup_steps below 1 as a fraction of the steps; 4.x had warmup_ratio for that.
    key, ratio = ("warmup_steps", warmup) if 0 < warmup < 1 else ("warmup_ratio", raw.get("warmup_ratio") or 0)
    if warmup >= 1:
        train["lr_warmup_steps"] = int(warmup)
    elif isinstance(ratio, (int, float)) and ratio > 0:
        if max_steps:
            train["lr_warmup_steps"] = math.ceil(ratio * max_steps)
            notes.append(f"{key} {ratio:g} x max_steps {max_steps} -> train.lr_warmup_steps={train['lr_warmup_steps']}")
        else:
            notes.append(f"{key} {ratio:g}: not imported (a fraction of the steps, which without max_steps are known "
                         "only at start-up; set train.lr_warmup_steps)")
    if isinstance(raw.get("max_grad_norm"), (int, float)) and raw["max_grad_norm"] > 0:
        train["max_grad_norm"] = float(raw["max_grad_norm"])
    if str(raw.get("eval_strategy", "")).lower() == "steps" and isinstance(raw.get("eval_steps"), (int, float)):
        notes.append(f"eval_steps: not imported (evaluation needs data: set train.eval_every={int(raw['eval_steps'])} "
                     "with data.eval_path or data.eval_fraction)")


def _check_wrap_exclusive(items: dict[str, Any], origin: Callable[[str], str]) -> None:
    if items.get("min_num_params") and items.get("transformer_layer_cls_to_wrap"):
        raise ConfigError(origin("min_num_params"), "transformers takes min_num_params or "
                                                    "transformer_layer_cls_to_wrap, not both")
