"""Variable-length chat SFT, side by side in one run: xla_shard (packed best-fit decreasing, and padded) against
TRL's `SFTTrainer` in the configurations its docs recommend, on the same model, rows, optimizer and settings.
Each leg reports real tokens per second (the examples' tokens, not packing's filler or padding) and its fill
rate (real tokens over the tokens it computes).

    python bench/sft_packing.py [--rows 500 --seq-len 1024 --batch 8 --steps 10 --rounds 2 --lora]

TRL's legs:
- `packing=True` (best-fit decreasing, which TRL runs padding-free), one packed row per forward and `--batch`
  accumulation steps: on a CPU, as on any device without FlashAttention's variable-length kernel, this is how
  TRL's docs pack. A forward of `--batch` packed rows would be one `batch x seq_len` sequence attended as a
  whole (transformers masks it block-diagonally), which no one runs there.
- `padding_free=True` without packing, `--batch` rows a forward: the rows joined without padding. TRL refuses a
  `max_length` there, so this leg's rows are not cut at --seq-len (the other legs cut the few longer ones).
- plain padding, `--batch` rows a forward, cut to the longest.

Alike on both sides: fp32, SDPA attention (xla_shard's `auto` picks it on a CPU; the start-up line says so),
no activation checkpointing (SFTConfig turns it on by default, and bf16: both turned off here), gradient clipping
at 1.0, AdamW at 1e-4, one CPU process with one thread each, the same rows (a chat template, loss on every
token). The legs run in turn, `--rounds` times over (so that drift on a shared machine hits all of them); a
leg's real tokens per second are its timed steps' real tokens over their time (a mean: padded batches differ
in length), its step time their median; each run's first step (the warm-up) is left out.

The rows are conversations with a long tail of lengths (a user turn, then an answer of log-normally many words:
tens to thousands of tokens), written here, with a Llama directory and its tokenizer (`save_pretrained`,
tests/model_dirs.py; nothing downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "USE_TORCH_XLA": "0",
              "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
LORA_R = 8


def write_rows(path: Path, rows: int, seed: int = 0) -> None:
    words = (REPO / "tests/fixtures/corpus.txt").read_text().split()
    rng = random.Random(seed)
    lines = []
    for i in range(rows):
        answer = int(min(3000, rng.lognormvariate(4.2, 1.1))) + 4
        start = rng.randrange(len(words))
        text = " ".join(words[(start + j) % len(words)] for j in range(answer))
        lines.append(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: go on from here."},
                                              {"role": "assistant", "content": text}]}))
    path.write_text("\n".join(lines) + "\n")


def xla_shard_run(directory: Path, data: Path, out: Path, args, packing: bool) -> dict:
    sets = [f"model.name={directory}", f"data.path={data}", "data.kind=chat", f"data.packing={str(packing).lower()}",
            "backend=torch_fsdp", f"train.seq_len={args.seq_len}", f"train.global_batch_size={args.batch}",
            f"train.steps={args.steps}", "train.optimizer=adamw", "train.lr=1e-4", "train.max_grad_norm=1.0",
            "model.attn_implementation=auto", f"output_dir={out}"]
    if args.lora:
        sets.append(f"model.lora={{r: {LORA_R}, alpha: 16, target_modules: all-linear}}")
    done = subprocess.run([sys.executable, "-m", "xla_shard.cli", "train", *[a for s in sets for a in ("--set", s)],
                           "--nproc-per-node", "1"], capture_output=True, text=True, env={**os.environ, **ONE_THREAD},
                          cwd=REPO)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    attention = next(line for line in done.stderr.splitlines() if "model: attention" in line)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    fill = next(line for line in done.stderr.splitlines() if "% of their tokens real" in line)
    return {"real": [r["real_tokens_per_s"] * r["step_time_s"] for r in records],
            "steps": [r["step_time_s"] for r in records],
            "fill": float(fill.split("% of their tokens real")[0].rsplit(" ", 1)[-1]) / 100,
            "attention": attention.split("model: attention ", 1)[1].split()[0]}


TRL_LEGS = {  # name: (SFTConfig's packing, padding_free, rows a forward (None: --batch), accumulation (None: --batch))
    "packed": (True, True, 1, None),
    "padding_free": (False, True, None, 1),
    "padded": (False, False, None, 1),
}


def trl_worker(directory: str, data: str, seq_len: str, batch: str, steps: str, leg: str, lora: str) -> None:
    """TRL's SFTTrainer on the rows: each optimizer step's real and computed tokens, and its time."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    packing, padding_free, rows, accumulation = TRL_LEGS[leg]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa", dtype=torch.float32)
    peft_config = None
    if lora == "1":
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA_R, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    counted: list[tuple[int, int]] = []
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    config = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=rows or int(batch),
                       gradient_accumulation_steps=accumulation or int(batch), max_steps=int(steps),
                       max_length=None if padding_free and not packing else int(seq_len), packing=packing,
                       padding_free=padding_free, bf16=False,
                       gradient_checkpointing=False, max_grad_norm=1.0, learning_rate=1e-4, optim="adamw_torch",
                       report_to=[], logging_steps=1000, save_strategy="no", use_cpu=True, dataloader_num_workers=0,
                       assistant_only_loss=False, completion_only_loss=None, seed=0)
    trainer = SFTTrainer(model=model, args=config, train_dataset=load_dataset("json", data_files=data, split="train"),
                         processing_class=tokenizer, callbacks=[Timer()], peft_config=peft_config)
    collate = trainer.data_collator

    def counting(examples):
        batch = collate(examples)
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        real = int(mask.sum()) if mask is not None else int(sum(len(e["input_ids"]) for e in examples))
        counted.append((real, ids.numel()))
        return batch

    trainer.data_collator = counting
    trainer.train()
    per_step = accumulation or int(batch)
    steps_counted = [counted[i:i + per_step] for i in range(0, per_step * len(times), per_step)]
    real = [sum(r for r, _ in micro) for micro in steps_counted]
    computed = [sum(n for _, n in micro) for micro in steps_counted]
    print(json.dumps({"real": real[1:], "steps": times[1:],
                      "fill": sum(real[1:]) / sum(computed[1:]), "attention": model.config._attn_implementation}),
          flush=True)


def trl_run(directory: Path, data: Path, args, leg: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--trl-worker", str(directory), str(data), str(args.seq_len),
                           str(args.batch), str(args.steps), leg, "1" if args.lora else "0"], capture_output=True,
                          text=True, env={**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO)})
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lora", action="store_true", help=f"LoRA r {LORA_R} on every linear layer, both sides")
    parser.add_argument("--trl-worker", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(*args.trl_worker)
        return
    from model_dirs import CHAT_TEMPLATE, llama_dir

    legs = {
        "xla_shard, packed (best-fit decreasing)": lambda work, r: xla_shard_run(directory, data, work / f"p{r}",
                                                                                args, True),
        "xla_shard, padded (cut to each micro-batch's longest)": lambda work, r: xla_shard_run(
            directory, data, work / f"u{r}", args, False),
        **{f"TRL SFTTrainer, {name}": (lambda work, r, name=name: trl_run(directory, data, args, name))
           for name in TRL_LEGS},
    }
    results: dict[str, list[dict]] = {name: [] for name in legs}
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        directory = llama_dir(work / "model", chat_template=CHAT_TEMPLATE, hidden=args.hidden, layers=args.layers,
                              positions=args.seq_len)
        data = work / "chat.jsonl"
        write_rows(data, args.rows)
        for round_ in range(args.rounds):
            for name, run in legs.items():
                results[name].append(run(work, round_))
    figures = {name: {"rate": sum(x for r in runs for x in r["real"]) / sum(x for r in runs for x in r["steps"]),
                      "step": statistics.median(x for r in runs for x in r["steps"]),
                      "fill": statistics.mean(r["fill"] for r in runs), "attention": runs[0]["attention"]}
               for name, runs in results.items()}
    best = max((n for n in figures if n.startswith("TRL")), key=lambda n: figures[n]["rate"])
    print(f"{args.rows} chat rows (answers of tens to thousands of tokens), rows of {args.seq_len} tokens, "
          f"{args.batch} rows a step, Llama hidden {args.hidden} x {args.layers} layers, "
          f"{f'LoRA r {LORA_R} all-linear' if args.lora else 'full fine-tuning'}, fp32, AdamW, clip 1.0, one CPU "
          f"process of one thread each, {args.rounds} rounds x {args.steps - 1} timed steps")
    print(f"| run | attention | real tokens/s | fill rate | step s | vs TRL's best ({best.split(', ')[1]}) |")
    print("|---|---|---|---|---|---|")
    for name, f in figures.items():
        print(f"| {name} | {f['attention']} | {f['rate']:.0f} | {100 * f['fill']:.1f}% | {f['step']:.2f} | "
              f"{f['rate'] / figures[best]['rate']:.2f} |")


if __name__ == "__main__":
    main()
