"""Train several runs one after another in one process (under torchrun: in every rank), each as `xla-shard train`
trains it (`Trainer(cfg).setup().run()`), each writing its metrics and checkpoints under its own output_dir:
one start-up, one runtime and one process group for all of them.

A run's `sigterm_after=N` (not a config key) sends each process SIGTERM as step N ends, as a spot VM's reclaim
or Kubernetes would: the run stops through its real handler, checkpoint and all, and the next run goes on.

Usage: train_runs.py [KEY=VALUE ...] -- [KEY=VALUE ...] [-- ...]   (common overrides, then each run's)
"""

import os
import signal
import sys

from runs import split_runs

from xla_shard import config
from xla_shard.launch import exit_without_finalizing
from xla_shard.train import Trainer

SIGTERM_AFTER = "sigterm_after="


def _sigterm_after(step: int):
    def hook(trainer, done, record):
        if done == step:
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


def main(*args: str) -> None:
    common, *runs = split_runs(args)
    trainer = None
    for run in runs:
        hooks = [_sigterm_after(int(a[len(SIGTERM_AFTER):])) for a in run if a.startswith(SIGTERM_AFTER)]
        overrides = [a for a in run if not a.startswith(SIGTERM_AFTER)]
        trainer = Trainer(config.load(None, [*common, *overrides]), on_step_end=hooks).setup()
        trainer.run()
        assert trainer.stopped_by == (143 if hooks else 0), "a SIGTERM that did not stop the run, or a stop without one"
        trainer.backend.processes.barrier()
    trainer.backend.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing(0)  # as xla-shard's own torchrun workers end: no gloo teardown at finalization
