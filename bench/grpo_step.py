"""A whole GRPO step, xla_shard's (method: grpo) beside TRL's GRPOTrainer on the same model, prompts, reward
function and generation settings: step time and generated tokens per second of step, side by side in one run,
and the ratios.

    python bench/grpo_step.py [--hidden 256 --layers 4 --prompts 4 --generations 4 --new 64 --steps 8]
                              [--processes 1] [--vllm]

Makes a Llama directory and its tokenizer with `save_pretrained` (tests/model_dirs.py; nothing downloaded), a
file of prompts and a reward function (the share of low token ids in a completion). Each side trains fully
(AdamW, fp32, this machine's CPU, `--threads` torch threads a process) for one warm-up step, then `--steps` timed ones,
in a process of its own: xla_shard's Trainer on torch_fsdp (`--processes` gloo processes sharing the batch and
the model's shards), and TRL's GRPOTrainer (which samples with transformers' `generate`, as it does without
vLLM). A step generates every completion of the batch (prompts x
generations, up to `--new` tokens each), scores them and trains on them; tokens/s counts the completions'
tokens over the step's wall time. The EOS token is out of the random model's likely draws, so both sample
about `--new` tokens a row.

`--vllm` (in an environment with vLLM, `.venv-vllm`) adds both sides' vLLM legs, colocated in the training
process: xla_shard's `grpo.use_vllm` and TRL's `use_vllm=True, vllm_mode="colocate"` (each engine's KV cache 1 GiB
on a CPU), the tokens/s column then the generation's share of the step included. The Llama's heads are of 64
(vLLM's CPU attention takes no smaller).

Like for like, as each side is set up by a user who knows it: xla_shard's prompt positions are the longest
prompt's (`train.seq_len` = it + `--new`; TRL pads each batch to its longest), both clip the gradient norm at
1.0 (TRL's default `max_grad_norm`), both attend with SDPA (transformers' default, which TRL loads; xla_shard's
`auto`, `sdpa_packed` on a CPU, is transformers' SDPA for unpacked rows), and each process runs `--threads`
threads (1: neither side takes the other's core).
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

from pretrained_load import torchrun_records

REPO = Path(__file__).resolve().parent.parent
REWARD = '''
def low_token_share(completion_ids, **kwargs):
    return [sum(token < 40 for token in ids) / max(len(ids), 1) for ids in completion_ids]
'''


def write_prompts(path: Path, prompts: int) -> None:
    topics = ["river", "bridge", "market", "harbour", "mill", "church", "school", "library", "castle", "square"]
    path.write_text("".join(json.dumps({"prompt": f"Question {i}: what do you know about the "
                                                  f"{topics[i % len(topics)]}?\nAnswer:"}) + "\n"
                            for i in range(prompts)))


def longest_prompt(directory: str, data: str) -> int:
    """Tokens of the longest prompt in `data`: what a user sizes xla_shard's prompt positions to."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    return max(len(tokenizer(json.loads(line)["prompt"])["input_ids"]) for line in Path(data).read_text().splitlines())


def ours(directory: str, data: str, rewards: str, generations: int, new: int, batch: int, steps: int,
         threads: int, processes: int, vllm: int = 0) -> dict:
    import torch

    from xla_shard import config
    from xla_shard.train import Trainer

    torch.set_num_threads(threads)
    trainer = Trainer(config.load(None, [
        f"model.name={directory}", f"data.path={data}", "backend=torch_fsdp", f"cpu_devices={processes}",
        "method=grpo", "data.kind=prompt", f"grpo.reward_funcs=[{rewards}:low_token_share]",
        f"grpo.num_generations={generations}", f"grpo.max_completion_length={new}",
        f"train.seq_len={new + longest_prompt(directory, data)}", f"train.global_batch_size={batch}",
        "train.max_grad_norm=1.0", "train.lr=1e-6", "train.optimizer=adamw", "model.attn_implementation=auto",
        f"grpo.use_vllm={bool(vllm)}", "output_dir=" + str(Path(data).parent / f"ours{vllm}")])).setup()
    times, tokens = [], []
    for step in range(steps + 1):
        start = time.perf_counter()
        trainer.step(step).item()
        elapsed = time.perf_counter() - start
        lengths = trainer.method.step_metrics(float)["completions/mean_length"]
        if step:  # the first is the warm-up
            times.append(elapsed)
            tokens.append(lengths * batch)
    trainer.backend.shutdown()
    return {"step_s": statistics.median(times), "tokens_per_s": sum(tokens) / sum(times)}


def trl(directory: str, data: str, rewards: str, generations: int, new: int, batch: int, steps: int,
        threads: int, vllm: int = 0) -> dict:
    import datasets
    import importlib.util

    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("bench_rewards", rewards)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    times: list[float] = []
    logged: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs or {}))

    engine = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=new + longest_prompt(directory, data)
                  ) if vllm else {}
    args = GRPOConfig(output_dir=str(Path(data).parent / "trl"), report_to=[], use_cpu=True, bf16=False, **engine,
                      per_device_train_batch_size=batch, num_generations=generations, max_completion_length=new,
                      max_steps=steps + 1, logging_steps=1, learning_rate=1e-6, save_strategy="no",
                      gradient_checkpointing=False, disable_tqdm=True, temperature=1.0, max_grad_norm=1.0)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(directory), reward_funcs=module.low_token_share,
                          args=args, train_dataset=datasets.load_dataset("json", data_files=data, split="train"),
                          processing_class=AutoTokenizer.from_pretrained(directory), callbacks=[Clock()])
    trainer.train()
    lengths = [r["completions/mean_length"] for r in logged if "completions/mean_length" in r][1:]
    times = times[1:]
    return {"step_s": statistics.median(times), "tokens_per_s": sum(n * batch for n in lengths) / sum(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="prompts a step")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--new", type=int, default=64, help="max_completion_length")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--processes", type=int, default=1, help="xla_shard's torch_fsdp processes (TRL: one)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads a process, each side")
    parser.add_argument("--vllm", action="store_true", help="add both sides' vLLM legs (colocated)")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        side, *rest = args.worker
        found = {"ours": ours, "trl": trl}[side](*rest[:3], *(int(v) for v in rest[3:]))
        print(json.dumps(found), flush=True)
        if side == "ours":
            from xla_shard.launch import exit_without_finalizing

            exit_without_finalizing(0)
        return
    sys.path.insert(0, str(REPO / "tests"))
    from model_dirs import llama_dir

    batch = args.prompts * args.generations
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = llama_dir(Path(tmp) / "llama", hidden=args.hidden, layers=args.layers)
        data, rewards = Path(tmp) / "prompts.jsonl", Path(tmp) / "bench_rewards.py"
        write_prompts(data, 4 * args.prompts * (args.steps + 1))
        rewards.write_text(REWARD)
        given = [str(directory), str(data), str(rewards), str(args.generations), str(args.new), str(batch),
                 str(args.steps), str(args.threads)]
        legs = [(False, "TRL GRPOTrainer", "xla_shard method: grpo")]
        if args.vllm:
            legs.append((True, "TRL, vLLM colocate", "xla_shard, grpo.use_vllm"))
        env = {**os.environ, "USE_TORCH_XLA": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        for vllm, trl_name, our_name in legs:
            done = subprocess.run([sys.executable, __file__, "--worker", "trl", *given, str(int(vllm))],
                                  capture_output=True, text=True, env=env, cwd=REPO)
            results[trl_name] = (json.loads(done.stdout.strip().splitlines()[-1]) if not done.returncode
                                 else {"failed": _last_error(done.stderr)})
            results[our_name] = torchrun_records(__file__, args.processes,
                                                 ["ours", *given, str(args.processes), str(int(vllm))],
                                                 "xla_shard")[-1]  # torch_fsdp's launcher
    print(f"Llama hidden {args.hidden} x {args.layers} layers, {args.prompts} prompts x {args.generations} "
          f"completions of up to {args.new} tokens a step, AdamW fp32, gradients clipped at 1.0, CPU, {args.threads} "
          f"thread(s) a process; xla_shard on {args.processes} process(es), TRL on one:")
    print(f"{'':28} {'step s':>8} {'generated tokens/s':>19} {'x TRL step':>11}")
    base = results["TRL GRPOTrainer"]
    for name, got in results.items():
        if "failed" in got:
            print(f"{name:28} failed: {got['failed']}")
            continue
        print(f"{name:28} {got['step_s']:8.3f} {got['tokens_per_s']:19.0f} {got['step_s'] / base['step_s']:11.2f}")


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "Error" in line]
    return (lines[-1] if lines else stderr.strip().splitlines()[-1] if stderr.strip() else "no output")[:300]


if __name__ == "__main__":
    main()
