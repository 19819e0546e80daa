"""The torch_tpu backend: the torch_fsdp code under TorchTPU's device profile. Off a TPU it refuses to start,
in one line naming `backend` (with the real torch_tpu package where it is installed: the newest-torch run);
`backend: auto` picks it on a TPU VM only where TorchTPU is importable; on a TPU VM, it trains and its
checkpoint resumes on torch_fsdp."""

import importlib.util
import json

import pytest

from xla_shard import backends, config
from xla_shard.backends import fsdp2_devices
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


@pytest.mark.parametrize("machine, has_torch_tpu, has_torch_xla, expect", [
    ("tpu", True, True, "torch_tpu"),
    ("tpu", False, True, "xla_spmd"),
    ("cpu", False, True, "xla_spmd"),
    ("cpu", True, False, "torch_fsdp"),
    ("cuda", True, True, "torch_fsdp"),
])
def test_auto_takes_what_the_machine_has_installed(monkeypatch, machine, has_torch_tpu, has_torch_xla, expect):
    present = {"torch_tpu": has_torch_tpu, "torch_xla": has_torch_xla}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (real("json") if present[name] else None) if name in present else real(name))
    monkeypatch.setattr(backends, "platform", lambda: machine)
    cfg = config.load(None, [])
    assert backends.resolve_name(cfg) == expect
    assert backends.resolve_name(cfg, on="tpu") == "xla_spmd"  # planned elsewhere: what the deployments install


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
