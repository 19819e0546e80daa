"""Mixture-of-experts checkpoints: files that store one tensor per expert load, shard by shard, into the fused
expert parameters transformers 5 builds, bitwise as `from_pretrained` builds them, on every backend; the export
loads back with `from_pretrained` to the same weights."""

import json
import math

import pytest
import torch
from conftest import FIXTURES, backend_params, run_cli, run_in_process, run_load_probe, run_worker, runnable
from model_dirs import MOE_FAMILIES, assemble, stored_tensors
from transformers import AutoModelForCausalLM

from xla_shard import config
from xla_shard.checkpoint.fused import Fused
from xla_shard.data import build
from xla_shard.errors import ConfigError
from xla_shard.pretrained import build_for

pytestmark = pytest.mark.torch_version  # its subject depends on torch's version

BACKENDS = {
    "xla_spmd": (["backend=xla_spmd", "cpu_devices=4"], 0),
    "xla_fsdp": (["backend=xla_fsdp", "cpu_devices=1"], 0),
    "torch_fsdp": (["backend=torch_fsdp"], 2),
}
DATA = [f"data.path={FIXTURES / 'corpus.jsonl'}", "train.seq_len=32"]


def plain(directory):
    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", use_cache=False).eval()


def test_a_box_of_a_fused_parameter_is_read_from_the_pieces_of_the_experts_it_spans():
    fused = Fused("gate_up", (3, 8, 5), dim=1, sources=[{e: f"gate{e}" for e in range(3)},
                                                         {e: f"up{e}" for e in range(3)}], lengths=[4, 4])
    # experts 1-2, rows 2..6 (gate rows 2-3, up rows 0-1), columns 1..4
    assert fused.pieces(((1, 2, 1), (2, 4, 3))) == [
        [("gate1", ((2, 1), (2, 3))), ("up1", ((0, 1), (2, 3)))],
        [("gate2", ((2, 1), (2, 3))), ("up2", ((0, 1), (2, 3)))],
    ]
    assert fused.pieces(((0, 4, 0), (1, 4, 5))) == [[("up0", ((0, 0), (4, 5)))]]  # only the up half


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_every_moe_family_is_matched_expert_by_expert(moe_dirs, family):
    model, weights, _ = build_for(config.load(None, [f"model.name={moe_dirs[family]}"]))
    fused = {n for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3}
    assert fused and all(weights.names[n].startswith("fused:") for n in fused)
    experts = model.config.num_local_experts if family == "mixtral" else model.config.num_experts
    assert all(len(source) == experts for f in weights.fused.values() for source in f.sources)


def test_a_missing_expert_is_refused_naming_it(moe_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for file in moe_dirs["qwen3_moe"].iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="no stored tensor for expert 2"):
        build_for(config.load(None, [f"model.name={broken}"]))


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(list(BACKENDS)))
def test_moe_experts_load_bitwise_and_give_from_pretrained_loss(moe_dirs, tmp_path, backend):
    sets, nproc = runnable(BACKENDS)[backend]
    for family in ("mixtral", "qwen3_moe"):
        directory = moe_dirs[family]
        loaded = run_load_probe(tmp_path / f"{backend}-{family}", f"model.name={directory}", *DATA, *sets,
                                nproc=nproc)
        want = plain(directory)
        held = assemble(loaded)
        different = [n for n, v in want.state_dict().items() if not torch.equal(held[n], v)]
        assert not different, (family, backend, different)
        cfg = config.load(None, [f"model.name={directory}", *DATA])
        with torch.no_grad():
            loss = want(**build(cfg, want.config, str(directory)).train.global_batch(0)).loss.item()
        assert math.isclose(loaded[0]["loss"], loss, rel_tol=1e-6), (family, backend, loaded[0]["loss"], loss)
        reads = [(p["report"]["bytes_read"], p["report"]["bytes_stored"]) for p in loaded]
        # one process per host reads every byte once; two torchrun processes each read about half
        assert all((read == stored) if not nproc else (read < 0.75 * stored) for read, stored in reads), reads


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_experts_are_exported_one_tensor_per_expert_as_save_pretrained_stores_them(moe_dirs, family):
    """Each family's fused expert parameters, cut as the export cuts them, are the model directory's own tensors
    (which save_pretrained wrote) under their names; every other tensor is written as held."""
    from xla_shard.checkpoint import per_expert

    model = plain(moe_dirs[family])
    params = {f"model/{name}": value for name, value in model.named_parameters()}
    pieces = per_expert.pieces(model, list(params), {name: tuple(v.shape) for name, v in params.items()})
    stored = stored_tensors(moe_dirs[family])
    assert sorted(piece.key for piece in pieces) == sorted(stored)
    assert any(piece.expert is not None for piece in pieces)
    for piece in pieces:
        assert torch.equal(piece.cut(params[piece.source].detach()), stored[piece.key]), piece


@pytest.mark.fsdp2
@pytest.mark.e2e
@pytest.mark.slow
def test_a_moe_fine_tune_exports_what_from_pretrained_loads(moe_dirs, tmp_path, capsys):
    out = tmp_path / "run"
    sets = [f"model.name={moe_dirs['olmoe']}", *DATA, "backend=torch_fsdp", "train.steps=2",
            f"output_dir={out}", f"checkpoint.dir={out}/ckpt", "fsdp.state_dict_type=FULL_STATE_DICT"]
    done = run_cli("train", *[a for s in sets for a in ("--set", s)], "--nproc-per-node", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    # The run's export is laid out as the model directory it started from (one tensor per expert) ...
    assert stored_tensors(out / "model").keys() == stored_tensors(moe_dirs["olmoe"]).keys()
    exported = plain(out / "model").state_dict()
    # ... and, on request, as the model holds its experts (fused): both load to the same weights.
    done = run_in_process(capsys, "ckpt", "export", str(out / "ckpt"), "--to", str(tmp_path / "fused"),
                          "--fused-experts")
    assert done.returncode == 0, done.stderr
    fused = stored_tensors(tmp_path / "fused")
    assert fused.keys() == exported.keys()
    assert all(torch.equal(exported[name], value) for name, value in fused.items())
    before = plain(moe_dirs["olmoe"]).state_dict()
    assert not torch.equal(exported["model.layers.0.mlp.experts.gate_up_proj"],
                           before["model.layers.0.mlp.experts.gate_up_proj"])  # trained
    assert json.loads((out / "model" / "config.json").read_text())["model_type"] == "olmoe"


@pytest.mark.fsdp2
@pytest.mark.e2e
def test_the_router_load_balancing_loss_is_added_when_the_config_asks(moe_dirs, tmp_path):
    """model.overrides output_router_logits: transformers adds router_aux_loss_coef x the load-balancing loss to
    the loss (on one process: as plain transformers)."""
    directory, aux = moe_dirs["mixtral"], {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    sets = [f"model.name={directory}", *DATA, f"model.overrides={json.dumps(aux)}", "train.global_batch_size=4"]
    loaded = run_load_probe(tmp_path / "aux", *sets, "backend=torch_fsdp", nproc=1)
    want = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", use_cache=False, **aux).eval()
    cfg = config.load(None, sets)
    with torch.no_grad():
        out = want(**build(cfg, want.config, str(directory)).train.global_batch(0))
    assert out.aux_loss > 0 and math.isclose(loaded[0]["loss"], out.loss.item(), rel_tol=1e-6)


@pytest.mark.xla
def test_torch_xla_backends_refuse_the_router_loss_naming_it(moe_dirs):
    from xla_shard import backends

    cfg = config.load(None, [f"model.name={moe_dirs['mixtral']}", "backend=xla_spmd", "cpu_devices=1",
                             'model.overrides={"output_router_logits": true}'])
    with pytest.raises(ConfigError) as raised:
        build_for(cfg, capabilities=backends.create(cfg).capabilities)
    assert (raised.value.key, raised.value.backend) == ("model.overrides.output_router_logits", "xla_spmd")
    assert "histc" in str(raised.value) and "backend torch_fsdp, which adds it" in str(raised.value)


def test_a_router_loss_under_the_sequence_axis_is_refused_when_the_model_is_built(moe_dirs):
    """Summed over each device's piece of a sequence it would not be the row's: refused by the build that
    `config check` runs too, not first by the wrap that `train` runs."""
    from xla_shard import backends

    cfg = config.load(None, [f"model.name={moe_dirs['mixtral']}", "backend=torch_fsdp", "mesh.context=2",
                             "train.seq_len=64", 'model.overrides={"output_router_logits": true}'])
    with torch.device("meta"), pytest.raises(ConfigError, match="router loss") as raised:
        build_for(cfg, capabilities=backends.create(cfg).capabilities)
    assert raised.value.key == "mesh.context"


@pytest.mark.xla
@pytest.mark.e2e
def test_grouped_matmul_experts_compute_what_transformers_batched_mm_does(moe_dirs, tmp_path):
    """On a TPU, torch_xla's MoE experts run as grouped matmuls (jax's Megablox kernel; interpreted here): for
    every MoE family, one forward and backward under SPMD over 2 devices (FSDP's layout: experts split, tokens
    split) and on one device give transformers' batched_mm loss and gradients, the experts' included; so do
    bare experts of both weight layouts ([experts, out, in] and Aria's [experts, in, out], whose SiLU is not its
    config's hidden_act)."""
    done = run_worker("moe_experts.py", "modules", "2", cwd=tmp_path)
    modules = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [m["module"] for m in modules] == ["Qwen3MoeExperts", "AriaExperts"]
    for module in modules:
        assert max(module["worst"].values()) < 1e-5, module
    for devices, families in ((2, MOE_FAMILIES), (1, ["qwen3_moe"])):
        done = run_worker("moe_experts.py", "grads", str(devices), *(str(moe_dirs[f]) for f in families),
                          cwd=tmp_path)
        results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        assert len(results) == len(families)
        for family, result in zip(families, results):
            want, got = result["losses"]
            assert math.isclose(got, want, rel_tol=1e-6), (devices, family, result)
            assert result["grads"] and result["experts_grads"] and result["worst"] < 1e-5, (devices, family, result)


@pytest.mark.xla
@pytest.mark.e2e
def test_grouped_matmul_experts_train_scanned_layers_as_batched_mm_does(moe_dirs, tmp_path):
    """The grouped experts are ops the scanned layer's trace (AOTAutograd) keeps whole, each a manual SPMD
    region inside XLA's layer loop: `xla-shard train` with scan_layers on xla_spmd over 2 devices takes the
    same steps with them as with batched_mm."""
    sets = [f"model.name={moe_dirs['qwen3_moe']}", *DATA, "backend=xla_spmd", "cpu_devices=2", "train.steps=2",
            "train.global_batch_size=4", "fsdp.scan_layers=true", "model.attn_implementation=eager"]
    for name, run in (("batched", run_cli), ("grouped", None)):
        args = ["--set", f"output_dir={tmp_path / name}", *(a for s in sets for a in ("--set", s))]
        if run:
            assert run("train", *args).returncode == 0
        else:
            run_worker("moe_experts.py", "train", *args, cwd=tmp_path)
    want, got = ([json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
                 for name in ("batched", "grouped"))
    assert len(want) == 2 and got == pytest.approx(want, rel=1e-6)


def test_experts_the_grouped_kernel_does_not_compute_run_as_batched_mm_and_say_so():
    """GPT-OSS's experts (biases, an interleaved gate with its own clamp) are not what the grouped path
    computes: asked for it, they run transformers' batched_mm, the same result, with one warning naming them.
    Where the grouped path runs at all: a torch_xla backend on a TPU (or traced for one)."""
    from transformers import GptOssConfig
    from transformers.integrations.moe import batched_mm_experts_forward
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from xla_shard import experts

    experts.register()
    module = GptOssExperts(GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4))
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.1)
    module.config._experts_implementation = experts.XLA_GMM
    hidden, index, route = torch.randn(6, 32), torch.randint(0, 4, (6, 2)), torch.rand(6, 2)
    with pytest.warns(UserWarning, match="GptOssExperts .*batched_mm runs instead"):
        out = module(hidden, index, route)
    assert torch.equal(out, batched_mm_experts_forward(module, hidden, index, route))
    assert experts.choose("batched_mm", "tpu") == experts.XLA_GMM
    assert experts.choose("batched_mm", "cpu") == "batched_mm"
    assert experts.choose(None, "tpu") is None  # not a torch_xla backend: transformers' own choice
