"""Each (params, grads, optimizer) sharding triple on xla_spmd: the cost model's predictions beside what the run
allocates, what its compiled step communicates, and its step time, in one invocation.

    python bench/sharding_triples.py [--model small-llama] [--devices 8] [--steps 8] [--optimizer adamw]

One process, CPU_NUM_DEVICES virtual XLA devices; every triple trains the same steps on the same data.
Memory: bytes of parameters / gradients / optimizer state on one device (the model: 4/P, 4/G, 8/OS per
parameter). Communication: tensor bytes of the step's collectives (the optimized HLO, by replica group),
summed over kinds, and what fits no kind (should be 0). Time: mean of the steps after the two that compile, and
its ratio to FULL_SHARD's (the raw FSDPv2 comparison for FULL_SHARD is bench/step_overhead.py). On a CPU the
collectives are memory copies, so the step time says what the sharding costs in compute and copies, not what
it saves on a network. The loss column is the last step's: equal across triples. Beside FULL_SHARD, each triple's
memory per device above it and the communication it saves (negative: costs more).

    python bench/sharding_triples.py --accum 1 2 4

Gradient accumulation instead: FULL_SHARD with k micro-batches per step (the global batch fixed), the compiled
step's gradient reductions (count of reduce ops over the gradient group and their bytes) next to the model's
prediction for xla_spmd (one reduction per micro-batch) and FSDP2's one per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    parser.add_argument("--triples", nargs="*", help="P/G/OS ... (default: a spread of every kind)")
    parser.add_argument("--accum", type=int, nargs="*", help="micro-batch counts k: the accumulation table instead")
    return parser.parse_args()


def _default_triples(n: int) -> list[tuple[int, int, int]]:
    half, quarter = max(1, n // 2), max(1, n // 4)
    picks = [(n, n, n), (quarter, half, n), (1, quarter, n), (1, 1, n), (1, n, n), (quarter, n, n), (half, half, n),
             (quarter, quarter, half), (quarter, quarter, quarter), (1, 1, 1)]
    return list(dict.fromkeys(picks))


def _accumulation(args, overrides: list[str], dump: str) -> None:
    """FULL_SHARD's gradient reductions per step for each micro-batch count."""
    from measure import compare

    n, mib = args.devices, 2 ** 20
    batch = n * max(args.accum)  # every micro-batch splits over the devices
    print(f"{args.model}, FULL_SHARD on {n} XLA CPU devices, global batch {batch} x {args.seq_len} tokens")
    print("| micro-batches k | gradient reduce ops | gradient MiB measured | predicted (xla_spmd: k reductions) "
          "| FSDP2 (one reduction) |")
    print("|---|---|---|---|---|")
    once = None
    for k in args.accum:
        (row,) = compare([*overrides, f"train.global_batch_size={batch}", f"train.grad_accum_steps={k}"],
                         [(n, n, n)], args.steps, dump)
        ops = sum(v["count"] for (op, size, _), v in row.measured.collectives.items()
                  if op in ("all-reduce", "reduce-scatter") and size == n)
        predicted = row.predicted_comm.get("grads", 0)
        once = once or predicted / k
        print(f"| {k} | {ops} | {row.measured_comm['grads'] / mib:.2f} | {predicted / mib:.2f} | {once / mib:.2f} |")


def main() -> None:
    args = _parse()
    dump = tempfile.mkdtemp(prefix="xla_shard_hlo_")
    os.environ["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
    from measure import compare

    overrides = [f"model={args.model}", "backend=xla_spmd", f"cpu_devices={args.devices}",
                 f"train.seq_len={args.seq_len}", f"train.optimizer={args.optimizer}",
                 f"output_dir={tempfile.mkdtemp(prefix='xla_shard_bench_')}"]
    if args.accum:
        return _accumulation(args, overrides, dump)
    triples = ([tuple(int(d) for d in t.split("/")) for t in args.triples] if args.triples
               else _default_triples(args.devices))
    rows = compare([*overrides, f"train.global_batch_size={args.batch}"], triples, args.steps, dump)
    full_shard = "/".join([str(args.devices)] * 3)
    base = next((r for r in rows if r.measured.triple == full_shard), None)
    baseline = base.measured.step_s if base else None
    mib = 2 ** 20
    print(f"{args.model}, {args.devices} XLA CPU devices, {args.batch} x {args.seq_len} tokens, {args.optimizer}, "
          f"{args.steps} steps per triple")
    print("| P/G/OS | params MiB pred / meas | grads MiB pred / meas | optimizer MiB pred / meas "
          "| comm MiB pred / meas (other) | vs FULL_SHARD: MiB more per device, comm MiB saved | step ms "
          "| vs FULL_SHARD | last loss |")
    print("|---|---|---|---|---|---|---|---|---|")

    def held(row):
        return sum(row.measured.memory.values())

    def moved(row):
        return sum(v for k, v in row.measured_comm.items() if k != "other")
    for r in rows:
        m, pm = r.measured, r.predicted_memory
        memory = " | ".join(f"{pm[k] / mib:.2f} / {m.memory[k] / mib:.2f}" for k in ("params", "grads", "optimizer"))
        found = {k: v for k, v in r.measured_comm.items() if k != "other"}
        comm = (f"{sum(r.predicted_comm.values()) / mib:.2f} / {sum(found.values()) / mib:.2f} "
                f"({r.measured_comm.get('other', 0) / mib:.2f})")
        ratio = f"{m.step_s / baseline:.2f}" if baseline else "-"
        versus = f"{(held(r) - held(base)) / mib:+.2f}, {(moved(base) - moved(r)) / mib:+.2f}" if base else "-"
        print(f"| {m.triple} | {memory} | {comm} | {versus} | {m.step_s * 1e3:.0f} | {ratio} | {m.losses[-1]:.6f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
