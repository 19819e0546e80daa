"""TRL's GRPOTrainer's loss on fixed completions, the reference `xla_shard.methods.grpo` is compared with: for
each case, the loss `GRPOTrainer._compute_loss` returns for one micro-batch in training mode and the gradient of
every parameter, saved with torch.save.

    python trl_grpo.py MODEL_DIR INPUTS.pt OUT.pt [ADAPTERS.pt [QUANT_TYPE]]

INPUTS.pt holds the tensors TRL's step hands its loss (prompt and completion ids and masks, advantages, the
old and the reference log-probabilities, num_items_in_batch) and a list of cases (loss_type, beta, epsilon,
epsilon_high, max_completion_length, temperature, whether the old log-probabilities are given, whether
the KL is weighed by the ratio). ADAPTERS.pt: LoRA matrices by parameter name (xla_shard's starting ones): peft
injects them into the model, which then trains them alone. QUANT_TYPE (nf4, fp4): the model is transformers'
bitsandbytes 4-bit load (peft's QLoRA). Run with USE_TORCH_XLA=0.
"""

import sys

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer


def reward(completions, **kwargs):
    return [0.0 for _ in completions]


def _with_adapters(model, adapters: dict):
    """The model with peft's LoRA layers where `adapters` has matrices (rank and alpha read from them: alpha is
    twice the rank, as the tests set it), holding those values; only they train."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in adapters})
    rank = next(value.shape[0] for name, value in adapters.items() if ".lora_A" in name)
    settings = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
    if getattr(model, "is_quantized", False):  # transformers' own way, which its Trainer asks of a 4-bit model
        model.add_adapter(settings)
    else:
        inject_adapter_in_model(settings, model)
    missing = set(adapters) - {name for name, _ in model.named_parameters()}
    assert not missing, missing
    model.load_state_dict(adapters, strict=False)
    for name, param in model.named_parameters():
        param.requires_grad_(name in adapters)
    return model


def main(model_dir: str, inputs_path: str, out_path: str, adapters_path: str | None = None,
         quant_type: str | None = None) -> None:
    given = torch.load(inputs_path)
    adapters = torch.load(adapters_path) if adapters_path else None
    prompts = datasets.Dataset.from_list([{"prompt": "a b"}] * 4)
    quantization = None
    if quant_type:
        from transformers import BitsAndBytesConfig

        from bench.bnb_reference import hold_bitsandbytes_to_its_reference

        torch._dynamo.config.disable = True  # bitsandbytes' CPU paths would compile for minutes
        hold_bitsandbytes_to_its_reference()
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type)
    found = []
    for case in given["cases"]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", use_cache=False,
                                                     quantization_config=quantization)
        if adapters:
            model = _with_adapters(model, adapters)
        args = GRPOConfig(output_dir=str(out_path) + ".trl", report_to=[], use_cpu=True, bf16=False,
                          per_device_train_batch_size=4, num_generations=2, loss_type=case["loss_type"],
                          beta=case["beta"], epsilon=case["epsilon"], epsilon_high=case["epsilon_high"],
                          max_completion_length=case["max_completion_length"], temperature=case["temperature"],
                          use_bias_correction_kl=case["kl_correction"], gradient_checkpointing=False,
                          disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=prompts,
                              processing_class=AutoTokenizer.from_pretrained(model_dir))
        trainer.current_gradient_accumulation_steps = 1
        if quantization is not None:  # GRPOTrainer casts a quantized model's adapters to bf16; compared in fp32
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.float()
            model.load_state_dict(adapters, strict=False)
        inputs = {key: value for key, value in given["inputs"].items() if key != "old_per_token_logps"}
        if case["old"]:
            inputs["old_per_token_logps"] = given["inputs"]["old_per_token_logps"]
        if not case["beta"]:
            inputs.pop("ref_per_token_logps")
        model.train()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        found.append({"loss": loss.detach(),
                      "grads": {name: p.grad.detach().clone() for name, p in model.named_parameters()
                                if p.grad is not None},
                      "metrics": {key: values[-1] for key, values in trainer._metrics["train"].items()}})
    torch.save(found, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
