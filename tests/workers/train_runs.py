"""Train several runs one after another in one process (under torchrun: in every rank), each as `xla-shard train`
trains it (`Trainer(cfg).setup().run()`), each writing its metrics and checkpoints under its own output_dir:
one start-up, one runtime and one process group for all of them.

Usage: train_runs.py [KEY=VALUE ...] -- [KEY=VALUE ...] [-- ...]   (common overrides, then each run's)
"""

import sys

from runs import split_runs

from xla_shard import config
from xla_shard.launch import exit_without_finalizing
from xla_shard.train import Trainer


def main(*args: str) -> None:
    common, *runs = split_runs(args)
    trainer = None
    for run in runs:
        trainer = Trainer(config.load(None, [*common, *run])).setup()
        trainer.run()
        trainer.backend.processes.barrier()
    trainer.backend.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing(0)  # as xla-shard's own torchrun workers end: no gloo teardown at finalization
