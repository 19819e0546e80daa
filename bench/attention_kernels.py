"""Which attention kernel is fastest on each device, beside what `model.attn_implementation: auto` picks there.

    python bench/attention_kernels.py [--hidden 128 --layers 2 --seq-len 1024 --batch 8 --steps 4]

On every device this machine has (torch's CPU; XLA's CPU client where torch_xla is installed; a CUDA GPU where
one is present), a Llama's training step (forward, loss, backward) runs with each kernel transformers offers
there (and xla_shard's `sdpa_packed`), on packed rows (four documents a row, told apart by restarting position
ids, as `data.packing` makes them) and on one row of --long tokens. Each kernel's loss and a gradient are held
against eager's (the same formula: equal to 1e-5), and its step time is the median after a warm-up step. A
kernel the device refuses is listed with the reason (FlexAttention has no backward on a CPU, for one). The last
column says whether `auto`'s pick is the fastest kernel that computes the same thing (within 5%, the noise of a
shared machine).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

KERNELS = {"cpu": ("eager", "sdpa", "sdpa_packed", "flex_attention"), "xla_cpu": ("eager", "sdpa"),
           "cuda": ("eager", "sdpa", "sdpa_packed", "flex_attention", "flash_attention_2")}


def step_times(device: str, kernel: str, rows: int, seq_len: int, args) -> dict:
    """A Llama's training steps with `kernel` on `rows` x `seq_len` packed tokens: median time, loss, gradient."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 32, num_key_value_heads=max(1, args.hidden // 64),
                         vocab_size=2048, max_position_embeddings=seq_len, use_cache=False)
    config._attn_implementation = kernel
    torch.manual_seed(0)
    if device == "xla_cpu":
        import torch_xla

        target, sync = torch_xla.device(), torch_xla.sync
    else:
        target = torch.device(device)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model = LlamaForCausalLM(config).to(target)
    ids = torch.randint(0, config.vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(1))
    documents = 4 if rows > 1 else 1
    positions = torch.arange(seq_len).remainder(seq_len // documents).expand(rows, -1)
    ids, positions = ids.to(target), positions.to(target)
    times = []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, position_ids=positions).loss
        loss.backward()
        sync()
        loss_value = loss.item()
        times.append(time.perf_counter() - started)
    grad = model.model.layers[0].self_attn.q_proj.weight.grad.norm().item()
    return {"step_s": statistics.median(times[1:]), "loss": loss_value, "grad": grad}


def worker(device: str, args) -> None:
    import torch

    from xla_shard import attention

    attention.register()  # xla_shard's own kernels (sdpa_packed)
    torch.set_num_threads(args.threads)
    results = []
    for rows, seq_len in ((args.batch, args.seq_len), (1, args.long)):
        for kernel in KERNELS[device]:
            entry = {"device": device, "kernel": kernel, "shape": f"{rows} x {seq_len}"}
            try:
                entry |= step_times(device, kernel, rows, seq_len, args)
            except Exception as exc:  # a kernel this device or install lacks: say why
                entry["refused"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
            results.append(entry)
    print(json.dumps(results))


def devices() -> list[str]:
    found = ["cpu"]
    if importlib.util.find_spec("torch_xla") is not None:
        found.append("xla_cpu")
    import torch

    if torch.cuda.is_available():
        found.append("cuda")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--long", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        return
    from xla_shard.attention import choose

    env = {**os.environ, "PJRT_DEVICE": "CPU", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "CPU_NUM_DEVICES": "1"}
    passed = [a for a in sys.argv[1:]]
    print(f"Llama hidden {args.hidden} x {args.layers} layers, a training step (forward, loss, backward), "
          f"{args.threads} thread(s), median of {args.steps - 1} steps after a warm-up")
    print("| device | rows x tokens | kernel | step s | x eager | loss, grad vs eager | auto's pick fastest? |")
    print("|---|---|---|---|---|---|---|")
    for device in devices():
        done = subprocess.run([sys.executable, __file__, "--worker", device, *passed], capture_output=True,
                              text=True, env=env)
        if done.returncode:
            print(f"| {device} | | | failed: {done.stderr.strip().splitlines()[-1][:120]} | | | |")
            continue
        results = json.loads(done.stdout.strip().splitlines()[-1])
        auto = choose("auto", device)
        for shape in dict.fromkeys(r["shape"] for r in results):
            rows = [r for r in results if r["shape"] == shape]
            eager = next(r for r in rows if r["kernel"] == "eager")
            same = [r for r in rows if "refused" not in r and abs(r["loss"] - eager["loss"]) <= 1e-5 * abs(
                eager["loss"]) and abs(r["grad"] - eager["grad"]) <= 1e-4 * abs(eager["grad"]) + 1e-9]
            fastest = min(same, key=lambda r: r["step_s"])
            picked = next((r for r in same if r["kernel"] == auto), None)
            verdict = ("yes" if picked and picked["step_s"] <= 1.05 * fastest["step_s"]
                       else f"no: {fastest['kernel']} is")
            for r in rows:
                if "refused" in r:
                    print(f"| {device} | {shape} | {r['kernel']} | refused: {r['refused']} | | | |")
                    continue
                print(f"| {device} | {shape} | {r['kernel']}{' (auto)' if r['kernel'] == auto else ''} | "
                      f"{r['step_s']:.3f} | {r['step_s'] / eager['step_s']:.2f} | "
                      f"{'equal' if r in same else 'DIFFERS'} | {verdict if r['kernel'] == auto else ''} |")


if __name__ == "__main__":
    main()
