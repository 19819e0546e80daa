"""First-step compile time and step time of xla_spmd with and without `fsdp.scan_layers`, by model depth.

    python bench/scan_layers.py [--model tiny-llama] [--layers 4 16 32] [--steps 4] [--devices 4]

Each (depth, scan) pair runs in its own process, so every first step compiles from nothing. Prints the first
step's wall time (tracing + XLA compile + one run), the median of the later steps, the ratio scanned /
unrolled for both, and the last loss (equal with and without scan).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--steps", type=int, default=4, help="steps per run, the first one compiling")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--checkpointing", action="store_true", help="fsdp.activation_checkpointing=true")
    parser.add_argument("--worker", nargs=2, metavar=("LAYERS", "SCAN"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _worker(args) -> None:
    from xla_shard import config
    from xla_shard.train import Trainer

    layers, scan = args.worker
    cfg = config.load(None, [f"model={args.model}", "backend=xla_spmd", f"cpu_devices={args.devices}",
                             f"model.overrides={{num_hidden_layers: {layers}}}", f"fsdp.scan_layers={scan}",
                             f"fsdp.activation_checkpointing={str(args.checkpointing).lower()}",
                             "train.seq_len=64", "train.optimizer=adamw",
                             f"output_dir={tempfile.mkdtemp(prefix='xla_shard_bench_')}"])
    trainer = Trainer(cfg).setup()
    times, losses = [], []
    for step in range(args.steps):
        started = time.perf_counter()
        losses.append(trainer.backend.mean_loss(trainer.step(step)))
        times.append(time.perf_counter() - started)
    print(json.dumps({"first_s": times[0], "step_s": statistics.median(times[2:] or times[1:]),
                      "loss": losses[-1]}))


def main() -> None:
    args = _parse()
    if args.worker:
        return _worker(args)
    rows = {}
    for layers in args.layers:
        for scan in ("false", "true"):
            cmd = [sys.executable, __file__, "--worker", str(layers), scan, "--model", args.model,
                   "--steps", str(args.steps), "--devices", str(args.devices)] + (
                ["--checkpointing"] if args.checkpointing else [])
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{layers} layers, scan_layers={scan} failed:\n{done.stderr[-3000:]}")
            rows[layers, scan] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{args.model}, xla_spmd on {args.devices} XLA CPU devices, AdamW, activation checkpointing "
          f"{'on' if args.checkpointing else 'off'}; first step = trace + compile + run")
    print("| layers | first step s: unrolled / scanned (ratio) | step ms: unrolled / scanned (ratio) | last loss "
          "unrolled / scanned |")
    print("|---|---|---|---|")
    for layers in args.layers:
        off, on = rows[layers, "false"], rows[layers, "true"]
        print(f"| {layers} | {off['first_s']:.1f} / {on['first_s']:.1f} ({on['first_s'] / off['first_s']:.2f}) "
              f"| {off['step_s'] * 1e3:.0f} / {on['step_s'] * 1e3:.0f} ({on['step_s'] / off['step_s']:.2f}) "
              f"| {off['loss']:.6f} / {on['loss']:.6f} |")


if __name__ == "__main__":
    main()
