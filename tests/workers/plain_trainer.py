"""A plain transformers.Trainer run, alone or after xla_shard has been imported and used in the same process:
prints what the run did (device, losses) and what xla_shard changed of the process (environment, torch
defaults) as JSON.

    python plain_trainer.py MODEL_DIR with|without
"""

import json
import os
import sys

import torch

model_dir, mode = sys.argv[1], sys.argv[2]


def process_state() -> dict:
    return {"environ": dict(os.environ), "dtype": str(torch.get_default_dtype()),
            "grad": torch.is_grad_enabled(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "threads": torch.get_num_threads(), "matmul": torch.get_float32_matmul_precision()}


before = process_state()
if mode == "with":
    import xla_shard

    cfg = xla_shard.load_config(None, [f"model={model_dir}", "train.steps=3"])
    xla_shard.create_backend(cfg)  # the registry, every backend module, the config's checks
    xla_shard.build_model(cfg.model, seed=0)
after = process_state()

from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402

torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(model_dir)
rows = [{"input_ids": torch.arange(i, i + 16) % model.config.vocab_size} for i in range(24)]
for row in rows:
    row["labels"] = row["input_ids"]
args = TrainingArguments(output_dir=os.path.join(os.path.dirname(model_dir), f"hf_{mode}"), max_steps=3,
                         per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, report_to=[],
                         save_strategy="no", seed=0, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=rows)
trainer.train()
print(json.dumps({"device": str(trainer.model.device), "losses": [r["loss"] for r in trainer.state.log_history
                                                                   if "loss" in r],
                  "changed": {key: [before[key], after[key]] for key in before if before[key] != after[key]}}))
