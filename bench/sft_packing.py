"""Variable-length chat SFT, side by side in one run: xla_shard (packed best-fit decreasing, and padded) against
TRL's `SFTTrainer` (with and without `packing=True`), on the same model, rows and optimizer. Each reports real
tokens per second (tokens of the examples, not packing's filler or padding) and its fill rate (real tokens over
the tokens it computes).

    python bench/sft_packing.py [--rows 400 --seq-len 1024 --batch 8 --steps 8 --hidden 256 --layers 4]

The rows are conversations with a long tail of lengths (a user turn, then an answer of log-normally many words:
tens to thousands of tokens), written here, with a Llama directory and its tokenizer (`save_pretrained`,
tests/model_dirs.py; nothing downloaded). xla_shard runs torch_fsdp on one CPU process (eager, so padded rows are
cut to their micro-batch's longest, as TRL's collator pads); TRL runs in a process of its own (USE_TORCH_XLA=0),
with `per_device_train_batch_size` = --batch. The first step is a warm-up; the others are timed (TRL's through a
callback around each optimizer step).
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
            f"train.steps={args.steps}", "train.optimizer=adamw", "train.lr=1e-4", f"output_dir={out}"]
    env = {**os.environ, "USE_TORCH_XLA": "0"}
    done = subprocess.run([sys.executable, "-m", "xla_shard.cli", "train", *[a for s in sets for a in ("--set", s)],
                           "--nproc-per-node", "1"], capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    fill = next(line for line in done.stderr.splitlines() if "% of their tokens real" in line)
    return {"real_tokens_per_s": statistics.median(r["real_tokens_per_s"] for r in records),
            "fill": float(fill.split("% of their tokens real")[0].rsplit(" ", 1)[-1]) / 100,
            "step_s": statistics.median(r["step_time_s"] for r in records)}


def trl_worker(directory: str, data: str, seq_len: str, batch: str, steps: str, packing: str) -> None:
    """TRL's SFTTrainer on the rows: real tokens and computed tokens of each step's batch, and its time."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
    counted: list[tuple[int, int]] = []
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    config = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=int(batch), max_steps=int(steps),
                       max_length=int(seq_len), packing=packing == "1", learning_rate=1e-4, optim="adamw_torch",
                       report_to=[], logging_steps=1000, save_strategy="no", use_cpu=True, dataloader_num_workers=0,
                       assistant_only_loss=False, completion_only_loss=None, seed=0)
    trainer = SFTTrainer(model=model, args=config, train_dataset=load_dataset("json", data_files=data, split="train"),
                         processing_class=tokenizer, callbacks=[Timer()])
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
    steps_timed = list(zip(counted, times))[1:]  # the first step warms up
    print(json.dumps({"real_tokens_per_s": statistics.median(r / t for (r, _), t in steps_timed),
                      "fill": sum(r for (r, _), _ in steps_timed) / sum(n for (_, n), _ in steps_timed),
                      "step_s": statistics.median(t for _, t in steps_timed)}), flush=True)


def trl_run(directory: Path, data: Path, args, packing: bool) -> dict:
    env = {**os.environ, "USE_TORCH_XLA": "0", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, __file__, "--trl-worker", str(directory), str(data), str(args.seq_len),
                           str(args.batch), str(args.steps), "1" if packing else "0"], capture_output=True,
                          text=True, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--trl-worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(*args.trl_worker)
        return
    from model_dirs import CHAT_TEMPLATE, llama_dir

    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        directory = llama_dir(work / "model", chat_template=CHAT_TEMPLATE, hidden=args.hidden, layers=args.layers,
                              positions=args.seq_len)
        data = work / "chat.jsonl"
        write_rows(data, args.rows)
        results = {
            "xla_shard, packed (best-fit decreasing)": xla_shard_run(directory, data, work / "packed", args, True),
            "xla_shard, padded (cut to each micro-batch's longest)": xla_shard_run(directory, data, work / "padded",
                                                                                   args, False),
            "TRL SFTTrainer, packing=True": trl_run(directory, data, args, True),
            "TRL SFTTrainer, packing=False": trl_run(directory, data, args, False),
        }
    base = results["TRL SFTTrainer, packing=True"]["real_tokens_per_s"]
    print(f"{args.rows} chat rows (answers of tens to thousands of tokens), rows of {args.seq_len} tokens, batch "
          f"{args.batch}, Llama hidden {args.hidden} x {args.layers} layers, AdamW, one CPU process each")
    print("| run | real tokens/s | fill rate | step s | real tokens/s vs TRL packed |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['real_tokens_per_s']:.0f} | {100 * r['fill']:.1f}% | {r['step_s']:.2f} | "
              f"{r['real_tokens_per_s'] / base:.2f} |")


if __name__ == "__main__":
    main()
