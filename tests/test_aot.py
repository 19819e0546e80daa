"""`xla-shard compile`: the trainer's own step, traced on virtual CPU devices and compiled by the real TPU compiler
(libtpu, through jax's compile-only client) for a slice this machine does not have."""

import os
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO, run_cli
from model_dirs import moe_dir
from tpu_compiles import USERS_XLA, compile_json, traces

from xla_shard.aot import target
from xla_shard.errors import ConfigError, UserError

pytestmark = pytest.mark.xla
ISOLATED = "XLA_SHARD_TPU_COMPILER"
TPU_COMPILER = Path(os.environ.get(ISOLATED, REPO / ".venv-tpu-compiler/bin/python"))


@pytest.mark.parametrize("name, topology, chips", [
    ("v5p-8", "v5p:2x2x1", 4), ("v5p-64", "v5p:2x4x4", 32), ("v6e-16", "v6e:4x4", 16),
    ("v5litepod-8", "v5e:2x4", 8), ("v4-32", "v4:2x2x4", 16), ("tpu7x-16", "tpu7x:2x2x2", 8),
])
def test_slices_are_named_as_deploy_names_them(name, topology, chips):
    chosen = target.parse(name)
    assert (chosen.topology, chosen.chips) == (topology, chips)
    assert chosen.per_device(chips * 2).hbm_bytes == chosen.chip.hbm_bytes / 2


@pytest.mark.parametrize("name", ["v5p-3", "v9-8", "v6e-512", "gpu-8"])
def test_a_slice_that_does_not_exist_is_one_line(name):
    with pytest.raises(UserError, match="--tpu"):
        target.parse(name)


# The heap's block as libtpu 0.0.20 and 0.0.42 write it, and as 0.0.52 does (a page, and blocks in other memories
# marked with their color), values abridged from their dumps.
_HEAP_0_0_20 = """allocation 7: size 110166048, preallocated-temp:
 value: <3281 add.1265 @0> (size=512,offset=2719744): u32[]{:T(128)}
 value: <88 fusion.3 @0> (size=16777216,offset=0): bf16[32,1,8192,4096]{3,2,1,0}
"""
_HEAP_0_0_52 = """allocation 321: size 1024, page 0, maybe-live-out:
 value: <4859 multiply_add_fusion.28{0} @0> (size=1024,offset=0): f32[2,128]{1,0:T(2,128)}
allocation 322: size 110166048, page 0, preallocated-temp:
 value: <3281 add.1265 @0> (size=512,offset=2719744): u32[]{:T(128)}
 value: <88 fusion.3 @0> (size=16777216,offset=0): bf16[32,1,8192,4096]{3,2,1,0}
allocation 323: size 60, color 2, page 0, preallocated-temp:
 value: <3290 copy-start.41{2} @2> (size=4,offset=0): u32[]{:S(2)}
"""


@pytest.mark.parametrize("text", [_HEAP_0_0_20, _HEAP_0_0_52], ids=["libtpu-0.0.20", "libtpu-0.0.52"])
def test_the_heap_is_read_from_either_compilers_buffer_assignment_and_its_slots_named_under_the_axis(text):
    from xla_shard.aot import memory

    found = memory.parse(text)
    assert found.heap == 110166048 and found.slots[0].shape == (32, 1, 8192, 4096)
    dims = memory.Dims(hidden=4096, vocab=128256, layers=32, intermediate=14336, head_dim=128, kv_width=1024,
                       tokens=65536, devices=32, context=8)  # each device holds 8192 of a sequence's tokens
    assert memory.named(found.slots[0], dims).startswith("layer checkpoints")


@pytest.mark.e2e
def test_the_trainers_step_compiles_for_a_tpu_and_holds_its_shards_per_device():
    """small-llama, FULL_SHARD over the 4 devices of a v5p-8, 256-token sequences: the TPU program runs Pallas
    flash attention (`auto` on a TPU), takes, per device, the shards the CPU trace holds (parameters and AdamW
    state, 1/4 each: within 2% of the compiled arguments with the batch), gathers them (all-gathers), reduces
    gradients, and fits."""
    pytest.importorskip("jax")
    report = compile_json("--tpu", "v5p-8", "--set", "model=small-llama", "--set", "train.seq_len=256")
    consumers = report["consumers"]
    sharded = consumers["parameters"] + consumers["optimizer state"]
    assert report["devices"] == 4 and report["fits"]
    assert abs(report["argument_bytes"] - sharded - consumers["batch"]) <= 0.02 * report["argument_bytes"]
    assert 0.9 * 3 * consumers["parameters"] <= sharded <= 1.1 * 3 * consumers["parameters"]  # AdamW: 2 states
    collectives = report["collectives"]
    assert collectives["all-gather"]["count"] > 0
    assert collectives.get("all-reduce", {}).get("count", 0) + collectives.get("reduce-scatter", {}).get("count", 0)
    assert report["flops_per_device"] > 0 and 0 < report["roofline"]["mfu_ceiling"] <= 1
    assert report["pallas_kernels"] > 0  # attention `auto` on a TPU: Pallas flash attention, compiled for it
    assert set(report["pallas_kernel_kinds"]) == {"flash attention"}  # a dense model: no grouped matmuls
    # every collective the program runs is one the planner accounts for, or is said to be what else it is
    said = report["what_collectives_move"]
    assert set(said) == set(collectives) and "not in the planner's model of this step" not in said.values(), said
    assert set(collectives) - {"collective-permute", "all-reduce"} <= set(report["planned_collectives"]), said


@pytest.mark.e2e
@pytest.mark.slow
def test_a_step_that_does_not_fit_says_so_in_one_line_with_what_would_fit():
    """A 3-layer Llama of width 1024 on one v5e chip (16 GiB), 16 x 2048 tokens with 16 heads of eager
    attention (asked for: with `auto`, flash attention, it fits): the activations do not fit (the compiler says
    17.3 GiB); activation checkpointing, compiled, does (10.2 GiB). Three layers, not eight: a compile of the
    step took 42-50 s against 64 s."""
    pytest.importorskip("jax")
    shape = ("{hidden_size: 1024, intermediate_size: 4096, num_hidden_layers: 3, num_attention_heads: 16, "
             "num_key_value_heads: 16, max_position_embeddings: 2048}")
    sets = ["model=small-llama", f"model.overrides={shape}", "model.attn_implementation=eager", "train.seq_len=2048",
            "train.global_batch_size=16"]
    done = run_cli("compile", "--tpu", "v5litepod-1", *[a for s in sets for a in ("--set", s)], drop=USERS_XLA)
    errors = [line for line in done.stderr.splitlines() if line.startswith("xla-shard: error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert "does NOT fit" in done.stdout and "it fits with fsdp.activation_checkpointing: true" in errors[0]
    assert "the step needs" in errors[0] and "temporaries" in errors[0]


@pytest.mark.e2e
def test_a_generation_this_libtpu_cannot_compile_is_one_line_before_anything_is_traced():
    """TPU7x needs a newer libtpu than torch_xla 2.9's jax takes: without the isolated compiler, one line saying
    how to install it."""
    pytest.importorskip("jax")
    done = run_cli("compile", "--tpu", "tpu7x-8", "--set", "model=small-llama", drop=USERS_XLA + (ISOLATED,))
    errors = [line for line in done.stderr.splitlines() if line.startswith("xla-shard: error:")]
    assert done.returncode == 2 and len(errors) == 1 and "TPU7x" in errors[0], done.stderr[-2000:]
    assert ISOLATED in errors[0] and "libtpu==" in errors[0]
    assert "xla_spmd on" not in done.stderr  # refused before the trace


def _script(path: Path, body: str, mode: int = 0o755) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize("make, words", [
    (lambda tmp: "/bin/true", ["answered 'nothing'"]),
    (lambda tmp: _script(tmp / "talks", "echo hello"), ["answered 'hello'"]),
    (lambda tmp: _script(tmp / "half", "echo '{\"count\": 4}'"), ["not its JSON with count, platform_version"]),
    (lambda tmp: _script(tmp / "odd", "echo '{\"count\": \"4\", \"platform_version\": 1}'"),
     ["not a device count and a version"]),
    (lambda tmp: _script(tmp / "fails", "echo boom >&2; exit 3"), ["failed: boom"]),
    (lambda tmp: str(tmp), ["not a file"]),
    (lambda tmp: _script(tmp / "plain", "true", mode=0o644), ["not executable"]),
    (lambda tmp: str(tmp / "absent"), ["no such file"]),
    (lambda tmp: _script(tmp / "hangs", "sleep 30"), ["did not answer within 1 s (describe); stopped"]),
])
def test_an_isolated_compiler_that_is_not_one_is_one_line_within_a_time_bound(tmp_path, monkeypatch, make, words):
    """XLA_SHARD_TPU_COMPILER is read from the environment: whatever it names (a program that prints nothing,
    or not JSON, or JSON without its keys; a directory; a file without the run bit; one that hangs) is one
    error naming the variable, within a stated time."""
    from xla_shard.aot import compiler

    def unknown(topology, slices=1):
        raise UserError("this libtpu does not know it")

    monkeypatch.setattr(compiler, "topology_devices", unknown)
    monkeypatch.setattr(compiler, "_DESCRIBE_S", 1)
    monkeypatch.setenv(ISOLATED, make(tmp_path))
    with pytest.raises(UserError) as refused:
        compiler.describe("tpu7x:2x2x1")
    assert ISOLATED in str(refused.value) and "\n" not in str(refused.value)
    for word in words:
        assert word in str(refused.value)


def test_an_isolated_compiler_that_writes_no_figures_is_one_line(tmp_path):
    from xla_shard.aot import compiler

    for body, words in (("true", "answered 'nothing'"), ('echo \'{"refused": 7}\' > "$7"', "not its JSON with"),
                        ('echo \'{"devices": 4}\' > "$7"', "not its JSON with")):
        python = _script(tmp_path / "compiles", body)
        with pytest.raises(UserError, match=words) as refused:
            compiler.Slice("tpu7x:2x2x1", 4, "v", python=python).compile(b"program")
        assert ISOLATED in str(refused.value)


def test_a_compile_past_its_time_bound_is_stopped_and_said(tmp_path):
    """A compile given a time bound runs in a process of its own and is stopped past it (libtpu 0.0.20 did not
    finish a bf16 token program in 10 minutes): CompileTimedOut, carrying the bound."""
    import time

    from xla_shard.aot import compiler

    started = time.monotonic()
    with pytest.raises(compiler.CompileTimedOut) as stopped:
        compiler.Slice("v5p:2x2x1", 4, "v", python=_script(tmp_path / "hangs", "sleep 30")).compile(b"p", timeout_s=1)
    assert stopped.value.timeout_s == 1 and time.monotonic() - started < 10


_NO_COLLECTIVES = "ENTRY %main () -> f32[] {\n  ROOT %c = f32[] constant(0)\n}\n"


def _generation_report(token, prompt=None):
    from xla_shard.aot import compiler, generation
    from xla_shard.aot.target import parse
    from xla_shard.sampling import Generation, Sampling

    def compiled(arguments, temporaries, accessed):
        return compiler.Compiled(4, arguments, 1000, 0, temporaries, 100, 1e6, accessed, hlo_text=_NO_COLLECTIVES)

    traced = generation.GenerationTrace(Generation(Sampling(16, (2,), 0), 64, 32, 4), 1, {})
    programs = {"layout": compiled(0, 10, 1e3), "prompt": prompt or compiled(5000, 3000, 1e6), "token": token}
    chosen = parse("v5p-8")
    return generation.GenerationReport(traced, programs, chosen.per_device(4), 2000, chosen.chips)


def test_a_generation_program_not_compiled_leaves_the_phase_unknown_or_refused():
    """What the report says of a generation whose token program did not finish compiling (whether it fits is
    unknown, no roofline), or whose prompt program the compiler refused for want of HBM (it does not fit, the
    compiler's count of the program is the phase's); and of one compiled (the roofline is the token's HBM
    bytes at the chip's bandwidth, every row a token)."""
    from xla_shard.aot import compiler

    slow = _generation_report(compiler.CompileTimedOut(UserError("slow"), 900.0))
    assert slow.fits is None and slow.decode_roofline() == {}
    assert any("did not finish within 900 s" in line for line in slow.lines())
    token = compiler.Compiled(4, 6000, 6000, 0, 500, 100, 1e6, 2.765e9, hlo_text=_NO_COLLECTIVES)
    refused = _generation_report(token, prompt=compiler.OutOfHbm(200 * 2**30, 95 * 2**30, None))
    assert refused.fits is False and refused.needed == 2000 + 200 * 2**30
    said = refused.refusal("v5p-8")
    assert "prompt program 200.00 GiB" in said and "train.global_batch_size" in said and "\n" not in said
    fine = _generation_report(token)
    assert fine.fits and fine.needed == 2000 + 5000 + 1000 + 3000 + 100  # the prompt's: arguments, outputs, temps
    roof = fine.decode_roofline()
    assert roof["hbm_s"] == pytest.approx(1e-3) and roof["tokens_per_s"] == pytest.approx(64 / 1e-3)


@pytest.mark.e2e
@pytest.mark.skipif(not TPU_COMPILER.exists(), reason=f"no isolated TPU compiler at {TPU_COMPILER} (tests/run.sh "
                                                      "makes .venv-tpu-compiler)")
def test_tpu7x_compiles_with_the_isolated_compiler(monkeypatch):
    """The same step for a tpu7x-8 (4 chips, 8 devices), traced here and compiled by the newer libtpu in its own
    environment: it fits, holds its shards per device as the trace does, runs Pallas flash attention (and
    eager attention none), and its all-gathers (TPU7x runs them on its SparseCores, as async calls) and
    gradient reductions are counted."""
    monkeypatch.setenv(ISOLATED, str(TPU_COMPILER))
    report = compile_json("--tpu", "tpu7x-8", "--set", "model=small-llama", "--set", "train.seq_len=256")
    consumers = report["consumers"]
    assert report["devices"] == 8 and report["fits"] and report["pallas_kernels"] > 0
    sharded = consumers["parameters"] + consumers["optimizer state"]
    assert abs(report["argument_bytes"] - sharded - consumers["batch"]) <= 0.02 * report["argument_bytes"]
    # The whole model gathered, at least once at 2 bytes a parameter: the TPU compiler gathers fp32 weights in
    # bf16, the precision its matmuls take them in by default.
    assert report["collectives"]["all-gather"]["bytes"] >= consumers["parameters"] * 8 / 2
    assert report["collectives"]["reduce-scatter"]["count"] > 0
    # Eager attention runs no Pallas kernel of ours, though TPU7x's compiler writes Mosaic kernels of its own
    # for it (`online-softmax`): those are not counted as the step's.
    eager = compile_json("--tpu", "tpu7x-2", "--set", "model=tiny-llama", "--set", "train.seq_len=256",
                     "--set", "model.attn_implementation=eager")
    assert eager["fits"] and eager["pallas_kernels"] == 0


@pytest.mark.e2e
def test_placeholders_trace_the_program_real_parameters_do(tmp_path):
    """`xla-shard compile` traces with placeholders (no storage at the model's size). Compiled for a v5p-8, each
    config's program is the one its real parameters and optimizer state trace: the same memory per device, FLOPs
    and collectives, for a model with LoRA, a triple sharding each state apart with micro-batches, and an MoE
    (Qwen3-MoE, from its directory's config.json; no weights read) with its layers scanned and checkpointed. Its
    experts compile as Pallas grouped-matmul kernels (the only kernels there: 64-token attention takes SDPA).
    (A scanned dense model compiles in test_aot_planner.py.)"""
    pytest.importorskip("jax")
    moe = moe_dir(tmp_path / "qwen3-moe", "qwen3_moe")
    (moe / "model.safetensors").unlink()
    runs = [["model=tiny-llama", "model.lora={r: 4}"],
            ["model=tiny-llama", "fsdp.sharding={params: 2, grads: 4, optimizer: 4}", "train.grad_accum_steps=2",
             "train.global_batch_size=8"],
            [f"model.name={moe}", "model.init=random", "fsdp.mixed_precision=bf16", "fsdp.scan_layers=true",
             "fsdp.activation_checkpointing=true"]]
    results = traces("v5p-8", "--real", "train.global_batch_size=4", "train.seq_len=64", runs=runs, cwd=tmp_path)
    for run, result in zip(runs, results):
        assert result["placeholders"] == result["real"], run
        assert result["real"]["collectives"]["all-gather"]["count"] > 0, run
        assert (result["real"]["kernels"] > 0) == (run[0] != "model=tiny-llama"), run


PREFERENCE = ["method=dpo", "data.kind=preference", f"data.path={FIXTURES / 'preference_chat.jsonl'}",
              "train.seq_len=64"]
# packed chat rows at a length the flash kernel's blocks tile (transformers' chat rows of the fixture: ~6 a row)
PACKED_CHAT = ["data.kind=chat", f"data.path={FIXTURES / 'chat.jsonl'}", "train.seq_len=256"]


@pytest.fixture(scope="module")
def chat_model_traces(model_dirs, tmp_path_factory):
    """A chat model's steps traced and compiled for a v5p-8 in one process: DPO fully fine-tuned, DPO with LoRA,
    and SFT on packed chat rows."""
    pytest.importorskip("jax")
    runs = {"dpo": PREFERENCE, "dpo_lora": [*PREFERENCE, "model.lora.r=4"], "packed_chat": PACKED_CHAT}
    results = traces("v5p-8", f"model.name={model_dirs.llama_chat}", "train.global_batch_size=4",
                     runs=list(runs.values()), cwd=tmp_path_factory.mktemp("chat_traces"))
    return dict(zip(runs, results))


@pytest.mark.e2e
def test_a_dpo_step_compiles_with_its_reference_model_sharded_as_the_policy(chat_model_traces):
    """DPO on a v5p-8, fully fine-tuned (its reference: a second copy of the starting weights, built beside the
    policy and never read in a trace: reading it into placeholders crashed the process) and with LoRA (its
    reference: the policy with its adapters off, nothing held). The trace shards the reference as it shards the
    policy, and the compiled program takes those shards as arguments. (The planner's 2% is held on lane-aligned
    shapes, as the tests above hold it: this fixture's 64-wide tensors take twice their bytes in the TPU's
    128-lane tiles.)"""
    for run in ("dpo", "dpo_lora"):
        compiled = chat_model_traces[run]["placeholders"]
        parameters, optimizer, batch, reference = compiled["traced"]
        assert reference == (0 if run == "dpo_lora" else parameters), run
        assert compiled["memory"][0] >= parameters + optimizer + batch + reference, run


@pytest.mark.e2e
def test_packed_chat_rows_compile_onto_the_flash_kernel_for_a_tpu(chat_model_traces):
    """Chat examples packed into 256-token rows (several a row, told apart by their restarting positions) reach
    the Pallas flash kernel in the program compiled for a TPU, forward and backward in each layer, with segment
    ids in place of a mask: before, transformers' block-diagonal mask sent every packed row to SDPA. (The 8K
    figures, beside synthetic rows: bench/aot_compile.py --packed-chat.)"""
    compiled = chat_model_traces["packed_chat"]["placeholders"]
    layers = 2  # tests/model_dirs.py's llama
    assert compiled["kernels"] >= 2 * layers, compiled["kernels"]


def test_a_buffer_larger_than_a_devices_hbm_is_the_compilers_out_of_hbm_verdict_naming_the_buffer():
    """libtpu's refusal of one buffer past HBM (a Qwen3-30B-A3B shape on a v5p-64: transformers' batched_mm
    experts gather a weight per token and expert), as the compiler worded it."""
    from xla_shard.aot.compiler import OutOfHbm, rejection

    text = ("RESOURCE_EXHAUSTED: Allocation (size=206158430208) would exceed memory (size=103079215104) :: "
            "#allocation533 [shape = 'bf16[32768,1536,2048]{2,1,0:T(8,128)(2,1)}', space=hbm, size = "
            "0xffffffffffffffff, tag = 'output of constant_dynamic-update-slice_fusion.78@{}'] :: <no-hlo-instruction>")
    verdict = rejection(text)
    assert isinstance(verdict, OutOfHbm) and verdict.used == 206158430208 and verdict.capacity == 96 * 2**30
    assert verdict.allocation == "bf16[32768,1536,2048]" and "one allocation (bf16[32768,1536,2048])" in str(verdict)
    assert not isinstance(rejection("INVALID_ARGUMENT: something else"), OutOfHbm)
    # What the isolated compiler's process hands back is the compiler's whole message, read again the same way.
    again = rejection(verdict.compiler_said)
    assert (again.used, again.capacity, again.allocation) == (verdict.used, verdict.capacity, verdict.allocation)


def test_temporaries_past_a_devices_hbm_are_the_compilers_out_of_hbm_verdict():
    """libtpu 0.0.42's refusal before any assignment (Llama-3-8B's generation layout on a v6e-8), as it worded
    it: the temporaries alone, a lower bound of what the program needs."""
    from xla_shard.aot.compiler import OutOfHbm, rejection

    verdict = rejection("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                        "temporaries (35.66G) exceeds available HBM (31.25G).")
    assert isinstance(verdict, OutOfHbm) and verdict.capacity == int(31.25 * 2**30)
    assert verdict.used == verdict.temporaries == int(35.66 * 2**30)


def test_a_slice_past_what_torch_can_trace_is_one_line():
    """v5p-256 is 128 devices: torch's 8-bit device index cannot run a backward over them (measured: an
    internal assert in autograd's engine), so the compile is refused before anything starts."""
    from xla_shard.aot import trace

    with pytest.raises(UserError, match="slice has 128 devices.*at most 127.*at most 64 devices"):
        trace._claim_devices(128)
    with pytest.raises(UserError, match="the 2 slices have 128 devices.*fewer slices"):
        trace._claim_devices(128, slices=2)


def test_the_search_for_a_change_that_fits_stops_at_its_time_budget_and_says_what_it_left(monkeypatch):
    """Each try is a compile (minutes for a 70B model): past `--budget-minutes` none starts, and the refusal
    names what was left untried."""
    import types

    from xla_shard import config
    from xla_shard.aot import run

    cfg = config.load(None, ["model.name=tiny-llama", "train.global_batch_size=8"])
    now = [0.0]

    def compile_for(changed, name, slices):
        now[0] += 600  # ten minutes a compile
        return types.SimpleNamespace(fits=False, needed=0)

    monkeypatch.setattr(run, "compile_for", compile_for)
    report = types.SimpleNamespace(target=types.SimpleNamespace(name="v5p-8", slices=1))
    fix, untried = run.what_fits(cfg, report, bigger=lambda name: pytest.fail("started past the budget"),
                                 budget_s=900, clock=lambda: now[0])
    assert fix is None and untried == ["--tpu v5p-16"] and now[0] == 1200
    report = types.SimpleNamespace(needed=2**35, available=2**34, consumers={"parameters": 2**34},
                                   target=types.SimpleNamespace(label="v5p-8 (4 chips)"))
    said = str(run.refusal(report, fix, untried))
    assert "ran out before trying --tpu v5p-16" in said and "\n" not in said


def test_a_change_the_slice_refuses_is_passed_over_not_the_searchs_end(monkeypatch):
    """Doubling train.grad_accum_steps can leave micro-batches that do not split over the slice's devices (8 rows
    in 2 on a v5litepod-8, found compiling a 70B QLoRA step): the config refuses that try, and the search goes on
    to the next slice size."""
    import types

    from xla_shard import config
    from xla_shard.aot import run

    cfg = config.load(None, ["model.name=tiny-llama", "train.global_batch_size=8",
                             "fsdp.activation_checkpointing=true"])
    asked = []

    def compile_for(changed, name, slices):
        asked.append(changed.train.grad_accum_steps)
        raise ConfigError("train.grad_accum_steps", "2 micro-batches of 4 rows: each must split evenly over 8 devices")

    monkeypatch.setattr(run, "compile_for", compile_for)
    report = types.SimpleNamespace(target=types.SimpleNamespace(name="v5litepod-8", slices=1))
    larger = types.SimpleNamespace(fits=True, needed=2**34)
    fix, untried = run.what_fits(cfg, report, bigger=lambda name: larger if name == "v5litepod-16" else None)
    assert asked == [2] and fix.startswith("--tpu v5litepod-16") and untried == []


@pytest.mark.parametrize("minutes", ["0", "-5", "nan"])
def test_a_search_budget_that_allows_no_compile_is_refused_in_one_line(minutes, capsys):
    from xla_shard import cli

    with pytest.raises(SystemExit) as done:
        cli._parser().parse_args(["compile", "--tpu", "v5p-8", "--longest", "--budget-minutes", minutes])
    assert done.value.code == 2 and "--budget-minutes" in capsys.readouterr().err


def test_longest_with_its_budget_spent_before_any_compile_says_so_not_that_nothing_fits(monkeypatch):
    """Whether train.seq_len fits is not known until it is compiled: a budget spent before that is said as such
    (it used to read "train.seq_len 64 does not fit v5p-8")."""
    import types

    from xla_shard import config
    from xla_shard.aot import run

    cfg = config.load(None, ["model.name=tiny-llama", "train.global_batch_size=8"])
    monkeypatch.setattr(run.compiler, "describe", lambda topology, slices=1: types.SimpleNamespace(count=4))
    monkeypatch.setattr(run, "compile_for", lambda *a: pytest.fail("compiled past the budget"))
    with pytest.raises(UserError, match=r"--budget-minutes .*ran out before train.seq_len \d+ was compiled"):
        run.longest(cfg, "v5p-8", budget_s=0.0)
    # a start past the model's positions is the config's error, not "does not fit"
    tiny = config.load(None, ["model.name=tiny-llama", "train.global_batch_size=8", "train.seq_len=4096"])
    with pytest.raises(ConfigError, match=r"4096 is longer than the model's \d+ positions") as refused:
        run.longest(tiny, "v5p-8")
    assert refused.value.key == "train.seq_len"


def test_a_compile_this_machine_cannot_hold_is_refused_before_the_trace_with_the_remedy():
    """libtpu's compile of an unrolled step takes host memory by the layer (an unrolled 8B: about 21 GiB); the
    kernel would kill it minutes in, without a word. Said first, in one line, with what fits."""
    from xla_shard import config
    from xla_shard.aot.run import check_host_memory

    cfg = config.load(None, ["model=llama-7b"])  # 32 layers
    with pytest.raises(UserError, match="about 21 GiB of host memory") as refused:
        check_host_memory(cfg, available=int(17.7 * 2**30))
    assert "fsdp.scan_layers: true" in str(refused.value) and "17.7 GiB available" in str(refused.value)
    check_host_memory(config.load(None, ["model=llama-7b", "fsdp.scan_layers=true"]), available=int(17.7 * 2**30))
    check_host_memory(cfg, available=64 * 2**30)
    check_host_memory(cfg, available=0)  # unknown: not guessed
