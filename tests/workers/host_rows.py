"""Place one micro-batch both ways an SPMD host can (marked as the whole batch, or handed over as the host's
part through a minibatch input sharding) and save how each came out.

Usage: host_rows.py OUT.json [KEY=VALUE ...]
"""

import json
import sys

import torch

from xla_shard import config
from xla_shard.launch import exit_without_finalizing
from xla_shard.train import Trainer


def main(out: str, *overrides: str) -> None:
    import torch_xla

    trainer = Trainer(config.load(None, overrides)).setup()
    backend, model = trainer.backend, trainer.model
    rows = trainer.micro_batches(0)[0]
    marked = backend.place(rows)
    placed = {key: backend._place_host_rows(value) for key, value in rows.items()}
    spec = torch_xla._XLAC._get_xla_sharding_spec
    with torch.no_grad(), backend.forward_context():
        losses = [model(**batch).loss.item() for batch in (placed, marked)]
    json.dump({"keys": sorted(placed), "sharding": spec(placed["input_ids"]),
               "marked_sharding": spec(marked["input_ids"]),
               "equal": all(torch.equal(placed[k].cpu(), marked[k].cpu()) for k in rows),
               "loss": losses[0], "marked_loss": losses[1]}, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing(0)
