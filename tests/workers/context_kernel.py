"""One model, one batch of packed rows, the sequence split 2 ways: the loss and gradient norm through the eager
path and through the splash kernel (interpreted on the CPU), with the layers unrolled and scanned, printed as
JSON.

Usage: context_kernel.py OUTPUT_DIR
"""

import json
import sys

import torch
import torch_xla

from xla_shard import config, sequence
from xla_shard.train import Trainer


def main(output_dir: str) -> None:
    generator = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.arange(300), torch.arange(212)]).expand(2, -1)
    rows = {"input_ids": torch.randint(0, 256, (2, 512), generator=generator),
            "labels": torch.randint(0, 256, (2, 512), generator=generator), "position_ids": positions}
    found = {}
    for scanned in (False, True):
        cfg = config.load(None, ["backend=xla_spmd", "cpu_devices=4", "model.name=tiny-llama", "train.seq_len=512",
                                 "train.global_batch_size=2", "mesh.context=2", f"output_dir={output_dir}",
                                 f"fsdp.scan_layers={str(scanned).lower()}"])
        trainer = Trainer(cfg).setup()
        for path, kernel in (("eager", False), ("kernel", True)):
            if scanned and not kernel:
                continue
            sequence.use_kernel = lambda kernel=kernel: kernel
            trainer.model.zero_grad(set_to_none=True)
            loss = trainer.objective.loss(trainer.model, trainer.backend.place(rows))
            loss.backward()
            torch_xla.sync()
            norms = [p.grad.cpu().norm() for p in trainer.model.parameters() if p.grad is not None]
            found[path + (" scanned" if scanned else "")] = {"loss": loss.item(),
                                                             "grad_norm": torch.stack(norms).norm().item()}
    print(json.dumps(found))


if __name__ == "__main__":
    main(*sys.argv[1:])
