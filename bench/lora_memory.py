"""Per-device memory of LoRA (model.lora) against full fine-tuning of the same model, one AdamW step each.

    python bench/lora_memory.py [--hidden 512 --layers 4 --rank 8 --nproc 2 --backend torch_fsdp]

Makes a Llama directory with `save_pretrained` (random weights, nothing downloaded), runs one optimizer step of
each under torchrun (CPU: gloo) through xla_shard's Trainer, and prints the bytes one device holds for
parameters and optimizer state after the step (`Trainer.memory_report`; gradients are freed by then, and
during the step they are the size of what trains), then LoRA / full.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from pretrained_load import make_model, torchrun_records


def worker(directory: str, backend: str, *overrides: str) -> None:
    from xla_shard import config
    from xla_shard.launch import exit_without_finalizing
    from xla_shard.train import Trainer

    trainer = Trainer(config.load(None, [f"model.name={directory}", f"backend={backend}", "train.seq_len=64",
                                         "train.optimizer=adamw", "train.global_batch_size=4", *overrides])).setup()
    trainer.step(0)
    if trainer.backend.processes.is_main:
        print(json.dumps(dataclasses.asdict(trainer.memory_report())), flush=True)
    trainer.backend.shutdown()
    exit_without_finalizing(0)


def run(directory: Path, nproc: int, backend: str, *overrides: str) -> dict:
    (record,) = torchrun_records(__file__, nproc, [str(directory), backend, *overrides], " ".join(overrides) or "full")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--backend", default="torch_fsdp")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "llama"
        size = make_model(directory, args.hidden, args.layers)
        runs = {"full": run(directory, args.nproc, args.backend),
                f"LoRA r={args.rank}": run(directory, args.nproc, args.backend, f"model.lora.r={args.rank}"),
                "+ bf16 base": run(directory, args.nproc, args.backend, f"model.lora.r={args.rank}",
                                   "model.lora.base_dtype=bfloat16")}
    mib = 2**20
    print(f"Llama {size / mib:.1f} MiB fp32, {args.backend} x{args.nproc}, AdamW; MiB on one device:")
    print(f"{'':12} {'params':>9} {'optimizer':>10} {'total':>9} {'/ full':>7}")
    full = runs["full"]["params"] + runs["full"]["optimizer"]
    for name, report in runs.items():
        total = report["params"] + report["optimizer"]
        print(f"{name:12} {report['params'] / mib:9.2f} {report['optimizer'] / mib:10.2f} {total / mib:9.2f} "
              f"{total / full:7.3f}")


if __name__ == "__main__":
    main()
