"""A LoRA run's checkpoint as the directory peft's `PeftModel.from_pretrained(base, dir)` loads.

peft's `save_pretrained` writes `adapter_config.json` (the LoraConfig, with the base model and task) and
`adapter_model.safetensors`, whose keys are the parameter names under `base_model.model.` with the adapter name
dropped (`...q_proj.lora_A.weight`; a module trained whole: `score.weight`). Written here from the manifest
alone, tensor by tensor, as full exports are.
"""

from __future__ import annotations

import json
from typing import Any

from xla_shard.checkpoint.manifest import CheckpointError

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
_TASKS = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS"}


def key(name: str) -> str:
    """`model/<param>` -> the key peft stores it under."""
    param = name[len("model/"):].replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
    param = param.replace(".modules_to_save.default.", ".")
    return f"base_model.model.{param}"


def config_json(lora: dict[str, Any], model: dict[str, Any], names: list[str]) -> bytes:
    """peft's LoraConfig for the run's `model.lora` section, as save_pretrained writes it."""
    from peft import LoraConfig

    whole = sorted({n[len("model/"):].split(".modules_to_save.")[0] for n in names if ".modules_to_save." in n})
    try:
        config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                            target_modules=lora["target_modules"], modules_to_save=whole or None,
                            task_type=_TASKS.get(model.get("task")),
                            base_model_name_or_path=str(model.get("name") or ""))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the manifest's model.lora section is not a LoRA config peft accepts: {exc}") from None
    fields = config.to_dict()
    fields["target_modules"] = sorted(fields["target_modules"]) if isinstance(fields["target_modules"], set) \
        else fields["target_modules"]
    fields = {k: (sorted(v) if isinstance(v, set) else v) for k, v in fields.items()}
    return json.dumps(fields, indent=2, default=str).encode()
