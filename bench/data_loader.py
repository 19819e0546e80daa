"""The data path against the step it feeds, in one run.

    python bench/data_loader.py [--docs 20000 --seq-len 512 --batch 8 --steps 50]

Writes a jsonl corpus and a byte-level BPE tokenizer (trained here with `tokenizers`; nothing downloaded),
then measures: tokenizing and packing the corpus with `datasets` (first build) against reading it back from
the cache (a restart); `datasets` alone producing the same rows by hand (the raw library) against xla_shard's
source (shuffled order, each process's rows); and the loader's time per step against a training step of a
small Llama on the CPU. The loader runs in a background thread during training, so it costs the step nothing
while its time per step stays below the step's (ratio < 1).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORDS = ("river town bridge stone market school railway farm wheat sheep harbour light keeper road ford merchant "
         "library record flood wall tree weir trout heron autumn winter summer spring valley hill sea").split()


def make_corpus(path: Path, docs: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as out:
        for _ in range(docs):
            sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 16))).capitalize() + "."
                         for _ in range(rng.randint(2, 8))]
            out.write(json.dumps({"text": " ".join(sentences)}) + "\n")


def make_model_dir(path: Path, corpus: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(corpus)], trainers.BpeTrainer(vocab_size=1024, special_tokens=["<pad>", "<s>", "</s>"],
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(path)
    LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=2048).save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["HF_DATASETS_CACHE"] = str(tmp / "cache")  # a cold cache, read before datasets is imported
        import numpy as np
        import torch

        from xla_shard import config, data
        from xla_shard.models import model_config

        corpus, model_dir = tmp / "corpus.jsonl", tmp / "model"
        make_corpus(corpus, args.docs)
        make_model_dir(model_dir, corpus)
        sets = [f"model.name={model_dir}", f"data.path={corpus}", f"train.seq_len={args.seq_len}",
                f"train.global_batch_size={args.batch}", "backend=torch_fsdp", f"output_dir={tmp / 'out'}"]
        cfg = config.load(None, sets)
        mconfig = model_config(cfg.model)

        start = time.perf_counter()
        source = data.build(cfg, mconfig, str(model_dir)).train
        first = time.perf_counter() - start
        start = time.perf_counter()
        data.build(cfg, mconfig, str(model_dir))
        cached = time.perf_counter() - start
        mib = corpus.stat().st_size / 2**20
        print(f"corpus: {args.docs} documents, {mib:.1f} MiB -> {source.rows_per_epoch} blocks of "
              f"{args.seq_len} tokens")
        print(f"tokenize + pack (first run): {first:.2f} s; from the cache (a restart): {cached:.2f} s "
              f"(ratio {cached / first:.3f})")

        table = source.table

        def raw_read(step):  # the raw library: contiguous rows, no shuffle
            rows = table[step * args.batch:(step + 1) * args.batch]
            return torch.from_numpy(np.asarray(rows["input_ids"])).long()

        def ours_read(step):
            return source.rows(step, range(args.batch))

        timings = {}
        for name, read in (("raw datasets slice", raw_read), ("xla_shard source", ours_read)):
            samples = []
            for step in range(args.steps):
                start = time.perf_counter()
                read(step)
                samples.append(time.perf_counter() - start)
            timings[name] = statistics.median(samples)
        for name, seconds in timings.items():
            print(f"{name}: {seconds * 1e3:.2f} ms per batch of {args.batch} x {args.seq_len}")
        print(f"ratio xla_shard / raw: {timings['xla_shard source'] / timings['raw datasets slice']:.2f} "
              "(shuffled gather vs contiguous slice)")

        from xla_shard.train import Trainer

        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0, world_size=1)
        trainer = Trainer(cfg).setup()
        steps = []
        for step in range(min(args.steps, 8)):
            start = time.perf_counter()
            trainer.step(step)
            steps.append(time.perf_counter() - start)
        step_s = statistics.median(steps[2:])
        print(f"training step (small Llama, torch_fsdp, 1 CPU process): {step_s * 1e3:.1f} ms; loader per step "
              f"{timings['xla_shard source'] * 1e3:.2f} ms: ratio {timings['xla_shard source'] / step_s:.4f} "
              "(target < 1; prefetched in a background thread)")
        trainer.backend.shutdown()


if __name__ == "__main__":
    main()
