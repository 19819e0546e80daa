"""The first loss of several model directories in turn, each loaded shard by shard by one backend started once.

Usage: families.py OUT SPECS.json   (SPECS: [{"name": ..., "sets": [KEY=VALUE, ...]}, ...]; under torchrun every
rank runs it, rank 0 writes OUT as JSON {name: loss, or the error it raised})
"""

import json
import sys
import traceback
from pathlib import Path

import torch

import xla_shard
from xla_shard.launch import exit_without_finalizing


def main(out: str, specs: str) -> None:
    backend, losses = None, {}
    for spec in json.loads(Path(specs).read_text()):
        cfg = xla_shard.load_config(None, spec["sets"])
        backend = backend or xla_shard.start_backend(cfg)
        try:
            model = xla_shard.load_model(cfg, backend).eval()  # eval: dropout off, as the reference runs
            batch = backend.local_batch(xla_shard.build_data(cfg).train.global_batch(0))
            with torch.no_grad(), backend.forward_context():
                losses[spec["name"]] = backend.mean_loss(model(**batch).loss)
        except Exception as exc:  # noqa: BLE001 - reported per family, so one failure does not hide the others
            losses[spec["name"]] = f"{type(exc).__name__}: {traceback.format_exc()[-1500:]}"
    if backend.processes.is_main:
        Path(out).write_text(json.dumps(losses))
    backend.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing(0)  # as xla-shard's own torchrun workers end: no gloo teardown at finalization
