"""One model, one batch of packed rows and one of padded rows, the sequence split 2 ways: the loss and gradient
norm through the eager path and through the splash kernel (interpreted on the CPU), with the layers unrolled and
scanned, printed as JSON.

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
    # padded rows (preference data's): the padding a segment of its own in the kernel, masked out in eager
    padded = dict(rows, attention_mask=torch.ones(2, 512, dtype=torch.long),
                  position_ids=torch.arange(512).expand(2, -1))
    padded["attention_mask"][1, 400:] = 0
    padded["labels"] = padded["labels"].masked_fill(padded["attention_mask"] == 0, -100)
    found = {}
    for scanned in (False, True):
        cfg = config.load(None, ["backend=xla_spmd", "cpu_devices=4", "model.name=tiny-llama", "train.seq_len=512",
                                 "train.global_batch_size=2", "mesh.context=2", f"output_dir={output_dir}",
                                 f"fsdp.scan_layers={str(scanned).lower()}"])
        trainer = Trainer(cfg).setup()
        for path, kernel, batch in (("eager", False, rows), ("kernel", True, rows), ("padded eager", False, padded),
                                    ("padded kernel", True, padded)):
            if scanned and path != "kernel":
                continue
            sequence.use_kernel = lambda kernel=kernel: kernel
            trainer.model.zero_grad(set_to_none=True)
            loss = trainer.objective.loss(trainer.model, trainer.backend.place(batch))
            loss.backward()
            torch_xla.sync()
            norms = [p.grad.cpu().norm() for p in trainer.model.parameters() if p.grad is not None]
            found[path + (" scanned" if scanned else "")] = {"loss": loss.item(),
                                                             "grad_norm": torch.stack(norms).norm().item()}
    print(json.dumps(found))


if __name__ == "__main__":
    main(*sys.argv[1:])
