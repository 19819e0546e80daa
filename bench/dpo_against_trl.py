"""A DPO step, xla_shard's (method: dpo) beside TRL's DPOTrainer on the same model, preference rows and settings:
step time and preference pairs per second, side by side in one run, and the ratio.

    python bench/dpo_against_trl.py [--hidden 256 --layers 4 --rows 64 --batch 8 --seq-len 256 --steps 6
                                     --rounds 2] [--lora]

Makes a Llama directory and its tokenizer with `save_pretrained` (tests/model_dirs.py; nothing downloaded) and a
file of prompt / chosen / rejected rows (bench/dpo_step.py's). Alike on both sides, as each is set up by a user
who knows it: sigmoid loss at beta 0.1, the reference the starting weights (full fine-tuning: a frozen copy;
`--lora`: the adapters switched off, as both do under peft), fp32, SDPA (xla_shard's `auto` on a CPU is
`sdpa_packed`, transformers' SDPA for padded rows), no activation checkpointing (DPOConfig turns it on by
default: turned off), gradients clipped at 1.0, AdamW, rows cut at --seq-len tokens, one CPU process of one
thread each. The two sides run in turn, `--rounds` times (so drift on a shared machine hits both); in each run
the first step is a warm-up, and the median of all the others is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dpo_step import write_rows

REPO = Path(__file__).resolve().parent.parent
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "USE_TORCH_XLA": "0",
              "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
LORA_R = 8


def ours(directory: Path, data: Path, out: Path, args) -> list[float]:
    sets = [f"model.name={directory}", f"data.path={data}", "method=dpo", "data.kind=preference",
            "backend=torch_fsdp", f"train.seq_len={args.seq_len}", f"train.global_batch_size={args.batch}",
            f"train.steps={args.steps}", "train.optimizer=adamw", "train.lr=1e-6", "train.max_grad_norm=1.0",
            "dpo.beta=0.1", f"output_dir={out}"]
    if args.lora:
        sets.append(f"model.lora={{r: {LORA_R}, alpha: 16, target_modules: all-linear}}")
    done = subprocess.run([sys.executable, "-m", "xla_shard.cli", "train", *[a for s in sets for a in ("--set", s)],
                           "--nproc-per-node", "1"], capture_output=True, text=True, env={**os.environ, **ONE_THREAD},
                          cwd=REPO)
    if done.returncode:
        sys.exit(f"xla_shard: {done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in records[1:]]


def trl_worker(directory: str, data: str, seq_len: str, batch: str, steps: str, lora: str) -> None:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    peft_config = None
    if lora == "1":
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA_R, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    config = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=int(batch), max_steps=int(steps),
                       max_length=int(seq_len), beta=0.1, bf16=False, gradient_checkpointing=False,
                       max_grad_norm=1.0, learning_rate=1e-6, optim="adamw_torch", report_to=[], logging_steps=1000,
                       save_strategy="no", use_cpu=True, dataloader_num_workers=0, seed=0)
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa", dtype=torch.float32)
    trainer = DPOTrainer(model=model, args=config, processing_class=AutoTokenizer.from_pretrained(directory),
                         train_dataset=load_dataset("json", data_files=data, split="train"), peft_config=peft_config,
                         callbacks=[Timer()])
    trainer.train()
    print(json.dumps(times[1:]), flush=True)


def trl(directory: Path, data: Path, args) -> list[float]:
    done = subprocess.run([sys.executable, __file__, "--trl-worker", str(directory), str(data), str(args.seq_len),
                           str(args.batch), str(args.steps), "1" if args.lora else "0"], capture_output=True,
                          text=True, env={**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO)})
    if done.returncode:
        sys.exit(f"TRL: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, interleaved")
    parser.add_argument("--lora", action="store_true", help=f"LoRA r {LORA_R} on every linear layer, both sides")
    parser.add_argument("--trl-worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(*args.trl_worker)
    sys.path.insert(0, str(REPO / "tests"))
    from model_dirs import llama_dir

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        directory = llama_dir(tmp / "llama", hidden=args.hidden, layers=args.layers)
        data = tmp / "pairs.jsonl"
        write_rows(data, args.rows)
        steps: dict[str, list[float]] = {"TRL DPOTrainer": [], "xla_shard method: dpo": []}
        for round_ in range(args.rounds):
            steps["TRL DPOTrainer"] += trl(directory, data, args)
            steps["xla_shard method: dpo"] += ours(directory, data, tmp / f"ours{round_}", args)
    medians = {name: statistics.median(times) for name, times in steps.items()}
    print(f"Llama hidden {args.hidden} x {args.layers} layers, {args.batch} preference pairs a step, rows cut at "
          f"{args.seq_len} tokens, {f'LoRA r {LORA_R} all-linear' if args.lora else 'full fine-tuning'}, fp32, "
          f"AdamW, clip 1.0, one CPU process of one thread each, median of {args.rounds} x {args.steps - 1} steps, "
          "interleaved")
    print("| trainer | step s | pairs/s | step x TRL's |")
    print("|---|---|---|---|")
    for name, median in medians.items():
        print(f"| {name} | {median:.3f} | {args.batch / median:.1f} | {median / medians['TRL DPOTrainer']:.2f} |")


if __name__ == "__main__":
    main()
