"""torch_fsdp across nodes, really run: two `xla-shard train` processes on 127.0.0.1, each a "node" of two gloo
workers meeting at torchrun's rendezvous, train as one node of four does, share one checkpoint, resume after
both are killed, and stop together (one line) when one of them dies."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import FIXTURES, REPO, _env, run_cli

from xla_shard import backends, config, launch
from xla_shard.errors import ConfigError

# FSDP2 alone, its subject torch's version; bounded in time
pytestmark = [pytest.mark.torch_version, pytest.mark.fsdp2, pytest.mark.serial]



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sets(model_dirs, out, *extra):
    return [f"model.name={model_dirs.llama}", f"data.path={FIXTURES / 'corpus.jsonl'}", "train.seq_len=32",
            "train.optimizer=sgd", "train.lr=0.5", "backend=torch_fsdp", f"output_dir={out}",
            f"checkpoint.dir={out}/ckpt", "checkpoint.every_steps=2", "checkpoint.keep_last=10", *extra]


def _start_nodes(sets, port, timeout_s=60):
    """Both nodes' launchers, node 0 serving the rendezvous; their Popen objects."""
    nodes = []
    for rank in (0, 1):
        node = [*sets, "launch.nnodes=2", f"launch.node_rank={rank}", f"launch.rdzv_endpoint=127.0.0.1:{port}",
                f"launch.timeout_s={timeout_s}"]
        command = [sys.executable, "-m", "xla_shard.cli", "train", *[a for s in node for a in ("--set", s)],
                   "--nproc-per-node", "2"]
        nodes.append(subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return nodes


def _losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.e2e
@pytest.mark.slow
def test_two_nodes_of_two_train_as_one_node_of_four_share_a_checkpoint_and_resume(model_dirs, tmp_path):
    """Both nodes killed mid-run (after a checkpoint), then started again: `resume: auto` continues, and the
    steps before the kill and after the restart are one node of four's. (One two-node run, killed and resumed,
    rather than a whole run and then a killed one: each start of both nodes is six processes' imports.)"""
    single = tmp_path / "single"
    done = run_cli("train", *[a for s in _sets(model_dirs, single, "train.steps=8") for a in ("--set", s)],
                   "--nproc-per-node", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    want = _losses(single)

    two = tmp_path / "two"
    nodes = _start_nodes(_sets(model_dirs, two, "train.steps=1000"), _free_port())
    deadline = time.monotonic() + 300
    while not (two / "ckpt" / "step-00000002" / "manifest.json").exists():
        assert time.monotonic() < deadline and all(node.poll() is None for node in nodes), "no checkpoint at step 2"
        time.sleep(0.05)
    for node in nodes:
        node.send_signal(signal.SIGKILL)  # its workers die with it
    logs = [node.communicate()[1] for node in nodes]
    assert "[process 2/4] pretrained load" in logs[1]  # node 1 holds ranks 2 and 3: it read its own shards
    resumed_from = max(int(p.parent.name.split("-")[1]) for p in (two / "ckpt").glob("step-*/manifest.json"))
    assert resumed_from < 8, "the run was not killed before its step 8"

    nodes = _start_nodes(_sets(model_dirs, two, "train.steps=8"), _free_port())
    logs = [node.communicate(timeout=600)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert f"resumed from {two / 'ckpt'}/step-{resumed_from:08d}" in logs[0], logs[0][-2000:]
    got = _losses(two)  # rank 0, which logs, is node 0's first worker; a constant learning rate: steps 1-8 alike
    assert got.keys() == want.keys() and all(abs(got[s] - want[s]) <= 1e-6 * abs(want[s]) for s in want), (got, want)
    # one checkpoint per step, written by all four processes of both nodes, committed once
    for step in (2, 4, 6, 8):
        directory = two / "ckpt" / f"step-{step:08d}"
        manifest = json.loads((directory / "manifest.json").read_text())
        assert manifest["writers"] == 4
        assert sorted(p.name for p in (directory / "shards").glob("*.safetensors")) == [
            f"{i:05d}-of-00004.safetensors" for i in range(4)]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_node_that_dies_stops_the_other_in_one_line(model_dirs, tmp_path):
    out = tmp_path / "run"
    nodes = _start_nodes(_sets(model_dirs, out, "train.steps=100000", "checkpoint.every_steps=1000"), _free_port(),
                         timeout_s=30)
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
        assert time.monotonic() < deadline and all(node.poll() is None for node in nodes), "no step was taken"
        time.sleep(0.1)
    nodes[1].send_signal(signal.SIGKILL)  # node 1 disappears, its workers with it
    nodes[1].communicate()
    started = time.monotonic()
    _, log = nodes[0].communicate(timeout=120)
    assert time.monotonic() - started < 30 + 15  # launch.timeout_s bounds the wait, and gloo notices sooner
    assert nodes[0].returncode == 1
    errors = [line for line in log.splitlines() if line.startswith("xla-shard: error:")]
    assert len(errors) == 1 and "another node's processes went away" in errors[0], log[-3000:]
    assert "Traceback" not in log
    assert os.path.exists(out / "metrics.jsonl")


@pytest.mark.e2e
def test_a_node_whose_node_0_never_comes_says_so_in_one_line(model_dirs, tmp_path):
    """No C++ socket errors and their frames (torch's client retries, some 40 lines) before the one line."""
    node = [*_sets(model_dirs, tmp_path / "run", "train.steps=1"), "launch.nnodes=2", "launch.node_rank=1",
            f"launch.rdzv_endpoint=127.0.0.1:{_free_port()}", "launch.timeout_s=5"]
    done = subprocess.run([sys.executable, "-m", "xla_shard.cli", "train", *[a for s in node for a in ("--set", s)],
                           "--nproc-per-node", "1"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
    assert "node 0 did not serve the rendezvous" in lines[0] and "launch.timeout_s=5" in lines[0]


def test_several_nodes_need_each_nodes_rank_and_the_rendezvous():
    with pytest.raises(ConfigError) as raised:
        launch.Nodes(2, None, None).torchrun_args()
    assert raised.value.key == "launch" and "launch.node_rank" in str(raised.value)
    args = launch.Nodes(3, 2, "10.0.0.1:29400", "job", 90.5).torchrun_args()
    assert {"--nnodes=3", "--node-rank=2", "--rdzv-endpoint=10.0.0.1:29400", "--rdzv-id=job",
            "--rdzv-conf=timeout=91", "--max-restarts=0"} <= set(args)
    assert launch.pick("torchrun", nproc=2, nodes=launch.Nodes(1, None, None)).nodes is None


@pytest.mark.parametrize("sets", [["launch.node_rank=0"], ["launch.rdzv_endpoint=host:29400"]])
def test_the_xla_backends_refuse_node_settings(sets):
    cfg = config.load(None, ["backend=xla_spmd", "cpu_devices=1", *sets])
    with pytest.raises(ConfigError) as raised:
        backends.create(cfg)
    assert raised.value.key == "launch" and raised.value.backend == "xla_spmd"
