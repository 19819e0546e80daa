"""Loading pretrained weights into a sharded model: xla_shard's shard-by-shard load vs transformers'
`from_pretrained` in every process followed by FSDP2 sharding (what a torchrun + transformers script does).

    python bench/pretrained_load.py [--hidden 1024 --layers 8 --nproc 1 2 4 --backend torch_fsdp]

Makes a Llama directory with `save_pretrained` (random weights, nothing downloaded), then for each process
count runs both loaders under torchrun and prints, per process: bytes read from storage, peak host-memory
growth during the load, and seconds; then the ratios xla_shard / transformers. On a GPU machine the shards
live in GPU memory, so host growth is the read batch alone; on a CPU they are host memory too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_model(directory: Path, hidden: int, layers: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=max(hidden // 128, 1),
                         num_key_value_heads=max(hidden // 128, 1), max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, max_shard_size="200MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def worker(mode: str, directory: str, backend: str) -> None:
    """One process of one loader; prints one JSON line."""
    from xla_shard import config
    from xla_shard.hostmem import peak_growth

    cfg = config.load(None, [f"model.name={directory}", f"backend={backend}", "train.seq_len=32",
                             "train.global_batch_size=64"])
    from xla_shard import backends

    backend_obj = backends.start(cfg)
    start = time.perf_counter()
    if mode == "xla_shard":
        from xla_shard.models import build_model, resolve_source
        from xla_shard.pretrained import PretrainedWeights

        weights = PretrainedWeights.find(resolve_source(cfg.model), "pretrained")
        model = build_model(cfg.model, 0, empty=True, source=weights.source)
        weights.match(model, 0)
        model = backend_obj.wrap(model)
        report = weights.load(backend_obj, model)
        read, growth = report.bytes_read, report.peak_host_growth
    else:
        import torch
        from transformers import AutoModelForCausalLM

        with peak_growth() as measured:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
            model = backend_obj.wrap(model)
        read = sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))
        growth = measured.bytes
    backend_obj.after_step()
    seconds = time.perf_counter() - start
    print(json.dumps({"mode": mode, "rank": backend_obj.processes.writer[0], "read": read, "growth": growth,
                      "seconds": seconds}), flush=True)
    backend_obj.shutdown()


def torchrun_records(script: str, nproc: int, args: list[str], what: str) -> list[dict]:
    """`script --worker ARGS` under torchrun; the JSON lines its processes print."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               script, "--worker", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{what} x{nproc} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def run(mode: str, directory: Path, nproc: int, backend: str) -> list[dict]:
    return sorted(torchrun_records(__file__, nproc, [mode, str(directory), backend], mode), key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--backend", default="torch_fsdp")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "llama"
        size = make_model(directory, args.hidden, args.layers)
        mib = 2**20
        print(f"Llama hidden={args.hidden} layers={args.layers}: {size / mib:.1f} MiB of fp32 weights, {args.backend}")
        print(f"{'procs':>5} {'loader':>12} {'read/proc MiB':>14} {'host growth/proc MiB':>21} {'seconds':>8}")
        for nproc in args.nproc:
            rows = {mode: run(mode, directory, nproc, args.backend) for mode in ("transformers", "xla_shard")}
            for mode, results in rows.items():
                print(f"{nproc:>5} {mode:>12} {max(r['read'] for r in results) / mib:>14.1f} "
                      f"{max(r['growth'] for r in results) / mib:>21.1f} {max(r['seconds'] for r in results):>8.2f}")
            ours, theirs = rows["xla_shard"], rows["transformers"]
            ratio = {key: max(r[key] for r in ours) / max(max(r[key] for r in theirs), 1) for key in
                     ("read", "growth", "seconds")}
            print(f"{nproc:>5} {'ratio':>12} {ratio['read']:>14.2f} {ratio['growth']:>21.2f} {ratio['seconds']:>8.2f}")


if __name__ == "__main__":
    main()
