"""TRL's GRPOTrainer's loss on fixed completions, the reference `xla_shard.methods.grpo` is compared with: for
each case, the loss `GRPOTrainer._compute_loss` returns for one micro-batch in training mode and the gradient of
every parameter, saved with torch.save.

    python trl_grpo.py MODEL_DIR INPUTS.pt OUT.pt

INPUTS.pt holds the tensors TRL's step hands its loss (prompt and completion ids and masks, advantages, the
old and the reference log-probabilities, num_items_in_batch) and a list of cases (loss_type, beta, epsilon,
epsilon_high, max_completion_length, temperature, whether the old log-probabilities are given, whether
the KL is weighed by the ratio). Run with
USE_TORCH_XLA=0.
"""

import sys

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer


def reward(completions, **kwargs):
    return [0.0 for _ in completions]


def main(model_dir: str, inputs_path: str, out_path: str) -> None:
    given = torch.load(inputs_path)
    prompts = datasets.Dataset.from_list([{"prompt": "a b"}] * 4)
    found = []
    for case in given["cases"]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", use_cache=False)
        args = GRPOConfig(output_dir=str(out_path) + ".trl", report_to=[], use_cpu=True, bf16=False,
                          per_device_train_batch_size=4, num_generations=2, loss_type=case["loss_type"],
                          beta=case["beta"], epsilon=case["epsilon"], epsilon_high=case["epsilon_high"],
                          max_completion_length=case["max_completion_length"], temperature=case["temperature"],
                          use_bias_correction_kl=case["kl_correction"], gradient_checkpointing=False,
                          disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=prompts,
                              processing_class=AutoTokenizer.from_pretrained(model_dir))
        trainer.current_gradient_accumulation_steps = 1
        inputs = {key: value for key, value in given["inputs"].items() if key != "old_per_token_logps"}
        if case["old"]:
            inputs["old_per_token_logps"] = given["inputs"]["old_per_token_logps"]
        if not case["beta"]:
            inputs.pop("ref_per_token_logps")
        model.train()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        found.append({"loss": loss.detach(),
                      "grads": {name: p.grad.detach().clone() for name, p in model.named_parameters()},
                      "metrics": {key: values[-1] for key, values in trainer._metrics["train"].items()}})
    torch.save(found, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
