"""xla_shard's GRPO loss on fixed completions, on a backend: the counterpart of trl_grpo.py. For each case, the
loss `Grpo.loss` gives for the whole batch (every process its rows, the processes' losses averaged as their
gradients are) and the full gradient of every trained parameter; with LoRA, also the adapters' starting values,
for TRL's model to start from.

    grpo_loss.py INPUTS.pt OUT.pt KEY=VALUE ...   (under torchrun every rank runs it, rank 0 writes)
"""

import sys

import torch

from xla_shard import config
from xla_shard.launch import exit_without_finalizing
from xla_shard.methods.grpo_objective import build
from xla_shard.train import Trainer


def _plain(name: str) -> str:
    """A parameter's transformers name (xla_spmd's wrappers add `_orig_module.` levels)."""
    return name.replace("_orig_module.", "")


def main(inputs_path: str, out: str, *overrides: str) -> None:
    given = torch.load(inputs_path)
    inputs = given["inputs"]
    trainer = Trainer(config.load(None, overrides)).setup()
    backend, model = trainer.backend, trainer.model
    full = backend.state.full_tensor
    rows = inputs["completion_ids"].shape[0]
    batch = {"input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
             "attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
             "completion_mask": inputs["completion_mask"], "advantages": inputs["advantages"],
             # TRL's num_items_in_batch, shared among the processes whose gradients are averaged
             "step_tokens": torch.full((rows,), float(inputs["num_items_in_batch"]) / backend.world)}
    found = []
    for case in given["cases"]:
        cfg = config.load(None, [*overrides, f"grpo.loss_type={case['loss_type']}", f"grpo.beta={case['beta']}",
                                 f"grpo.epsilon={case['epsilon']}", f"grpo.epsilon_high={case['epsilon_high']}",
                                 f"grpo.max_completion_length={case['max_completion_length']}",
                                 f"grpo.temperature={case['temperature']}",
                                 f"grpo.kl_correction={str(case['kl_correction']).lower()}"])
        objective = build(cfg, trainer.adapter, None)[0]
        rows_of_case = dict(batch)
        if case["old"]:
            rows_of_case["old_logps"] = inputs["old_per_token_logps"]
        if case["beta"]:
            rows_of_case["ref_logps"] = inputs["ref_per_token_logps"]
        placed = backend.local_batch(rows_of_case)
        trainer.optimizer.zero_grad(set_to_none=True)
        with backend.forward_context():
            loss = objective.loss(model, placed)
        loss.backward()
        backend.after_step()
        grads = {_plain(name): full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
        found.append({"loss": backend.mean_loss(loss), "grads": grads,
                      "metrics": objective.step_metrics(backend.mean_loss)})
    adapters = {_plain(name): full(p) for name, p in model.named_parameters() if ".lora_" in name}
    if backend.processes.is_main:
        torch.save({"cases": found, "adapters": adapters}, out)
    backend.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing(0)
