"""DPO (data.kind preference) with its reference = the LoRA adapters switched off, and with a reference model of
its own (dpo.reference: the same directory, built frozen beside the policy), against SFT on the same rows: step
time and the host memory a step takes, per process, side by side in one run.

    python bench/dpo_step.py [--hidden 256 --layers 4 --rows 32 --seq-len 256 --nproc 2 --backend torch_fsdp]

Makes a Llama directory and its tokenizer with `save_pretrained` (tests/model_dirs.py; nothing downloaded) and a
file of preference rows; trains LoRA adapters through xla_shard's Trainer under torchrun (CPU: gloo): DPO on
prompt / chosen / rejected (twice: the two references), and SFT (prompt_completion) on prompt / chosen of the same
rows. Each run takes one
warm-up step, then `--steps` timed ones; the peak host memory growth over all of them (VmHWM, from the end of
setup) is per process.
A DPO step runs a forward without gradients (the reference) and a training step over twice the sequences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pretrained_load import torchrun_records

REPO = Path(__file__).resolve().parent.parent
TOPICS = ["river", "bridge", "market", "harbour", "mill", "church", "school", "library", "castle", "square"]


def write_rows(path: Path, rows: int) -> None:
    lines = []
    for i in range(rows):
        topic = TOPICS[i % len(TOPICS)]
        prompt = f"Question {i}: tell me what you know about the {topic} and who built it.\nAnswer:"
        chosen = f" The {topic} was built of stone by the people of the town. " * 3
        rejected = f" I have never heard of a {topic} in this town, and nobody has. " * 2
        lines.append(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected,
                                 "completion": chosen}))
    path.write_text("\n".join(lines) + "\n")


def worker(directory: str, data: str, backend: str, steps: str, *overrides: str) -> None:
    import torch

    from xla_shard import config
    from xla_shard.hostmem import peak_growth
    from xla_shard.launch import exit_without_finalizing
    from xla_shard.train import Trainer

    trainer = Trainer(config.load(None, [f"model.name={directory}", f"data.path={data}", f"backend={backend}",
                                         "model.lora.r=8", "train.optimizer=adamw", *overrides])).setup()
    times = []
    with peak_growth() as growth:
        trainer.step(0).item()  # warm-up: not timed, but its memory counts
        for step in range(1, int(steps) + 1):
            start = time.perf_counter()
            trainer.step(step).item()  # waits for the step (XLA runs it asynchronously)
            times.append(time.perf_counter() - start)
    measured = torch.tensor([statistics.median(times), float(growth.bytes)], dtype=torch.float64)
    if torch.distributed.is_initialized():  # the largest over the processes
        torch.distributed.all_reduce(measured, op=torch.distributed.ReduceOp.MAX)
    if trainer.backend.processes.is_main:
        print(json.dumps({"step_s": measured[0].item(), "peak_growth": measured[1].item()}), flush=True)
    trainer.backend.shutdown()
    exit_without_finalizing(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--backend", default="torch_fsdp")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    sys.path.insert(0, str(REPO / "tests"))
    from model_dirs import llama_dir

    common = [f"train.seq_len={args.seq_len}", f"train.global_batch_size={args.batch}"]
    with tempfile.TemporaryDirectory() as tmp:
        directory = llama_dir(Path(tmp) / "llama", hidden=args.hidden, layers=args.layers)
        data = Path(tmp) / "rows.jsonl"
        write_rows(data, args.rows)
        runs = {}
        for name, sets in (("SFT (prompt + chosen)", ["data.kind=prompt_completion"]),
                           ("DPO, reference = adapters off", ["method=dpo", "data.kind=preference"]),
                           ("DPO, reference model of its own", ["method=dpo", "data.kind=preference",
                                                                 f"dpo.reference={directory}"])):
            worker_args = [str(directory), str(data), args.backend, str(args.steps), *sets, *common]
            runs[name] = torchrun_records(__file__, args.nproc, worker_args, name)
    mib = 2**20
    print(f"Llama hidden {args.hidden} x {args.layers} layers, LoRA r=8, {args.backend} x{args.nproc}, "
          f"{args.batch} rows of {args.seq_len} tokens a step; per process (the largest):")
    print(f"{'':32} {'step s':>8} {'x SFT':>6} {'peak MiB':>9} {'x SFT':>6}")
    base = runs["SFT (prompt + chosen)"]
    base_s = max(r["step_s"] for r in base)
    base_mem = max(r["peak_growth"] for r in base)
    for name, records in runs.items():
        step_s, grown = max(r["step_s"] for r in records), max(r["peak_growth"] for r in records)
        print(f"{name:32} {step_s:8.3f} {step_s / base_s:6.2f} {grown / mib:9.1f} {grown / max(base_mem, 1):6.2f}")


if __name__ == "__main__":
    main()
