"""Ray Train: xla_shard's trainer as the training function of Ray's `TorchTrainer`.

    import ray
    from xla_shard import config, ray_train

    ray.init()  # or connect to your cluster
    ray_train.torch_trainer(config.load("config.yaml")).fit()

Ray starts the workers and forms their process group (gloo on CPUs, NCCL on GPUs); each worker then runs what
`xla-shard train` runs, `Trainer(cfg).setup().run()`, which takes that group as it takes torchrun's. The
checkpoints are xla_shard's own, committed by all workers together under `checkpoint.dir` (a path every worker
reaches: a bucket when they are on several machines). When a worker dies, Ray's `FailureConfig` starts the
group again and `checkpoint.resume: auto` continues from the newest committed step, exactly. Each logged
step's record also goes to `ray.train.report`, where Ray's own tooling shows it.

Where the workers run comes from the config, as the deploy targets read it: xla_spmd asks Ray for one
worker per TPU VM of `deploy.accelerator_type` x `deploy.num_slices` (`use_tpu`, the slice's topology and
Ray's accelerator type), torch_fsdp for one per GPU (`launch.nnodes` x `launch.nproc_per_node`) or, on a
machine without one, one per CPU process (`cpu_devices`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from xla_shard.config.schema import ShardConfig
from xla_shard.errors import ConfigError

Hook = Callable[[Any, int, dict | None], None]
# Ray's accelerator type of each TPU generation (ray.util.accelerators), by deploy.accelerator_type's prefix.
RAY_TPUS = {"v4": "TPU-V4", "v5litepod": "TPU-V5LITEPOD", "v5p": "TPU-V5P", "v6e": "TPU-V6E", "tpu7x": "TPU-V7X"}


def train_loop_per_worker(config: dict, on_step_end: Sequence[Hook] = ()) -> None:
    """One Ray worker's run: the config (`ShardConfig.model_dump(mode="json")` under "xla_shard"), trained as
    `xla-shard train` trains it in a process of torchrun's."""
    import ray.train

    from xla_shard.config import validate
    from xla_shard.train import Trainer

    def report(trainer, done: int, record: dict | None) -> None:
        if record is not None:
            ray.train.report({k: v for k, v in record.items() if isinstance(v, (int, float))})

    trainer = Trainer(validate(config["xla_shard"]), on_step_end=[report, *on_step_end]).setup()
    trainer.run()


def scaling_config(cfg: ShardConfig, cuda: bool | None = None):
    """The workers Ray starts for `cfg` (see the module's docstring); `cuda`: whether torch_fsdp's run on GPUs
    (default: this machine has one)."""
    from ray.train import ScalingConfig

    from xla_shard import backends
    from xla_shard.deploy import tpu

    capabilities = backends.capabilities(backends.resolve_name(cfg, on="tpu"))
    if "cuda" in capabilities.platforms:  # FSDP2: a process per GPU, or per CPU process over gloo
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        if cuda:
            if cfg.launch.nproc_per_node is None:  # the driver need not be on a GPU node: it cannot count them
                raise ConfigError("launch.nproc_per_node", "Ray starts one worker per GPU: set the GPUs per node "
                                                           "(and launch.nnodes)")
            return ScalingConfig(num_workers=cfg.launch.nnodes * cfg.launch.nproc_per_node, use_gpu=True)
        return ScalingConfig(num_workers=cfg.cpu_devices, resources_per_worker={"CPU": 1})
    if capabilities.launcher != "in_process":
        raise ConfigError("backend", f"{capabilities.name} starts its own processes on each TPU VM "
                                     f"({capabilities.launcher}), which Ray's one worker per VM does not run yet; "
                                     "use xla_spmd (one process per VM)")
    chosen = tpu.parse_gke(cfg.deploy.accelerator_type)
    return ScalingConfig(num_workers=chosen.hosts * cfg.deploy.num_slices, use_tpu=True, topology=chosen.topology,
                         accelerator_type=RAY_TPUS[chosen.generation.prefix],
                         resources_per_worker={"TPU": chosen.chips_per_host})


def torch_trainer(cfg: ShardConfig | dict, *, max_failures: int = 3, storage_path: str | None = None,
                  name: str | None = None, train_loop: Callable[[dict], None] = train_loop_per_worker,
                  cuda: bool | None = None):
    """Ray's `TorchTrainer` running `cfg` (`fit()` it). `max_failures`: times Ray starts the workers again after
    one died; `storage_path` and `name`: where Ray keeps its own run records; `train_loop`: the per-worker
    function, `train_loop_per_worker` or one that calls it."""
    from ray.train import FailureConfig, RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if isinstance(cfg, dict):  # a config as YAML reads: validated as a file's would be
        from xla_shard.config import validate

        cfg = validate(cfg)
    if not isinstance(cfg, ShardConfig):
        raise TypeError(f"torch_trainer takes a ShardConfig (xla_shard.config.load(path)) or a dict of its keys, "
                        f"not a {type(cfg).__name__}")
    if not cfg.checkpoint.dir:
        raise ConfigError("checkpoint.dir", "Ray starts the workers again after a failure, and they continue from "
                                            "a committed checkpoint: set checkpoint.dir")
    scaling = scaling_config(cfg, cuda)
    torch_config = None if scaling.use_tpu else TorchConfig(backend="nccl" if scaling.use_gpu else "gloo",
                                                            timeout_s=int(cfg.launch.timeout_s))
    return TorchTrainer(train_loop, train_loop_config={"xla_shard": cfg.model_dump(mode="json")},
                        torch_config=torch_config, scaling_config=scaling,
                        run_config=RunConfig(name=name or cfg.deploy.name, storage_path=storage_path,
                                             failure_config=FailureConfig(max_failures=max_failures)))
