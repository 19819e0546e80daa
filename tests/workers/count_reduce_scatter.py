"""One training step under torchrun, counting FSDP2's gradient reduce-scatters; rank 0 writes the count.

Usage: count_reduce_scatter.py OUT [KEY=VALUE ...]
"""

import sys

import torch.distributed as dist

from xla_shard import config
from xla_shard.train import Trainer


def main(out: str, *overrides: str) -> None:
    calls = []
    reduce_scatter = dist.reduce_scatter_tensor

    def counted(*args, **kwargs):
        calls.append(1)
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_tensor = counted
    trainer = Trainer(config.load(None, overrides)).setup()
    trainer.step(0)
    if trainer.backend.is_main:
        with open(out, "w") as f:
            f.write(str(len(calls)))
    trainer.backend.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
