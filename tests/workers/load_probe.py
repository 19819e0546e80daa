"""Set up a run (which loads its pretrained weights) and save, per writing process, what the tests assert on.

Usage: load_probe.py OUT [KEY=VALUE ...]   (under torchrun every rank runs it; writes OUT.<process>.pt)
Saves: the boxes of every parameter this process holds (as a checkpoint would write them), the loss of the
first batch before any step, and the process's pretrained load report.
"""

import dataclasses
import sys

import torch

from xla_shard import config
from xla_shard.launch import exit_without_finalizing
from xla_shard.train import Trainer


def main(out: str, *overrides: str) -> None:
    trainer = Trainer(config.load(None, overrides)).setup()
    backend, model = trainer.backend, trainer.model
    chunks = {t.name[len("model/"):]: (t.shape, t.chunks()) for t in backend.state.tensors(model)}
    with torch.no_grad(), backend.forward_context():
        loss = trainer.objective.loss(model, backend.local_batch(trainer.source.global_batch(0)))
    report = dataclasses.asdict(trainer.load_report) if trainer.load_report else None
    index, _ = backend.processes.writer
    torch.save({"chunks": chunks, "loss": backend.mean_loss(loss), "report": report,
                "tied": [n for n, _ in model.named_parameters(remove_duplicate=False)]}, f"{out}.{index}.pt")
    backend.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing(0)  # as xla-shard's own torchrun workers end: no gloo teardown at finalization
