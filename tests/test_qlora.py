"""QLoRA (`model.quantization`): LoRA over a base held in bitsandbytes' 4-bit format, computed as bitsandbytes
computes it (its CPU build, the real thing) and trained as peft trains it over a bitsandbytes base."""

import json

import pytest
import torch
from conftest import FIXTURES, run_cli, run_in_process
from transformers import AutoModelForCausalLM

from xla_shard import config
from xla_shard.errors import ConfigError
from xla_shard.pretrained import build_for
from xla_shard.quant.linear4bit import Linear4bit

bnb = pytest.importorskip("bitsandbytes")
from bench.bnb_reference import hold_bitsandbytes_to_its_reference  # noqa: E402

hold_bitsandbytes_to_its_reference()

QLORA = ["model.lora.r=4", "model.lora.alpha=8", "model.quantization.bnb_4bit_quant_type=nf4"]


@pytest.fixture(autouse=True)
def _no_dynamo():
    """bitsandbytes compiles some CPU paths with torch.compile: minutes on this machine for nothing tested."""
    with torch._dynamo.config.patch(disable=True):
        yield


def _bitsandbytes_layer(weight, bias, kind, nested, compute):
    layer = bnb.nn.Linear4bit(weight.shape[1], weight.shape[0], bias=True, compute_dtype=compute, quant_type=kind,
                              compress_statistics=nested)
    layer.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type=kind,
                                     compress_statistics=nested).to("cpu")
    layer.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
    return layer


def _scales(state) -> torch.Tensor:
    if not state.nested:
        return state.absmax
    return bnb.functional.dequantize_blockwise(state.absmax, state.state2) + state.offset


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True], ids=["single", "double"])
@pytest.mark.parametrize("given, compute", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                            (torch.float32, torch.bfloat16)],
                         ids=["fp32", "bf16-in-fp32", "fp32-in-bf16"])
def test_a_4bit_layer_computes_and_backpropagates_as_bitsandbytes_linear4bit(kind, nested, given, compute):
    """From bitsandbytes' own quantized state: the output and the input's gradient are its Linear4bit's (as
    transformers builds it, given bnb_4bit_compute_dtype), bit for bit, whatever the input's dtype."""
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 128, generator=generator), torch.randn(48, generator=generator)
    theirs = _bitsandbytes_layer(weight, bias, kind, nested, compute).train()
    ours = Linear4bit(128, 48, True, kind, nested, torch.float32, compute)
    with torch.no_grad():
        ours.weight_packed.copy_(theirs.weight.data.view(ours.weight_packed.shape))
        ours.weight_scales.copy_(_scales(theirs.weight.quant_state).float().view(torch.uint8).view(-1, 4))
        ours.bias.copy_(bias)
    if not nested:  # the same bytes from the weight (double quantization's: tests/test_quant.py)
        ours_again = Linear4bit(128, 48, True, kind, nested, torch.float32)
        ours_again.set_weight(weight)
        assert torch.equal(ours_again.weight_packed, ours.weight_packed)
        assert torch.equal(ours_again.weight_scales, ours.weight_scales)
    x = torch.randn(3, 5, 128, generator=generator).to(given)
    out = {}
    for name, layer in (("ours", ours), ("theirs", theirs)):
        leaf = x.clone().requires_grad_()
        y = layer(leaf)
        (y.float() * torch.linspace(-1, 1, 48)).sum().backward()
        out[name] = (y, leaf.grad)
    assert out["ours"][0].dtype == given
    assert torch.equal(out["ours"][0], out["theirs"][0]) and torch.equal(out["ours"][1], out["theirs"][1])


def test_the_scales_bytes_read_back_as_the_very_floats():
    """`floats` (arithmetic, so XLA traces it) gives back each fp32 from its bytes bit for bit: signs, zeros,
    subnormals, the largest."""
    from xla_shard.quant.linear4bit import floats

    values = torch.cat([torch.randn(4096) * 10.0 ** torch.randint(-30, 30, (4096,)),
                        torch.tensor([0.0, -0.0, 1e-40, -3e-39, 1.0, 3.4e38, 1.17549435e-38])])
    assert torch.equal(floats(values.view(torch.uint8).view(-1, 4)).view(torch.int32), values.view(torch.int32))


def test_the_layers_transformers_keeps_whole_stay_whole_and_the_rest_hold_4_bits(model_dirs):
    """The output head stays as it is; every other linear layer's base is a 4-bit layer whose uint8 parameters
    are [blocks, ...] (FSDP shards them on block boundaries); the adapters train, nothing else."""
    cfg = config.load(None, [f"model.name={model_dirs.llama}", *QLORA, "model.init=random"])
    model, _, _ = build_for(cfg)
    four_bit = {n: m for n, m in model.named_modules() if isinstance(m, Linear4bit)}
    assert four_bit and all(n.endswith(".base_layer") for n in four_bit)
    assert isinstance(model.lm_head, torch.nn.Linear)
    plain = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and ".lora_" not in n]
    assert plain == ["lm_head"]
    for layer in four_bit.values():
        blocks = layer.in_features * layer.out_features // 64
        assert layer.weight_packed.shape == (blocks, 32) and layer.weight_scales.shape == (blocks, 4)
        assert layer.weight_packed.dtype == layer.weight_scales.dtype == torch.uint8
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if ".lora_" in n}
    # transformers' rule: a list of its own replaces the default skips, so the output head is quantized too
    skip = config.load(None, [f"model.name={model_dirs.llama}", *QLORA, "model.init=random",
                              "model.quantization.llm_int8_skip_modules=[v_proj]"])
    skipped = dict(build_for(skip)[0].named_modules())
    assert not any(isinstance(m, Linear4bit) for n, m in skipped.items() if "v_proj" in n)
    assert isinstance(skipped["lm_head"], Linear4bit) and isinstance(skipped[next(iter(four_bit))], Linear4bit)


@pytest.mark.parametrize("sets, key, words", [
    ([], "model.quantization", "set model.lora"),
    (["model.lora.r=4", "model.lora.use_dora=true"], "model.lora.use_dora", "DoRA over a 4-bit base"),
    (["model.lora.r=4", "model.quantization.load_in_4bit=false"], "model.quantization.load_in_4bit", "4 bits only"),
    (["model.lora.r=4", "model.quantization.load_in_8bit=true"], "model.quantization.load_in_8bit", ""),
])
def test_a_quantized_base_without_adapters_or_with_what_it_lacks_is_refused(sets, key, words):
    with pytest.raises(ConfigError) as raised:
        config.load(None, ["model.quantization.bnb_4bit_quant_type=nf4", *sets])
    assert key in str(raised.value) and words in str(raised.value)


def test_a_resume_under_other_quantization_is_refused_and_an_older_checkpoint_was_unquantized():
    """The adapters were trained over one base's values: another quantization (or none) would resume them over
    another; a checkpoint written before model.quantization existed resumes an unquantized run only."""
    import types

    from xla_shard.checkpoint.run_record import changed_identity

    def written_with(*sets, drop=False):
        saved = config.load(None, list(sets)).model_dump(mode="json", by_alias=True)
        if drop:
            del saved["model"]["quantization"]
        return types.SimpleNamespace(data={"config": saved}, url="ckpt/step-1")

    nf4, lora = config.load(None, QLORA).run_identity(), ["model.lora.r=4", "model.lora.alpha=8"]
    assert changed_identity(written_with(*QLORA), nf4) is None
    for before in (written_with(*lora, "model.quantization.bnb_4bit_quant_type=fp4"), written_with(*lora),
                   written_with(*lora, drop=True)):
        assert changed_identity(before, nf4)[0] == "model.quantization"
    assert changed_identity(written_with(*lora, drop=True), config.load(None, lora).run_identity()) is None


@pytest.mark.parametrize("nested", [False, True], ids=["single", "double"])
def test_a_share_of_blocks_is_read_from_its_rows_alone_and_equals_the_whole_weights(nested):
    """A process holding blocks [first, first + count) reads the weight's rows that hold them (a block's scale is
    its own), and gets the very bytes the whole weight's quantization has there; double quantization scales the
    blocks' scales around their mean, so it reads the weight whole."""
    import types

    from xla_shard.quant.linear4bit import quantized_parts
    from xla_shard.quant.model import QuantReader, Source

    weight = torch.randn(12, 128, generator=torch.Generator().manual_seed(0))  # 2 blocks a row, 24 in all

    class Rows:
        def __init__(self):
            self.bytes_read, self.asked = 0, []

        def read(self, requests):
            self.asked += [box for _, box in requests]
            return [weight[tuple(slice(o, o + n) for o, n in zip(*box))] for _, box in requests]

    inner = Rows()
    manifest = types.SimpleNamespace(tensors={"w": {"shape": [12, 128]}})
    reader = QuantReader(inner, {f"p/{part}": Source("w", part, "nf4", nested)
                                 for part in ("weight_packed", "weight_scales")}, manifest)
    whole = dict(zip(("weight_packed", "weight_scales"), quantized_parts(weight, "nf4", nested)))
    for first, count in ((0, 12), (5, 9), (23, 1)):
        got = reader.read([(f"p/{part}", ((first, 0), (count, whole[part].shape[1]))) for part in whole])
        for part, value in zip(whole, got):
            assert torch.equal(value, whole[part][first:first + count]), (part, first, count)
    assert inner.asked == ([((0, 0), (12, 128))] if nested else
                           [((0, 0), (6, 128)), ((2, 0), (5, 128)), ((11, 0), (1, 128))])


@pytest.fixture(scope="module")
def four_bit_dirs(model_dirs, tmp_path_factory):
    """The test Llama saved 4-bit by transformers + bitsandbytes, nf4 single and double."""
    from model_dirs import four_bit_dir

    root = tmp_path_factory.mktemp("four_bit")
    return {nested: four_bit_dir(root / f"nested{int(nested)}", model_dirs.llama, nested) for nested in (False, True)}


@pytest.mark.parametrize("nested", [False, True], ids=["single", "double"])
def test_a_directory_saved_in_4_bits_reads_as_bitsandbytes_stored_it(model_dirs, four_bit_dirs, nested):
    """Every 4-bit parameter read from transformers' 4-bit save, for any share of blocks, is bitsandbytes'
    quantization of the full-precision weight: its packed bytes, and each block's scale as its state gives it
    back (double quantization: the 8-bit codes through the nested absmax, plus the offset)."""
    from safetensors.torch import load_file

    from xla_shard.checkpoint import hf_dir
    from xla_shard.checkpoint.reader import ChunkReader
    from xla_shard.io.storage import Storage
    from xla_shard.quant.model import PARTS, QuantReader, Source, stored_four_bit

    storage = Storage(str(four_bit_dirs[nested]))
    manifest = hf_dir.read_manifest(storage)
    full = {f"model/{k}": v for f in model_dirs.llama.glob("*.safetensors") for k, v in load_file(f).items()}
    stored = stored_four_bit(manifest.tensors)
    assert sorted(stored) == sorted(n for n in full if "_proj." in n)  # the output head kept whole
    for name in stored:
        packed, state = bnb.functional.quantize_4bit(full[name], quant_type="nf4", compress_statistics=nested)
        scales = _scales(state) if nested else state.absmax
        whole = {"weight_packed": packed.view(-1, 32), "weight_scales": scales.float().view(torch.uint8).view(-1, 4)}
        reader = QuantReader(ChunkReader(storage, manifest), {p: Source(name, p, "nf4", nested, True) for p in PARTS},
                             manifest)
        blocks = whole["weight_scales"].shape[0]
        for first, count in ((0, blocks), (3, blocks // 2)):
            got = reader.read([(p, ((first, 0), (count, whole[p].shape[1]))) for p in PARTS])
            for part, value in zip(PARTS, got):
                assert torch.equal(value, whole[part][first:first + count]), (name, part, first, count)


def test_a_directory_saved_in_4_bits_is_refused_unless_the_run_reads_it_as_it_is(model_dirs, four_bit_dirs, tmp_path):
    """Its quantization is said up front (4-bit weights are not quantized again), and a layer it stores in 4
    bits that the run would keep whole is named."""
    from model_dirs import four_bit_dir

    base = [f"model.name={four_bit_dirs[True]}", "model.lora.r=4"]
    for sets, words in (([], "model.quantization={bnb_4bit_quant_type: nf4, bnb_4bit_use_double_quant: true}"),
                        (["model.quantization.bnb_4bit_quant_type=nf4"], "not quantized again")):
        with pytest.raises(ConfigError, match="saved in 4 bits") as refused:
            build_for(config.load(None, [*base, *sets]))
        assert refused.value.key == "model.quantization" and words in str(refused.value)
    skipped = four_bit_dir(tmp_path / "skipped", model_dirs.llama, False, skip=["lm_head", "q_proj"])
    with pytest.raises(ConfigError, match="layers.0.mlp.down_proj.weight in 4 bits, which this run keeps whole"):
        build_for(config.load(None, [f"model.name={skipped}", "model.lora.r=4",
                                     "model.quantization={bnb_4bit_quant_type: nf4, llm_int8_skip_modules: "
                                     "[lm_head, down_proj]}"]))


def test_a_model_of_conv1d_layers_is_refused_rather_than_left_whole():
    """GPT-2's layers are transformers' Conv1D, which transformers quantizes (transposed): left whole here, the
    run would quietly differ from transformers'."""
    with pytest.raises(ConfigError) as raised:
        build_for(config.load(None, ["model=tiny-gpt2", "model.init=random", *QLORA]))
    assert raised.value.key == "model.quantization" and "Conv1D" in str(raised.value)


def test_the_planner_holds_the_4bit_layers_at_four_and_a_half_bits(model_dirs):
    """The frozen base's bytes per weight: 4 bits and a 64-weight block's fp32 scale for the layers held in 4
    bits, the base dtype for the rest (embeddings, norms, the output head)."""
    from xla_shard import backends, planner
    from xla_shard.aot import target

    sets = [f"model.name={model_dirs.llama}", "model.lora.r=4", "model.init=random"]
    chip = target.parse("v5p-8").chip
    plain, four_bit = (planner.workload(config.load(None, [*sets, *extra]), 4, backends.capabilities("xla_spmd"), chip)
                       for extra in ([], ["model.quantization.bnb_4bit_quant_type=nf4"]))
    model = AutoModelForCausalLM.from_pretrained(model_dirs.llama)
    linear = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and n != "lm_head")
    frozen = four_bit.params - four_bit.trained
    assert plain.frozen_bytes == 4
    assert four_bit.frozen_bytes * frozen == pytest.approx(linear * 0.5625 + (frozen - linear) * 4)


def test_backends_that_do_not_run_a_4bit_base_refuse_it_naming_the_backend():
    """torch_tpu (not verified yet), and torch_fsdp on a torch whose FSDP2 cannot hold integer parameters."""
    from xla_shard import backends

    refusing = {"torch_tpu": "not verified"}
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 13):
        refusing["torch_fsdp"] = "torch 2.13"
    for backend, words in refusing.items():
        with pytest.raises(ConfigError) as raised:
            backends.capabilities(backend).check(config.load(None, [f"backend={backend}", *QLORA]))
        assert (raised.value.key, raised.value.backend) == ("model.quantization", backend)
        assert words in str(raised.value)
    assert backends.capabilities("torch_fsdp").trains(config.load(None, QLORA)) == ("torch_fsdp" not in refusing)
    assert backends.capabilities("xla_spmd").trains(config.load(None, QLORA))


BACKENDS = {"torch_fsdp": (["backend=torch_fsdp"], 2), "xla_spmd": (["backend=xla_spmd", "cpu_devices=2"], 0)}


@pytest.mark.torch_version  # torch_fsdp's runs on the newest torch (its FSDP2 holds integer parameters)
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("backend, nested", [
    ("torch_fsdp", False),  # double quantization differs from single in the scales' values alone: once is enough
    pytest.param("xla_spmd", False, marks=pytest.mark.xla), pytest.param("xla_spmd", True, marks=pytest.mark.xla)],
    ids=["torch_fsdp-single", "xla_spmd-single", "xla_spmd-double"])
def test_qlora_follows_peft_over_a_bitsandbytes_base(model_dirs, four_bit_dirs, tmp_path, capsys, backend, nested):
    """Two devices (FSDP2 over gloo; SPMD), the 4-bit base sharded by block and read quantized shard by shard,
    train 3 SGD steps with the losses of peft over transformers' bitsandbytes base, from the same adapters; on
    XLA the step compiles once (the scales' bytes read back by arithmetic, not through the host), and the layers
    as one scanned loop give the same losses, as does the model saved 4-bit by transformers (read as stored). A
    run stopped after step 2 resumes to the same step 3, and its exports are the model peft trained: the adapter
    onto the bitsandbytes base, the merge in full precision."""
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig

    from conftest import sgd_losses
    from xla_shard.data import build

    sets, nproc = BACKENDS[backend]
    args = [f"model.name={model_dirs.llama}", f"data.path={FIXTURES / 'corpus.jsonl'}", "train.seq_len=32",
            "train.optimizer=sgd", "train.lr=1.0", *sets, *QLORA,
            f"model.quantization.bnb_4bit_use_double_quant={str(nested).lower()}"]
    out = tmp_path / "run"
    done = run_cli("train", *[a for s in [*args, f"output_dir={out}", "train.steps=3"] for a in ("--set", s)],
                   *(["--nproc-per-node", str(nproc)] if nproc else []))
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    got = [r["loss"] for r in records]
    assert "recompiles" not in records[-1]  # XLA: no graph compiled after the second step
    if backend == "xla_spmd" and nested:  # the layers as one scanned loop: each its own tables, the same losses
        scan = [*args, f"output_dir={tmp_path / 'scan'}", "train.steps=3", "fsdp.scan_layers=true"]
        done = run_cli("train", *[a for s in scan for a in ("--set", s)])
        assert done.returncode == 0, done.stderr[-3000:]
        scanned = [json.loads(line)["loss"] for line in (tmp_path / "scan" / "metrics.jsonl").read_text().splitlines()]
        assert scanned == pytest.approx(got, rel=1e-6), (scanned, got)
        # the same model saved 4-bit by transformers: its bytes read as stored, the same training
        saved = [*args, f"model.name={four_bit_dirs[True]}", f"output_dir={tmp_path / 'saved'}", "train.steps=3",
                 f"checkpoint.dir={tmp_path / 'saved_ckpt'}"]
        done = run_cli("train", *[a for s in saved for a in ("--set", s)])
        assert done.returncode == 0, done.stderr[-3000:]
        read = [json.loads(line)["loss"] for line in (tmp_path / "saved" / "metrics.jsonl").read_text().splitlines()]
        assert read == pytest.approx(got, rel=1e-6), (read, got)
        step = tmp_path / "saved_ckpt" / "step-00000003"
        adapter = run_in_process(capsys, "ckpt", "export", str(step), "--to", str(tmp_path / "saved_adapter"))
        assert adapter.returncode == 0, adapter.stderr[-2000:]
        merge = run_in_process(capsys, "ckpt", "export", str(step), "--to", str(tmp_path / "merged"), "--merge")
        assert merge.returncode != 0 and "stores its weights in 4 bits" in merge.stderr, merge.stderr[-2000:]
    if not nested:  # stopped after step 2 and resumed: the base quantized again as it is read, step 3 the same
        stop = [*args, f"output_dir={tmp_path / 'stop'}", f"checkpoint.dir={tmp_path / 'ckpt'}",
                "checkpoint.every_steps=2"]
        for steps in (2, 3):
            done = run_cli("train", *[a for s in [*stop, f"train.steps={steps}"] for a in ("--set", s)],
                           *(["--nproc-per-node", str(nproc)] if nproc else []))
            assert done.returncode == 0, done.stderr[-3000:]
        assert "resumed the trained parameters; the frozen weights read from" in done.stderr
        resumed = [json.loads(line) for line in (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()]
        assert resumed[-1]["step"] == 3 and resumed[-1]["loss"] == got[2], (resumed, got)

    cfg = config.load(None, args)
    _, weights, _ = build_for(cfg)
    base = AutoModelForCausalLM.from_pretrained(
        model_dirs.llama, attn_implementation="eager", use_cache=False, dtype=torch.float32,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_use_double_quant=nested))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    adapters = {f"base_model.model.{k}": v for k, v in weights.fresh.items()}
    assert not model.load_state_dict(adapters, strict=False).unexpected_keys
    want = sgd_losses(model, build(cfg, base.config, str(model_dirs.llama)).train, cfg.train.lr, 3)
    plain = AutoModelForCausalLM.from_pretrained(model_dirs.llama, attn_implementation="eager", use_cache=False)
    full = sgd_losses(get_peft_model(plain, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")),
                      build(cfg, plain.config, str(model_dirs.llama)).train, cfg.train.lr, 1)
    assert got == pytest.approx(want, rel=1e-5), (got, want)  # measured within 1e-7, both ways
    # the log counts the weights a 4-bit layer stands for, not its bytes
    assert f"of {sum(p.numel() for p in plain.parameters()):,} parameters trained" in log
    assert "of them in 4 bits: model.quantization" in log
    assert want[-1] < want[0] and abs(want[0] - full[0]) > 1e-4  # the 4-bit base is not the fp32 one
    if not nested:
        _exports_are_the_model_peft_trained(model, model_dirs.llama, tmp_path / "ckpt", tmp_path / "export", capsys)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_qlora_on_an_moe_model_follows_peft_over_a_bitsandbytes_base(moe_dirs, tmp_path, family):
    """An MoE model: the layers transformers quantizes (attention, a shared expert's linears; not the fused
    experts nor the router, which are no nn.Linear) held in 4 bits, the adapters all-linear as peft puts them
    (fused experts included, where peft adapts them): 3 SGD steps on 2 SPMD devices follow peft over
    transformers' bitsandbytes base."""
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig

    from conftest import sgd_losses
    from xla_shard.data import build

    args = [f"model.name={moe_dirs[family]}", f"data.path={FIXTURES / 'corpus.jsonl'}", "train.seq_len=32",
            "train.optimizer=sgd", "train.lr=1.0", "backend=xla_spmd", "cpu_devices=2", *QLORA]
    done = run_cli("train", *[a for s in [*args, f"output_dir={tmp_path}", "train.steps=3"] for a in ("--set", s)])
    assert done.returncode == 0, done.stderr[-3000:]
    got = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    cfg = config.load(None, args)
    _, weights, _ = build_for(cfg)
    base = AutoModelForCausalLM.from_pretrained(
        moe_dirs[family], attn_implementation="eager", use_cache=False, dtype=torch.float32,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    adapters = {f"base_model.model.{k}": v for k, v in weights.fresh.items()}
    assert not model.load_state_dict(adapters, strict=False).unexpected_keys
    want = sgd_losses(model, build(cfg, base.config, str(moe_dirs[family])).train, cfg.train.lr, 3)
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    assert want[-1] < want[0]


def _exports_are_the_model_peft_trained(trained, base_dir, ckpt, out, capsys):
    """The run's last checkpoint (step 3) exported: as an adapter, which peft loads onto transformers'
    bitsandbytes base to give the logits of `trained` (peft's own QLoRA after the same steps); with --merge, a
    full-precision model directory (the base dequantized as the run held it, the adapters added, as peft's
    merge_and_unload computes it before quantizing again) whose logits are the same, and not those of a merge
    into the full-precision base."""
    from peft import PeftModel
    from transformers import BitsAndBytesConfig

    (step,) = [path for path in sorted(ckpt.glob("step-*")) if path.name.endswith("3")]
    for kind, extra in (("adapter", []), ("merged", ["--merge"])):
        done = run_in_process(capsys, "ckpt", "export", str(step), "--to", str(out / kind), *extra)
        assert done.returncode == 0, done.stderr[-2000:]
        assert ("weights the run held in 4 bits" in done.stdout) == (kind == "merged"), done.stdout
    four_bit = AutoModelForCausalLM.from_pretrained(
        base_dir, attn_implementation="eager", dtype=torch.float32,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    loaded = PeftModel.from_pretrained(four_bit, out / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", attn_implementation="eager").eval()
    whole = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager"),
                                      out / "adapter").eval()
    assert not any("4bit" in type(m).__name__ for m in merged.modules())  # written in full precision
    ids = torch.randint(3, min(300, merged.config.vocab_size), (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained.eval()(input_ids=ids).logits
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        assert (whole(input_ids=ids).logits - want).abs().max() > 1e-3  # the 4-bit base, not the full one
