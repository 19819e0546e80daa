"""Train with `on_step_end` and `on_evaluate` hooks that record every call, and save what they saw next to the
trainer's own records.

Usage: hooks.py OUT.pt [KEY=VALUE ...]
"""

import sys

import torch

from xla_shard import config
from xla_shard.launch import exit_without_finalizing
from xla_shard.train import Trainer


def main(out: str, *overrides: str) -> None:
    steps, evaluations = [], []

    def on_step_end(trainer, done, record):
        steps.append((done, None if record is None else dict(record), trainer.lr))

    def on_evaluate(trainer, done, record):
        evaluations.append((done, dict(record)))

    trainer = Trainer(config.load(None, overrides), on_step_end=[on_step_end], on_evaluate=[on_evaluate])
    declared = sorted(vars(trainer))
    trainer.setup()
    grown = sorted(set(vars(trainer)) - set(declared))
    trainer.run()
    trainer.backend.shutdown()
    torch.save({"steps": steps, "evaluations": evaluations, "records": trainer.records, "grown": grown,
                "checkpointer": type(trainer.checkpointer).__name__}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing(0)  # as xla-shard's own torchrun workers end: no gloo teardown at finalization
