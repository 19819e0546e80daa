"""What the torch sequence axis saves: one process holding each row whole beside `--processes` processes splitting
it (`mesh.context`), on torch_fsdp over gloo, in one run.

    python bench/context_memory.py [--seq-len 16384 --processes 2 --hidden 128 --layers 2]

A Llama directory (`save_pretrained`, tests/model_dirs.py) trains two steps on one row of `--seq-len` synthetic
tokens, each process with one thread. Per process: the peak host memory's growth over what it held once set up
(the model, its shards and the optimizer are set up before; the steps' activations, attention and collectives
are what grows), the step time (the second step's), and the loss, which must be the same with and without the
axis. The ratio column is the split run's growth over the whole run's.

Both legs run with glibc's mmap threshold fixed at 128 KiB (`MALLOC_MMAP_THRESHOLD_`): by default glibc raises
the threshold after large frees and serves later tensors from its heaps, whose freed blocks stay in the process
(and each collective thread has its own heap), so the peak resident size then varies by +-10% between identical
runs. Fixed, every tensor over 128 KiB is its own mapping, returned when freed, and the peak is the tensors'.
`--glibc-default` measures without it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(directory: str, processes: int, seq_len: int, report: str) -> None:
    import torch

    from xla_shard import config
    from xla_shard.launch import exit_without_finalizing
    from xla_shard.train import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(config.load(None, [
        f"model.name={directory}", "backend=torch_fsdp", f"cpu_devices={processes}", f"mesh.context={processes}",
        f"train.seq_len={seq_len}", "train.global_batch_size=1", "train.steps=2",
        f"output_dir={Path(directory).parent / f'out{processes}'}"])).setup()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, loss = [], 0.0
    for step in range(2):
        started = time.perf_counter()
        loss = trainer.step(step).item()
        times.append(time.perf_counter() - started)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    Path(report, f"{os.environ['RANK']}.json").write_text(
        json.dumps({"growth_mib": grown, "step_s": times[-1], "loss": loss}))
    exit_without_finalizing(0)


def run(directory: Path, processes: int, seq_len: int, glibc_default: bool) -> list[dict]:
    env = {**os.environ, "USE_TORCH_XLA": "0", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    if not glibc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    report = directory.parent / f"report{processes}"
    report.mkdir()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={processes}", __file__, "--worker", str(directory), str(processes),
                           str(seq_len), str(report)], env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    return [json.loads(path.read_text()) for path in sorted(report.glob("*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--glibc-default", action="store_true", help="leave glibc's mmap threshold dynamic")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]), int(args.worker[2]), args.worker[3])
    sys.path.insert(0, str(REPO / "tests"))
    from model_dirs import llama_dir

    with tempfile.TemporaryDirectory() as tmp:
        directory = llama_dir(Path(tmp) / "llama", hidden=args.hidden, layers=args.layers, positions=args.seq_len)
        whole = run(directory, 1, args.seq_len, args.glibc_default)[0]
        split = run(directory, args.processes, args.seq_len, args.glibc_default)
    print(f"Llama hidden {args.hidden} x {args.layers} layers, one row of {args.seq_len} tokens, torch_fsdp on the "
          "CPU (gloo), one thread a process; growth = peak host memory over the set-up's, glibc's mmap threshold "
          + ("dynamic" if args.glibc_default else "fixed at 128 KiB"))
    print("| run | growth MiB per process | x whole | step s | loss |")
    print("|---|---|---|---|---|")
    print(f"| 1 process, the row whole | {whole['growth_mib']:.0f} | 1.00 | {whole['step_s']:.2f} | "
          f"{whole['loss']:.6f} |")
    worst = max(split, key=lambda r: r["growth_mib"])
    print(f"| {args.processes} processes, mesh.context={args.processes} (the largest) | {worst['growth_mib']:.0f} | "
          f"{worst['growth_mib'] / whole['growth_mib']:.2f} | {worst['step_s']:.2f} | {worst['loss']:.6f} |")


if __name__ == "__main__":
    main()
