"""Run one step of a backend and save what the tests assert on.

Usage: probe.py OUT.pt [KEY=VALUE ...] [-- [KEY=VALUE ...] ...]   (config overrides; under torchrun every rank
runs it, rank 0 writes). Saves: loss, full gradients by parameter name (before the optimizer step), per-device
memory after one optimizer step, and the names of the modules sharded as their own unit. Each `--` starts a run
of its own in the same process (one start-up for several), with its overrides added: OUT.pt then holds a list.
"""

import dataclasses
import sys

import torch
from runs import split_runs

from xla_shard import config
from xla_shard.launch import exit_without_finalizing
from xla_shard.train import Trainer


def probe(overrides) -> tuple[dict, object]:
    trainer = Trainer(config.load(None, overrides)).setup()
    backend, model = trainer.backend, trainer.model
    batch = backend.local_batch(trainer.source.global_batch(0))
    with backend.forward_context():
        loss = model(**batch).loss
    loss.backward()
    backend.after_step()
    grads = {name: backend.state.full_tensor(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    loss_value = backend.mean_loss(loss)
    trainer.optimizer.step()
    backend.after_step()
    memory = dataclasses.asdict(trainer.memory_report())
    units = backend.sharded_units(model)
    return {"loss": loss_value, "grads": grads, "memory": memory, "units": units,
            "devices": backend.num_devices}, backend


def main(out: str, *args: str) -> None:
    common, *runs = split_runs(args)
    results = [probe([*common, *run]) for run in runs] if runs else [probe(common)]
    backend = results[-1][1]
    if backend.processes.is_main:
        found = [result for result, _ in results]
        torch.save(found if runs else found[0], out)
    backend.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing(0)  # as xla-shard's own torchrun workers end: no gloo teardown at finalization
