"""The torch_tpu backend: the torch_fsdp code under TorchTPU's device profile. Off a TPU it refuses to start,
in one line naming `backend` (with the real torch_tpu package where it is installed: the newest-torch run);
`backend: auto` picks it on a TPU VM only where TorchTPU is importable; on a TPU VM, it trains and its
checkpoint resumes on torch_fsdp."""

import importlib.util
import json

import pytest

from xla_shard import backends, config
from xla_shard.backends import fsdp2_devices, torchtpu
from xla_shard.errors import ConfigError
from xla_shard.io.device import on_tpu

pytestmark = pytest.mark.torch_version  # its subject depends on torch's version


def test_off_a_tpu_torch_tpu_refuses_to_start_naming_backend():
    if on_tpu():
        pytest.skip("this machine has a TPU")
    backend = backends.create(config.load(None, ["backend=torch_tpu"]))  # a config for a TPU checks anywhere
    assert fsdp2_devices.TPU.installed() == (importlib.util.find_spec("torch_tpu") is not None)
    with pytest.raises(ConfigError) as raised:
        backend.check_runtime()
    assert (raised.value.key, raised.value.backend) == ("backend", "torch_tpu")
    assert "no TPU" in str(raised.value)


@pytest.mark.e2e
def test_the_cli_refuses_torch_tpu_off_a_tpu_in_one_line(cli):
    if on_tpu():
        pytest.skip("this machine has a TPU")
    done = cli("train", "--set", "backend=torch_tpu", "--set", "train.steps=1")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "xla-shard: error: config key 'backend' (backend torch_tpu): runs on a Cloud TPU VM and this machine has no "
        "TPU; use torch_fsdp (GPUs, or CPUs over gloo) or xla_spmd"]


def _machine(monkeypatch, machine: str, has_torch_tpu: bool, has_torch_xla: bool) -> None:
    present = {"torch_tpu": has_torch_tpu, "torch_xla": has_torch_xla}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (real("json") if present[name] else None) if name in present else real(name))
    monkeypatch.setattr(backends, "platform", lambda: machine)


@pytest.mark.parametrize("machine, has_torch_tpu, has_torch_xla, expect", [
    ("tpu", True, True, "torch_tpu"),
    ("tpu", False, True, "xla_spmd"),
    ("cpu", False, True, "xla_spmd"),  # in this process (not torchrun's): SPMD; the CLI takes torch_fsdp (below)
    ("cpu", True, False, "torch_fsdp"),
    ("cuda", True, True, "torch_fsdp"),
])
def test_auto_takes_what_the_machine_has_installed(monkeypatch, machine, has_torch_tpu, has_torch_xla, expect):
    _machine(monkeypatch, machine, has_torch_tpu, has_torch_xla)
    cfg = config.load(None, [])
    assert backends.resolve_name(cfg) == expect
    assert backends.resolve_name(cfg, on="tpu") == "xla_spmd"  # planned elsewhere: what the deployments install


@pytest.mark.xla  # xla_spmd's own checks read torch_xla
@pytest.mark.e2e  # xla_spmd's check of fsdp.scan_layers imports jax and torchax: 2.4-3.4 s, 5.2 on a loaded machine
def test_auto_on_a_cpu_takes_xla_spmd_where_fsdp2_does_not_train_the_config_and_says_why(monkeypatch):
    _machine(monkeypatch, "cpu", False, True)
    name, why = backends.auto_choice(config.load(None, ["fsdp.scan_layers=true"]), can_launch=True)
    assert name == "xla_spmd" and why.startswith("torch_fsdp does not train this config (fsdp.scan_layers: ")
    name, why = backends.auto_choice(config.load(None, []), can_launch=True)
    assert (name, why) == ("torch_fsdp", "torch_fsdp: the fastest on a CPU")
    # a program of its own (the Python API), not started by torchrun, trains in its one process: SPMD
    name, why = backends.auto_choice(config.load(None, []), can_launch=False)
    assert name == "xla_spmd" and why.startswith("torch_fsdp trains in processes torchrun starts")
    _machine(monkeypatch, "cpu", False, False)  # nothing else installed: the fastest, whose check says why not
    assert backends.auto_choice(config.load(None, ["fsdp.scan_layers=true"]), can_launch=True)[0] == "torch_fsdp"
    assert backends.auto_choice(config.load(None, []), can_launch=False)[0] == "torch_fsdp"


def test_torch_tpu_refuses_what_torchtpu_does_not_offer_naming_key_and_backend():
    for sets, key in ((["fsdp.offload_params=true"], "fsdp.offload_params"),
                      (["fsdp.scan_layers=true"], "fsdp.scan_layers"),
                      (["fsdp.xla_settings={flatten_parameters: false}"], "fsdp.xla_settings")):
        with pytest.raises(ConfigError) as raised:
            backends.create(config.load(None, ["backend=torch_tpu", *sets]))
        assert (raised.value.key, raised.value.backend) == (key, "torch_tpu")


@pytest.mark.tpu
@pytest.mark.e2e
def test_on_a_tpu_vm_torch_tpu_trains_and_its_checkpoint_resumes_on_torch_fsdp(cli, tmp_path):
    if not (on_tpu() and fsdp2_devices.TPU.installed()):
        pytest.skip("needs a Cloud TPU VM with torch_tpu installed")

    def train(name, *sets):
        done = cli("train", "--set", "train.steps=4", "--set", f"output_dir={tmp_path / name}",
                   "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "checkpoint.every_steps=2",
                   *[arg for s in sets for arg in ("--set", s)])
        assert done.returncode == 0, done.stderr[-3000:]
        return {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").open())}

    on_tpu_losses = train("tpu", "backend=torch_tpu")
    resumed = train("cpu", "backend=torch_fsdp", "cpu_devices=1",
                    f"checkpoint.resume={tmp_path / 'ckpt' / 'step-00000002'}")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(on_tpu_losses[step], rel=1e-3), step


# What a host of a 4-host TPU slice is given: a GKE TPU pod of an indexed Job (JobSet), and a TPU VM worker.
JOBSET_POD = {"TPU_WORKER_HOSTNAMES": ",".join(f"run-slice-0-{i}.run" for i in range(4)), "TPU_WORKER_ID": "2",
              "JOB_COMPLETION_INDEX": "2", "MASTER_ADDR": "run-slice-0-0.run"}
TPU_VM_WORKER = {"TPU_WORKER_HOSTNAMES": "10.130.0.2,10.130.0.3,10.130.0.4,10.130.0.5", "TPU_WORKER_ID": "3"}


@pytest.mark.parametrize("environ, rank, endpoint", [
    (JOBSET_POD, 2, "run-slice-0-0.run:29500"), (TPU_VM_WORKER, 3, "10.130.0.2:29500"),
])
def test_each_host_of_a_pod_slice_takes_its_rank_and_world_from_torchtpus_launch_environment(
        monkeypatch, environ, rank, endpoint):
    """Without TorchTPU here its contract is derived the same way (the hosts from TPU_WORKER_HOSTNAMES, the rank
    from JOB_COMPLETION_INDEX or TPU_WORKER_ID, the rendezvous at the first host): the launch section each host
    runs with, and the torchrun it starts, one process per chip."""
    from xla_shard import launch

    for key in ("TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "JOB_COMPLETION_INDEX", "MASTER_ADDR", "MASTER_PORT",
                "NNODES", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torchtpu, "_set_tpu_launch_env", lambda: None)  # TorchTPU's own asks the TPU: TPU-only
    cfg, said = backends.launch_from_environment(config.load(None, ["backend=torch_tpu"]))
    nodes = cfg.launch
    assert (nodes.nnodes, nodes.node_rank, nodes.rdzv_endpoint) == (4, rank, endpoint)
    assert f"host {rank} of 4" in said
    argv = launch.Nodes(nodes.nnodes, nodes.node_rank, nodes.rdzv_endpoint).torchrun_args()
    assert {"--nnodes=4", f"--node-rank={rank}", "--rdzv-backend=static", f"--rdzv-endpoint={endpoint}"} <= set(argv)
    # A config that names its nodes keeps them; one host, or another backend, is left as it is.
    named = config.load(None, ["backend=torch_tpu", "launch.nnodes=2", "launch.node_rank=1",
                               "launch.rdzv_endpoint=h:1"])
    assert backends.launch_from_environment(named) == (named, None)
    assert backends.launch_from_environment(config.load(None, ["backend=xla_spmd"]))[1] is None


def test_a_pod_host_that_cannot_tell_its_rank_is_one_line(monkeypatch):
    for key in ("JOB_COMPLETION_INDEX", "MASTER_ADDR", "NNODES", "NODE_RANK", "TPU_WORKER_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "a,b")
    monkeypatch.setattr(torchtpu, "_set_tpu_launch_env", lambda: None)
    with pytest.raises(ConfigError) as raised:
        backends.launch_from_environment(config.load(None, ["backend=torch_tpu"]))
    assert raised.value.key == "launch" and "TPU_WORKER_ID" in str(raised.value)


@pytest.mark.parametrize("hosts", [f"{'h' * 100_000},b", "a,$(reboot)"])
def test_worker_hostnames_that_are_no_hosts_are_one_short_line(monkeypatch, hosts):
    for key in ("JOB_COMPLETION_INDEX", "MASTER_ADDR", "NNODES", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", hosts)
    monkeypatch.setenv("TPU_WORKER_ID", "0")
    monkeypatch.setattr(torchtpu, "_set_tpu_launch_env", lambda: None)
    with pytest.raises(ConfigError) as raised:
        backends.launch_from_environment(config.load(None, ["backend=torch_tpu"]))
    assert raised.value.key == "launch" and "TPU_WORKER_HOSTNAMES holds" in str(raised.value)
    assert len(str(raised.value)) < 400


@pytest.mark.skipif(not on_tpu() or not fsdp2_devices.TPU.installed(), reason="needs a Cloud TPU VM with TorchTPU")
def test_torchtpus_own_launch_environment_is_what_we_derive():
    """On a TPU VM, TorchTPU's `set_tpu_launch_env` given a JobSet pod's variables sets what `pod_launch`
    derives without it."""
    import os
    import subprocess
    import sys

    script = ("import json, os, torch, torch_tpu\ntorch.tpu.distributed.set_tpu_launch_env()\n"
              "print(json.dumps({k: os.environ[k] for k in ('NNODES', 'NODE_RANK', 'MASTER_ADDR', 'MASTER_PORT')}))")
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, **JOBSET_POD}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == torchtpu.pod_launch(JOBSET_POD)


def test_a_tpu_vm_worker_learns_the_slice_from_its_metadata_as_torch_xla_reads_it():
    """A Cloud TPU VM's environment names no hosts: its metadata does (`worker-network-endpoints`, `tpu-env`),
    and that becomes the contract's variables; one host, or metadata without them, gives none."""
    metadata = {"worker-network-endpoints": "t1v-n-0:0:10.130.0.2,t1v-n-1:1:10.130.0.3,t1v-n-2:2:10.130.0.4,"
                                            "t1v-n-3:3:10.130.0.5",
                "tpu-env": "ACCELERATOR_TYPE: 'v5p-32'\nWORKER_ID: '3'\nZONE: 'us-east5-a'\n"}
    assert torchtpu.tpu_vm_workers(metadata.__getitem__) == TPU_VM_WORKER
    assert torchtpu.pod_launch(torchtpu.tpu_vm_workers(metadata.__getitem__)) == {
        "NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "10.130.0.2", "MASTER_PORT": "29500"}
    single = {**metadata, "worker-network-endpoints": "t1v-n-0:0:10.130.0.2"}
    assert torchtpu.tpu_vm_workers(single.__getitem__) == {}

    def unreachable(attribute):
        raise OSError("no metadata server")

    assert torchtpu.tpu_vm_workers(unreachable) == {}


@pytest.mark.parametrize("change, words", [
    ({"worker-network-endpoints": "t1v-n-0,t1v-n-1"}, "not hostname:uid:address"),
    ({"worker-network-endpoints": f"a:0:{'h' * 100_000},b:1:10.0.0.3"}, "at most 253"),
    ({"worker-network-endpoints": "a:0:10.0.0.2,b:1:$(reboot)"}, "not hostname:uid:address"),
    ({"tpu-env": "- WORKER_ID: 1\n"}, "tpu-env is a YAML list"),
    ({"tpu-env": "WORKER_ID: [1\n"}, "tpu-env is not YAML"),
    ({"tpu-env": "WORKER_ID: one\n"}, "not a worker index"),
])
def test_tpu_vm_metadata_that_cannot_say_where_the_workers_are_is_one_line(change, words):
    metadata = {"worker-network-endpoints": "a:0:10.0.0.2,b:1:10.0.0.3", "tpu-env": "WORKER_ID: '1'\n", **change}
    with pytest.raises(ConfigError) as refused:
        torchtpu.tpu_vm_workers(metadata.__getitem__)
    assert refused.value.key == "launch" and words in str(refused.value) and len(str(refused.value)) < 400
