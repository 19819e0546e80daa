"""A training process of `xla-shard train` under torchrun: `python -m xla_shard.worker SETTLED.yaml`.

The launcher validated the config, checked it against the backend and the devices, and prepared the data
(tokenized into `datasets`' cache) before it started torchrun; each worker reads the config it settled and
trains, repeating none of that. A user error in a worker still reaches the user as one line from the
launcher, exit 2 (`launch.exit_status`).
"""

from __future__ import annotations

import sys

from xla_shard import config as cfglib
from xla_shard import launch
from xla_shard.io import device


def main(settled: str) -> int:
    device.declare_xla_device()
    launch.as_torchrun_worker()

    def train() -> int:
        cfg = cfglib.load(settled)
        from xla_shard import backends

        backend = backends.create(cfg)
        device.declare_runtime(backend.capabilities.torch_xla)
        from xla_shard import train as trainer

        return trainer.run(cfg, backend)

    return launch.exit_status(train)


if __name__ == "__main__":
    launch.exit_without_finalizing(main(*sys.argv[1:]))
