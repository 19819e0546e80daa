"""The sharding planner: triples of (parameter, gradient, optimizer-state) degrees, the cost model's predictions
against what the backends allocate and what XLA compiles, `xla-shard plan`, and `fsdp.sharding: auto`."""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import REPO, _env, run_cli, run_probe
from xla_shard import config, plan
from xla_shard.errors import ConfigError
from xla_shard.planner import Triple, Workload, accelerator, candidates, estimate, for_device_kind, workload
from xla_shard.planner.hlo import collectives, step_program

PSI = 1_000_000


def _work(**changes) -> Workload:
    fields = dict(params=PSI, units=5, flops_per_token=6 * PSI, tokens_per_device=1024, layers=4, hidden=64,
                  seq_len=128, compute_bytes=2, optimizer="adamw")
    return Workload(**{**fields, **changes})


def test_triples_nest_and_divide_the_devices():
    found = candidates(8)
    assert Triple(8, 8, 8) in found and Triple(1, 1, 1) in found and Triple(2, 4, 8) in found
    assert all(t.grads % t.params == 0 and t.optimizer % t.grads == 0 and 8 % t.optimizer == 0 for t in found)
    assert len(found) == 20  # chains p | g | o | 8 over the divisors 1, 2, 4, 8


def test_the_cost_model_counts_ring_bytes_from_first_principles():
    h100 = accelerator("h100")
    zero3 = estimate(_work(), Triple(8, 8, 8), 8, h100, domain=8)
    # ZeRO-3 on one node: bf16 parameters gathered twice, fp32 gradients reduce-scattered, all over NVLink.
    assert zero3.traffic["NVLink"] == pytest.approx(2 * 7 / 8 * PSI * 2 + 7 / 8 * PSI * 4)
    assert zero3.traffic["network"] == 0
    assert zero3.memory["params"] == 4 * PSI / 8 and zero3.memory["optimizer"] == 8 * PSI / 8
    # Two nodes of 8, sharded inside each node: gathers on NVLink, the gradient shards all-reduced across nodes.
    hsdp = estimate(_work(), Triple(8, 8, 8), 16, h100, domain=8)
    assert hsdp.traffic["network"] == pytest.approx(2 * (2 - 1) / 2 * PSI / 8 * 4)
    # Optimizer state wider than parameters: the updated shards are gathered back to the parameters' layout.
    wide = estimate(_work(), Triple(2, 8, 8), 8, h100, domain=8)
    assert wide.traffic["NVLink"] == pytest.approx(2 * 1 / 2 * PSI * 2 + 7 / 8 * PSI * 4 + 3 / 4 * PSI / 2 * 4)
    sixteen = estimate(_work(), Triple(16, 16, 16), 16, h100, domain=8)
    assert sixteen.traffic["network"] > 0 and sixteen.comm_s > zero3.comm_s  # a group across nodes: the slow links


def test_a_triple_is_the_plan_of_its_named_strategy():
    cfg = config.load(None, ["fsdp.sharding={params: 2, grads: 2, optimizer: 2}"])
    named = config.load(None, ["fsdp.sharding_strategy=HYBRID_SHARD", "mesh.replica=4"])
    got, want = plan.resolve(cfg.fsdp, cfg.mesh, 8), plan.resolve(named.fsdp, named.mesh, 8)
    assert (got.strategy, got.replicas, got.shard, got.params) == (want.strategy, want.replicas, want.shard, want.params)
    full = config.load(None, ["fsdp.sharding={params: all, grads: all, optimizer: all}"])
    assert plan.resolve(full.fsdp, full.mesh, 8).strategy.value == "FULL_SHARD"
    none = config.load(None, ["fsdp.sharding={params: none, grads: none, optimizer: none}"])
    assert plan.resolve(none.fsdp, none.mesh, 8).strategy.value == "NO_SHARD"


@pytest.mark.parametrize("sets, key, words", [
    (["fsdp.sharding={params: 4, grads: 2, optimizer: 4}"], "fsdp.sharding", ["must nest"]),
    (["fsdp.sharding={params: 3, grads: 3, optimizer: 3}"], "fsdp.sharding.params", ["does not divide the 4"]),
    (["fsdp.sharding={params: 2, grads: 4, optimizer: 4}"], "fsdp.sharding", ["2/4/4", "uniform triple"]),
    (["fsdp.sharding={params: 2, grads: 2, optimizer: 2}", "fsdp.sharding_strategy=FULL_SHARD"], None,
     ["drop fsdp.sharding_strategy"]),
])
def test_triples_the_backends_cannot_run_are_refused_naming_the_key(sets, key, words):
    from xla_shard import backends

    with pytest.raises(ConfigError) as raised:
        cfg = config.load(None, ["backend=xla_spmd", *sets])
        backends.create(cfg).check_launch()
    assert raised.value.key == key and all(w in str(raised.value) for w in words), str(raised.value)


def test_xla_fsdp_refuses_a_hybrid_triple_naming_it():
    from xla_shard import backends

    cfg = config.load(None, ["backend=xla_fsdp", "cpu_devices=1", "fsdp.sharding={params: 2, grads: 2, optimizer: 2}"])
    with pytest.raises(ConfigError) as raised:
        backends.create(cfg).resolve_plan(8)  # as on an 8-chip TPU
    assert raised.value.key == "fsdp.sharding" and "HYBRID_SHARD" in str(raised.value)


def test_auto_picks_the_fastest_runnable_triple_and_says_why():
    from xla_shard import backends

    # One sequence per GPU on 1024 H100s: communication-bound, where ZeRO-3's groups over every GPU cost most.
    cfg = config.load(None, ["backend=torch_fsdp", "model=llama-7b", "fsdp.sharding=auto", "fsdp.mixed_precision=bf16",
                             "train.seq_len=2048", "train.global_batch_size=1024", "fsdp.activation_checkpointing=true"])
    backend = backends.create(cfg)
    backend.device_kind = "NVIDIA H100 80GB HBM3"
    chosen = backend.auto_plan(1024)
    from xla_shard import planner

    ranked = planner.plan(workload(cfg, 1024), 1024, accelerator("h100"), hosts=128)
    runnable = [e for e in ranked.ranked if e.fits and planner.realisable(e.triple)]
    assert (chosen.params, chosen.grads, chosen.optimizer) == (runnable[0].triple.params,) * 3
    assert chosen.params < 1024 and chosen.strategy.value == "HYBRID_SHARD"
    assert runnable[0].step_s < 0.9 * ranked.baseline.step_s and "vs FULL_SHARD" in chosen.reason
    backend.device_kind = "cpu"
    assert backend.auto_plan(4).strategy.value == "FULL_SHARD" and "no hardware model" in backend.auto_plan(4).reason


def test_device_kinds_map_to_the_table():
    assert for_device_kind("NVIDIA H100 80GB HBM3").name == "H100 80GB"
    assert for_device_kind("tpu v5litepod-16").name == "TPU v5e"
    assert for_device_kind("tpu v5p-128").name == "TPU v5p"
    assert for_device_kind("cpu") is None


def test_plan_prints_candidates_that_fit_best_first():
    done = run_cli("plan", "--set", "model=llama-7b", "--set", "fsdp.mixed_precision=bf16", "--set",
                   "train.seq_len=2048", "--set", "train.global_batch_size=1024", "--devices", "128",
                   "--accelerator", "h100", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    rows = result["candidates"]
    assert len(rows) == len(candidates(128)) and result["fast_domain"] == 8
    fitting = [r for r in rows if r["fits"]]
    assert fitting and rows[:len(fitting)] == fitting  # those that fit come first
    assert [r["step_s"] for r in fitting] == sorted(r["step_s"] for r in fitting)
    assert all(r["memory"]["total"] <= 80e9 for r in fitting)
    assert not any(r["fits"] for r in rows if r["triple"] == "1/1/1")  # 7B unsharded, with AdamW: 112 GB
    small = run_cli("plan", "--set", "model=llama-70b", "--devices", "8", "--accelerator", "h100", "--hbm-gib", "8")
    assert small.returncode == 0 and "nothing fits in 8 GiB per device" in small.stdout
    bad = run_cli("plan", "--devices", "8", "--accelerator", "a100")
    assert bad.returncode == 2 and "--accelerator 'a100'" in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("backend, sets, nproc", [
    ("xla_spmd", ["backend=xla_spmd", "cpu_devices=8", "fsdp.sharding={params: 8, grads: 8, optimizer: 8}"], 0),
    ("xla_spmd", ["backend=xla_spmd", "cpu_devices=8", "fsdp.sharding={params: 2, grads: 2, optimizer: 2}"], 0),
    ("torch_fsdp", ["backend=torch_fsdp", "fsdp.sharding={params: 2, grads: 2, optimizer: 2}"], 4),
])
def test_per_device_bytes_are_what_the_plan_predicts(probe, backend, sets, nproc):
    """Parameters, gradients and AdamW state on one device, against 4/P, 4/G and 8/OS bytes per parameter
    (FSDP pads each parameter's first dimension to a multiple of the degree: at most one row per tensor)."""
    cfg = config.load(None, ["model=tiny-llama", "train.seq_len=32", *sets])
    result = probe("model=tiny-llama", "train.seq_len=32", *sets, nproc=nproc)
    devices = result["devices"]
    resolved = plan.resolve(cfg.fsdp, cfg.mesh, devices)
    work = workload(cfg, devices)
    predicted = estimate(work, Triple(resolved.params, resolved.grads, resolved.optimizer), devices,
                         accelerator("h100"), domain=devices).memory
    memory = result["memory"]
    slack = 21 * 64 * 4  # one row of the widest tensor, per tensor
    for kind in ("params", "grads", "optimizer"):
        assert predicted[kind] <= memory[kind] <= predicted[kind] + (2 if kind == "optimizer" else 1) * slack, \
            (kind, memory[kind], predicted[kind])


@pytest.mark.slow
@pytest.mark.parametrize("degree", [8, 2])
def test_the_compiled_step_gathers_over_p_and_reduces_what_the_model_says(tmp_path, degree):
    """The optimized HLO of xla_spmd's step on 8 devices: every all-gather runs in groups of P devices (the
    inner mesh axis), and the gradient reduction over G-device groups carries the gradient bytes the model
    predicts (XLA's CPU compiler lowers the reduce-scatter as an all-reduce of the same bytes, then a slice).
    The parameter gathers move between 1 and 2 times the parameter bytes: the model's 2 (forward, and again in
    backward) is an upper bound, as XLA keeps some gathered parameters from forward for backward."""
    dump = tmp_path / "hlo"
    sets = ["model=tiny-llama", "backend=xla_spmd", "cpu_devices=8", "train.steps=1", "train.seq_len=32",
            "train.optimizer=sgd", f"output_dir={tmp_path}/run",
            f"fsdp.sharding={{params: {degree}, grads: {degree}, optimizer: {degree}}}"]
    env = {**_env(), "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"}
    done = subprocess.run([sys.executable, "-m", "xla_shard.cli", "train", *[a for s in sets for a in ("--set", s)]],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = collectives(step_program(dump))
    cfg = config.load(None, sets)
    param_bytes = workload(cfg, 8).params * 4
    gathers = {size: v for (op, size), v in found.items() if op == "all-gather"}
    assert set(gathers) == {degree}, found
    assert param_bytes <= gathers[degree]["bytes"] <= 2 * param_bytes
    reductions = {size: v["bytes"] for (op, size), v in found.items() if op != "all-gather"}
    # Over G-device groups (XLA reduces a few small, replicated tensors over all 8 at once instead).
    over_g = reductions.get(degree, 0) + (reductions.get(8, 0) if degree < 8 else 0)
    assert math.isclose(over_g, param_bytes, rel_tol=0.05), found
