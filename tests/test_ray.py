"""Ray Train (`xla_shard.ray_train`): xla_shard's trainer as the training function of Ray's TorchTrainer, on a
local Ray cluster of CPU workers over gloo, against torchrun's run of the same config; and the TPU workers it
asks a Ray cluster for, as Ray's own ScalingConfig validates them."""

import json

import pytest
from conftest import run_trainings, run_worker

from xla_shard import config
from xla_shard.checkpoint import Storage, committed_steps
from xla_shard.errors import ConfigError

pytestmark = pytest.mark.torch_version  # what FSDP2 and gloo run under Ray depends on torch's version



@pytest.fixture(scope="module", autouse=True)
def _ray_imported():
    """Ray Train's import (3-5 s on the 2-core machine) paid once, in set-up: the unit tier's budget is each
    test's own call."""
    pytest.importorskip("ray.train")


CONFIG = ["model=tiny-llama", "backend=torch_fsdp", "cpu_devices=2", "train.seq_len=32",
          "train.global_batch_size=4", "train.steps=5", "checkpoint.every_steps=1", "checkpoint.keep_last=5"]


@pytest.mark.e2e
@pytest.mark.slow
def test_ray_trains_as_torchrun_does_and_a_killed_worker_resumes_exactly(tmp_path):
    """Two Ray workers train as two torchrun processes do (the same losses); every step's checkpoint is committed
    by both together (one shard file each); worker 1 killed as step 3 ends (before its checkpoint) is started
    again by Ray with the other, and the run continues from step 2's checkpoint with the uninterrupted run's
    losses."""
    pytest.importorskip("ray")
    want = run_trainings(tmp_path / "torchrun", [*CONFIG, f"checkpoint.dir={tmp_path / 'torchrun-ckpt'}"],
                         {"run": []}, nproc=2)["run"]
    ckpt, out, marker = tmp_path / "ckpt", tmp_path / "out", tmp_path / "killed"
    done = run_worker("ray_train.py", str(marker), "3", *CONFIG, f"checkpoint.dir={ckpt}", f"output_dir={out}",
                      cwd=tmp_path, timeout=900)
    log = done.stdout + done.stderr
    assert marker.exists() and f"resumed from {ckpt}/step-00000002 at step 2" in log, log[-4000:]
    got = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        got[record["step"]] = record["loss"]
    assert sorted(got) == list(range(1, 6))
    assert [got[s] for s in sorted(got)] == pytest.approx([r["loss"] for r in want], rel=1e-6, abs=0)
    assert committed_steps(Storage(str(ckpt))) == [1, 2, 3, 4, 5]
    for step in range(1, 6):
        manifest = json.loads((ckpt / f"step-{step:08d}" / "manifest.json").read_text())
        files = {c["file"] for t in manifest["tensors"].values() for c in t["chunks"]}
        assert len(files) == 2, (step, files)  # a shard file of each worker


@pytest.mark.parametrize("accelerator, slices, workers, topology, ray_type, chips", [
    ("v5p-32", 1, 4, "2x2x4", "TPU-V5P", 4), ("v5p-32", 2, 8, "2x2x4", "TPU-V5P", 4),
    ("v6e-16", 1, 4, "4x4", "TPU-V6E", 4), ("v5litepod-8", 1, 2, "2x4", "TPU-V5LITEPOD", 4),
    ("v4-16", 1, 2, "2x2x2", "TPU-V4", 4),
])
def test_on_tpus_ray_is_asked_for_a_worker_per_tpu_vm_of_the_slice(accelerator, slices, workers, topology, ray_type,
                                                                   chips):
    """Built by Ray's own ScalingConfig, which checks the worker count against the topology it parses."""
    pytest.importorskip("ray")
    from ray.util import accelerators

    from xla_shard.ray_train import RAY_TPUS, scaling_config

    cfg = config.load(None, ["backend=xla_spmd", f"deploy.accelerator_type={accelerator}",
                             f"deploy.num_slices={slices}"])
    scaling = scaling_config(cfg)
    assert (scaling.num_workers, scaling.use_tpu, scaling.topology, scaling.accelerator_type) == (
        workers, True, topology, ray_type)
    assert scaling.resources_per_worker == {"TPU": chips}
    assert set(RAY_TPUS.values()) <= {v for v in vars(accelerators).values() if isinstance(v, str)}  # Ray's names


def test_ray_needs_a_checkpoint_dir_to_restart_from():
    pytest.importorskip("ray")
    from xla_shard.ray_train import torch_trainer

    with pytest.raises(ConfigError) as raised:
        torch_trainer(config.load(None, CONFIG))
    assert raised.value.key == "checkpoint.dir"
    # a dict of the config's keys is validated as a file's would be (it was an AttributeError)
    with pytest.raises(ConfigError) as raised:
        torch_trainer({"model": "tiny-llama", "train": {"steps": "x"}})
    assert raised.value.key == "train.steps"
    with pytest.raises(TypeError, match="not a str"):
        torch_trainer("run.yaml")


@pytest.mark.parametrize("backend", ["xla_fsdp", "torch_tpu"])
def test_tpu_backends_that_start_processes_of_their_own_are_refused(backend):
    pytest.importorskip("ray")
    from xla_shard.ray_train import scaling_config

    with pytest.raises(ConfigError) as raised:
        scaling_config(config.load(None, [f"backend={backend}", "deploy.accelerator_type=v5p-8"]))
    assert raised.value.key == "backend" and "xla_spmd" in str(raised.value)


def test_on_gpus_ray_asks_for_the_gpus_the_config_names():
    pytest.importorskip("ray")
    from xla_shard.ray_train import scaling_config

    gpus = config.load(None, ["backend=torch_fsdp", "launch.nnodes=2", "launch.nproc_per_node=8"])
    scaling = scaling_config(gpus, cuda=True)
    assert (scaling.num_workers, scaling.use_gpu) == (16, True)
    with pytest.raises(ConfigError) as raised:
        scaling_config(config.load(None, ["backend=torch_fsdp"]), cuda=True)
    assert raised.value.key == "launch.nproc_per_node"
