"""Sample one GRPO generation on xla_spmd in three weight layouts and record what each drew and compiled.

Usage: xla_generation.py OUT.json DUMP_DIR [KEY=VALUE ...]   (config overrides; XLA_FLAGS must dump to DUMP_DIR
as text)
Layouts: `training` (the FSDP-sharded weights as they are, the way the sampler ran before it had a layout of its
own), `whole` (mesh.generation 1) and `split` (mesh.generation 2). Saves, per layout, the completions and masks
sampled with one set of row keys, and the collectives (`xla_shard.planner.hlo.collective_totals`) of each program
compiled while it sampled: the programs that run the model's forward (the prompt's and the token's) apart
from the one that lays the weights out (no forward in it). Also the bytes of the weights.
"""

import contextlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch_xla

from xla_shard import config, sampling
from xla_shard.backends.base import Backend
from xla_shard.planner.hlo import collective_totals
from xla_shard.train import Trainer


def main(out: str, dump: str, *overrides: str) -> None:
    trainer = Trainer(config.load(None, overrides)).setup()
    backend, model = trainer.backend, trainer.model
    rows = trainer.micro_batches(0)
    prompts = {key: torch.cat([batch[key] for batch in rows]) for key in ("input_ids", "attention_mask")}
    settings = sampling.Sampling(6, (10**6,), 0, temperature=1.0, top_k=40)  # an EOS never drawn: 6 tokens a row
    keys = sampling.row_keys([1, 2], range(prompts["input_ids"].shape[0]))
    group = sampling.shared_prompts(prompts["input_ids"], prompts["attention_mask"])
    found = {"weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}

    @contextlib.contextmanager
    def training_layout(model):  # the base backend's: the weights as training holds them
        with Backend.generation_context(backend, model) as place:
            yield place

    layouts = {"training": training_layout, "whole": backend.generation_context, "split": backend.generation_context}
    for name, context in layouts.items():
        backend.plan = replace(backend.plan, generation=2 if name == "split" else 1)
        before = set(Path(dump).glob("*after_optimizations.txt"))
        with context(model) as place:
            placed = place(prompts)
            ids, mask = sampling.sample(model, placed["input_ids"], placed["attention_mask"], settings, keys,
                                        after_token=backend.after_step, group=group)
            ids, mask = backend.to_host(ids, mask)
        torch_xla.sync()
        programs = []
        for path in sorted(set(Path(dump).glob("*after_optimizations.txt")) - before):
            text = path.read_text()
            programs.append({"forward": " dot(" in text or " convolution(" in text,
                             "collectives": collective_totals(text)})
        found[name] = {"ids": ids.tolist(), "mask": mask.tolist(), "programs": programs}
    Path(out).write_text(json.dumps(found))


if __name__ == "__main__":
    main(*sys.argv[1:])
