"""Train a config under Ray Train, as `xla_shard.ray_train` runs it, on a local Ray cluster started here
(`cpu_devices` CPU workers over gloo). Worker 1 dies (os._exit) as step KILL_AT ends, the first time only (the
MARKER file says it happened), and Ray's FailureConfig starts the workers again.

Usage: ray_train.py MARKER KILL_AT [KEY=VALUE ...]
"""

import os
import sys

import ray

from xla_shard import config, ray_train


def main(marker: str, kill_at: str, *overrides: str) -> None:
    cfg = config.load(None, list(overrides))

    def loop(train_config: dict) -> None:
        def die(trainer, done, record):
            if done == int(kill_at) and trainer.backend.processes.index == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)

        ray_train.train_loop_per_worker(train_config, on_step_end=[die])

    ray.init(num_cpus=cfg.cpu_devices, include_dashboard=False)
    ray_train.torch_trainer(cfg, max_failures=1, storage_path=os.path.abspath("ray"), train_loop=loop).fit()
    ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
