"""TRL's DPOTrainer over plain transformers on one CPU process, the reference DPO runs are compared with: prints
each training step's loss and logged metrics, and the evaluation after the last step, as JSON.

    python trl_dpo.py ROWS.jsonl REFERENCE|- [KEY=VALUE ...]   (the xla_shard run's config overrides)

With `model.lora` the policy is peft's LoRA model from the run's own initial adapters (drawn from train.seed as
xla_shard draws them) and its reference the adapters switched off (with `model.quantization`, over transformers'
bitsandbytes 4-bit base: peft's QLoRA); else REFERENCE is DPOTrainer's `ref_model`.
Run with USE_TORCH_XLA=0: accelerate would otherwise place the run on an XLA device where torch_xla is installed.
"""

import json
import sys
from pathlib import Path

import datasets
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

from xla_shard import config
from xla_shard.pretrained import build_for


def main(path: str, reference: str, *overrides: str) -> None:
    cfg = config.load(None, list(overrides))
    model_dir, train = cfg.model.name, cfg.train
    quantization = cfg.model.quantization
    if quantization is not None:  # peft's QLoRA: transformers' bitsandbytes base
        import torch
        from transformers import BitsAndBytesConfig

        from bench.bnb_reference import hold_bitsandbytes_to_its_reference

        torch._dynamo.config.disable = True  # bitsandbytes' CPU paths would compile for minutes
        hold_bitsandbytes_to_its_reference()
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantization.bnb_4bit_quant_type,
                                          bnb_4bit_use_double_quant=quantization.bnb_4bit_use_double_quant)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", use_cache=False,
                                                 quantization_config=quantization)
    if cfg.model.lora is not None:
        _, weights, _ = build_for(cfg)
        lora = cfg.model.lora
        model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=lora.target_modules))
        adapters = {f"base_model.model.{k}": v for k, v in weights.fresh.items()}
        assert not model.load_state_dict(adapters, strict=False).unexpected_keys
    ref_model = None if reference == "-" else AutoModelForCausalLM.from_pretrained(
        reference, attn_implementation="eager", use_cache=False)
    rows = datasets.Dataset.from_list([json.loads(line) for line in Path(path).read_text().splitlines()])
    losses = []

    class Recording(DPOTrainer):
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            if self.model.training:
                losses.append(loss.item())
            return loss

    args = DPOConfig(output_dir=str(Path(path).parent / "trl_dpo"), max_length=train.seq_len, report_to=[],
                     use_cpu=True, bf16=False, gradient_checkpointing=False, save_strategy="no",
                     per_device_train_batch_size=train.global_batch_size,
                     per_device_eval_batch_size=train.global_batch_size, learning_rate=train.lr, optim="sgd",
                     lr_scheduler_type="constant", max_steps=train.steps, beta=cfg.dpo.beta, max_grad_norm=0.0,
                     logging_steps=1, disable_tqdm=True)
    trainer = Recording(model=model, ref_model=ref_model, processing_class=AutoTokenizer.from_pretrained(model_dir),
                        train_dataset=rows, eval_dataset=rows, args=args)
    if cfg.model.quantization is not None:
        # DPOTrainer casts a quantized model's adapters to bf16 (the QLoRA paper's choice); xla_shard holds them in
        # fp32 unless fsdp.mixed_precision says otherwise: the same adapters, in fp32, compared
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.data = param.data.float()
        trainer.model.load_state_dict(adapters, strict=False)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "rewards/margins" in entry]
    print(json.dumps({"losses": losses, "logged": logged, "eval": trainer.evaluate()}))


if __name__ == "__main__":
    main(*sys.argv[1:])
