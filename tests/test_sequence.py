"""The sequence axis (`mesh.context`): each sequence split over devices in a balanced causal order, attention
across the pieces, the loss scored per piece; a run with it trains as the same run without it."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import FIXTURES, run_trainings, run_worker
from model_dirs import CHAT_TEMPLATE, llama_dir
from xla_shard import backends, config, sequence
from xla_shard.attention import segment_mask, segments
from xla_shard.backends.torch_fsdp import TorchFsdpBackend
from xla_shard.backends.torchtpu import TorchTpuBackend
from xla_shard.backends.xla_fsdp import XlaFsdpBackend
from xla_shard.backends.xla_spmd import XlaSpmdBackend
from xla_shard.errors import ConfigError
from xla_shard.plan import PlanError, resolve, with_context


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_each_shard_holds_an_early_and_a_late_chunk_and_the_order_comes_back(shards):
    tokens = 32
    placed = sequence.reorder(torch.arange(tokens), shards)
    assert sorted(placed.tolist()) == list(range(tokens))
    assert torch.equal(sequence.restore(placed, shards), torch.arange(tokens))
    chunk = tokens // (2 * shards)
    work = {int((piece + 1).sum()) for piece in placed.view(shards, -1)}  # keys each shard's queries see
    assert len(work) == 1
    for shard, piece in enumerate(placed.view(shards, -1)):
        assert sorted({int(t) // chunk for t in piece}) == sorted({shard, 2 * shards - 1 - shard})


@pytest.mark.parametrize("shards", [2, 4])
def test_the_split_sequences_mask_is_the_packed_rows_causal_mask_in_the_new_order(shards):
    tokens = 32
    positions = torch.tensor([list(range(10)) + list(range(7)) + list(range(15)),
                              list(range(32))])
    padding = torch.ones(2, tokens, dtype=torch.bool)
    padding[1, 28:] = False
    seen = sequence.allowed(sequence.reorder(positions, shards), sequence.reorder(padding, shards), shards)
    back = sequence.restore(sequence.restore(seen.squeeze(1), shards, dim=1), shards, dim=2)
    wanted = segment_mask(segments(positions, 2), tokens, tokens).squeeze(1) & padding[:, None, :]
    wanted |= torch.eye(tokens, dtype=torch.bool)
    assert torch.equal(back, wanted)


@pytest.mark.parametrize("shards", [2, 4])
def test_each_process_attends_block_by_block_as_sdpa_with_its_rows_of_the_mask(monkeypatch, shards):
    """torch_fsdp's attention over a split sequence on a CPU (`BlockwiseAttention`), in blocks of 8 tokens so
    that every kind of block occurs (seen whole, in part, not at all: skipped; rows seeing nothing of a block):
    each process's output and its gradients of queries, keys and values equal SDPA with its rows of the whole
    mask, for packed documents and padding, with two query heads to a key/value head."""
    monkeypatch.setattr(sequence, "_BLOCK_TOKENS", 8)
    tokens, heads, dim = 64, 4, 8
    positions = torch.tensor([list(range(20)) + list(range(9)) + list(range(35)), list(range(64))])
    padding = torch.ones(2, tokens, dtype=torch.bool)
    padding[1, 50:] = False
    place = sequence.reorder(torch.arange(tokens), shards)
    docs = sequence.documents(sequence.reorder(positions, shards), shards)
    generator = torch.Generator().manual_seed(3)
    key, value = (torch.randn(2, heads // 2, tokens, dim, generator=generator, requires_grad=True) for _ in range(2))
    per_process = tokens // shards
    for rank in range(shards):
        mine = slice(rank * per_process, (rank + 1) * per_process)
        query = torch.randn(2, heads, per_process, dim, generator=generator, requires_grad=True)
        blocks = sequence.Blocks(place, docs, sequence.reorder(padding, shards), mine)
        got = sequence.BlockwiseAttention.apply(query, key, value, blocks, 0.3)
        want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=blocks.whole(),
                                                                scale=0.3, enable_gqa=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        upstream = torch.randn(got.shape, generator=generator)
        grads = [torch.autograd.grad(out, (query, key, value), upstream) for out in (got, want)]
        for mine_grad, sdpa_grad in zip(*grads):
            torch.testing.assert_close(mine_grad, sdpa_grad, rtol=1e-4, atol=1e-6)


def test_rows_are_reordered_but_their_labels_are_not_and_positions_are_added():
    rows = {"input_ids": torch.arange(16).view(2, 8), "labels": torch.arange(16).view(2, 8),
            "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    placed = sequence.reorder_rows(rows, 2, 8)
    assert torch.equal(placed["labels"], rows["labels"])
    assert placed["input_ids"][0].tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert placed["position_ids"][1].tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    preference = {"input_ids": torch.arange(32).view(2, 2, 8), "labels": torch.zeros(2, 2, 8)}
    assert sequence.reorder_rows(preference, 2, 8)["input_ids"][1, 1].tolist() == [24, 25, 30, 31, 26, 27, 28, 29]


@pytest.mark.parametrize("backend", [XlaFsdpBackend, TorchTpuBackend])
def test_backends_without_a_sequence_axis_refuse_it_naming_the_key(backend):
    cfg = config.load(None, ["model.name=tiny-llama", "mesh.context=2", "train.seq_len=64"])
    with pytest.raises(ConfigError, match=r"mesh\.context") as refused:
        backend.capabilities.check(cfg)
    assert "\n" not in str(refused.value)
    XlaSpmdBackend.capabilities.check(cfg)  # run it
    TorchFsdpBackend.capabilities.check(cfg)


@pytest.fixture
def jax_imported():
    """jax's first import (3 s) outside the test's call: not its subject."""
    return pytest.importorskip("jax")


@pytest.mark.xla
@pytest.mark.usefixtures("jax_imported")
@pytest.mark.parametrize("sets, key", [(["mesh.context=2"], "mesh.context"), (["fsdp.scan_layers=true"],
                                                                             "fsdp.scan_layers")])
def test_a_jax_kernel_without_jax_and_flax_is_refused_before_anything_is_built(monkeypatch, sets, key):
    """torch_xla calls them through torchax (which imports flax) and only asserts "Jax is required" at the first
    step, inside `xla-shard compile` too: [aot] holds what [scan] holds for them."""
    import tomllib
    monkeypatch.setitem(sys.modules, "torchax", None)  # as without flax: torchax does not import
    cfg = config.load(None, ["model.name=tiny-llama", "backend=xla_spmd", "train.seq_len=64", *sets])
    with pytest.raises(ConfigError, match="needs jax and flax") as refused:
        backends.create(cfg)
    assert refused.value.key == key
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert set(extras["scan"]) <= set(extras["aot"])


@pytest.mark.parametrize("sets, words", [
    (["train.seq_len=66", "mesh.context=2"], "4 equal chunks"),
    (["mesh.context=2", "train.loss_chunks=0"], "loss_chunks"),
    (["mesh.context=2", "model.name=tiny-bert", "model.task=sequence_classification", "model.num_labels=2"],
     "causal LM"),
])
def test_a_sequence_axis_it_cannot_split_is_refused_in_one_line(sets, words):
    with pytest.raises(ConfigError, match=words) as refused:
        config.load(None, ["model.name=tiny-llama", "train.seq_len=64", *sets])
    assert "mesh.context" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("backend, attention, refused", [
    ("xla_spmd", "sdpa", True), ("xla_spmd", "eager", False), ("torch_fsdp", "eager", True),
    ("torch_fsdp", "sdpa", False), ("torch_fsdp", "auto", False), ("xla_spmd", "flash_attention_2", True),
])
def test_an_attention_the_backend_does_not_split_the_sequence_with_is_refused_by_its_capabilities(
        backend, attention, refused):
    """Each backend attends across the split sequence with its own kernel, declared in its capabilities: an
    attn_implementation that would replace it is refused, naming the key and the backend, before a model exists."""
    from xla_shard.backends import BACKENDS

    cfg = config.load(None, ["model.name=tiny-llama", "train.seq_len=64", "mesh.context=2", f"backend={backend}",
                             f"model.attn_implementation={attention}"])
    if not refused:
        BACKENDS[backend].capabilities.check(cfg)
        return
    with pytest.raises(ConfigError, match=f"{attention}: mesh.context=2 attends across") as error:
        BACKENDS[backend].capabilities.check(cfg)
    assert (error.value.key, error.value.backend) == ("model.attn_implementation", backend)


def test_the_sequence_axis_lies_inside_a_parameters_devices():
    cfg = config.load(None, ["fsdp.sharding_strategy=HYBRID_SHARD", "mesh.replica=4", "mesh.context=4"])
    plan = resolve(cfg.fsdp, cfg.mesh, 8)  # 2-way shards: 4 does not divide them
    with pytest.raises(PlanError, match="must divide") as refused:
        with_context(plan, 4)
    assert refused.value.key == "mesh.context"
    plan = with_context(resolve(cfg.fsdp, cfg.mesh.model_copy(update={"replica": 2}), 8), 4)
    assert (plan.context, plan.rows_split, plan.params) == (4, 2, 4)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return llama_dir(tmp_path_factory.mktemp("context_model") / "model", chat_template=CHAT_TEMPLATE, positions=512)


def _exact(runs: dict, base: str, rel: float = 1e-5) -> None:
    for name, records in runs.items():
        assert len(records) == len(runs[base])
        for got, want in zip(records, runs[base]):
            for key in ("loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=rel), (name, got["step"], key)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.xla
def test_a_split_sequence_trains_packed_chat_as_the_whole_one_and_its_checkpoints_cross_meshes(tmp_path, chat_model):
    """Full fine-tuning of packed chat rows, 2 and 4 ways with fsdp beside (4 devices), then each checkpoint
    resumed on the other mesh."""
    common = ["backend=xla_spmd", "cpu_devices=4", f"model.name={chat_model}", "train.steps=4", "train.seq_len=256",
              "train.global_batch_size=4", "train.lr=1e-3", "train.max_grad_norm=1e6", "data.kind=chat",
              f"data.path={FIXTURES / 'chat.jsonl'}", "checkpoint.every_steps=2", "checkpoint.async=false"]
    ckpt = {name: f"checkpoint.dir={tmp_path / name / 'ckpt'}" for name in ("whole", "two", "four")}
    runs = run_trainings(tmp_path, common, {
        "whole": [ckpt["whole"]], "two": ["mesh.context=2", ckpt["two"]], "four": ["mesh.context=4", ckpt["four"]],
        "two_from_whole": ["mesh.context=2", f"checkpoint.dir={tmp_path / 'a'}",
                           f"checkpoint.resume={tmp_path / 'whole' / 'ckpt' / 'step-00000002'}"],
        "whole_from_four": [f"checkpoint.dir={tmp_path / 'b'}",
                            f"checkpoint.resume={tmp_path / 'four' / 'ckpt' / 'step-00000002'}"]})
    assert "sequences split 2-way" in (tmp_path / "train_runs.log").read_text()
    assert "attention xla_context" in (tmp_path / "train_runs.log").read_text()
    _exact({name: runs[name] for name in ("whole", "two", "four")}, "whole")
    assert [r["step"] for r in runs["two_from_whole"]] == [3, 4]
    _exact({"two_from_whole": runs["two_from_whole"], "whole": runs["whole"][2:]}, "whole")
    _exact({"whole_from_four": runs["whole_from_four"], "four": runs["four"][2:]}, "four")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.torch_version
@pytest.mark.fsdp2
def test_processes_splitting_a_sequence_train_as_one_holding_it_whole(tmp_path, chat_model):
    """torch_fsdp, 4 processes over gloo: packed chat rows split 2 ways (fsdp beside) and 4 ways, LoRA, DPO's
    padded preference rows; a checkpoint of the split run resumed without the axis."""
    common = ["backend=torch_fsdp", f"model.name={chat_model}", "train.steps=3", "train.global_batch_size=4",
              "train.lr=1e-3", "train.max_grad_norm=1e6", "checkpoint.async=false"]
    chat = ["data.kind=chat", f"data.path={FIXTURES / 'chat.jsonl'}", "train.seq_len=256"]
    lora = [*chat, "model.lora.r=4"]
    dpo = ["method=dpo", "data.kind=preference", f"data.path={FIXTURES / 'preference_chat.jsonl'}", "train.seq_len=64"]
    two = ["mesh.context=2", "checkpoint.every_steps=2", f"checkpoint.dir={tmp_path / 'two' / 'ckpt'}"]
    runs = run_trainings(tmp_path, common, {
        "whole": chat, "two": [*chat, *two], "four": [*chat, "mesh.context=4"],
        "whole_from_two": [*chat, f"checkpoint.dir={tmp_path / 'a'}",
                           f"checkpoint.resume={tmp_path / 'two' / 'ckpt' / 'step-00000002'}"],
        "lora": lora, "lora_two": [*lora, "mesh.context=2"], "dpo": dpo, "dpo_four": [*dpo, "mesh.context=4"]},
        nproc=4)
    assert "attention torch_context" in (tmp_path / "train_runs.log").read_text()
    _exact({name: runs[name] for name in ("whole", "two", "four")}, "whole")
    assert [r["step"] for r in runs["whole_from_two"]] == [3]
    _exact({"whole_from_two": runs["whole_from_two"], "whole": runs["whole"][2:]}, "whole")
    _exact({"lora_two": runs["lora_two"], "lora": runs["lora"]}, "lora")
    _exact({"dpo_four": runs["dpo_four"], "dpo": runs["dpo"]}, "dpo")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.xla
def test_a_split_sequence_trains_lora_on_scanned_layers_and_dpo_as_the_whole_one(tmp_path, chat_model):
    common = ["backend=xla_spmd", "cpu_devices=4", f"model.name={chat_model}", "train.steps=3",
              "train.global_batch_size=4", "train.lr=1e-3", "train.max_grad_norm=1e6"]
    lora = ["model.lora.r=4", "fsdp.scan_layers=true", "data.kind=chat", f"data.path={FIXTURES / 'chat.jsonl'}",
            "train.seq_len=256"]
    dpo = ["method=dpo", "data.kind=preference", f"data.path={FIXTURES / 'preference_chat.jsonl'}", "train.seq_len=64"]
    runs = run_trainings(tmp_path, common, {"lora": lora, "lora_two": [*lora, "mesh.context=2"],
                                            "dpo": dpo, "dpo_four": [*dpo, "mesh.context=4"]})
    _exact({"lora_two": runs["lora_two"], "lora": runs["lora"]}, "lora")
    _exact({"dpo_four": runs["dpo_four"], "dpo": runs["dpo"]}, "dpo")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.xla
def test_the_splash_kernel_over_a_split_sequence_computes_the_eager_attention(tmp_path):
    """The TPU's path (jax's splash kernel in a manual SPMD region, its mask data split over the sequence axis),
    interpreted on the CPU, against the eager path: packed rows of two documents, 2 ways, the layers unrolled and
    scanned (the kernel is an op AOTAutograd keeps whole); padded rows (padding as a segment of its own)."""
    done = run_worker("context_kernel.py", str(tmp_path / "run"), cwd=tmp_path)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for path, eager in (("kernel", "eager"), ("kernel scanned", "eager"), ("padded kernel", "padded eager")):
        for key in ("loss", "grad_norm"):
            assert found[path][key] == pytest.approx(found[eager][key], rel=1e-5), (path, key)
    assert found["padded eager"]["loss"] != pytest.approx(found["eager"]["loss"], rel=1e-5)  # another batch


@pytest.mark.e2e
@pytest.mark.xla
def test_the_compiled_axis_does_maxtexts_attention_work_and_moves_each_devices_own_rows(tmp_path):
    """Compiled for a v5p-8 (scanned, checkpointed layers, sequences split 2 ways):
    - the splash backward takes the forward's output and log-sum-exp rather than running the kernel's forward
      again, so a layer runs the forward twice (forward, checkpointing's recompute), dq and dkv once, each
      counted at causal attention's FLOPs from the shapes; the matmuls of the scanned layers once per layer:
      the model's own count (the recompute adds its layers' forward), within what the loss adds;
    - the embedding's looked-up rows reach their devices without any device gathering the whole batch's
      hidden states (XLA did, and sliced its own, for the forward and again for the gradient)."""
    pytest.importorskip("jax")
    from tpu_compiles import traces

    layers, hidden, heads, kv_heads, head, mlp, vocab, tokens, rows = 2, 512, 8, 2, 64, 1024, 2048, 4096, 4
    shape = (f"{{hidden_size: {hidden}, intermediate_size: {mlp}, num_hidden_layers: {layers}, num_attention_heads: "
             f"{heads}, num_key_value_heads: {kv_heads}, vocab_size: {vocab}, max_position_embeddings: {tokens}}}")
    sets = ["model=small-llama", f"model.overrides={shape}", f"train.seq_len={tokens}",
            f"train.global_batch_size={rows}", "fsdp.mixed_precision=bf16", "mesh.context=2", "fsdp.scan_layers=true",
            "fsdp.activation_checkpointing=true"]
    (found,) = traces("v5p-8", *sets, runs=[[]], cwd=tmp_path)
    ran, devices = found["placeholders"]["executed"], found["placeholders"]["devices"]
    # each device: rows * tokens / devices query positions against whole sequences of keys, causal
    causal = 2 * 2 * (rows * tokens // devices) * tokens * heads * head / 2
    assert ran["attention forward"] == pytest.approx(2 * layers * causal)
    assert ran["attention dq"] == pytest.approx(1.5 * layers * causal)
    assert ran["attention dkv"] == pytest.approx(2 * layers * causal)
    per_layer = 2 * hidden * heads * head + 2 * hidden * kv_heads * head + 3 * hidden * mlp
    positions = rows * tokens / devices
    model = 2 * positions * (layers * per_layer + vocab * hidden)
    # the recompute needs no layer's last projection (its output is the next checkpoint, kept): XLA drops it
    recompute = 2 * positions * layers * (per_layer - hidden * mlp)
    assert 3 * model + recompute <= ran["matmuls"] <= 1.02 * (3 * model + recompute + 2 * positions * layers * hidden
                                                              * mlp)
    whole_batch = rows * tokens * hidden
    assert all(math.prod(dims) < whole_batch for dims in found["placeholders"]["all_gathered"])


def test_the_longest_sequence_search_tries_the_axis_sizes_the_batch_allows():
    from xla_shard.aot.run import context_sizes

    cfg = config.load(None, ["model.name=tiny-llama", "train.global_batch_size=4"])
    assert context_sizes(cfg, 32) == [8, 16, 32]  # 4 rows split over 32 / c devices
    cfg = config.load(None, ["model.name=tiny-llama", "train.global_batch_size=8", "train.grad_accum_steps=2",
                             "fsdp.sharding_strategy=HYBRID_SHARD", "mesh.replica=2"])
    assert context_sizes(cfg, 8) == [2, 4]  # inside the 4 devices a parameter spans, 4-row micro-batches
    # what the config itself refuses is not tried: GRPO generates whole sequences
    grpo = config.load(None, ["model.name=tiny-llama", "method=grpo", "train.global_batch_size=8",
                              "train.seq_len=512", "data.kind=prompt", f"data.path={FIXTURES / 'prompts.jsonl'}",
                              f"grpo.reward_funcs=[{FIXTURES / 'rewards.py'}:short]"])
    assert context_sizes(grpo, 8) == [1]


def test_the_cost_model_prices_the_sequence_axis():
    from xla_shard.planner.cost import Workload, collectives, memory
    from xla_shard.plan import Triple

    work = Workload(params=8_000_000, units=4, flops_per_token=1.0, tokens_per_device=8192, layers=4, hidden=512,
                    seq_len=65536, compute_bytes=2, activation_checkpointing=True, kv_width=128, context=8)
    kv = 2 * 128 * 8 * 8192 * 2  # keys and values of this device's row, whole along the axis
    found = {x.name: x for x in collectives(work, Triple(32, 32, 32), 32)}
    assert found["context_kv"].size == 8 and found["context_kv"].tensor_bytes == 3 * 4 * kv
    assert found["context_kv_grads"].op == "reduce-scatter"  # torch_fsdp's; on the TPU an all-to-all, then a sum
    compiled = Workload(**{**work.__dict__, "tpu_compiler": True})
    assert {x.name: x for x in collectives(compiled, Triple(32, 32, 32), 32)}["context_kv_grads"].op == "all-to-all"
    assert memory(work, Triple(32, 32, 32), 32)["context"] == 2 * kv
    plain = Workload(**{**work.__dict__, "context": 1})
    assert "context_kv" not in {x.name for x in collectives(plain, Triple(32, 32, 32), 32)}


def test_a_model_the_split_sequence_cannot_hold_is_refused_where_every_loaded_model_is_checked():
    """The sequence axis's refusals of a model are `pretrained.check_model`'s, which the run's preflight calls on
    the meta model before any process starts (and a backend again where it splits the sequence): sliding-window
    attention, and a loss that cannot be scored per piece of the sequence."""
    from model_dirs import family_model

    from xla_shard.pretrained import check_model

    cfg = config.load(None, ["model.name=tiny-llama", "train.seq_len=64", "mesh.context=2"])
    llama = family_model("llama")
    check_model(cfg, llama)  # attends to every earlier position; its loss is scored in chunks
    with pytest.raises(ConfigError, match="sliding windows or chunks") as refused:
        check_model(cfg, family_model("gemma2"))
    assert refused.value.key == "mesh.context"

    class Clamped(type(llama)):
        def forward(self, input_ids=None, labels=None, **kwargs):  # a tail the chunked loss does not know
            logits = self.lm_head(self.model(input_ids=input_ids, **kwargs).last_hidden_state)
            logits = logits.clamp(-5, 5)
            loss = None
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
            return loss, logits

    llama.__class__ = Clamped
    with pytest.raises(ConfigError, match="scored per piece of the split sequence, and Clamped"):
        check_model(cfg, llama)
    check_model(config.load(None, ["model.name=tiny-llama", "train.seq_len=64"]), llama)  # no axis, no refusal
