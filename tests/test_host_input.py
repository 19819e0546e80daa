"""Per-host input under SPMD: each host reads its own part of every micro-batch, the hosts' parts together are
the global batch (each row once) at every step, resumed or not, and the step's loss weights are those of one
host reading it all. Hosts are simulated (`Processes(index, count)`): torch_xla's CPU client is single-process,
so several SPMD hosts cannot run here; the placement of a host's part is run for real on XLA CPU devices."""

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import FIXTURES, WORKERS, _env

from xla_shard import config
from xla_shard.backends.processes import Processes
from xla_shard.backends.xla_spmd import XlaSpmdBackend
from xla_shard.data import build
from xla_shard.models import model_config, resolve_source
from xla_shard.methods import objective_for
from xla_shard.train import Trainer

CORPUS = FIXTURES / "corpus.jsonl"
HOSTS = (1, 2, 4)


def _setup(model_dir, *sets):
    cfg = config.load(None, ["backend=xla_spmd", f"model.name={model_dir}", f"data.path={CORPUS}",
                             "train.seq_len=32", "train.global_batch_size=8", "train.grad_accum_steps=2", *sets])
    return cfg, build(cfg, model_config(cfg.model), resolve_source(cfg.model).directory).train


def _host(cfg, source, index: int, count: int):
    """What host `index` of `count` trains on: the Trainer's own reading, on an unstarted SPMD backend."""
    backend = XlaSpmdBackend(cfg)
    backend.processes = Processes(index, count)
    return SimpleNamespace(cfg=cfg, source=source, backend=backend)


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
@pytest.mark.parametrize("hosts", HOSTS)
def test_the_hosts_parts_are_the_global_batch_each_row_once(model_dirs, hosts, streaming):
    sets = ["data.streaming=true", "data.shuffle_buffer=8"] if streaming else []
    cfg, source = _setup(model_dirs.llama, *sets)
    for step in (0, 1, 5):
        whole = source.global_batch(step)["input_ids"]
        parts = [Trainer.micro_batches(_host(cfg, source, h, hosts), step) for h in range(hosts)]
        assert all(len(p[0]["input_ids"]) == 8 // 2 // hosts for p in parts)  # each host reads its rows only
        joined = torch.cat([parts[h][j]["input_ids"] for j in range(2) for h in range(hosts)])
        assert torch.equal(joined, whole), (hosts, step)  # micro-batch by micro-batch, host by host
    # A host that resumes at step 5 reads what it would have read without stopping.
    _, fresh = _setup(model_dirs.llama, *sets)
    resumed, kept = (Trainer.micro_batches(_host(cfg, s, hosts - 1, hosts), 5) for s in (fresh, source))
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(resumed, kept))


class _Hosts(Processes):
    """One host of several, whose collective sums have been taken already (what the gloo group returns)."""

    def __init__(self, index, count, totals):
        super().__init__(index, count)
        self.totals = totals

    def total(self, counts):
        return self.totals


@pytest.mark.parametrize("hosts", HOSTS[1:])
def test_token_weights_over_hosts_are_one_hosts(model_dirs, hosts):
    cfg, source = _setup(model_dirs.llama, "data.packing=false", "train.seq_len=128")  # padded: uneven counts
    objective = objective_for(cfg)
    one = _host(cfg, source, 0, 1)
    expected = objective.weights(Trainer.micro_batches(one, 3), one.backend.processes, 1)
    assert len(set(expected)) == 2  # the counts differ, so the weights do
    parts = [Trainer.micro_batches(_host(cfg, source, h, hosts), 3) for h in range(hosts)]
    counts = [[int((rows["labels"][:, 1:] != -100).sum()) for rows in part] for part in parts]
    totals = [sum(column) for column in zip(*counts)]
    assert expected == pytest.approx([t / sum(totals) for t in totals])  # each its share of the step's tokens
    for h in range(hosts):
        assert objective.weights(parts[h], _Hosts(h, hosts, totals), 1) == expected


@pytest.mark.xla
@pytest.mark.e2e
def test_a_hosts_rows_placed_as_minibatch_are_the_marked_global_batch(model_dirs, tmp_path):
    """The several-hosts placement (torch_xla's minibatch input sharding), run on one host of 4 devices: the
    same global tensor, the same sharding and the same loss as the one-host path, bit for bit."""
    import subprocess

    out = tmp_path / "placed.json"
    done = subprocess.run([sys.executable, str(WORKERS / "host_rows.py"), str(out), "backend=xla_spmd",
                           "cpu_devices=4", f"model.name={model_dirs.llama}", f"data.path={CORPUS}",
                           "data.packing=false", "train.seq_len=32", "train.global_batch_size=8"],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(out.read_text())
    assert found["keys"] == ["attention_mask", "input_ids", "labels"]
    assert found["sharding"] == found["marked_sharding"] and "devices=[4" in found["sharding"]
    assert found["equal"] and found["loss"] == found["marked_loss"]
