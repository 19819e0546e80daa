"""A QLoRA step: xla_shard beside peft over transformers' bitsandbytes 4-bit base, and LoRA over a bf16 base.

    python bench/qlora_step.py [--hidden 512 --layers 4 --rank 8 --seq 256 --batch 4 --steps 5]

Makes a Llama directory with `save_pretrained` (random weights, nothing downloaded) and runs, each in its own
process on the same CPU, the same rows (the run's synthetic tokens, `xla_shard.data.build`) for 2 warm-up and
`--steps` timed AdamW steps:
  - peft + bitsandbytes: `from_pretrained(quantization_config=BitsAndBytesConfig(nf4))`, `get_peft_model`;
  - xla_shard QLoRA: `model.quantization` nf4 (torch_fsdp on one process: torch >= 2.13; older torch: xla_spmd);
  - xla_shard LoRA over a bf16 base (`model.lora.base_dtype: bfloat16`);
  - and, to tell the 4-bit layers' cost from the trainer's, peft's and xla_shard's LoRA over the fp32 base.
It prints the median step time, the peak host memory the process grew by from before the model was built (what
the model, its step and its optimizer took), the first loss (the two QLoRA rows train the same model from the
same adapters: their first losses agree), and ratios against peft.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
from pretrained_load import make_model, torchrun_records

QLORA = ["model.quantization.bnb_4bit_quant_type=nf4"]


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _settings(directory: str, backend: str, rank: int, seq: int, batch: int, *more: str) -> list[str]:
    return [f"model.name={directory}", f"backend={backend}", f"model.lora.r={rank}", f"model.lora.alpha={2 * rank}",
            f"train.seq_len={seq}", f"train.global_batch_size={batch}", "train.optimizer=adamw", "train.lr=1e-4",
            *more]


def _timed(step, steps: int) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for index in range(2 + steps):
        start = time.perf_counter()
        losses.append(step(index))
        if index >= 2:
            times.append(time.perf_counter() - start)
    return times, losses


def worker(mode: str, directory: str, backend: str, rank: str, seq: str, batch: str, steps: str, *more: str) -> None:
    from xla_shard import config

    before = _rss_mib()
    cfg = config.load(None, _settings(directory, backend, int(rank), int(seq), int(batch), *more))
    if mode.startswith("peft"):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        from xla_shard.data import build

        torch._dynamo.config.disable = True  # bitsandbytes' CPU paths would compile for minutes
        quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4") if mode == "peft4" else None
        base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, quantization_config=quantized)
        model = get_peft_model(base, LoraConfig(r=int(rank), lora_alpha=2 * int(rank), target_modules="all-linear"))
        source = build(cfg, base.config, directory).train
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.train.lr)

        def step(index: int) -> float:
            loss = model(**source.global_batch(index)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.item()
    else:
        from xla_shard.train import Trainer

        trainer = Trainer(cfg).setup()

        def step(index: int) -> float:
            return float(trainer.step(index))
    times, losses = _timed(step, int(steps))
    print(json.dumps({"step_s": statistics.median(times), "peak_mib": _peak_mib() - before, "loss": losses[0]}),
          flush=True)
    if not mode.startswith("peft"):
        from xla_shard.launch import exit_without_finalizing

        trainer.backend.shutdown()
        exit_without_finalizing(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-bf16", action="store_true",
                        help="leave out the bf16 base's row (minutes a step on a CPU without native bf16 matmuls)")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    backend = "torch_fsdp" if torch.torch_version.TorchVersion(torch.__version__) >= (2, 13) else "xla_spmd"
    single = ["cpu_devices=1"] if backend == "xla_spmd" else []
    common = [str(args.rank), str(args.seq), str(args.batch), str(args.steps)]
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "llama"
        size = make_model(directory, args.hidden, args.layers)
        rows = {}
        runs = [("peft + bitsandbytes QLoRA", "peft4", []),
                (f"xla_shard QLoRA ({backend})", "xla_shard", [*single, *QLORA]),
                ("peft LoRA, fp32 base", "peft", []),
                (f"xla_shard LoRA, fp32 base ({backend})", "xla_shard", single),
                (f"xla_shard LoRA, bf16 base ({backend})", "xla_shard", [*single, "model.lora.base_dtype=bfloat16"])]
        for name, mode, more in runs[:-1] if args.no_bf16 else runs:
            (rows[name],) = torchrun_records(__file__, 1, [mode, str(directory), backend, *common, *more], name)
    print(f"Llama {size / 2**20:.1f} MiB fp32 (hidden {args.hidden}, {args.layers} layers), LoRA r={args.rank} "
          f"all-linear, AdamW, {args.batch} x {args.seq} tokens, {torch.get_num_threads()} threads; median of "
          f"{args.steps} steps after 2:")
    print(f"{'':40} {'step s':>8} {'/ peft':>7} {'peak MiB':>9} {'/ peft':>7} {'first loss':>11}")
    peft = rows["peft + bitsandbytes QLoRA"]
    for name, row in rows.items():
        print(f"{name:40} {row['step_s']:8.3f} {row['step_s'] / peft['step_s']:7.2f} {row['peak_mib']:9.1f} "
              f"{row['peak_mib'] / peft['peak_mib']:7.2f} {row['loss']:11.6f}")


if __name__ == "__main__":
    main()
